"""The training and held-out text: CPython's standard library sources (and Python's own
documentation sources, when the ``python3.11-doc`` package installed them), split by file.

A file is held out when the SHA-256 of its path relative to its corpus root falls in one
bucket of ``HELD_OUT_EVERY``: the split is the same on every machine and for every tool
(training, ``eval``, ``scan``), and no file's text is on both sides.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..engram.tokenizer import append_capped

__all__ = ["CorpusFile", "corpus_files", "split", "token_sequences", "text_pieces", "DOCS_ROOT", "EOS_ID",
           "HELD_OUT_EVERY", "PIECE_CHARS"]

DOCS_ROOT = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc
HELD_OUT_EVERY = 20  # one file in 20 is held out
EOS_ID = 1  # DeepSeek's "<｜end▁of▁sentence｜>"
SUFFIXES = (".py", ".txt", ".rst")


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    name: str  # the path relative to its corpus root, with the root's label: "stdlib/json/decoder.py"

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(self.name.encode()).digest()
        return int.from_bytes(digest[:8], "little") % HELD_OUT_EVERY == 0


def _files_under(root: Path, label: str, suffixes: tuple[str, ...] = SUFFIXES) -> list[CorpusFile]:
    found = [p for p in root.rglob("*") if p.suffix in suffixes and p.is_file()
             and "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return [CorpusFile(p, f"{label}/{p.relative_to(root).as_posix()}") for p in sorted(found)]


def corpus_files(roots: Iterable[str | Path] | None = None) -> list[CorpusFile]:
    """Text files under ``roots`` (default: the standard library, plus ``DOCS_ROOT`` if present).

    A default root is labelled ``stdlib`` (its ``.py`` files) or ``docs`` (its ``.txt``
    files); a given root by its folder name (its ``.py``, ``.txt`` and ``.rst`` files). A given
    root may be one such file: a corpus of that file alone, labelled by its name.
    """
    if roots is None:
        pairs: list[tuple[Path, str, tuple[str, ...]]] = [(Path(sysconfig.get_paths()["stdlib"]), "stdlib", (".py",))]
        if DOCS_ROOT.is_dir():
            pairs.append((DOCS_ROOT, "docs", (".txt",)))
    else:
        pairs = [(Path(r), Path(r).resolve().name, SUFFIXES) for r in roots]
    files: list[CorpusFile] = []
    for root, label, suffixes in pairs:
        if root.is_file() and roots is not None:
            if root.suffix not in suffixes:
                raise ValueError(f"corpus {root} is not a .py/.txt/.rst file: give such a file or a folder of them")
            files.append(CorpusFile(root, label))  # one file: a corpus of one, labelled by its name
            continue
        if root.exists() and not root.is_dir():
            raise ValueError(f"corpus {root} is neither a file nor a folder: give a folder of .py/.txt/.rst files")
        if not root.is_dir():
            raise FileNotFoundError(f"corpus folder {root} does not exist: give a folder of .py/.txt/.rst files")
        files += _files_under(root, label, suffixes)
    if not files:
        raise FileNotFoundError(f"no .py/.txt/.rst files under {[str(p[0]) for p in pairs]}")
    return files


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files)."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


# A file is read and tokenized at most this many characters at a time; smaller files are read
# whole and tokenized ``_BATCH_FILES`` at a time (up to ``_BATCH_CHARS``). ``max_tokens`` stops
# the reading: no more of a file (or of the corpus) is read than the tokens asked for need.
PIECE_CHARS = 1 << 20
_FIRST_PIECE_CHARS = 1 << 16
_BATCH_FILES = 64
_BATCH_CHARS = 16 << 20


def token_sequences(files: Iterable[CorpusFile], tokenizer: Any, max_tokens: int | None = None,
                    min_tokens: int = 16, *, piece_chars: int = PIECE_CHARS) -> list[np.ndarray]:
    """DeepSeek token ids (int64) of each file in order, ``max_tokens`` in all (the last file
    cut); files of fewer than ``min_tokens`` tokens are skipped.

    Memory is bounded whatever the files: a file larger than ``piece_chars`` is read and
    tokenized piece by piece (cut only between pre-tokens, so the ids equal those of the
    whole text), and reading stops once ``max_tokens`` are in hand."""
    out: list[np.ndarray] = []
    total = 0
    pending = iter(files)
    head: CorpusFile | None = next(pending, None)
    while head is not None and (max_tokens is None or total < max_tokens):
        if _file_chars_at_most(head.path) > piece_chars:
            need = None if max_tokens is None else max(max_tokens - total, min_tokens)
            docs = [_stream_tokens(head.path, tokenizer, need, piece_chars)]
            head = next(pending, None)
        else:
            texts: list[str] = []
            size = 0
            while head is not None and len(texts) < _BATCH_FILES and size < _BATCH_CHARS \
                    and (chars := _file_chars_at_most(head.path)) <= piece_chars:
                texts.append(_read(head.path))
                size += chars
                head = next(pending, None)
            docs = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        for ids in docs:
            total = append_capped(out, ids, total, min_tokens, max_tokens)
            if max_tokens is not None and total >= max_tokens:
                return out
    return out


def _file_chars_at_most(path: Path) -> int:
    """An upper bound of the characters of a UTF-8 file: its bytes (a bad byte reads as one U+FFFD)."""
    return path.stat().st_size


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stream_tokens(path: Path, tokenizer: Any, need: int | None, piece_chars: int) -> np.ndarray:
    """The token ids of one file read in pieces, at least ``need`` of them (all: None) where the
    file has them; the first piece is small, so a few tokens need little reading."""
    parts: list[np.ndarray] = []
    count = 0
    for piece in text_pieces(path, tokenizer, piece_chars,
                             first_chars=_FIRST_PIECE_CHARS if need is not None else piece_chars):
        ids = np.asarray(tokenizer.encode(piece, add_special_tokens=False).ids, dtype=np.int64)
        parts.append(ids)
        count += ids.size
        if need is not None and count >= need:
            break
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def text_pieces(path: Path, tokenizer: Any, piece_chars: int = PIECE_CHARS,
                first_chars: int | None = None) -> Iterator[str]:
    """The text of ``path`` (UTF-8, bad bytes replaced, universal newlines as ``read_text``) in
    pieces of at most about ``piece_chars`` characters (``first_chars`` for the first, growing),
    each cut before the second-to-last pre-token the tokenizer's pre-tokenizer finds in it:
    regex pre-tokenization looks only a character or so ahead, so the pieces' token ids
    concatenate to the whole text's. A single pre-token longer than ``4 * piece_chars``
    (a run of 4 MiB of letters) is cut where it is, to keep memory bounded."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers tokenizer's own
    pre = getattr(backend, "pre_tokenizer", None)
    size = first_chars or piece_chars
    with open(path, encoding="utf-8", errors="replace") as f:
        carry = ""
        while block := f.read(size):
            size = min(size * 4, piece_chars)
            text = carry + block
            cut = _cut(text, pre)
            if cut == 0 and len(text) < 4 * piece_chars:
                carry = text
                continue
            cut = cut or len(text)
            yield text[:cut]
            carry = text[cut:]
        if carry:
            yield carry


def _cut(text: str, pre_tokenizer: Any) -> int:
    """Where ``text`` may be cut so that what follows is pre-tokenized as in the whole text: the
    start of its second-to-last pre-token (0: no safe cut yet). Without a pre-tokenizer, after
    the last line break that is followed by more text."""
    if pre_tokenizer is None:
        return text.rfind("\n", 0, len(text) - 1) + 1
    spans = pre_tokenizer.pre_tokenize_str(text)
    return spans[-2][1][0] if len(spans) >= 3 else 0
