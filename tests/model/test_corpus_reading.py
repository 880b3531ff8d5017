"""Reading a corpus: only what ``max_tokens`` needs is read, a large file in bounded pieces, and
the pieces' token ids are the whole text's."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engram_offload.cli import main
from engram_offload.engram.tokenizer import load_tokenizer
from engram_offload.model import corpus
from engram_offload.model.corpus import CorpusFile, text_pieces, token_sequences

from corpus_fakes import CharTokenizer, read_bytes

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



@pytest.mark.parametrize("piece_chars", [64, 1000, 1 << 20])
def test_pieces_give_the_whole_texts_token_ids(tmp_path, tokenizer, mixed_text, piece_chars):
    path = tmp_path / "mixed.txt"
    path.write_text(mixed_text, encoding="utf-8")
    whole = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids)
    got = token_sequences([CorpusFile(path, "mixed")], tokenizer, None, 1, piece_chars=piece_chars)
    assert len(got) == 1 and np.array_equal(got[0], whole)
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
    before = read_bytes()
    ids = token_sequences([CorpusFile(big, "big")], tokenizer, 1000, 2)
    read = read_bytes() - before
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
        before = read_bytes()
        for command in ("eval", "scan"):
            assert main([command, "--corpus", str(folder), "--all-files", "--max-tokens", "1000", "--json"]) == 0
            assert '"tokens": 999' in capsys.readouterr().out
        read[name] = read_bytes() - before
    assert read["large"] - read["small"] < 1 << 20, read


LINES = ("x" * 49 + "\n") * 200  # 10,000 characters in lines of 50


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _file(tmp_path: Path, name: str, text: str) -> CorpusFile:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return CorpusFile(path, f"t/{name}", "prose")


@pytest.fixture
def small_first_piece(monkeypatch):
    monkeypatch.setattr(corpus, "_FIRST_PIECE_CHARS", 100)


@pytest.mark.parametrize("max_tokens,pieces", [(450, [50, 400]), (451, [50, 400, 1000])])
def test_a_large_file_is_read_piece_by_piece_until_its_tokens_are_in_hand(tmp_path, small_first_piece, max_tokens,
                                                                           pieces):
    """Pieces end after a line break and grow from the first (100 characters here) fourfold up to
    ``piece_chars``; reading stops at the piece that completes the tokens asked for."""
    tokenizer = CharTokenizer()
    got = token_sequences([_file(tmp_path, "big.txt", LINES)], tokenizer, max_tokens, 1, piece_chars=1000)
    assert tokenizer.encoded == pieces and tokenizer.batches == []
    assert len(got) == 1 and got[0].tolist() == _ids(LINES[:max_tokens]) and got[0].dtype == np.int64


def test_a_large_file_after_others_reads_only_what_the_budget_leaves(tmp_path, small_first_piece):
    tokenizer = CharTokenizer()
    small, big = _file(tmp_path, "small.txt", "s" * 1000), _file(tmp_path, "big.txt", LINES)
    got = token_sequences([small, big], tokenizer, 1450, 1, piece_chars=1000)
    assert tokenizer.batches == [[1000]] and tokenizer.encoded == [50, 400]
    assert [g.tolist() for g in got] == [_ids("s" * 1000), _ids(LINES[:450])]


def test_a_whole_large_file_is_read_in_full_pieces_and_the_files_after_it_too(tmp_path, small_first_piece):
    tokenizer = CharTokenizer()
    big, after = _file(tmp_path, "big.txt", LINES), _file(tmp_path, "after.txt", "a" * 20)
    got = token_sequences([big, after], tokenizer, None, 1, piece_chars=1000)
    assert tokenizer.encoded[:2] == [950, 1000] and sum(tokenizer.encoded) == len(LINES)
    assert [g.tolist() for g in got] == [_ids(LINES), _ids("a" * 20)]


@pytest.mark.parametrize("sizes,batch_files,batches", [
    ([50, 49, 10, 50, 50, 10], 64, [[50, 49, 10], [50, 50], [10]]),  # a batch closes at 100 characters
    ([5, 5, 5], 2, [[5, 5], [5]]),
])
def test_small_files_are_tokenized_in_bounded_batches(tmp_path, monkeypatch, sizes, batch_files, batches):
    monkeypatch.setattr(corpus, "_BATCH_CHARS", 100)
    monkeypatch.setattr(corpus, "_BATCH_FILES", batch_files)
    tokenizer = CharTokenizer()
    texts = [chr(ord("a") + i) * n for i, n in enumerate(sizes)]
    got = token_sequences([_file(tmp_path, f"{i}.txt", t) for i, t in enumerate(texts)], tokenizer, None, 1)
    assert tokenizer.batches == batches
    assert [g.tolist() for g in got] == [_ids(t) for t in texts]


def test_a_file_of_exactly_piece_chars_is_read_whole_with_its_neighbours(tmp_path):
    tokenizer = CharTokenizer()
    files = [_file(tmp_path, "a.txt", "a" * 10), _file(tmp_path, "b.txt", "b" * 1000), _file(tmp_path, "c.txt", "c")]
    got = token_sequences(files, tokenizer, None, 1, piece_chars=1000)
    assert tokenizer.batches == [[10, 1000, 1]] and tokenizer.encoded == []
    assert [g.size for g in got] == [10, 1000, 1]


def test_budgets_end_exactly_and_short_files_follow_min_tokens(tmp_path):
    files = [_file(tmp_path, "a.txt", "a" * 20), _file(tmp_path, "b.txt", "b" * 20)]
    assert token_sequences(files, CharTokenizer(), 0, 1) == []
    assert [g.tolist() for g in token_sequences(files, CharTokenizer(), 20, 1)] == [_ids("a" * 20)]
    assert token_sequences([], CharTokenizer()) == []
    sixteen, fifteen = _file(tmp_path, "16.txt", "c" * 16), _file(tmp_path, "15.txt", "d" * 15)
    assert [g.size for g in token_sequences([fifteen, sixteen], CharTokenizer())] == [16]  # min_tokens=16
    empty = _file(tmp_path, "empty.txt", "")
    got = token_sequences([empty, sixteen], CharTokenizer(), None, 0)
    assert [(g.size, g.dtype) for g in got] == [(0, np.int64), (16, np.int64)]


def _pieces(tmp_path: Path, text: str, tokenizer, piece_chars: int, first_chars: int | None = None) -> list[str]:
    path = tmp_path / "pieces.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(text_pieces(path, tokenizer, piece_chars, first_chars))
    assert "".join(pieces) == text
    return pieces


def test_without_a_pre_tokenizer_pieces_end_at_the_last_line_break_before_the_last_character(tmp_path):
    tokenizer = CharTokenizer()
    text = "ab\n" * 100  # the first 100 characters end "\na": the cut is after that line break
    assert _pieces(tmp_path, text, tokenizer, 1000, 100)[0] == text[:99]
    assert _pieces(tmp_path, "\n" + "x" * 150 + "\n" + "y" * 50, tokenizer, 1000, 100) == \
        ["\n", "x" * 150 + "\n", "y" * 50]
    # no line break at all: carried until four pieces long, then cut where it is
    assert [len(p) for p in _pieces(tmp_path, "z" * 10_000, tokenizer, 1000)] == [4000, 4000, 2000]


def test_with_the_pre_tokenizer_a_piece_ends_before_the_second_to_last_pre_token(tmp_path, tokenizer):
    three = "a" * 30 + " " + "b" * 30 + "!!!"  # exactly three pre-tokens in the first 64 characters
    assert _pieces(tmp_path, three + " c" * 40, tokenizer, 64)[0] == "a" * 30
    assert [len(p) for p in _pieces(tmp_path, "a" * 300, tokenizer, 64)] == [256, 44]  # one long pre-token
    wrapped = SimpleNamespace(backend_tokenizer=tokenizer)  # a transformers tokenizer holds its own
    text = "x = 1\n" * 100 + "日本語 12345678 héllo\n\n\n\t" * 10
    assert _pieces(tmp_path, text, wrapped, 64) == _pieces(tmp_path, text, tokenizer, 64)


def test_bad_bytes_read_as_replacement_characters_in_every_reader(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"caf\xe9 au lait\n" * 200)
    expected = "caf\ufffd au lait\n" * 200
    assert "".join(text_pieces(path, CharTokenizer(), 64)) == expected
    got = token_sequences([CorpusFile(path, "t/bad.txt", "prose")], CharTokenizer(), None, 1, piece_chars=64)
    assert got[0].tolist() == _ids(expected)
    got = token_sequences([CorpusFile(path, "t/bad.txt", "prose")], CharTokenizer(), None, 1)
    assert got[0].tolist() == _ids(expected)
