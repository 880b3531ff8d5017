import json

from engram_offload.cli import main


def test_info_json_reference_figures(capsys):
    assert main(["info", "--preset", "deepseek-v4.1-flash", "--tp", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["table_bytes"] == 202_758_032_400
    assert out["rows_per_token"] == 48
    assert out["bytes_per_token"] == 12_672
    assert out["bytes_per_token_per_gpu"] == 3_168
    assert out["layers"] == [
        {"layer_id": 1, "rows": 384_006_168, "row_base": 0},
        {"layer_id": 14, "rows": 384_016_682, "row_base": 384_006_168},
    ]


def test_info_text_and_config_file(tmp_path, capsys):
    cfg = {
        "engram_layer_ids": [2], "engram_max_ngram_size": 3, "engram_n_heads": 2,
        "engram_head_dim": 32, "engram_vocab_size": 100, "hidden_size": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["info", "--config", str(path)]) == 0
    assert "rows" in capsys.readouterr().out


def test_info_errors_are_reported(capsys):
    assert main(["info", "--preset", "bogus"]) == 2
    assert "unknown preset 'bogus'" in capsys.readouterr().err
    assert main(["info", "--preset", "deepseek-demo", "--tp", "0"]) == 2  # a usage error


def test_hash_text_and_json(capsys):
    assert main(["hash", "--preset", "deepseek-v4.1-flash", "Hello world"]) == 0
    text = capsys.readouterr().out
    assert "compressed vocab 99,092" in text and "layer 14 4-gram" in text
    assert main(["hash", "--json", "--table-ids", "Hello world"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["token"] for t in out["tokens"]] == ["Hello", "Ġworld"]
    rows14 = out["tokens"][1]["rows"]["14"]
    assert list(rows14) == ["2-gram", "3-gram", "4-gram"] and len(rows14["2-gram"]) == 8
    assert min(rows14["2-gram"]) >= 384_006_168  # flat table ids of the second layer


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_error_lines_name_the_problem_and_the_fix():
    import errno

    from engram_offload.cli import _message, describe

    assert describe(OSError(errno.ENOSPC, "No space left on device", "t.tbl")) == \
        "No space left on device: t.tbl; free space or write elsewhere"
    assert describe(PermissionError(errno.EACCES, "Permission denied", "/x")).endswith("check the path's permissions")
    assert describe(KeyError("layer 3 is not an Engram layer")) == "layer 3 is not an Engram layer"
    assert describe(ValueError("two\nlines")) == "two lines"
    assert "free memory" in describe(MemoryError())
    unexpected = _message(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert unexpected.startswith("unexpected RuntimeError: DefaultCPUAllocator") and "--debug" in unexpected


def test_info_config_directory_is_read(tmp_path, capsys):
    cfg = {"engram_layer_ids": [2], "engram_max_ngram_size": 3, "engram_n_heads": 2,
           "engram_head_dim": 32, "engram_vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": cfg}))
    assert main(["info", "--config", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_rows"] > 0
