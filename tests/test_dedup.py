"""dedup: unique + inverse over a step's row ids."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engram_offload.dedup import dedup


@settings(max_examples=80, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(1, 6)),
              elements=st.integers(0, 50)))
def test_unique_inverse_round_trip(ids):
    d = dedup(ids)
    assert (d.unique == np.unique(ids)).all()
    assert (d.unique[d.inverse] == ids.reshape(-1)).all()
    assert d.shape == ids.shape
    assert d.requested == ids.size
    assert 0 < d.ratio <= 1 or ids.size == 0


def test_expand_restores_the_step_shape():
    ids = torch.tensor([[[4, 4], [9, 1]], [[1, 4], [9, 9]]])  # [B, L, C]
    d = dedup(ids)
    rows = torch.from_numpy(d.unique).float()[:, None].expand(-1, 3)  # [u, 3]
    out = d.expand(rows)
    assert out.shape == (2, 2, 2, 3)
    assert torch.equal(out[..., 0], ids.float())
    assert d.ratio == 3 / 8


def test_empty_step():
    d = dedup(np.empty((0, 2, 4), np.int64))
    assert d.unique.size == 0 and d.ratio == 1.0


@settings(max_examples=40, deadline=None)
@given(arrays(np.int64, st.integers(1, 300), elements=st.sampled_from([0, 7, 2**40, 2**55 + 3, 2**62, -5])))
def test_ids_too_large_to_pack_still_dedup(ids):
    d = dedup(ids)
    assert (d.unique == np.unique(ids)).all()
    assert (d.unique[d.inverse] == ids).all()


def test_dedup_leaves_the_callers_ids_alone():
    ids = np.array([5, 3, 5, 1], np.int64)
    dedup(ids)
    assert ids.tolist() == [5, 3, 5, 1]
