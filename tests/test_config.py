import json
import subprocess
import sys
from pathlib import Path

import pytest

from engram_offload.config import PRESETS, EngramConfig, is_prime, next_unused_prime


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


RELEASED_CONFIG = Path(__file__).resolve().parent / "data" / "deepseek-v4.1-flash-config.json"


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
        "assert EngramLayer.__module__ == 'engram_offload.layer' and callable(open_table)\n"
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
