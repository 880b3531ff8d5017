"""The C hit path and the NumPy one leave identical slots, pins and policy state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.cache import LFUPolicy, LRUPolicy, RowCache
from engram_offload.cache.row_cache import native_hitpath
from engram_offload.serving.store import TableStore

from cache_fakes import FakeTier, small_config

needs_native = pytest.mark.skipif(native_hitpath() is None, reason="cache._hitpath not built (or disabled)")

RB = 8
NUM_ROWS = 60
CAPACITY = 12


def make_pair(monkeypatch, policy: str, index: str, instance: bool) -> tuple[RowCache, RowCache]:
    """The same cache twice: with the C hit path, and with NumPy only."""

    def build() -> RowCache:
        pol = policy
        if instance:  # a policy object: separate (unstrided) arrays, short aging period
            pol = LFUPolicy(CAPACITY, aging_period=7, max_count=5) if policy == "lfu" else LRUPolicy(CAPACITY)
        return RowCache(CAPACITY * RB, RB, pol, evict_batch=2, num_rows=NUM_ROWS, index=index)

    native = build()
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    fallback = build()
    monkeypatch.delenv("ENGRAM_OFFLOAD_NO_NATIVE")
    assert native.native and not fallback.native
    return native, fallback


def state(cache: RowCache) -> dict:
    policy = cache.policy
    keys, slots = cache.index.items()
    order = np.argsort(keys)
    return {
        "pins": cache.pins.copy(),
        "ready": cache.ready.copy(),
        "slot_id": cache.slot_id.copy(),
        "index": (keys[order], slots[order]),
        "stamp": policy.stamp.copy(),
        "count": getattr(policy, "count", np.zeros(0)).copy(),
        "clock": policy.clock,
        "since_aging": getattr(policy, "_since_aging", 0),
        "free": cache._free[: cache._nfree].copy(),
        "evictions": cache.evictions,
    }


def assert_same(a: RowCache, b: RowCache) -> None:
    sa, sb = state(a), state(b)
    for key in sa:
        if isinstance(sa[key], tuple):
            for x, y in zip(sa[key], sb[key]):
                np.testing.assert_array_equal(x, y, err_msg=key)
        else:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


def rows_of(ids: np.ndarray) -> torch.Tensor:
    """Row bytes derived from the ids (what a fill writes)."""
    return torch.from_numpy(np.repeat(ids[:, None], RB, 1).astype(np.uint8))

ids_lists = st.lists(st.integers(0, NUM_ROWS - 1), min_size=0, max_size=14).map(
    lambda v: np.unique(np.array(v, np.int64)))
ops = st.lists(st.tuples(st.sampled_from(["acquire", "into", "release", "fill", "reserve", "publish", "abandon"]),
                         ids_lists, st.integers(0, 1000)), max_size=40)


@needs_native
@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), index=st.sampled_from(["direct", "hash"]),
       instance=st.booleans(), steps=ops)
def test_native_and_numpy_agree_over_random_interleavings(policy, index, instance, steps):
    with pytest.MonkeyPatch.context() as mp:
        caches = make_pair(mp, policy, index, instance)
    held: list[list[np.ndarray]] = [[], []]  # per cache: acquired slot sets not yet released
    pending: list[list[np.ndarray]] = [[], []]  # per cache: reserved slot sets not yet published
    for op, ids, pick in steps:
        results = []
        for k, cache in enumerate(caches):
            if op == "acquire":
                slots, hits = cache.acquire_counted(ids)
                assert hits == int(np.count_nonzero(slots >= 0))
                held[k].append(slots)
                results.append(slots)
            elif op == "into":  # look up and, when everything hits, copy (pinned or not)
                out = np.zeros((ids.size, RB), np.uint8)
                slots, hits = cache.acquire_into(ids, out, pin=bool(pick % 2))
                if hits < ids.size or pick % 2:
                    held[k].append(slots)
                results.append(np.concatenate([slots, out.reshape(-1).astype(np.int64)]))
            elif op == "release" and held[k]:
                cache.release(held[k].pop(pick % len(held[k])))
            elif op == "fill":
                results.append(cache.fill(ids, rows_of(ids)))
            elif op == "reserve":
                slots = cache.reserve(ids)
                pending[k].append(slots)
                results.append(slots)
            elif op == "publish" and pending[k]:
                slots = pending[k].pop(pick % len(pending[k]))
                kept = slots[slots >= 0]
                cache.write(kept, rows_of(cache.slot_id[kept]))  # bytes first, then visible
                cache.publish(slots)
            elif op == "abandon" and pending[k]:
                cache.abandon(pending[k].pop(pick % len(pending[k])))
        if results:
            np.testing.assert_array_equal(results[0], results[1])
        assert_same(*caches)
    for k, cache in enumerate(caches):
        for slots in held[k]:
            cache.release(slots)
        for slots in pending[k]:
            cache.abandon(slots)
        cache.check()
        assert cache.pinned() == 0
    assert_same(*caches)


@needs_native
@pytest.mark.parametrize("index", ["direct", "hash"])
def test_native_errors_change_nothing(monkeypatch, index):
    caches = make_pair(monkeypatch, "lfu", index, False)
    ids = np.array([1, 5, 9], np.int64)
    for cache in caches:
        cache.fill(ids, torch.zeros(3, RB, dtype=torch.uint8))
        slots = cache.acquire(ids)
        cache.release(slots)
        with pytest.raises(RuntimeError, match="released more often"):
            cache.release(slots)  # pins back to zero: a second release is a bug
    assert_same(*caches)
    if index == "direct":
        for cache in caches:
            with pytest.raises(IndexError):
                cache.acquire(np.array([2, NUM_ROWS], np.int64))  # outside the direct index
        assert_same(*caches)


@needs_native
def test_native_takes_any_integer_layout(monkeypatch):
    caches = make_pair(monkeypatch, "lru", "direct", False)
    ids = np.arange(0, 20, 2, dtype=np.int64)
    for cache in caches:
        cache.fill(ids, torch.zeros(ids.size, RB, dtype=torch.uint8))
    strided = np.arange(0, 40, dtype=np.int32)[::4]  # int32, not contiguous: 0, 4, ..., 36
    got = [cache.acquire(strided) for cache in caches]
    np.testing.assert_array_equal(got[0], got[1])
    for cache, slots in zip(caches, got):
        cache.release(slots[::-1][::-1])  # a strided view of the slots
    assert_same(*caches)


def test_fetch_checks_ids_with_and_without_native(monkeypatch):
    for disable in (False, True):
        if disable:
            monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
        config = small_config()
        tier = FakeTier(config.num_rows, config.row_bytes)
        store = TableStore(tier, config, [RowCache(64 * config.row_bytes, config.row_bytes,
                                                    num_rows=config.num_rows)])
        with pytest.raises(ValueError, match="sorted distinct"):
            store.fetch(np.array([3, 1], np.int64))
        with pytest.raises(IndexError):
            store.fetch(np.array([1, config.num_rows], np.int64))
        ids = np.array([2, 7, 11], np.int32)
        for _ in range(2):  # a miss, then a hit in the first level
            with store.fetch(ids) as lease:
                assert torch.equal(lease.raw, tier.rows[torch.from_numpy(ids.astype(np.int64))])
        assert store.levels[0].pinned() == 0


@needs_native
@pytest.mark.parametrize("index", ["direct", "hash"])
def test_large_batches_agree(monkeypatch, index):
    """Batches big enough for the helper to let go of the GIL, with copies, both policies."""
    for policy in ("lru", "lfu"):
        caches = []
        for disable in (False, True):
            if disable:
                monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
            caches.append(RowCache(30_000 * RB, RB, policy, num_rows=100_000, index=index))
            monkeypatch.delenv("ENGRAM_OFFLOAD_NO_NATIVE", raising=False)
        rng = np.random.default_rng(1)
        ids = np.sort(rng.choice(100_000, 25_000, replace=False))
        rows = torch.from_numpy(rng.integers(0, 256, (ids.size, RB), dtype=np.uint8))
        ask = np.sort(rng.choice(100_000, 20_000, replace=False))
        outs = []
        for cache in caches:
            cache.fill(ids, rows)
            slots, hits = cache.acquire_counted(ask)  # some miss
            cache.release(slots)
            out = np.zeros((ids.size, RB), np.uint8)
            slots, hits = cache.acquire_into(ids, out, pin=False)  # all hit: copied, not pinned
            assert hits == ids.size
            outs.append(out)
            cache.check()
        np.testing.assert_array_equal(outs[0], rows.numpy())
        np.testing.assert_array_equal(outs[1], rows.numpy())
        assert_same(*caches)


@needs_native
@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), seed=st.integers(0, 2**32 - 1), count=st.integers(0, 300),
       spread=st.sampled_from([3, 1000, 1 << 20, 1 << 36]))
def test_native_victims_are_the_policys_in_its_order(policy, seed, count, spread):
    """HitPath.victims picks the policy's victims in the policy's order, also where its score
    buckets are wider than one score (spreads beyond 65,536: the edge bucket's lower scores
    merged into those below it) and where many slots tie (a spread of 3)."""
    rng = np.random.default_rng(seed)
    capacity = 1000
    cache = RowCache(capacity * RB, RB, policy, num_rows=10 * capacity)
    assert cache.native
    cache.slot_id[:] = np.where(rng.random(capacity) < 0.9, rng.integers(0, 10 * capacity, capacity), -1)
    cache.pins[:] = (rng.random(capacity) < 0.1).astype(np.int32)
    stamps = rng.integers(0, spread, capacity)
    cache.policy.stamp[:] = stamps
    cache.policy.clock = int(stamps.max())
    if policy == "lfu":
        cache.policy.count[:] = rng.integers(0, 4, capacity)
    evictable = (cache.slot_id >= 0) & (cache.pins == 0)
    want = cache.policy.victims(count, evictable)
    out = np.empty(count, np.int64)
    got = out[: cache._native.victims(count, cache.slot_id, out, cache.policy.score_bound())]
    assert got.tolist() == want.tolist()
    # without the bound: the extra pass finds the range, the same victims
    assert out[: cache._native.victims(count, cache.slot_id, out)].tolist() == want.tolist()


@needs_native
@pytest.mark.parametrize("spread", [1, 3000, 1 << 36])
def test_native_victims_in_a_bucket_of_many_ties(spread):
    """Most of a large LFU cache at one count (one score bucket of 150,000 slots): v is
    selected from that bucket in rounds (stamps spread over 2**36 take more than one), and the victims
    are still the policy's, in its order."""
    rng = np.random.default_rng(spread)
    capacity = 200_000
    cache = RowCache(capacity * RB, RB, "lfu", num_rows=10 * capacity)
    cache.slot_id[:] = rng.permutation(10 * capacity)[:capacity]
    cache.pins[:] = (rng.random(capacity) < 0.01).astype(np.int32)
    cache.policy.count[:] = np.where(rng.random(capacity) < 0.75, 1, rng.integers(2, 40, capacity))
    cache.policy.stamp[:] = rng.integers(0, spread, capacity)
    evictable = (cache.slot_id >= 0) & (cache.pins == 0)
    for count in (1, 5_000, 100_000):
        want = cache.policy.victims(count, evictable)
        out = np.empty(count, np.int64)
        for upper in (cache.policy.score_bound(), -1):  # buckets by count, or over the scores' range
            got = out[: cache._native.victims(count, cache.slot_id, out, upper)]
            assert got.tolist() == want.tolist()


