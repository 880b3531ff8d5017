"""Helpers of the corpus tests: the bytes this process has read, and a tokenizer of one token a
character that records what it was asked to encode."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

BOS_ID = 0


def read_bytes() -> int:
    """Bytes this process has read through read(2) and friends so far (/proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


class CharTokenizer:
    """One token a character (its code point), no pre-tokenizer; like a Hugging Face tokenizer it
    puts a BOS token first unless told ``add_special_tokens=False``. ``encoded`` lists the length
    of every text given to ``encode``, ``batches`` those given to each ``encode_batch``."""

    def __init__(self) -> None:
        self.encoded: list[int] = []
        self.batches: list[list[int]] = []

    def _ids(self, text: str, add_special_tokens: bool) -> SimpleNamespace:
        return SimpleNamespace(ids=[BOS_ID] * add_special_tokens + [ord(c) for c in text])

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.encoded.append(len(text))
        return self._ids(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[SimpleNamespace]:
        self.batches.append([len(t) for t in texts])
        return [self._ids(t, add_special_tokens) for t in texts]
