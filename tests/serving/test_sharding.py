"""Column shards: vLLM's split, the rows a shard can read, and all-gathered rows over gloo."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher
from engram_offload.serving.sharding import (
    assemble_columns,
    column_range,
    require_in_shard,
    shard_columns,
    shard_ids,
    shard_rows,
)
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table, random_rows

TIERS = (("memory", {}), ("direct", {"engine": "threads", "queue_depth": 4}))


def sharded_config(max_ngram_size: int, n_heads: int) -> EngramConfig:
    """Two layers of ``(max_ngram_size - 1) * n_heads`` columns, small primes."""
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=max_ngram_size, n_heads=n_heads, head_dim=32,
                        prime_starts=(200,) * (max_ngram_size - 1), row_format="bf16")


def vllm_split(num_columns: int, rank: int, world: int) -> tuple[int, int]:
    """vLLM's ParallelEngramEmbedding: part = cdiv(C, tp); head_start = rank * part;
    head_end = head_start + part, sliced (so clamped) to the C heads."""
    part = (num_columns + world - 1) // world
    heads = list(range(num_columns))[rank * part: rank * part + part]
    return (heads[0], heads[-1] + 1) if heads else (min(rank * part, num_columns),) * 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 16, 24, 25, 32])
def test_shard_columns_follow_vllm_and_cover_every_column_once(world):
    config = EngramConfig.from_name("deepseek-v4.1-flash")
    c = config.cols_per_layer
    shards = [shard_columns(config, r, world) for r in range(world)]
    assert all((c0, c1) == vllm_split(c, r, world) for r, (c0, c1) in enumerate(shards))
    owned = [col for c0, c1 in shards for col in range(c0, c1)]
    assert owned == list(range(c))  # consecutive, each once, in rank order
    part = -(-c // world)
    assert all(c1 - c0 <= part for c0, c1 in shards)
    assert shards[0] == (0, min(part, c))


def test_shard_columns_at_tp4_is_six_columns_a_rank():
    config = EngramConfig.from_name("deepseek-v4.1-flash")
    assert [shard_columns(config, r, 4) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert shard_columns(config, 6, 7) == (24, 24)  # cdiv(24, 7) = 4: rank 6 owns nothing


@pytest.mark.parametrize("rank, world", [(0, 0), (2, 2), (-1, 2)])
def test_shard_columns_rejects_bad_ranks(rank, world):
    with pytest.raises(ValueError, match="rank|world"):
        shard_columns(sharded_config(3, 2), rank, world)


def test_shard_ids_slice_the_columns():
    ids = torch.arange(5 * 2 * 6).view(5, 2, 6)
    part = shard_ids(ids, (2, 4))
    assert part.shape == (5, 2, 2) and part.is_contiguous()
    assert torch.equal(part, ids[..., 2:4])
    assert shard_ids(ids.numpy(), (6, 6)).shape == (5, 2, 0)
    with pytest.raises(ValueError, match="columns"):
        shard_ids(ids, (4, 7))


def hashed_ids(config: EngramConfig, tokens: int = 300, seed: int = 5) -> torch.Tensor:
    """Flat table ids ``[T, L, C]`` of random tokens through a real hasher."""
    rng = np.random.default_rng(seed)
    hasher = NgramHasher(config, np.arange(1000) % 700)
    return hasher.table_ids(hasher.hash_all(rng.integers(0, 1000, (1, tokens)))[0])


@pytest.mark.parametrize("max_ngram_size, n_heads, world", [(3, 2, 3), (2, 7, 4), (4, 3, 4), (3, 3, 1)])
def test_shard_rows_hold_exactly_the_rows_of_the_shards_columns(max_ngram_size, n_heads, world):
    config = sharded_config(max_ngram_size, n_heads)
    ids = hashed_ids(config).numpy()  # [T, L, C]
    every = np.zeros(config.num_rows, np.int64)
    for rank in range(world):
        columns = shard_columns(config, rank, world)
        rows = shard_rows(config, columns)
        mine = shard_ids(ids, columns).reshape(-1)
        assert rows.contains(mine).all()
        others = np.delete(ids, np.arange(*columns), axis=-1).reshape(-1)
        assert not rows.contains(others).any()  # two ranks never read the same row
        span = np.concatenate([np.arange(lo, hi) for lo, hi in rows.ranges])
        every[span] += 1
        assert rows.num_rows == span.size
    assert (every == 1).all()  # the shards' rows tile the table


def test_shard_rows_ranges_are_the_heads_row_ranges():
    config = sharded_config(3, 3)  # C = 6
    rows = shard_rows(config, (2, 5))
    for (lo, hi), layer_id, base in zip(rows.ranges, config.layer_ids, config.layer_row_bases):
        offsets, sizes = config.head_offsets(layer_id), config.head_sizes(layer_id)
        assert (lo, hi) == (base + offsets[2], base + offsets[4] + sizes[4])
    empty = shard_rows(config, (6, 6))
    assert empty.num_rows == 0 and not empty.contains(np.arange(config.num_rows)).any()


# ---------------------------------------------------------------------- gloo, several processes
def _rank_main(rank: int, world: int, init_file: str, table: str, expected: np.ndarray) -> None:
    """One rank: fetch its columns on each tier, all-gather, compare with the whole rows."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for tier, options in TIERS:
            with open_table(table, tier, **options) as store:
                config = store.config
                columns = shard_columns(config, rank, world)
                owned = shard_rows(config, columns)
                ids = hashed_ids(config)  # [T, L, C]: every rank hashes every column
                local = shard_ids(ids, columns)  # [T, L, c]
                assert owned.contains(local.numpy().reshape(-1)).all()
                for li in range(len(config.layer_ids)):
                    mine = store.gather(local[:, li], torch.bfloat16)  # [T, c, d]
                    full = assemble_columns(mine, config.cols_per_layer)  # [T, C, d]
                    single = store.gather(ids[:, li], torch.bfloat16)  # unsharded, this process
                    assert torch.equal(full, single), (tier, rank, li)
                    raw = torch.from_numpy(expected[ids[:, li].numpy()])  # [T, C, row_bytes]
                    assert torch.equal(store.decode(raw.reshape(-1, raw.shape[-1]), torch.bfloat16),
                                       full.reshape(-1, full.shape[-1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, max_ngram_size, n_heads", [(2, 2, 7), (4, 3, 3)])
def test_all_gathered_shards_equal_single_process_rows(tmp_path, world, max_ngram_size, n_heads):
    """world 2 over C = 7 (4 + 3 columns: the last rank fewer); world 4 over C = 6 (2, 2, 2, 0:
    the last rank owns nothing)."""
    config = sharded_config(max_ngram_size, n_heads)
    table = make_random_table(tmp_path / "t.table", config, seed=3)
    expected = np.concatenate(list(random_rows(config, 3)))
    mp.spawn(_rank_main, args=(world, str(tmp_path / "rendezvous"), str(table), expected), nprocs=world)


def _prefetch_rank_main(rank: int, world: int, init_file: str, table: str) -> None:
    """One rank: a Prefetcher over a store of its columns, several steps, each layer's rows
    all-gathered and compared with this process's unsharded Prefetcher."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(9)  # the same tokens on every rank
        tokens = rng.integers(0, 1000, (2, 10))
        steps = [[tokens[0, :6], tokens[1, :4]], *[[tokens[0, t: t + 1], tokens[1, t: t + 1]] for t in range(6, 10)]]
        with open_table(table, "mmap") as whole:
            config = whole.config
            columns = shard_columns(config, rank, world)
            with open_table(table, "direct", columns=columns, cache_bytes=64 * config.row_bytes,
                            engine="threads") as store, \
                    Prefetcher(store, NgramHasher(config, np.arange(1000) % 700), split_min_rows=1) as pf, \
                    Prefetcher(whole, NgramHasher(config, np.arange(1000) % 700)) as single:
                for pieces in steps:
                    pf.begin_step([4, 5], pieces)
                    single.begin_step([4, 5], pieces)
                    for layer in config.layer_ids:
                        mine = pf.rows(layer, timeout=10)  # [T, c, d]
                        full = assemble_columns(mine, config.cols_per_layer)  # [T, C, d]
                        assert torch.equal(full, single.rows(layer, timeout=10)), (rank, layer)
                    pf.end_step()
                    single.end_step()
    finally:
        dist.destroy_process_group()


def test_all_gathered_prefetcher_rows_equal_single_process_rows(tmp_path):
    """Two ranks over C = 7 columns (4 + 3), each with a store and a Prefetcher of its columns."""
    config = sharded_config(2, 7)
    table = make_random_table(tmp_path / "t.table", config, seed=4)
    mp.spawn(_prefetch_rank_main, args=(2, str(tmp_path / "rendezvous"), str(table)), nprocs=2)


def test_the_package_exports_the_sharding_helpers():
    import engram_offload
    from engram_offload.serving import sharding

    assert engram_offload.shard_columns is sharding.shard_columns
    assert engram_offload.assemble_columns is sharding.assemble_columns
    assert {"shard_columns", "assemble_columns"} <= set(engram_offload.__all__)


# ---------------------------------------------------------------------- arguments and messages
def test_argument_errors_say_what_is_wrong():
    config = sharded_config(3, 3)  # C = 6
    with pytest.raises(ValueError, match=r"^world size must be >= 1, got 0$"):
        shard_columns(config, 0, 0)
    for rank in (-1, 4):
        with pytest.raises(ValueError, match=rf"^rank must be in \[0, 4\), got {rank}$"):
            shard_columns(config, rank, 4)
    for columns in ((-1, 2), (3, 2), (0, 7)):
        with pytest.raises(ValueError, match=rf"^columns must satisfy 0 <= c0 <= c1 <= 6, got "
                                             rf"{re.escape(str(columns))}$"):
            shard_rows(config, columns)
    assert shard_rows(config, (0, 6)).num_rows == config.num_rows  # the whole layer: every row
    ids = torch.arange(2 * 2 * 6).reshape(2, 2, 6)
    assert shard_ids(ids, (np.int64(6), np.int64(6))).shape == (2, 2, 0)
    rows = shard_rows(config, (2, 4))
    outside = int(rows.ranges[1, 1])
    with pytest.raises(IndexError, match=rf"^row {outside} is not in the rows of this rank's columns \[2, 4\) "
                                         rf"\({re.escape(str(rows.ranges.tolist()))}\): fetch only the rank's "
                                         r"columns \(sharding.shard_ids\), or open the table without columns=$"):
        require_in_shard(rows, (2, 4), np.array([int(rows.ranges[0, 0]), outside]))
    require_in_shard(rows, (2, 4), np.concatenate([np.arange(lo, hi) for lo, hi in rows.ranges]))


def test_shard_rows_membership_at_the_range_edges():
    config = sharded_config(3, 3)
    rows = shard_rows(config, (2, 4))
    (lo0, hi0), (lo1, hi1) = rows.ranges.tolist()
    ids = np.array([lo0 - 1, lo0, hi0 - 1, hi0, lo1 - 1, lo1, hi1 - 1, hi1, 0, config.num_rows - 1])
    assert rows.contains(ids).tolist() == [False, True, True, False, False, True, True, False, False, False]


def test_assemble_columns_in_a_group_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        local = torch.randn(3, 5, 4, dtype=torch.bfloat16)
        full = assemble_columns(local, 5)
        assert full.dtype == torch.bfloat16 and torch.equal(full, local)
        with pytest.raises(ValueError, match=r"^rank 0 of 1 owns columns \[0, 5\) of 5: local rows must be "
                                             r"\[T, 5, d\], got \(3, 4, 4\)$"):
            assemble_columns(local[:, :4], 5)
        with pytest.raises(ValueError, match=r"got \(3, 5\)$"):
            assemble_columns(local[:, :, 0], 5)
    finally:
        dist.destroy_process_group()


def test_shard_rows_over_three_layers():
    config = EngramConfig(layer_ids=(1, 3, 5), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(200, 200),
                          row_format="bf16")  # C = 4
    rows = shard_rows(config, (1, 3))
    assert rows.ranges.shape == (3, 2) and (np.diff(rows.ranges.reshape(-1)) >= 0).all()  # sorted, disjoint
    span = np.concatenate([np.arange(lo, hi) for lo, hi in rows.ranges])
    assert rows.num_rows == span.size and rows.contains(span).all()
    lo, hi = rows.ranges[2]
    assert rows.contains(np.array([lo - 1, hi])).tolist() == [False, False]


def _subgroup_main(rank: int, world: int, init_file: str) -> None:
    """Ranks 0-1 and 2-3 each assemble their own 5 columns in their own group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        group, member = groups[rank // 2], rank % 2
        full = torch.arange(3 * 5 * 4, dtype=torch.float32).reshape(3, 5, 4) + 1000 * (rank // 2)  # [T, C, d]
        c0, c1 = column_range(5, member, 2)  # [0, 3) and [3, 5)
        assert torch.equal(assemble_columns(full[:, c0:c1].clone(), 5, group=group), full)
        with pytest.raises(ValueError, match=(rf"^rank {member} of 2 owns columns \[{c0}, {c1}\) of 5: local rows "
                                              rf"must be \[T, {c1 - c0}, d\], got \(3, 1, 4\)$")):
            assemble_columns(full[:, :1].clone(), 5, group=group)
    finally:
        dist.destroy_process_group()


def test_assemble_columns_within_a_group(tmp_path):
    """Four ranks in two groups of two: each group's ranks own and gather their group's
    columns (its size and a rank's place in it, not the world's), and a rank past the first
    names its own columns in the shape error."""
    mp.spawn(_subgroup_main, args=(4, str(tmp_path / "rendezvous")), nprocs=4)
