"""Which n-grams a model saw in training, kept as a Bloom filter beside the checkpoint.

An Engram row is shared by every n-gram that hashes to it, so a row read for an n-gram never
seen in training holds what colliding n-grams wrote there. ``SeenNgrams`` remembers the
(compressed) 2- to ``max_n``-grams of every training window, so that ``scan`` can tell the
reads of unseen n-grams from the others and report the gate on each. With ``BITS`` bits and
``HASHES`` hash functions, an unseen n-gram is taken for a seen one with probability about
``(1 - exp(-HASHES * n / BITS)) ** HASHES`` for ``n`` distinct n-grams (0.1% at a million, 1.5% at three million).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..engram.hashing import NgramHasher

__all__ = ["SeenNgrams", "ngram_keys", "SEEN_NGRAMS"]

SEEN_NGRAMS = "seen_ngrams.npy"
BITS = 1 << 25
HASHES = 3
_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], dtype=np.uint64)


def ngram_keys(hasher: NgramHasher, input_ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """DeepSeek ids ``[B, T]`` -> uint64 keys ``[B, T, N-1]`` of the 2- to N-gram ending at each
    position (compressed ids, the pad id before the window's start, as the Engram hash reads them)."""
    comp = hasher.compress(np.asarray(input_ids))  # [B, T]
    n = hasher.config.max_ngram_size
    b, t = comp.shape
    padded = np.concatenate([np.full((b, n - 1), hasher.pad, np.int64), comp], axis=1)  # [B, T+n-1]
    base = np.uint64(hasher.compressed_vocab_size + 1)
    keys = []
    key = padded[:, n - 1:].astype(np.uint64)
    for k in range(1, n):  # the k-th token back
        key = key * base + padded[:, n - 1 - k: n - 1 - k + t].astype(np.uint64)
        keys.append(key * np.uint64(8) + np.uint64(k + 1))  # the order in the low bits
    return np.stack(keys, axis=-1)


class SeenNgrams:
    """A Bloom filter of n-gram keys (``ngram_keys``)."""

    def __init__(self, bits: np.ndarray | None = None) -> None:
        self.bits = np.zeros(BITS, bool) if bits is None else bits

    @staticmethod
    def _slots(keys: np.ndarray) -> np.ndarray:
        flat = keys.reshape(-1, 1).astype(np.uint64)
        return ((flat * _MULTIPLIERS) >> np.uint64(64 - BITS.bit_length() + 1)).astype(np.int64)  # [K, HASHES]

    def add(self, keys: np.ndarray) -> None:
        self.bits[self._slots(keys).reshape(-1)] = True

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """bool, the shape of ``keys``: True where the key was (probably) added."""
        return self.bits[self._slots(keys)].all(axis=1).reshape(keys.shape)

    def save(self, folder: str | os.PathLike[str]) -> None:
        from ..atomic import atomic_path

        with atomic_path(Path(folder) / SEEN_NGRAMS) as tmp, open(tmp, "wb") as f:
            np.save(f, np.packbits(self.bits))

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> "SeenNgrams | None":
        """The filter saved in ``folder``; None when there is none."""
        path = Path(folder) / SEEN_NGRAMS
        if not path.is_file():
            return None
        return cls(np.unpackbits(np.load(path))[:BITS].astype(bool))
