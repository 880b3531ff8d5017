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
from typing import Any, Iterable

import numpy as np

from ..engram.tokenizer import encode_documents

__all__ = ["CorpusFile", "corpus_files", "split", "token_sequences", "DOCS_ROOT", "EOS_ID", "HELD_OUT_EVERY"]

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


def token_sequences(files: Iterable[CorpusFile], tokenizer: Any, max_tokens: int | None = None,
                    min_tokens: int = 16) -> list[np.ndarray]:
    """DeepSeek token ids (int64) of each file in order, ``max_tokens`` in all."""
    texts = (f.path.read_text(encoding="utf-8", errors="replace") for f in files)
    return encode_documents(texts, tokenizer, max_tokens, min_tokens)
