import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_offload.engram.config import PRESETS, EngramConfig, check_config_fields, is_prime, next_unused_prime


def test_v41_flash_reference_figures():
    c = EngramConfig.from_name("deepseek-v4.1-flash")
    assert [c.rows_per_layer[i] for i in c.layer_ids] == [384_006_168, 384_016_682]
    assert c.row_bytes == 264
    assert c.table_bytes == 202_758_032_400
    assert c.rows_per_token == 48
    assert c.bytes_per_token == 12_672
    assert c.bytes_per_token_per_gpu(4) == 3_168
    assert c.layer_row_base(1) == 0
    assert c.layer_row_base(14) == 384_006_168


@pytest.mark.parametrize(
    "name,rows,params",
    [("engram-27b", 36.2e6, 5.7e9), ("engram-40b", 115.8e6, 18.5e9)],
)
def test_paper_presets(name, rows, params):
    c = EngramConfig.from_name(name)
    for layer_rows in c.rows_per_layer.values():
        assert layer_rows == pytest.approx(rows, rel=0.002)
    assert c.row_bytes == 160
    assert c.num_rows * c.head_dim == pytest.approx(params, rel=0.02)


def test_every_preset_builds():
    for name in PRESETS:
        c = EngramConfig.from_name(name)
        assert c.name == name and c.num_rows > 0


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="deepseek-v4.1-flash"):
        EngramConfig.from_name("nope")


def test_primes_and_multipliers_match_demo(demo_vectors):
    meta = demo_vectors["meta"]
    c = EngramConfig.from_demo(**meta["config"])
    for layer, per_order in meta["head_sizes"].items():
        assert [list(o) for o in c.primes[int(layer)]] == per_order
    for layer, mults in meta["layer_multipliers"].items():
        assert c.multipliers(int(layer), meta["compressed_vocab_size"]).tolist() == mults
    assert c.head_dim == 64 and c.hidden_size == 128 and c.rows_per_layer[15] == 18_634


def test_primes_are_distinct_primes_above_start():
    c = EngramConfig(layer_ids=(3, 7), max_ngram_size=3, n_heads=4, head_dim=8, prime_starts=(100, 50))
    all_primes = [p for layer in c.primes.values() for order in layer for p in order]
    assert len(set(all_primes)) == len(all_primes)
    assert all(is_prime(p) for p in all_primes)
    assert min(c.primes[3][0]) > 99 and min(c.primes[3][1]) > 49
    assert c.head_offsets(3)[1] == c.primes[3][0][0]


def test_is_prime_matches_sieve():
    n = 20_000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for i in range(2, n):
        if sieve[i]:
            for j in range(i * i, n, i):
                sieve[j] = False
    assert [is_prime(i) for i in range(n)] == sieve
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)
    assert next_unused_prime(1008, {1009}) == 1013


def _hf_dict():
    return {
        "hidden_size": 4096,
        "hc_mult": 4,
        "rms_norm_eps": 1e-6,
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 16_000_000,
        "engram_num_embeddings": [384_006_168, 384_016_682],
        "engram_compressed_vocab_size": 99_092,
        "engram_pad_token_id": 2,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    }


def test_from_hf_config_dict_and_file(tmp_path):
    c = EngramConfig.from_hf_config(_hf_dict())
    assert c.table_bytes == 202_758_032_400 and c.variant == "v4.1"
    assert c.compressed_vocab_size == 99_092
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": _hf_dict()}))
    assert EngramConfig.from_hf_config(path) == c
    assert EngramConfig.from_hf_config(tmp_path) == c


def test_from_hf_config_rejects_wrong_num_embeddings():
    bad = _hf_dict() | {"engram_num_embeddings": [384_006_168, 1]}
    with pytest.raises(ValueError, match="disagrees with the rows derived from the primes"):
        EngramConfig.from_hf_config(bad)


def test_from_hf_config_missing_fields():
    with pytest.raises(ValueError, match="engram_head_dim"):
        EngramConfig.from_hf_config({k: v for k, v in _hf_dict().items() if k != "engram_head_dim"})


