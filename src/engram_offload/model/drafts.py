"""The trained model's own next tokens as drafts (``bench --drafts model[:K]``), standing in
for an MTP head: ``ModelPredictor`` gives ``bench.drafts`` each position's top-1 next token.

The model reads a sequence in windows of ``WINDOW`` tokens (its training length), ``STRIDE``
apart; each position takes its prediction from the window that gives it the most context
(at least ``WINDOW - STRIDE`` tokens once the sequence is that long). Attention is causal and
Engram rows hash the tokens up to their position, so no prediction sees a later token.
Tokens outside the model's vocabulary cannot be predicted: a position whose top-1 is the
"other" class predicts nothing (-1), and the draft stops there.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .checkpoint_io import load_model
from .lm import UNKNOWN, EngramLM

__all__ = ["ModelPredictor", "STRIDE", "WINDOW"]

WINDOW = 128  # tokens a window holds: the shipped model's training length
STRIDE = 64  # between window starts
BATCH = 64  # windows a forward pass takes


class ModelPredictor:
    """Top-1 next DeepSeek token of every position of a sequence (``bench.drafts.Predictor``).

    ``directory``: a model folder written by ``train`` (default: the shipped model), loaded on
    first use with its own Engram table, so it pickles as its folder alone (a benchmark run in
    a child process loads it there).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = None if directory is None else os.fspath(directory)
        self._model: EngramLM | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "_model": None}

    def model(self) -> EngramLM:
        if self._model is None:
            self._model = load_model(self.directory)
        return self._model

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` int64 [n] -> int64 [n]: the token predicted after each position (-1: none)."""
        model = self.model()
        tokens = np.asarray(tokens, dtype=np.int64)
        n = tokens.size
        predicted = np.full(n, -1, np.int64)
        if n == 0:
            return predicted
        width = min(WINDOW, n)
        starts = list(range(0, n - width + 1, STRIDE))
        if starts[-1] != n - width:
            starts.append(n - width)
        # position p takes the window that starts latest at or before p - (WINDOW - STRIDE):
        # the first window serves its whole span, each later one its positions past the last
        # one's useful end
        ends = [starts[i + 1] + width - STRIDE if i + 1 < len(starts) else n for i in range(len(starts))]
        firsts = [0] + ends[:-1]
        windows = torch.from_numpy(np.stack([tokens[s: s + width] for s in starts]))  # [W, width]
        vocab = model.vocab_ids.numpy()  # [K]: the DeepSeek id of model id k + 1
        with torch.no_grad():
            for b in range(0, len(starts), BATCH):
                top = model(windows[b: b + BATCH]).argmax(-1)  # [w, width] model ids
                for i, row in enumerate(top.numpy(), start=b):
                    lo, hi = firsts[i], ends[i]
                    ids = row[lo - starts[i]: hi - starts[i]]
                    known = ids != UNKNOWN
                    out = predicted[lo:hi]
                    out[known] = vocab[ids[known] - 1]
        return predicted
