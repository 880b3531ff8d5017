"""Corpora: real text through DeepSeek's tokenizer, a folder of files, Zipf, clear errors."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engram_offload.bench import corpus as corpus_module
from engram_offload.bench.corpus import load_corpus, zipf_corpus
from engram_offload.engram.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_stdlib_is_real_code_tokenized(tokenizer):
    c = load_corpus("stdlib", tokenizer, max_tokens=5000)
    assert c.tokens == 5000 and len(c.documents) >= 1
    text = tokenizer.decode(c.documents[0][:50].tolist())
    assert any(word in text for word in ("def ", "import ", "class ", "#", '"""'))


def test_a_folder_of_text_files(tokenizer, tmp_path):
    (tmp_path / "a.md").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    (tmp_path / "b.bin").write_bytes(bytes(range(256)) * 10)  # not UTF-8: skipped
    c = load_corpus(str(tmp_path), tokenizer)
    assert len(c.documents) == 1 and c.documents[0].size > 64
    warm, measured = c.split()  # one document: its two halves
    assert np.concatenate([warm.documents[0], measured.documents[0]]).tolist() == c.documents[0].tolist()


def test_missing_corpora_say_what_to_do(tokenizer, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a built-in"):
        load_corpus(str(tmp_path / "nope"), tokenizer)
    monkeypatch.setattr(corpus_module, "DOCS_GLOBS", (str(tmp_path / "none*"),))
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        load_corpus("docs", tokenizer)
    with pytest.raises(FileNotFoundError, match="no text documents"):
        load_corpus(str(tmp_path), tokenizer)


def test_zipf_corpus_is_seeded_and_skewed():
    a = zipf_corpus(1000, documents=2, length=5000, seed=3)
    b = zipf_corpus(1000, documents=2, length=5000, seed=3)
    assert all((x == y).all() for x, y in zip(a.documents, b.documents))
    counts = np.bincount(np.concatenate(a.documents), minlength=1000)
    assert counts.max() > 20 * np.median(counts[counts > 0])
    assert a.documents[0].max() < 1000
    with pytest.raises(ValueError, match="exponent"):
        zipf_corpus(1000, alpha=1.0)


def _unblocked(call, fifo):
    """``call()`` in a thread that must end within 10 s; one still blocked on the FIFO fails the
    test once the FIFO's other end is opened to free it."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # the blocked reader's open returns, and it reads nothing
        thread.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return result[0]


def test_a_listed_file_that_became_a_fifo_or_grew_is_skipped_not_waited_on(tmp_path, monkeypatch):
    fifo, big, text = tmp_path / "fifo.txt", tmp_path / "big.txt", tmp_path / "a.txt"
    os.mkfifo(fifo)  # swapped in after the folder was listed
    monkeypatch.setattr(corpus_module, "MAX_FILE_BYTES", 100)
    big.write_text("x" * 101)  # grew past the bound after it was listed
    text.write_text("text")
    assert _unblocked(lambda: list(corpus_module._read_texts([fifo, big, text], seed=0)), fifo) == ["text"]