def test_from_demo_accepts_unused_fields_and_rejects_unknown():
    c = EngramConfig.from_demo(tokenizer_name_or_path="x", vocab_size=5, num_layers=30, layer_ids=[1, 15])
    assert c == EngramConfig.from_name("deepseek-demo")
    with pytest.raises(ValueError, match="unknown demo config fields"):
        EngramConfig.from_demo(n_layers=3)


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError, match="prime_starts"):
        EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=8, prime_starts=(10, 10, 10))
    with pytest.raises(ValueError, match="divisible by 32"):
        EngramConfig(layer_ids=(1,), max_ngram_size=2, n_heads=2, head_dim=48, prime_starts=(10,),
                     row_format="fp8_e4m3_ue8m0")
    with pytest.raises(KeyError, match="not an Engram layer"):
        EngramConfig.from_name("deepseek-demo").layer_row_base(2)


def test_scaled_and_dict_round_trip():
    c = EngramConfig.from_name("deepseek-v4.1-flash")
    s = c.scaled(0.0625)
    assert s.table_bytes / 2**30 == pytest.approx(11.8, rel=0.01)
    assert EngramConfig(**s.to_dict()) == s


RELEASED_CONFIG = Path(__file__).resolve().parents[1] / "data" / "deepseek-v4.1-flash-config.json"


def test_the_preset_is_the_released_config():
    preset = EngramConfig.from_name("deepseek-v4.1-flash")
    assert (preset.hidden_size, preset.hc_mult, preset.rms_norm_eps) == (5120, 4, 1e-20)
    assert preset.image_token_id == 129_264
    released = EngramConfig.from_hf_config(RELEASED_CONFIG)
    assert released == preset  # every field (the name aside)
    assert released.row_format == "fp8_e4m3_ue8m0" and released.table_bytes == 202_758_032_400


def test_from_hf_config_reads_top_level_quantization_and_image_token_beside_text_config():
    text = {k: v for k, v in _hf_dict().items() if k != "quantization_config"}
    nested = {"image_token_id": 129_264, "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"},
              "text_config": text}
    c = EngramConfig.from_hf_config(nested)
    assert c.row_format == "fp8_e4m3_ue8m0" and c.image_token_id == 129_264
    assert EngramConfig.from_hf_config({"text_config": text}).row_format == "bf16"  # no quantization
    assert EngramConfig.from_hf_config(_hf_dict()).image_token_id is None  # flat, no image token


def test_info_on_the_released_config_reports_the_reference_figures():
    script = Path(sys.executable).with_name("engram-offload")
    assert script.is_file(), f"the engram-offload command is not installed next to {sys.executable}"
    done = subprocess.run([str(script), "info", "--config", str(RELEASED_CONFIG), "--tp", "4"],
                          capture_output=True, text=True, check=True)
    assert "fp8_e4m3_ue8m0" in done.stdout
    assert "202,758,032,400 bytes" in done.stdout
    assert "3,168 bytes per GPU" in done.stdout


def test_prime_search_starts_above_a_prime_boundary():
    # the engines take the next prime above vocab_size - 1: with a start of 102 the boundary
    # 101 is itself prime and must not be taken
    c = EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=8, prime_starts=(102, 102))
    assert c.primes == {1: ((103, 107), (109, 113))}
    assert next_unused_prime(101, set()) == 103


def test_tiny_config_primes_are_pinned(tiny_config):
    # 499 = 500 - 1 is prime, so a search starting at the boundary would change these
    c = tiny_config()
    assert c.primes == {1: ((307, 311), (503, 509)), 3: ((313, 317), (521, 523))}
    assert c.rows_per_layer == {1: 1630, 3: 1674}


def test_importing_the_package_is_light_and_never_initialises_cuda():
    code = (
        "import sys\n"
        "import engram_offload\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'eager heavy imports'\n"
        "from engram_offload import (NgramHasher, EngramLayer, compress_tokenizer, cached_token_map,\n"
        "                            Prefetcher, open_table)\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert EngramLayer.__module__ == 'engram_offload.engram.layer' and callable(open_table)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("fields", [
    {"n_heads": 10_000_000},                       # the prime search would run for hours
    {"n_heads": 0},
    {"max_ngram_size": 17},
    {"head_dim": 1 << 20},
    {"layer_ids": (1, 1 << 20)},
    {"prime_starts": (1 << 60, 10)},
    {"layer_ids": tuple(range(64)), "n_heads": 64},  # 64 x 2 x 64 hashed heads, over the bound
])
def test_config_refuses_out_of_range_fields_at_construction(fields):
    base = dict(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(100, 200))
    with pytest.raises(ValueError):
        EngramConfig(**{**base, **fields})


# ---------------------------------------------------------------- field checks, one by one
BASE = dict(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=[100, 200])


