"""Draft tokens for the serving benchmark: what speculative decoding would propose next.

``ngram[:K]`` is prompt-lookup decoding (as vLLM's and SGLang's n-gram speculators do): the
K tokens that followed the last earlier occurrence of the sequence's current suffix in its
own history, trying the longest suffix first (``MAX_NGRAM`` tokens down to 1); no match, no
draft. ``model[:K]`` takes the K tokens a language model predicts next (standing in for an MTP
head): a ``Predictor`` handed in by the caller (``model.drafts`` builds one from the trained
model), run once per sequence over its whole token array (teacher forced, so a position's
prediction sees only the tokens before it), its first prediction exactly the model's top-1
continuation and later ones those after the true tokens (the greedy continuation whenever the
earlier drafts are right). The benchmark hands them to ``Prefetcher.begin_step(..., drafts=)``,
which fetches their rows a step early; a right draft makes the next step's rows hits, a wrong
one costs reads. ``none`` (the default) drafts nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

__all__ = ["DRAFT_KINDS", "Drafter", "MAX_NGRAM", "PredictedDrafter", "Predictor", "draft_kind", "make_drafter",
           "ngram_draft"]

# a sequence's token array and how many of its tokens are known so far -> its draft tokens
Drafter = Callable[[np.ndarray, int], np.ndarray]
# a sequence's tokens int64 [n] -> int64 [n]: the token predicted after each position (-1: none)
Predictor = Callable[[np.ndarray], np.ndarray]
MAX_NGRAM = 3  # the longest suffix looked up
DEFAULT_K = 1
DRAFT_KINDS = ("none", "ngram", "model")
KEPT_SEQUENCES = 4096  # sequences whose predictions a PredictedDrafter keeps


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


class PredictedDrafter:
    """Drafts of ``k`` tokens from a ``Predictor``, run once per sequence token array (the
    most recent ``KEPT_SEQUENCES`` kept): after ``tokens[:known]``, the predictions at
    positions ``known - 1 ..``, cut at the first position with none."""

    def __init__(self, predict: Predictor, k: int) -> None:
        self.predict = predict
        self.k = k
        self._kept: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # id -> (tokens, predictions)

    def predictions(self, tokens: np.ndarray) -> np.ndarray:
        kept = self._kept.get(id(tokens))
        if kept is None or kept[0] is not tokens:  # a new array (an id may be reused once one is freed)
            predicted = np.asarray(self.predict(tokens), dtype=np.int64)
            if predicted.shape != tokens.shape:
                raise ValueError(f"the draft predictor gave {predicted.shape} predictions for {tokens.shape} tokens")
            kept = (tokens, predicted)
            self._kept[id(tokens)] = kept
            while len(self._kept) > KEPT_SEQUENCES:
                self._kept.popitem(last=False)
        return kept[1]

    def __call__(self, tokens: np.ndarray, known: int) -> np.ndarray:
        draft = self.predictions(tokens)[known - 1: known - 1 + self.k]
        missing = np.flatnonzero(draft < 0)
        return (draft[: missing[0]] if missing.size else draft).copy()


def draft_kind(spec: str) -> tuple[str, int]:
    """``--drafts`` -> (kind, K); ``ValueError`` in one line for anything else."""
    kind, _, count = spec.strip().partition(":")
    if kind not in DRAFT_KINDS or (kind == "none" and count):
        raise ValueError(f"--drafts {spec!r}: choose none, ngram[:K] (prompt lookup, K draft tokens) or model[:K] "
                         "(the trained model's next K tokens)")
    try:
        k = int(count) if count else DEFAULT_K
    except ValueError:
        raise ValueError(f"--drafts {spec!r}: K must be a whole number of draft tokens") from None
    if k < 1:
        raise ValueError(f"--drafts {spec!r}: K must be >= 1")
    return kind, k


def make_drafter(spec: str, predictor: Predictor | None = None) -> Drafter | None:
    """``none`` -> None; ``ngram[:K]`` -> a prompt-lookup drafter of K tokens (default 1);
    ``model[:K]`` -> ``predictor``'s next K tokens (``ValueError`` without one)."""
    kind, k = draft_kind(spec)
    if kind == "none":
        return None
    if kind == "ngram":
        return lambda tokens, known: ngram_draft(tokens[:known], k)
    if predictor is None:
        raise ValueError(f"--drafts {spec!r} needs a model to predict with: the command line loads the trained "
                         "model (engram_offload.model.drafts.ModelPredictor)")
    return PredictedDrafter(predictor, k)
