"""rowcopy.move_rows: the fetch path's row copies, native and NumPy, against plain indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.buffers import rowcopy
from engram_offload.buffers.rowcopy import move_rows

PATHS = ["native", "numpy"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "native":
        if rowcopy._built_move() is None:
            pytest.skip("the C helper is not built")
        monkeypatch.delenv("ENGRAM_OFFLOAD_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    return request.param


def _rows(n: int, rb: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, rb), dtype=np.uint8))


@pytest.mark.parametrize("rb", [264, 7, 8, 1])
def test_gather_scatter_and_move_equal_plain_indexing(path, rb):
    src = _rows(50, rb)
    pick = np.array([49, 0, 3, 3, 17], np.int64)
    out = torch.zeros((5, rb), dtype=torch.uint8)
    move_rows(src, pick, out, None)  # gather
    assert torch.equal(out, src[torch.from_numpy(pick)])

    dst = _rows(20, rb, seed=1)
    expected = dst.clone()
    where = np.array([19, 0, 8], np.int64)
    expected[torch.from_numpy(where)] = src[:3]
    move_rows(src[:3], None, dst, where)  # scatter
    assert torch.equal(dst, expected)

    dst2 = _rows(20, rb, seed=2)
    expected2 = dst2.clone()
    expected2[torch.from_numpy(where)] = src[torch.from_numpy(pick[:3])]
    move_rows(src, pick[:3], dst2, where)  # both indexed
    assert torch.equal(dst2, expected2)


def test_byte_offsets_pick_unaligned_runs(path):
    flat = _rows(1, 4096)[0]  # [4096] bytes
    offsets = np.array([0, 1, 4096 - 264, 777], np.int64)
    out = torch.empty((4, 264), dtype=torch.uint8)
    move_rows(flat, offsets, out, None, src_byte_offsets=True)
    for i, off in enumerate(offsets):
        assert torch.equal(out[i], flat[off: off + 264])


def test_numpy_arrays_and_float_rows_as_bytes(path):
    src = torch.randn(30, 16)
    out = torch.empty(4, 16)
    pick = np.array([29, 2, 2, 0], np.int64)
    move_rows(src.view(torch.uint8), pick, out.view(torch.uint8), None)
    assert torch.equal(out, src[torch.from_numpy(pick)])
    a = np.arange(40, dtype=np.uint8).reshape(10, 4)
    b = np.zeros((2, 4), np.uint8)
    move_rows(a, np.array([9, 1]), b, None)
    assert b.tolist() == [a[9].tolist(), a[1].tolist()]


@pytest.mark.parametrize("bad", [-1, 50])
def test_an_index_out_of_range_raises_before_copying(path, bad):
    src = _rows(50, 264)
    out = torch.zeros((3, 264), dtype=torch.uint8)
    with pytest.raises(IndexError, match="outside"):
        move_rows(src, np.array([1, 2, bad], np.int64), out, None)
    assert not out.any()  # nothing copied, not even the rows before the bad one
    dst = torch.zeros((4, 264), dtype=torch.uint8)
    with pytest.raises(IndexError, match="outside"):
        move_rows(src[:2], None, dst, np.array([0, bad if bad < 0 else 4], np.int64))
    assert not dst.any()


def test_a_byte_offset_running_past_the_end_raises(path):
    flat = _rows(1, 1000)[0]
    out = torch.zeros((1, 264), dtype=torch.uint8)
    with pytest.raises(IndexError, match="outside"):
        move_rows(flat, np.array([1000 - 263], np.int64), out, None, src_byte_offsets=True)


def test_too_few_destination_rows_raise(path):
    with pytest.raises(IndexError, match="overrun"):
        move_rows(_rows(10, 8), np.arange(5), torch.zeros((4, 8), dtype=torch.uint8), None)


def test_no_index_at_all_is_refused():
    with pytest.raises(ValueError, match="^move_rows: give src_rows, dst_rows or both$"):
        move_rows(_rows(2, 8), None, torch.zeros((2, 8), dtype=torch.uint8), None)


def test_strided_tensors_take_the_tensor_path():
    src = _rows(20, 16)[:, :8]  # not contiguous
    out = torch.zeros((3, 8), dtype=torch.uint8)
    move_rows(src, np.array([5, 0, 19]), out, None)
    assert torch.equal(out, src[[5, 0, 19]])
    dst = torch.zeros((6, 16), dtype=torch.uint8)[:, 8:]  # not contiguous
    move_rows(_rows(2, 8), None, dst, np.array([4, 1]))
    assert torch.equal(dst[[4, 1]], _rows(2, 8))


@pytest.mark.parametrize("tier", ["memory", "direct"])
def test_host_fetches_never_copy_rows_with_tensor_ops(tmp_path, monkeypatch, tier):
    """Every row copy of a host fetch (tier reads, cache hits and fills, the result's order,
    a prefetched layer's rows) goes through move_rows' host path, never a tensor op (whose
    idle OpenMP workers spin on the other cores after each call)."""
    from engram_offload import NgramHasher, Prefetcher, open_table, write_table
    from engram_offload.engram.config import EngramConfig
    from engram_offload.engram.rows import encode_rows

    def refuse(*args, **kwargs):
        raise AssertionError("a host row copy went through tensor ops")

    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(2e-5)
    x = torch.randn(config.num_rows, config.head_dim)  # [rows, 256]
    raw = encode_rows(x, config.row_format)
    path = write_table(tmp_path / "t.tbl", config, x)
    ids = np.array([7, 3, 7, config.num_rows - 1, 0])
    expected = raw[torch.from_numpy(ids)]
    monkeypatch.setattr(rowcopy, "_move_tensors", refuse)
    for owner, name in ((torch, "index_select"), (torch.Tensor, "index_select"), (torch.Tensor, "index_copy_")):
        monkeypatch.setattr(owner, name, refuse)
    with open_table(path, tier, cache_bytes=64 * config.row_bytes) as store:
        for _ in range(2):  # misses (tier, fill), then hits
            assert torch.equal(store.read_raw(ids), expected)
        hasher = NgramHasher(config, np.arange(config.compressed_vocab_size, dtype=np.int64))
        with Prefetcher(store, hasher) as prefetcher:
            step = prefetcher.begin_step([0, 1], [np.array([5, 6, 7]), np.array([9])])
            for layer in config.layer_ids:
                assert step.rows(layer).shape[-1] == config.head_dim
            prefetcher.end_step(step)


def test_the_helper_is_looked_up_once_and_none_when_missing(monkeypatch):
    import sys

    monkeypatch.setattr(rowcopy, "_built", rowcopy._UNRESOLVED)
    monkeypatch.setitem(sys.modules, "engram_offload.buffers._rowcopy", None)  # import fails
    monkeypatch.delattr(sys.modules["engram_offload.buffers"], "_rowcopy", raising=False)
    assert rowcopy._built_move() is None and rowcopy._built is None
    monkeypatch.delitem(sys.modules, "engram_offload.buffers._rowcopy")
    monkeypatch.setattr(rowcopy, "_built", rowcopy._UNRESOLVED)
    try:
        from engram_offload.buffers import _rowcopy
    except ImportError:
        pytest.skip("the C helper is not built")
    assert rowcopy._built_move() is _rowcopy.move_rows and rowcopy._built is _rowcopy.move_rows


def test_out_of_range_messages_name_the_side_and_the_first_bad_offset(path):
    """The message names the buffer (src or dst) and the first offset out of range, after
    valid ones at both ends (offset 0, the last row)."""
    src, out = _rows(50, 8), torch.zeros((4, 8), dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"src offset 400 .*outside 0\.\.392"):
        move_rows(src, np.array([0, 49, 50, 51], np.int64), out, None)
    with pytest.raises(IndexError, match=r"src offset -8 .*outside"):
        move_rows(src, np.array([0, 49, -1, 51], np.int64), out, None)
    with pytest.raises(IndexError, match=r"dst offset 32 .*outside 0\.\.24"):
        move_rows(src[:3], None, out, np.array([0, 3, 4], np.int64))
    with pytest.raises(IndexError, match="overrun the 32-byte dst"):
        move_rows(src, np.arange(5), out, None)
    with pytest.raises(IndexError, match="overrun the 16-byte src"):
        move_rows(src[:2], None, out, np.arange(3))
    assert not out.any()


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.uint16])
def test_indexes_of_any_integer_dtype(path, dtype):
    src = _rows(300, 8)
    pick = np.array([255, 40, 299 if dtype != np.uint8 else 33], dtype)
    out = torch.zeros((3, 8), dtype=torch.uint8)
    move_rows(src, pick, out, None)
    assert torch.equal(out, src[torch.from_numpy(pick.astype(np.int64))])
    dst = torch.zeros((300, 8), dtype=torch.uint8)
    move_rows(src[:3], None, dst, pick)
    assert torch.equal(dst[torch.from_numpy(pick.astype(np.int64))], src[:3])
    with pytest.raises(TypeError, match="row indexes must be integers, got float64"):
        move_rows(src, np.array([1.0]), out, None)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_the_tensor_path_gathers_scatters_and_picks_byte_offsets(dtype):
    """Strided tensors (as rows on a device) go through tensor ops: byte offsets into a flat
    source up to its last window, indexes of any integer dtype, a destination longer than
    the rows moved."""
    flat = _rows(1, 512)[0, ::2]  # [256] bytes, not contiguous
    offsets = np.array([0, 1, 256 - 16, 100], dtype)
    out = torch.zeros((6, 32), dtype=torch.uint8)[:, :16]  # not contiguous, more rows than moved
    move_rows(flat, offsets, out, None, src_byte_offsets=True)
    for i, off in enumerate(offsets.tolist()):
        assert torch.equal(out[i], flat[off: off + 16])
    assert not out[4:].any()
    src = _rows(40, 32)[:, :16]  # not contiguous
    dst = torch.zeros((40, 32), dtype=torch.uint8)[:, 16:]
    where = np.array([39, 0, 7], dtype)
    move_rows(src, np.array([3, 30, 1], dtype), dst, where)
    assert torch.equal(dst[torch.from_numpy(where.astype(np.int64))], src[[3, 30, 1]])
    assert int(dst.count_nonzero()) == int(src[[3, 30, 1]].count_nonzero())


def test_the_native_switch_turns_the_helper_off(monkeypatch):
    if rowcopy._built_move() is None:
        pytest.skip("the C helper is not built")
    monkeypatch.delenv("ENGRAM_OFFLOAD_NO_NATIVE", raising=False)
    assert rowcopy.native_move_rows() is rowcopy._built_move()
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    assert rowcopy.native_move_rows() is None


def test_rows_of_a_destination_with_more_dimensions(path):
    """Rows are the last dimension of ``dst`` whatever its other dimensions."""
    src = _rows(10, 8)
    dst = torch.zeros((2, 2, 8), dtype=torch.uint8)  # 4 rows of 8 bytes
    move_rows(src, np.array([9, 0, 4, 4]), dst, None)
    assert torch.equal(dst.reshape(4, 8), src[[9, 0, 4, 4]])