@pytest.mark.parametrize("change,message", [
    ({"max_ngram_size": 1}, r"max_ngram_size must be an integer in \[2, 16\], got 1"),
    ({"max_ngram_size": 17}, r"max_ngram_size must be an integer in \[2, 16\], got 17"),
    ({"n_heads": 1025}, r"n_heads must be an integer in \[1, 1024\], got 1025"),
    ({"n_heads": True}, r"n_heads must be an integer in \[1, 1024\], got True"),
    ({"head_dim": 0}, r"head_dim must be an integer in \[1, 65536\], got 0"),
    ({"seed": -1}, r"seed must be an integer in \[0, 9223372036854775807\], got -1"),
    ({"pad_id": 2**31}, r"pad_id must be an integer in \[-2147483648, 2147483647\], got 2147483648"),
    ({"hidden_size": 0}, r"hidden_size must be an integer in \[1, 1048576\], got 0"),
    ({"hc_mult": 1025}, r"hc_mult must be an integer in \[1, 1024\], got 1025"),
    ({"kernel_size": 0}, r"kernel_size must be an integer in \[1, 1024\], got 0"),
    ({"layer_ids": []}, r"layer_ids must be a list of 1 to 256 layer ids, got \[\]"),
    ({"layer_ids": list(range(257))}, r"layer_ids must be a list of 1 to 256 layer ids, got \[0, 1, .*\]"),
    ({"layer_ids": (1,)}, r"layer_ids must be a list of 1 to 256 layer ids, got \(1,\)"),
    ({"layer_ids": [65537]}, r"a layer id must be an integer in \[0, 65536\], got 65537"),
    ({"layer_ids": [-1]}, r"a layer id must be an integer in \[0, 65536\], got -1"),
    ({"prime_starts": [0, 5]}, r"a prime-search start must be an integer in \[1, 281474976710656\], got 0"),
    ({"prime_starts": 2**48 + 1}, r"a prime-search start must be an integer in \[1, 281474976710656\], got 281474976710657"),
    ({"layer_ids": list(range(256)), "max_ngram_size": 3, "n_heads": 9},
     r"256 layers x 2 orders x 9 heads = 4,608 hashed heads, more than the 4,096 supported"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a number in \(0, 1\), got 0"),
    ({"rms_norm_eps": 1}, r"rms_norm_eps must be a number in \(0, 1\), got 1"),
    ({"rms_norm_eps": True}, r"rms_norm_eps must be a number in \(0, 1\), got True"),
    ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a number in \(0, 1\), got '1e-6'"),
    ({"compressed_vocab_size": 0}, r"compressed_vocab_size must be an integer in \[1, 1099511627776\], got 0"),
    ({"variant": 4}, r"variant must be a string, got 4"),
    ({"row_format": None}, r"row_format must be a string, got None"),
    ({"name": 5}, r"name must be a string or null, got 5"),
])
def test_each_bad_field_is_named(change, message):
    with pytest.raises(ValueError, match=rf"^{message}$"):
        check_config_fields({**BASE, **change})


def test_field_checks_accept_the_bounds_and_a_missing_optional():
    check_config_fields({**BASE, "max_ngram_size": 16, "n_heads": 1, "layer_ids": [0, 65536],
                         "prime_starts": [1, 2**48], "rms_norm_eps": 0.5, "compressed_vocab_size": 1,
                         "name": "x", "seed": 2**63 - 1})
    check_config_fields({"layer_ids": list(range(256)), "prime_starts": [7]})  # 256 x 1 x 1 heads
    check_config_fields({**BASE, "layer_ids": [1] * 256, "max_ngram_size": 2, "n_heads": 16})  # 4,096 heads
    check_config_fields({**BASE, "rms_norm_eps": 1e-20, "compressed_vocab_size": None, "name": None})
    with pytest.raises(ValueError, match=r"^the config must be a JSON object, got list$"):
        check_config_fields([BASE])


def test_constructor_messages():
    base = dict(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=8, prime_starts=(10, 10))
    cases = [
        ({"layer_ids": ()}, r"layer_ids is empty: an Engram config needs at least one layer"),
        ({"layer_ids": (3, 1, 3)}, r"layer_ids has duplicates: \[3, 1, 3\]"),
        ({"max_ngram_size": 1, "prime_starts": ()}, r"max_ngram_size must be >= 2, got 1"),
        ({"n_heads": 0}, r"n_heads and head_dim must be positive, got 0 and 8"),
        ({"head_dim": 0}, r"n_heads and head_dim must be positive, got 2 and 0"),
        ({"prime_starts": (10,)}, r"prime_starts needs one value per n-gram order \(2\), got 1: \[10\]"),
        ({"variant": "v5"}, r"variant must be one of \('demo', 'v4.1'\), got 'v5'"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=rf"^{message}$"):
            EngramConfig(**{**base, **change})
    assert EngramConfig(**{**base, "prime_starts": 10}).prime_starts == (10, 10)  # one start for every order
    assert EngramConfig(**{**base, "layer_ids": [np.int64(4)]}).layer_ids == (4,)
    assert type(EngramConfig(**{**base, "layer_ids": [np.int64(4)]}).layer_ids[0]) is int
    with pytest.raises(ValueError, match=r"^unknown preset 'nope'; choose one of: deepseek-v4.1-flash, engram-27b, "
                                         r"engram-40b, deepseek-demo$"):
        EngramConfig.from_name("nope")
    with pytest.raises(KeyError, match=r"layer 2 is not an Engram layer; Engram layers: \[1, 15\]"):
        EngramConfig.from_name("deepseek-demo").head_sizes(2)


def test_is_prime_edges():
    assert [n for n in range(-3, 3) if is_prime(n)] == [2]
    assert all(is_prime(p) for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43))
    # strong pseudoprimes to the first bases, and Carmichael numbers: composite
    for n in (2047, 1373653, 25326001, 3215031751, 2152302898747, 3474749660383, 341550071728321,
              3825123056546413051, 318665857834031151167461, 561, 1105, 41 * 43):
        assert not is_prime(n), n
    assert is_prime(2**89 - 1) and is_prime(10**18 + 9)
    assert next_unused_prime(0, set()) == 2 and next_unused_prime(2, {3}) == 5
    assert next_unused_prime(10, {11, 13, 17}) == 19
    assert next_unused_prime(12, set()) == 13 and next_unused_prime(1, set()) == 2  # start + 1 itself


def test_from_hf_config_field_fallbacks(tmp_path):
    minimal = {"engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_n_heads": 2,
               "engram_head_dim": 32, "engram_vocab_size": [100, 200]}
    c = EngramConfig.from_hf_config(minimal)
    assert (c.prime_starts, c.pad_id, c.hidden_size, c.hc_mult, c.rms_norm_eps) == ((100, 200), 2, 1024, 4, 1e-6)
    assert (c.row_format, c.variant, c.compressed_vocab_size, c.image_token_id) == ("bf16", "v4.1", None, None)
    c = EngramConfig.from_hf_config(minimal | {"engram_pad_id": 7, "engram_vocab_size": 300, "rms_norm_eps": 1e-5,
                                               "engram_compressed_vocab_size": 0, "hidden_size": 64, "hc_mult": 2})
    assert (c.prime_starts, c.pad_id, c.rms_norm_eps, c.compressed_vocab_size) == ((300, 300), 7, 1e-5, None)
    assert (c.hidden_size, c.hc_mult) == (64, 2)
    assert EngramConfig.from_hf_config(minimal | {"engram_pad_token_id": 5, "engram_pad_id": 7}).pad_id == 5
    assert EngramConfig.from_hf_config(minimal | {"quantization_config": {"fmt": "e4m3"}}).row_format == "fp8_e4m3_ue8m0"
    assert EngramConfig.from_hf_config(minimal | {"quantization_config": {"quant_method": "fp8"}}).row_format == \
        "fp8_e4m3_ue8m0"
    assert EngramConfig.from_hf_config(minimal | {"quantization_config": {"quant_method": "awq"}}).row_format == "bf16"
    assert EngramConfig.from_hf_config(minimal | {"quantization_config": None}).row_format == "bf16"
    assert EngramConfig.from_hf_config(minimal | {"quantization_config": {"fmt": "e4m3"},
                                                  "engram_row_format": "fp32"}).row_format == "fp32"
    assert EngramConfig.from_hf_config(minimal | {"image_token_id": 0}).image_token_id == 0
    rows = EngramConfig.from_hf_config(minimal).rows_per_layer[1]
    assert EngramConfig.from_hf_config(minimal | {"engram_num_embeddings": rows}).rows_per_layer[1] == rows
    with pytest.raises(ValueError, match=rf"^engram_num_embeddings \[{rows + 1}\] disagrees with the rows derived "
                                         rf"from the primes \[{rows}\] \(layers \[1\], prime start \[100, 200\]\): "
                                         "check engram_vocab_size, engram_n_heads and engram_max_ngram_size$"):
        EngramConfig.from_hf_config(minimal | {"engram_num_embeddings": rows + 1})
    # the text model's fields win over top-level ones of the same name
    nested = {"hidden_size": 8, "text_config": minimal | {"hidden_size": 96}}
    assert EngramConfig.from_hf_config(nested).hidden_size == 96
    with pytest.raises(ValueError, match=r"^config.json lacks the Engram fields \['engram_layer_ids', "
                                         r"'engram_max_ngram_size', 'engram_n_heads', 'engram_head_dim', "
                                         r"'engram_vocab_size'\]$"):
        EngramConfig.from_hf_config({"text_config": 5})
    with pytest.raises(FileNotFoundError, match=rf"^no Hugging Face config at {tmp_path / 'config.json'}$"):
        EngramConfig.from_hf_config(tmp_path)
    (tmp_path / "other.json").write_text(json.dumps(minimal))
    assert EngramConfig.from_hf_config(str(tmp_path / "other.json")) == EngramConfig.from_hf_config(minimal)


def test_from_demo_defaults_and_fields():
    assert EngramConfig.from_demo() == EngramConfig.from_name("deepseek-demo")
    c = EngramConfig.from_demo(engram_vocab_size=1000, max_ngram_size=4, n_embed_per_ngram=96,
                               n_head_per_ngram=3, layer_ids=[2], pad_id=0, seed=9, kernel_size=3,
                               hidden_size=64, hc_mult=2)
    assert (c.prime_starts, c.n_heads, c.head_dim, c.layer_ids, c.pad_id) == ((1000,) * 3, 3, 32, (2,), 0)
    assert (c.seed, c.kernel_size, c.hidden_size, c.hc_mult, c.variant, c.row_format) == (9, 3, 64, 2, "demo", "fp32")
    assert EngramConfig.from_demo(engram_vocab_size=[500, 700]).prime_starts == (500, 700)
    with pytest.raises(ValueError, match=r"^n_embed_per_ngram \(100\) must be divisible by n_head_per_ngram \(8\)$"):
        EngramConfig.from_demo(n_embed_per_ngram=100)
    with pytest.raises(ValueError, match=r"^unknown demo config fields: \['a', 'b'\]$"):
        EngramConfig.from_demo(b=1, a=2, seed=1)


def test_scaled_configs():
    c = EngramConfig.from_name("deepseek-v4.1-flash")
    assert c.scaled(1) is c
    half = c.scaled(0.5)
    assert half.prime_starts == (8_000_000,) * 3 and half.name == "deepseek-v4.1-flash@0.5"
    assert c.replace(name=None).scaled(0.5).name is None
    tiny = c.scaled(1e-9)  # never below two primes' worth per head
    assert tiny.prime_starts == (16,) * 3
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=rf"^scale must be in \(0, 1\], got {bad}$"):
            c.scaled(bad)


