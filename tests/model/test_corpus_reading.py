"""Reading a corpus: only what ``max_tokens`` needs is read, a large file in bounded pieces, and
the pieces' token ids are the whole text's."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from engram_offload.cli import main
from engram_offload.engram.tokenizer import load_tokenizer
from engram_offload.model.corpus import CorpusFile, token_sequences

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def mixed_text() -> str:
    """Real source text plus the awkward parts of pre-tokenization: long digit runs, CJK,
    accents, runs of blank lines and tabs."""
    source = "".join(p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:12])
    odd = "日本語のテキスト 12345678901234 héllo wörld   \n\n\n\t\t  x = 0.5e-3\r\n" * 40
    return source[:150_000] + odd + source[150_000:200_000]


def _read_bytes() -> int:
    """Bytes this process has read through read(2) and friends so far (/proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("piece_chars", [64, 1000, 1 << 20])
def test_pieces_give_the_whole_texts_token_ids(tmp_path, tokenizer, mixed_text, piece_chars):
    path = tmp_path / "mixed.txt"
    path.write_text(mixed_text, encoding="utf-8")
    whole = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids)
    got = token_sequences([CorpusFile(path, "mixed")], tokenizer, None, 1, piece_chars=piece_chars)
    assert len(got) == 1 and np.array_equal(got[0], whole)
    from engram_offload.model.corpus import text_pieces

    pieces = list(text_pieces(path, tokenizer, piece_chars))
    assert "".join(pieces) == path.read_text(encoding="utf-8")
    assert max(len(p) for p in pieces) <= 5 * piece_chars or piece_chars > len(mixed_text)
    cut = token_sequences([CorpusFile(path, "mixed")], tokenizer, 777, 1, piece_chars=piece_chars)
    assert np.array_equal(cut[0], whole[:777])


def test_a_few_tokens_of_a_large_file_read_only_a_little_of_it(tmp_path, tokenizer, mixed_text):
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as f:
        while f.tell() < 8 << 20:  # 8 MiB
            f.write(mixed_text)
    before = _read_bytes()
    ids = token_sequences([CorpusFile(big, "big")], tokenizer, 1000, 2)
    read = _read_bytes() - before
    assert sum(x.size for x in ids) == 1000
    assert read < 1 << 20, f"read {read:,} bytes of an 8 MiB file for 1,000 tokens"


def test_eval_and_scan_of_a_large_file_read_what_they_need(tmp_path, mixed_text, capsys):
    """The commands read about as much for 1,000 tokens of an 8 MiB file as of a 0.2 MiB one."""
    read = {}
    for name, size in (("small", 0), ("large", 8 << 20)):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "text.txt", "w", encoding="utf-8") as f:
            f.write(mixed_text)
            while f.tell() < size:
                f.write(mixed_text)
        before = _read_bytes()
        for command in ("eval", "scan"):
            assert main([command, "--corpus", str(folder), "--all-files", "--max-tokens", "1000", "--json"]) == 0
            assert '"tokens": 999' in capsys.readouterr().out
        read[name] = _read_bytes() - before
    assert read["large"] - read["small"] < 1 << 20, read
