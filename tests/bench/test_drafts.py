"""The benchmark's prompt-lookup drafter."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.bench import drafts
from engram_offload.bench.drafts import PredictedDrafter, make_drafter, ngram_draft


def test_the_tokens_after_the_last_earlier_match_of_the_longest_suffix():
    h = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])  # suffix [2, 3]: last earlier at 7..8
    assert ngram_draft(h, 2).tolist() == [7, 8]
    # the 3-token suffix [1, 2, 3] wins over shorter ones: after its last earlier occurrence
    h = np.array([1, 2, 3, 4, 2, 3, 5, 1, 2, 3])
    assert ngram_draft(h, 1).tolist() == [4]
    assert ngram_draft(np.array([1, 2, 3]), 2).size == 0  # nothing recurs
    assert ngram_draft(np.array([4, 4]), 3).tolist() == [4]  # as many as the history holds
    assert ngram_draft(np.array([7]), 1).size == 0


def test_draft_specs():
    assert make_drafter("none") is None
    assert make_drafter("ngram")(np.array([1, 2, 1]), 3).tolist() == [2]
    assert make_drafter("ngram:3")(np.array([1, 2, 3, 4, 1]), 5).tolist() == [2, 3, 4]
    assert make_drafter("ngram:3")(np.array([1, 2, 3, 4, 1, 9, 9]), 5).tolist() == [2, 3, 4]  # later tokens unseen
    for bad, message in [("ngram:0", ">= 1"), ("ngram:x", "whole number"), ("none:2", "choose none"),
                         ("mtp", "choose none, ngram[:K] (prompt lookup, K draft tokens) or model[:K] "
                                 "(the trained model's next K tokens)"),
                         ("model:2", "needs a model to predict with: the command line loads the trained model "
                                     "(engram_offload.model.drafts.ModelPredictor)")]:
        with pytest.raises(ValueError) as caught:
            make_drafter(bad)
        assert message in str(caught.value)


def test_a_prompt_lookup_matches_every_token_of_the_suffix():
    # [1, 9, 3] agrees with the suffix [1, 2, 3] at its ends only: the real match is the first
    assert ngram_draft(np.array([1, 2, 3, 1, 9, 3, 7, 1, 2, 3]), 1).tolist() == [1]
    # int64 drafts from any integer history, a match or none
    assert ngram_draft(np.array([5, 6, 5], np.int32), 1).dtype == np.int64
    assert ngram_draft(np.array([5, 6], np.int32), 1).dtype == np.int64


class CountingPredictor:
    """Predicts token + 1 after every position, -1 after a token 0; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.where(tokens == 0, -1, tokens + 1)


def test_model_drafts_take_the_predictions_after_the_known_tokens():
    predictor = CountingPredictor()
    drafter = make_drafter("model:3", predictor)
    tokens = np.array([5, 6, 7, 0, 9, 10])
    assert drafter(tokens, 1).tolist() == [6, 7, 8]  # after 5: the predictions at positions 0, 1, 2
    assert drafter(tokens, 2).tolist() == [7, 8]  # cut at position 3's "none"
    assert drafter(tokens, 5).tolist() == [10, 11]  # as many as the sequence holds
    assert predictor.calls == 1  # one run per sequence array
    other = tokens.copy()
    assert drafter(other, 1).tolist() == [6, 7, 8] and predictor.calls == 2
    assert make_drafter("model", predictor)(tokens, 1).tolist() == [6]  # K defaults to 1


def test_token_zero_is_a_draft_and_drafts_are_int64():
    drafter = make_drafter("model:2", lambda tokens: np.array([0, 0, -1, 4], np.int32))  # token 0 is a real token
    got = drafter(np.arange(4, dtype=np.int32), 1)
    assert got.tolist() == [0, 0] and got.dtype == np.int64
    assert drafter(np.arange(4), 2).tolist() == [0]


def test_a_predictor_of_the_wrong_shape_is_refused():
    drafter = PredictedDrafter(lambda tokens: tokens[:-1], 2)
    with pytest.raises(ValueError, match="predictions for"):
        drafter(np.arange(4), 1)


def test_kept_predictions_are_bounded(monkeypatch):
    monkeypatch.setattr(drafts, "KEPT_SEQUENCES", 2)
    predictor = CountingPredictor()
    drafter = PredictedDrafter(predictor, 1)
    arrays = [np.arange(1, 5) for _ in range(3)]
    for a in arrays:
        drafter(a, 1)
    assert len(drafter._kept) == 2 and predictor.calls == 3
    drafter(arrays[0], 2)  # dropped as the oldest: predicted again
    assert predictor.calls == 4