def test_derived_sizes_of_a_small_layout():
    c = EngramConfig(layer_ids=(5, 2), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(10, 20),
                     row_format="fp16")
    assert c.primes == {5: ((11, 13), (23, 29)), 2: ((17, 19), (31, 37))}
    assert c.head_sizes(5) == (11, 13, 23, 29) and c.head_offsets(5) == (0, 11, 24, 47)
    assert c.rows_per_layer == {5: 76, 2: 104} and c.num_rows == 180
    assert c.layer_row_base(5) == 0 and c.layer_row_base(2) == 76 and c.layer_row_bases == (0, 76)
    assert (c.num_orders, c.cols_per_layer, c.rows_per_token) == (2, 4, 8)
    assert (c.row_bytes, c.table_bytes, c.bytes_per_token) == (64, 180 * 64, 8 * 64)
    assert [c.bytes_per_token_per_gpu(tp) for tp in (1, 2, 3, 4, 5)] == [512, 256, 256, 128, 128]
    assert c.bytes_per_token_per_gpu() == 512  # one rank by default
    with pytest.raises(ValueError, match=r"^tensor-parallel degree must be >= 1, got 0$"):
        c.bytes_per_token_per_gpu(0)
    assert c.to_dict()["layer_ids"] == [5, 2] and c.to_dict()["prime_starts"] == [10, 20]


