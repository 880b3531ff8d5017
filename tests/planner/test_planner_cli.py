import json

import numpy as np

from engram_offload.cli import main


def test_plan_text(capsys):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "B300"]) == 0
    out = capsys.readouterr().out
    assert "Recommendation" in out and "smallest workable TP is 4" in out and "hbm" in out


def test_plan_json_keys(capsys):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--gpus", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("table_bytes", "bytes_per_token", "bytes_per_token_per_gpu", "placements", "recommendation"):
        assert key in d
    assert d["bytes_per_token_per_gpu"]["4"] == 3168
    assert {p["tp"] for p in d["placements"]} == {1, 2, 4}
    assert d["recommendation"]["smallest_tp"]["dram"] == 2


def test_plan_with_trace_and_options(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "rows.npy", rng.zipf(1.2, 20_000).astype(np.int64) % 1_000_000)
    (tmp_path / "rows.txt").write_text("1 2 3 1 2 3\n")
    for trace in ("rows.npy", "rows.txt"):
        args = ["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "h200", "--trace", str(tmp_path / trace),
                "--objective", "tokens-per-dollar", "--price", "2.5", "--context", "8192", "--json"]
        assert main(args) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["workload"]["miss_ratio_curve"].startswith("trace of")
        assert d["gpu"]["price_per_hour"] == 2.5


def test_plan_errors_say_what_to_do(tmp_path, capsys):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "a100"]) == 2
    assert "choose one of: h100, h200, b200, b300, gb200, gb300, mi355x" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("999999999999")
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--trace", str(tmp_path / "t.txt")]) == 1
    assert "outside the table" in capsys.readouterr().err


def test_plan_custom_model_from_config(tmp_path, capsys):
    cfg = {
        "num_hidden_layers": 43, "hidden_size": 4096, "n_routed_experts": 256, "num_experts_per_tok": 6,
        "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_vocab_size": 1_000_000,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path), "--gpu", "b200"]) == 1
    assert "--total-params" in capsys.readouterr().err
    assert main(["plan", "--config", str(path), "--gpu", "b200", "--total-params", "100e9",
                 "--active-params", "10e9", "--kv-bytes-per-token", "2000", "--expert-precision", "fp4",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_token"] == 2 * 24 * 264
    assert d["recommendation"]["placement"] is not None
