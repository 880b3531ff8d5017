"""Draft tokens for the serving benchmark: what speculative decoding would propose next.

``ngram[:K]`` is prompt-lookup decoding (as vLLM's and SGLang's n-gram speculators do): the
K tokens that followed the last earlier occurrence of the sequence's current suffix in its
own history, trying the longest suffix first (``MAX_NGRAM`` tokens down to 1); no match, no
draft. The benchmark hands them to ``Prefetcher.begin_step(..., drafts=)``, which fetches
their rows a step early; a right draft makes the next step's rows hits, a wrong one costs
reads. ``none`` (the default) drafts nothing.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["DRAFT_KINDS", "Drafter", "MAX_NGRAM", "make_drafter", "ngram_draft"]

Drafter = Callable[[np.ndarray], np.ndarray]  # a sequence's tokens so far -> its draft tokens
MAX_NGRAM = 3  # the longest suffix looked up
DEFAULT_K = 1
DRAFT_KINDS = ("none", "ngram")


def ngram_draft(history: np.ndarray, k: int, max_n: int = MAX_NGRAM) -> np.ndarray:
    """The ``k`` tokens after the last earlier occurrence of ``history``'s longest matching
    suffix (``max_n`` tokens down to 1); empty when no suffix recurs."""
    h = np.asarray(history)
    for n in range(min(max_n, h.size - 1), 0, -1):
        suffix = h[-n:]
        # starts of earlier occurrences: the suffix's first token, then the others agree
        starts = np.flatnonzero(h[: h.size - n] == suffix[0])
        for j in range(1, n):
            starts = starts[h[starts + j] == suffix[j]]
        if starts.size:
            at = int(starts[-1]) + n
            return h[at: at + k].astype(np.int64, copy=False)
    return np.empty(0, np.int64)


def make_drafter(spec: str) -> Drafter | None:
    """``none`` -> None; ``ngram`` or ``ngram:K`` -> a prompt-lookup drafter of K tokens
    (default 1). ``ValueError`` in one line for anything else."""
    kind, _, count = spec.strip().partition(":")
    if kind == "none" and not count:
        return None
    if kind != "ngram":
        raise ValueError(f"--drafts {spec!r}: choose none or ngram[:K] (prompt lookup, K draft tokens)")
    try:
        k = int(count) if count else DEFAULT_K
    except ValueError:
        raise ValueError(f"--drafts {spec!r}: K must be a whole number of draft tokens") from None
    if k < 1:
        raise ValueError(f"--drafts {spec!r}: K must be >= 1")
    return lambda history: ngram_draft(history, k)
