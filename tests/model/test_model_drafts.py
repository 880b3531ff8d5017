"""The trained model's predictions as drafts (``bench --drafts model[:K]``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from engram_offload.model.drafts import STRIDE, WINDOW, ModelPredictor
from engram_offload.model.lm import UNKNOWN


def _top1(model, tokens: np.ndarray) -> np.ndarray:
    """The model's top-1 next DeepSeek token over one window, -1 for the "other" class."""
    with torch.no_grad():
        top = model(torch.from_numpy(tokens)[None]).argmax(-1)[0].numpy()
    return np.where(top == UNKNOWN, -1, model.vocab_ids.numpy()[np.maximum(top - 1, 0)])


def test_a_short_sequence_is_the_models_top1_at_every_position(model, held_out_pieces):
    predictor = ModelPredictor()
    predictor._model = model
    tokens = np.concatenate([np.asarray(p) for p in held_out_pieces])[:100]
    got = predictor(tokens)
    assert got.shape == tokens.shape
    assert np.array_equal(got, _top1(model, tokens))
    assert (got >= 0).mean() > 0.3  # many predictions are tokens of its vocabulary
    assert (got[:-1] == tokens[1:]).mean() > 0.1  # and some are right (16% here)


def test_a_long_sequence_takes_each_position_from_a_window_with_context_and_never_sees_ahead(model, held_out_pieces):
    predictor = ModelPredictor()
    predictor._model = model
    tokens = np.concatenate([np.asarray(p) for p in held_out_pieces])[: 3 * WINDOW + 17]
    got = predictor(tokens)
    # position p comes from a window of WINDOW tokens whose start leaves p at least WINDOW - STRIDE of context
    for p in (0, WINDOW - 1, WINDOW, 2 * WINDOW + 5, tokens.size - 1):
        start = 0 if p < WINDOW else min(tokens.size - WINDOW, (p - (WINDOW - STRIDE)) // STRIDE * STRIDE)
        assert start <= p < start + WINDOW and (p < WINDOW or p - start >= WINDOW - STRIDE - 1)
        assert got[p] == _top1(model, tokens[start: start + WINDOW])[p - start], p
    # later tokens changed: no earlier prediction moves
    changed = tokens.copy()
    changed[200:] = changed[200:][::-1]
    assert np.array_equal(predictor(changed)[:200], got[:200])


def test_the_predictor_pickles_as_its_folder(model_dir):
    predictor = ModelPredictor(model_dir)
    predictor.model()
    copy = pickle.loads(pickle.dumps(predictor))
    assert copy.directory == str(model_dir) and copy._model is None
    assert np.array_equal(copy(np.arange(1000, 1040)), predictor(np.arange(1000, 1040)))


def _expected_everywhere(model, tokens: np.ndarray) -> np.ndarray:
    """Each position's prediction from the window the predictor should use for it: windows of
    WINDOW tokens STRIDE apart (the last ending at the sequence's end), a position taken from
    the latest window that leaves it at least WINDOW - STRIDE tokens of context (or the first)."""
    n = tokens.size
    width = min(WINDOW, n)
    starts = sorted(set(range(0, n - width + 1, STRIDE)) | {n - width})
    tops = {s: _top1(model, tokens[s: s + width]) for s in starts}
    want = np.empty(n, np.int64)
    for p in range(n):
        s = max([s for s in starts if p - s >= width - STRIDE], default=0)
        want[p] = tops[s][p - s]
    return want


def test_every_position_of_sequences_of_awkward_lengths_takes_its_window(model, held_out_pieces):
    predictor = ModelPredictor()
    predictor._model = model
    text = np.concatenate([np.asarray(p) for p in held_out_pieces])
    # the first position predicts a token of the vocabulary here, so a missed position 0 shows
    offset = next(o for o in range(200) if _top1(model, text[o: o + 8])[0] >= 0)
    for n in (1, 255, 256, 401):  # 255: the last window start falls exactly on a stride
        tokens = text[offset: offset + n]
        assert np.array_equal(predictor(tokens), _expected_everywhere(model, tokens)), n
    assert predictor(np.empty(0, np.int64)).shape == (0,)
    tokens = text[offset: offset + 300]
    assert np.array_equal(predictor(tokens.astype(np.int32)), predictor(tokens))


def test_more_windows_than_a_batch(model, held_out_pieces):
    predictor = ModelPredictor()
    predictor._model = model
    text = np.concatenate([np.asarray(p) for p in held_out_pieces] * 2)
    tokens = text[: 66 * STRIDE + WINDOW]  # 67 windows: two forward passes
    assert tokens.size == 66 * STRIDE + WINDOW
    got = predictor(tokens)
    for p in (64 * STRIDE + 70, tokens.size - 1):  # positions in the second pass
        s = (p - (WINDOW - STRIDE)) // STRIDE * STRIDE
        assert got[p] == _top1(model, tokens[s: s + WINDOW])[p - s], p


def test_a_missing_model_folder_is_an_error(tmp_path):
    with pytest.raises((OSError, ValueError)):
        ModelPredictor(tmp_path / "no-model").model()
