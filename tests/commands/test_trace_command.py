"""``trace``: a corpus folder or a token-id log -> the row ids a server reads, for ``plan --trace``."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from engram_offload.cli import main
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.tokenizer import cached_token_map, encode_documents, load_tokenizer
from engram_offload.planner.trace import serving_steps

V41 = EngramConfig.from_name("deepseek-v4.1-flash")
TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "The quick brown fox jumps over the lazy dog. " * 30,
         "import os\nprint(os.getcwd())\n" * 10]


def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text(TEXTS[0])
    (folder / "sub" / "b.txt").write_text(TEXTS[1])
    (folder / "sub" / "c.md.gz").write_bytes(gzip.compress(TEXTS[2].encode()))
    (folder / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    return folder


def expected(sequences, batch, chunk, distinct=True):
    steps = serving_steps(V41, cached_token_map(), sequences, batch=batch, chunk=chunk)
    return np.concatenate([np.unique(s.reshape(-1)) if distinct else s.reshape(-1) for s in steps])


def test_trace_of_a_corpus_is_what_a_server_reads(tmp_path, capsys):
    folder, out = corpus(tmp_path), tmp_path / "t.npy"
    assert main(["trace", "--corpus", str(folder), "--out", str(out), "--batch", "2", "--chunk", "4"]) == 0
    assert "use it with plan --trace" in capsys.readouterr().out
    ids = np.load(out)
    # files in path order, the .gz decompressed, the binary one skipped
    sequences = encode_documents(TEXTS, load_tokenizer())
    assert ids.dtype == np.int64 and np.array_equal(ids, expected(sequences, 2, 4))
    assert main(["trace", "--corpus", str(folder), "--out", str(out), "--force", "--batch", "2", "--chunk", "4",
                 "--every-id"]) == 0
    assert np.array_equal(np.load(out), expected(sequences, 2, 4, distinct=False))
    assert sum(s.size for s in sequences) * V41.rows_per_token == np.load(out).size
    capsys.readouterr()
    np.save(out, ids)
    # the trace sizes plan's cache
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--trace", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["miss_ratio_curve"].startswith(f"trace of {ids.size:,} ids")


def test_trace_of_a_token_log(tmp_path, capsys):
    log, out = tmp_path / "tokens.log", tmp_path / "t.npy"
    log.write_text("1 2 3 4 5 6 7 8\n\n9, 10, 11, 1, 2, 3\n")
    assert main(["trace", "--token-ids", str(log), "--out", str(out), "--chunk", "1", "--tokens", "10"]) == 0
    sequences = [np.arange(1, 9), np.array([9, 10])]
    assert np.array_equal(np.load(out), expected(sequences, 32, 1))
    log.write_text("1 2 x\n")
    assert main(["trace", "--token-ids", str(log), "--out", str(out), "--force"]) == 1
    assert "tokens.log:1: a token log holds integer token ids" in capsys.readouterr().err
    log.write_text("1 2 999999999\n")
    assert main(["trace", "--token-ids", str(log), "--out", str(out), "--force"]) == 1
    assert "outside the tokenizer's" in capsys.readouterr().err


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_trace_errors_say_what_to_do(tmp_path, capsys, make):
    folder = tmp_path / "c"
    if make == "empty":
        folder.mkdir()
    assert main(["trace", "--corpus", str(folder), "--out", str(tmp_path / "t.npy")]) == 1
    err = capsys.readouterr().err
    assert ("not a folder" in err) if make == "missing" else ("no files matching" in err)
    assert not (tmp_path / "t.npy").exists()