def test_multipliers_are_odd_and_bounded():
    c = EngramConfig(layer_ids=(1, 2), max_ngram_size=4, n_heads=1, head_dim=8, prime_starts=(10, 10, 10), seed=3)
    for vocab in (1, 37, 99_092, 2**40):
        m = c.multipliers(1, vocab)
        assert m.dtype == np.int64 and m.shape == (4,) and (m % 2 == 1).all() and (m >= 1).all()
        assert int(m.max()) * vocab <= 2**63 - 1 + vocab  # products of compressed ids stay within int64
    assert not np.array_equal(c.multipliers(1, 37), c.multipliers(2, 37))
    assert not np.array_equal(c.multipliers(1, 37), c.replace(seed=4).multipliers(1, 37))
    huge = c.multipliers(1, 2**62)  # the bound floors at 1: every multiplier is 1
    assert huge.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("vocab", [1, 2, 3, 37, 1000, 99_092, 2**40])
def test_multipliers_follow_the_spec_formula(vocab):
    """SPEC section 2, in Python integers: m = rng.integers(0, max(1, ((2**63-1) // V') // 2),
    size=N, dtype=int64) * 2 + 1 with rng = default_rng(seed + 10007 * layer_id)."""
    c = EngramConfig(layer_ids=(1, 6), max_ngram_size=5, n_heads=1, head_dim=8, prime_starts=(10,) * 4, seed=11)
    for layer in c.layer_ids:
        rng = np.random.default_rng(11 + 10007 * layer)
        want = rng.integers(0, max(1, ((2**63 - 1) // vocab) // 2), size=5, dtype=np.int64) * 2 + 1
        assert c.multipliers(layer, vocab).tolist() == want.tolist()


def test_head_count_defaults_for_missing_fields():
    # a missing max_ngram_size counts as 2 (one order), a missing n_heads as 1
    check_config_fields({"layer_ids": list(range(256)), "prime_starts": [7], "n_heads": 16})  # 256 x 1 x 16
    check_config_fields({"layer_ids": list(range(256)), "prime_starts": [7], "max_ngram_size": 17 - 1})  # x 15 x 1


def test_too_many_heads_with_a_missing_field_is_a_value_error():
    with pytest.raises(ValueError, match=r"^256 layers x 1 orders x 17 heads = 4,352 hashed heads"):
        check_config_fields({"layer_ids": list(range(256)), "prime_starts": [7], "n_heads": 17})


def test_the_smallest_layout_and_three_layers():
    c = EngramConfig(layer_ids=(9, 4, 7), max_ngram_size=2, n_heads=1, head_dim=1, prime_starts=(2,))
    assert c.row_bytes == 4 and c.primes == {9: ((2,),), 4: ((3,),), 7: ((5,),)}  # primes >= the start
    assert c.layer_row_bases == (0, 2, 5) and c.layer_row_base(7) == 5 and c.num_rows == 10
    assert c.bytes_per_token_per_gpu() == c.bytes_per_token == 12


def test_a_flat_config_ignores_a_text_config_beside_it():
    flat = {"engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
            "engram_vocab_size": [100, 200], "hidden_size": 64}
    assert EngramConfig.from_hf_config(flat | {"text_config": {"hidden_size": 96, "engram_n_heads": 4}}) == \
        EngramConfig.from_hf_config(flat)


@pytest.mark.parametrize("field, value, name", [
    ("engram_n_heads", 2.7, "engram_n_heads"),
    ("engram_head_dim", 63.5, "engram_head_dim"),
    ("engram_max_ngram_size", 3.2, "engram_max_ngram_size"),
    ("engram_vocab_size", 300.9, "engram_vocab_size"),
    ("engram_layer_ids", [1.5, 3], "a layer id"),
    ("hidden_size", "128", "hidden_size"),
])
def test_a_fractional_field_is_refused_not_truncated(tmp_path, capsys, field, value, name):
    from engram_offload.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_hf_dict(), field: value}))
    assert main(["info", "--config", str(path), "--json"]) == 1
    err = capsys.readouterr().err
    assert f"{name} must be a whole number, got {value if not isinstance(value, list) else value[0]!r}" in err
    with pytest.raises(ValueError, match=f"^{name} must be a whole number"):
        EngramConfig.from_hf_config({**_hf_dict(), field: value})


def test_a_whole_float_field_is_the_integer(tmp_path):
    """JSON writers may write 8.0 for 8: the same value, accepted."""
    whole = {**_hf_dict(), "engram_n_heads": 8.0, "engram_head_dim": 256.0, "engram_layer_ids": [1.0, 14]}
    assert EngramConfig.from_hf_config(whole) == EngramConfig.from_hf_config(_hf_dict())
