"""The benchmark's prompt-lookup drafter."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.bench.drafts import make_drafter, ngram_draft


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
    assert make_drafter("ngram")(np.array([1, 2, 1])).tolist() == [2]
    assert make_drafter("ngram:3")(np.array([1, 2, 3, 4, 1])).tolist() == [2, 3, 4]
    for bad, message in [("ngram:0", ">= 1"), ("ngram:x", "whole number"), ("mtp", "choose none or ngram")]:
        with pytest.raises(ValueError, match=message):
            make_drafter(bad)
