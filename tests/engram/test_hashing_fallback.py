"""The hash kernel's NumPy fallback against the C kernel, both in one process.

Each path is run on its own hasher and its own ``SequenceHistory``, step after step, so a
fallback that remembers history in the wrong order (or a kernel that does) differs at the
first step that reads it, in the default run and not only under ``ENGRAM_OFFLOAD_NO_NATIVE``.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.engram.hashing import NgramHasher, native_kernel

from test_hashing import SMALL, TOKEN_MAP, VOCAB

pytestmark = [pytest.mark.native,
              pytest.mark.skipif(native_kernel() is None, reason="the native hash kernel is not built")]


def _pair() -> tuple[NgramHasher, NgramHasher]:
    native, fallback = NgramHasher(SMALL, TOKEN_MAP), NgramHasher(SMALL, TOKEN_MAP)
    fallback._kernel = None
    return native, fallback


# A decode schedule: per step, which of 6 sequences take a token, and the tokens.
steps = st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, VOCAB - 1)), min_size=1, max_size=6,
                          unique_by=lambda pair: pair[0]), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(steps, st.booleans())
def test_decode_steps_agree_and_leave_the_same_history(schedule, flat):
    native, fallback = _pair()
    histories = native.new_history(capacity=2), fallback.new_history(capacity=2)  # grows on the way
    for step in schedule:
        seq_ids = [seq for seq, _ in step]
        tokens = np.array([token for _, token in step], np.int64)
        got = [hasher.decode_ids(history, seq_ids, tokens, flat=flat)
               for hasher, history in zip((native, fallback), histories)]
        np.testing.assert_array_equal(got[0], got[1])
        native_slots, fallback_slots = (h.slots_for(seq_ids) for h in histories)
        np.testing.assert_array_equal(histories[0].tokens[native_slots], histories[1].tokens[fallback_slots])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), st.integers(1, 5))
def test_pieces_then_decode_agree_with_hashing_whole(tokens, split):
    """A prefill piece then decode steps, on both paths, equal hashing the sequence whole."""
    native, fallback = _pair()
    whole = native.hash_all(np.array([tokens])).numpy()[0]  # [P, L, C]
    split = min(split, len(tokens))
    for hasher in (native, fallback):
        history = hasher.new_history()
        parts = [hasher.pieces_ids(history, [7], [np.array(tokens[:split])])]
        parts += [hasher.decode_ids(history, [7], [token]) for token in tokens[split:]]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
