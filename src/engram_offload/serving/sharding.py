"""Column shards: which of a layer's ``C = (N-1) * H`` hashed heads a tensor-parallel rank owns.

The split is vLLM's for the DeepSeek-V4.1 Engram embedding: every rank owns
``cdiv(C, world)`` consecutive columns of each layer (the same columns in every layer), the
last rank possibly fewer, and ranks past the end none. A column is one head of one n-gram
order, and a layer's heads lie back to back in the table's flat row space, so a rank's rows
are one contiguous range per layer (``ShardRows``): a store or cache of that rank needs only
those rows, and two ranks never read the same row.

Each rank fetches ``[T, c1 - c0, d]`` per layer; ``assemble_columns`` puts the full
``[T, C, d]`` back together with ``torch.distributed.all_gather`` (padding the short or
empty shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engram.config import EngramConfig

__all__ = ["Columns", "ShardRows", "assemble_columns", "check_columns", "require_in_shard", "shard_columns", "shard_ids",
           "shard_rows"]

Columns = tuple[int, int]  # [c0, c1): a rank's columns of every layer


def _columns_per_rank(num_columns: int, world: int) -> int:
    return -(-num_columns // world)


def column_range(num_columns: int, rank: int, world: int) -> Columns:
    """``[c0, c1)`` of ``num_columns`` columns for ``rank`` of ``world`` (empty past the end)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    part = _columns_per_rank(num_columns, world)
    c0 = min(rank * part, num_columns)
    return c0, min(c0 + part, num_columns)


def shard_columns(config: EngramConfig, rank: int, world: int) -> Columns:
    """The columns ``[c0, c1)`` of each Engram layer that ``rank`` of ``world`` owns.

    ``cdiv(C, world)`` consecutive columns a rank, ``C = config.cols_per_layer``; the last
    rank may own fewer and ranks past the end own none (``c0 == c1``). V4.1-Flash at 4
    ranks: ``(0, 6), (6, 12), (12, 18), (18, 24)``.
    """
    return column_range(config.cols_per_layer, rank, world)


def check_columns(columns: Columns, num_columns: int) -> Columns:
    """``columns`` as two ints; ``ValueError`` unless ``0 <= c0 <= c1 <= num_columns``."""
    c0, c1 = (int(c) for c in columns)
    if not 0 <= c0 <= c1 <= num_columns:
        raise ValueError(f"columns must satisfy 0 <= c0 <= c1 <= {num_columns}, got {columns}")
    return c0, c1


def shard_ids(table_ids: Any, columns: Columns) -> Any:
    """A step's ids ``[T, L, C]`` (tensor or array) -> the rank's ``[T, L, c1 - c0]``.

    The slice is made contiguous, so later reshapes and dedup see the rank's ids only.
    """
    c0, c1 = check_columns(columns, int(table_ids.shape[-1]))
    part = table_ids[..., c0:c1]
    return part.contiguous() if isinstance(part, torch.Tensor) else np.ascontiguousarray(part)


@dataclass(frozen=True)
class ShardRows:
    """The table rows one column shard can ever read: one range ``[lo, hi)`` per layer.

    ``ranges`` int64 ``[L, 2]`` in the table's flat row space, in layer order (so sorted and
    disjoint). An empty shard has empty ranges.
    """

    ranges: np.ndarray  # int64 [L, 2]

    @property
    def num_rows(self) -> int:
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Whether each flat row id ``[n]`` is one of the shard's rows -> bool ``[n]``."""
        ids = np.asarray(ids, np.int64)
        layer = np.searchsorted(self.ranges[:, 0], ids, side="right") - 1  # the range starting at or below
        inside = layer >= 0
        layer = np.maximum(layer, 0)
        return inside & (ids < self.ranges[layer, 1])


def require_in_shard(shard: ShardRows, columns: Columns, ids: np.ndarray) -> None:
    """``IndexError`` naming ``columns`` for the first of ``ids`` outside ``shard``'s rows."""
    inside = shard.contains(ids)
    if not inside.all():
        bad = int(np.asarray(ids)[np.flatnonzero(~inside)[0]])
        raise IndexError(f"row {bad} is not in the rows of this rank's columns [{columns[0]}, {columns[1]}) "
                         f"({shard.ranges.tolist()}): fetch only the rank's columns (sharding.shard_ids), "
                         "or open the table without columns=")


def shard_rows(config: EngramConfig, columns: Columns) -> ShardRows:
    """The flat row ranges of ``columns``' heads in every layer (contiguous per layer)."""
    c0, c1 = check_columns(columns, config.cols_per_layer)
    ranges = []
    for layer_id, base in zip(config.layer_ids, config.layer_row_bases):
        offsets = config.head_offsets(layer_id)
        sizes = config.head_sizes(layer_id)
        ends = [o + s for o, s in zip(offsets, sizes)]  # one past each head's last row in the layer
        lo = offsets[c0] if c0 < c1 else 0
        hi = ends[c1 - 1] if c0 < c1 else 0
        ranges.append((base + lo, base + hi))
    return ShardRows(np.asarray(ranges, np.int64).reshape(-1, 2))


def assemble_columns(local: torch.Tensor, num_columns: int, group: Any = None) -> torch.Tensor:
    """This rank's rows ``[T, c1 - c0, d]`` -> every column's ``[T, C, d]`` on every rank.

    A collective: every rank of ``group`` (default: the world) calls it with the same ``T``
    and ``num_columns`` (``config.cols_per_layer``). Shards are padded to ``cdiv(C, world)``
    columns for ``all_gather`` (which needs equal sizes) and the padding dropped; the rows
    travel as bytes, so any dtype works on any backend.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    c0, c1 = column_range(num_columns, rank, world)
    if local.dim() != 3 or local.shape[1] != c1 - c0:
        raise ValueError(f"rank {rank} of {world} owns columns [{c0}, {c1}) of {num_columns}: local rows must "
                         f"be [T, {c1 - c0}, d], got {tuple(local.shape)}")
    part = _columns_per_rank(num_columns, world)
    t, d = int(local.shape[0]), int(local.shape[2])
    width = d * local.element_size()
    raw = local.contiguous().view(torch.uint8).reshape(t, c1 - c0, width)  # [T, c, d * itemsize]
    padded = raw.new_zeros((t, part, width))  # [T, part, d * itemsize]
    padded[:, : c1 - c0] = raw
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=group)
    full = torch.cat(shards, dim=1)[:, :num_columns].contiguous()  # [T, C, d * itemsize]
    return full.view(local.dtype).reshape(t, num_columns, d)