@needs_native
@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), seed=st.integers(0, 2**32 - 1),
       count=st.sampled_from([1, 60, 700, 9_000]), spread=st.sampled_from([2, 50, 1 << 20]),
       pinned=st.sampled_from([0.0, 0.5, 0.995]))
def test_native_victims_of_a_large_cache(policy, seed, count, spread, pinned):
    """A cache large enough for the one-pass victims (a sample bounds the scores kept): the
    policy's victims in its order, whether the sample settles them (few victims) or leaves them
    to the exact passes (9,000 of 20,000 slots; nearly every slot pinned; ties at the sampled
    bound beyond the room kept for them, with a spread of 2)."""
    rng = np.random.default_rng(seed)
    capacity = 20_000
    cache = RowCache(capacity * RB, RB, policy, num_rows=10 * capacity)
    cache.slot_id[:] = np.where(rng.random(capacity) < 0.95, rng.permutation(10 * capacity)[:capacity], -1)
    cache.pins[:] = (rng.random(capacity) < pinned).astype(np.int32)
    stamps = rng.integers(0, spread, capacity)
    cache.policy.stamp[:] = stamps
    cache.policy.clock = int(stamps.max())
    if policy == "lfu":
        cache.policy.count[:] = rng.geometric(0.6, capacity)
    evictable = (cache.slot_id >= 0) & (cache.pins == 0)
    want = cache.policy.victims(count, evictable)
    out = np.empty(count, np.int64)
    got = out[: cache._native.victims(count, cache.slot_id, out, cache.policy.score_bound())]
    assert got.tolist() == want.tolist()


@needs_native
def test_an_lfu_cache_whose_score_bound_passes_int64_still_evicts():
    """An LFU max_count of 2**23 or more puts the score bound past int64: the C helper gets no
    bound (it scans for the scores' range) instead of an OverflowError at the first eviction."""
    cache = RowCache(64 * RB, RB, LFUPolicy(64, max_count=1 << 23), num_rows=1000)
    assert cache.native
    for start in range(0, 200, 16):
        cache.fill(np.arange(start, start + 16), torch.zeros((16, RB), dtype=torch.uint8))
    assert len(cache) <= 64 and cache.evictions > 0
    cache.check()
