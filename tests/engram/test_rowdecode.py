"""The native fp8 row decoder: bit-exact with the reference dequantizer, every byte and scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.engram.rows import _fp8_table_bits, _native_decode, decode_rows, dequantize_fp8_ue8m0

FMT = "fp8_e4m3_ue8m0"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _every_pair_rows() -> torch.Tensor:
    """Rows covering every (scale byte, fp8 byte) pair, each byte but the NaNs in a block
    without a NaN (a block holding one takes the table's lookup): 512 rows of 256 values, two
    per scale, every block of a row with that scale. Both rows put the two NaN bytes first,
    then the other 254 values, the second with them rotated by 30 so that the 30 that share
    the NaNs' block in the first lie in blocks of their own."""
    head_dim = 256
    nan = [0x7F, 0xFF]
    others = [v for v in range(256) if v not in nan]
    orders = torch.tensor([nan + others, nan + others[30:] + others[:30]], dtype=torch.uint8)  # [2, 256]
    rows = torch.empty((256, 2, head_dim + 8), dtype=torch.uint8)
    rows[:, :, :head_dim] = orders
    rows[:, :, head_dim:] = torch.arange(256, dtype=torch.uint8)[:, None, None]  # the scale of every block
    return rows.view(512, head_dim + 8)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_is_bit_exact_with_the_reference_and_the_numpy_path(monkeypatch, dtype):
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    raw = _every_pair_rows()
    native = decode_rows(raw, FMT, 256, dtype)
    reference = dequantize_fp8_ue8m0(raw[:, :256].contiguous().view(torch.float8_e4m3fn), raw[:, 256:], dtype)
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    fallback = decode_rows(raw, FMT, 256, dtype)
    assert torch.equal(_bits(native), _bits(reference))  # NaNs, infs and zeros included, by their bits
    assert torch.equal(_bits(native), _bits(fallback))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_each_float32_decode_path_is_bit_exact_on_every_pair(mode):
    """Mode 0 looks values up; 1 computes them with the CPU's widest vectors; 2 with AVX2 even
    where AVX-512 is there: each gives the reference's bits for every (scale, byte) pair, with
    and without an index into a larger block of rows."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    raw = _every_pair_rows().numpy()  # [512, 264]
    reference = dequantize_fp8_ue8m0(torch.from_numpy(raw[:, :256].copy()).view(torch.float8_e4m3fn),
                                     torch.from_numpy(raw[:, 256:].copy()), torch.float32)
    table = _fp8_table_bits(torch.float32)
    out = np.empty((512, 256), np.int32)
    _native_decode()(raw, 256, table, out, None, mode)
    assert torch.equal(torch.from_numpy(out), _bits(reference))
    picks = np.random.default_rng(mode).integers(0, 512, 700)  # rows in any order, some twice
    out = np.empty((700, 256), np.int32)
    _native_decode()(raw, 256, table, out, picks, mode)
    assert torch.equal(torch.from_numpy(out), _bits(reference)[picks])


def test_the_arithmetic_path_is_the_one_the_cpu_allows():
    """avx512 where the CPU has AVX-512 F, BW and VL; else avx2; the table while subnormals
    are flushed (and for mode 0)."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    from engram_offload.engram import _rowdecode
    from engram_offload.engram.rows import fp8_decode_path

    flags = _cpu_flags()
    avx2 = "avx2" if "avx2" in flags else "table"
    widest = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else avx2
    assert (_rowdecode.arithmetic_path(0), _rowdecode.arithmetic_path(), _rowdecode.arithmetic_path(2)) == (
        "table", widest, avx2)
    assert fp8_decode_path(torch.float32) == widest and fp8_decode_path(torch.bfloat16) == "table"
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        assert _rowdecode.arithmetic_path() == "table"
    finally:
        torch.set_flush_denormal(False)


def test_a_decode_asks_for_the_widest_arithmetic_and_reports_its_path(monkeypatch):
    """decode_rows asks the C helper for its automatic float32 decode (bfloat16 always looks
    up); the rows are the reference's."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    from engram_offload.engram import _rowdecode
    from engram_offload.engram.rows import fp8_decode_path

    assert _asked_of_the_c_helper(monkeypatch, 5) == [1, 0]  # a[5], the arithmetic
    assert fp8_decode_path() == _rowdecode.arithmetic_path(1)


def _asked_of_the_c_helper(monkeypatch, argument: int) -> list:
    """Every row decoded into float32 and into bfloat16 through ``decode_rows``: the C helper's
    ``argument``-th argument in each call; the float32 rows checked against the reference."""
    asked = []
    real = _native_decode()
    monkeypatch.setattr("engram_offload.engram.rows._native_decode",
                        lambda: lambda *a: asked.append(a[argument]) or real(*a))
    raw = _every_pair_rows()
    got = decode_rows(raw, FMT, 256, torch.float32, index=np.arange(512))
    decode_rows(raw, FMT, 256, torch.bfloat16, index=np.arange(512))
    want = dequantize_fp8_ue8m0(raw[:, :256].contiguous().view(torch.float8_e4m3fn), raw[:, 256:], torch.float32)
    assert torch.equal(_bits(got), _bits(want))
    return asked


def test_without_the_c_helper_the_decode_path_is_numpy(monkeypatch):
    from engram_offload.engram.rows import fp8_decode_path

    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    assert fp8_decode_path() == "numpy"


def test_native_decode_of_many_rows_and_none():
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(rng.integers(0, 256, (1000, 64 + 2), dtype=np.uint8))  # head_dim 64: the GIL-free size
    got = decode_rows(raw, FMT, 64)
    want = dequantize_fp8_ue8m0(raw[:, :64].contiguous().view(torch.float8_e4m3fn), raw[:, 64:], torch.float32)
    assert torch.equal(_bits(got), _bits(want))
    assert decode_rows(raw[:0], FMT, 64).shape == (0, 64)


def test_native_decode_refuses_mismatched_buffers():
    decode = _native_decode()
    if decode is None:
        pytest.skip("the C decoder is not built")
    table = np.zeros(65536, np.int32)
    with pytest.raises(ValueError, match="whole 66-byte rows"):
        decode(np.zeros(67, np.uint8), 64, table, np.zeros(64, np.int32))
    with pytest.raises(ValueError, match="expected 256"):
        decode(np.zeros(66, np.uint8), 64, table, np.zeros(63, np.int32))
    with pytest.raises(ValueError, match="65536 values"):
        decode(np.zeros(66, np.uint8), 64, np.zeros(100, np.int32), np.zeros(64, np.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        decode(np.zeros(66, np.uint8), 48, table, np.zeros(64, np.int32))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_ue8m0", "fp32", "bf16", "int8"])
def test_decode_with_an_index_equals_decoding_the_gathered_rows(monkeypatch, native, fmt):
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    raw = encode_rows(torch.randn(40, 64), fmt)  # [40, row_bytes]
    index = np.array([39, 0, 7, 7, 12], np.int64)
    for dtype in DTYPES:
        got = decode_rows(raw, fmt, 64, dtype, index=index)
        want = decode_rows(raw[torch.from_numpy(index)], fmt, 64, dtype)
        assert got.shape == (5, 64) and torch.equal(_bits(got), _bits(want))
        # the same rows from a NumPy array of the raw bytes, into a [1, 5] leading shape
        from_array = decode_rows(raw.numpy(), fmt, 64, dtype, index=index, shape=(1, 5))
        assert from_array.dtype == dtype and from_array.shape == (1, 5, 64)
        assert torch.equal(_bits(from_array[0]), _bits(want))
        assert torch.equal(_bits(decode_rows(raw.numpy(), fmt, 64, dtype)), _bits(decode_rows(raw, fmt, 64, dtype)))
    with pytest.raises(IndexError, match="outside"):
        decode_rows(raw, fmt, 64, index=np.array([0, 40], np.int64))
    assert decode_rows(raw, fmt, 64, index=np.zeros(0, np.int64)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"^shape \(2, 2\) holds 4 rows, not the 5 decoded$"):
        decode_rows(raw, fmt, 64, index=index, shape=(2, 2))
    with pytest.raises(ValueError, match=r"must be uint8 \[n, "):
        decode_rows(raw.numpy().view(np.int8), fmt, 64)



@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_ue8m0", "fp32"])
def test_decode_reads_a_strided_index_less_its_base(monkeypatch, native, fmt):
    """The prefetcher's layer index: a strided [T, C] view of a step's inverse whose entries
    are positions in the step's distinct ids; less the part's first position (index_base)
    they are positions in the part's rows. Read in C order, as index.reshape(-1) - base."""
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    raw = encode_rows(torch.randn(30, 64), fmt)  # the part's rows [30, row_bytes]
    inverse = np.random.default_rng(1).integers(100, 130, size=(4, 2, 3)).astype(np.int64)  # [T, L, C]
    inverse[2, 1, 0] = 100  # the part's first row
    view = inverse[:, 1]  # [T, C], not contiguous
    assert not view.flags.c_contiguous
    want = decode_rows(raw, fmt, 64, index=np.ascontiguousarray(view).reshape(-1) - 100)
    got = decode_rows(raw, fmt, 64, index=view, index_base=100, shape=(4, 3))
    assert got.shape == (4, 3, 64) and torch.equal(_bits(got.reshape(12, 64)), _bits(want))
    with pytest.raises(IndexError, match="outside"):
        decode_rows(raw, fmt, 64, index=view, index_base=101)  # the base's own position is then -1


def test_float32_decode_is_exact_when_the_cpu_flushes_subnormals():
    """The arithmetic float32 decode needs subnormals as IEEE has them: with FTZ/DAZ set
    (``torch.set_flush_denormal``) it must fall back to the table, not flush them."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    raw = _every_pair_rows()
    want = decode_rows(raw, FMT, 256, torch.float32)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got = decode_rows(raw, FMT, 256, torch.float32)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(_bits(got), _bits(want))
    assert int((want.abs() < torch.finfo(torch.float32).tiny).logical_and(want != 0).sum()) > 0  # subnormals there


@pytest.mark.parametrize("native", [True, False])
def test_leading_dimensions_without_an_index(monkeypatch, native):
    """``shape`` without an index lays the n decoded rows out as [*shape, head_dim]; a shape
    that does not hold n rows is refused."""
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    raw = encode_rows(torch.randn(6, 64), FMT)  # [6, 66]
    got = decode_rows(raw, FMT, 64, shape=(2, 3))
    assert got.shape == (2, 3, 64) and torch.equal(_bits(got.reshape(6, 64)), _bits(decode_rows(raw, FMT, 64)))
    with pytest.raises(ValueError, match=r"^shape \(4, 2\) holds 8 rows, not the 6 decoded$"):
        decode_rows(raw, FMT, 64, shape=(4, 2))


@pytest.mark.parametrize("native", [True, False])
def test_an_index_of_int32_or_into_float64_decodes_the_same_rows(monkeypatch, native):
    """An index of int32 is read as int64; float64 rows (no C decode) are gathered first."""
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    raw = encode_rows(torch.randn(20, 64), FMT)
    index = np.array([[19, 3], [3, 0], [7, 11]], np.int64)  # [3, 2]
    want = decode_rows(raw[torch.from_numpy(index.reshape(-1))], FMT, 64)  # [6, 64]
    got = decode_rows(raw, FMT, 64, index=index.astype(np.int32), shape=(3, 2))
    assert torch.equal(_bits(got.reshape(6, 64)), _bits(want))
    wide = decode_rows(raw, FMT, 64, torch.float64, index=index + 5, index_base=5)
    assert wide.dtype == torch.float64 and torch.equal(wide, want.double())


def test_decoded_rows_come_from_the_buffers_given(monkeypatch):
    """With ``buffers``, the C decoder's result is one of their arrays (used again once let go)."""
    from engram_offload.buffers.recycle import RecycledArrays
    from engram_offload.engram.rows import encode_rows

    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    buffers = RecycledArrays(min_bytes=0)
    raw = encode_rows(torch.randn(8, 64), FMT)
    first = decode_rows(raw, FMT, 64, buffers=buffers)
    assert (buffers.made, buffers.reused, buffers.kept_bytes) == (1, 0, first.numel() * 4)
    pointer = first.data_ptr()
    del first
    again = decode_rows(raw, FMT, 64, torch.float32, index=np.arange(8), buffers=buffers)
    assert (buffers.made, buffers.reused) == (1, 1)
    assert again.data_ptr() == pointer and torch.equal(again, decode_rows(raw, FMT, 64))


def _aligned_out(rows: int, offset: int = 0) -> np.ndarray:
    """int32 [rows, 256] whose data starts ``offset`` bytes past a 64-byte boundary."""
    from engram_offload.buffers.recycle import aligned_bytes

    return aligned_bytes(rows * 1024 + offset)[offset:].view(np.int32).reshape(rows, 256)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_streaming_stores_write_the_reference_bits_where_the_output_is_aligned(mode):
    """stores=2 streams a float32 arithmetic decode's stores into a 64-byte aligned output
    (and says so); the bits are the reference's for every (scale, byte) pair, with and without
    an index. An output 16 bytes off a cache line, stores=1, and the table's lookups (mode 0)
    take cached stores, with the same bits."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    from engram_offload.engram import _rowdecode

    arithmetic = _rowdecode.arithmetic_path(mode) != "table"
    raw = _every_pair_rows().numpy()  # [512, 264]
    want = _bits(dequantize_fp8_ue8m0(torch.from_numpy(raw[:, :256].copy()).view(torch.float8_e4m3fn),
                                      torch.from_numpy(raw[:, 256:].copy()), torch.float32))
    table = _fp8_table_bits(torch.float32)
    picks = np.random.default_rng(mode).integers(0, 512, 700)  # rows in any order, some twice
    for index, expected in ((None, want), (picks, want[picks])):
        rows = expected.shape[0]
        for offset, stores, streams in ((0, 2, arithmetic), (16, 2, False), (0, 1, False), (0, 0, False)):
            out = _aligned_out(rows, offset)
            out.fill(-1)
            assert _native_decode()(raw, 256, table, out, index, mode, 0, stores) is streams
            assert torch.equal(torch.from_numpy(out), expected)


def test_auto_stores_stream_from_four_mib_of_output():
    """stores=0 (the default) streams an aligned output of 4 MiB and more, not one a row short."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    from engram_offload.engram import _rowdecode

    arithmetic = _rowdecode.arithmetic_path() != "table"
    raw = _every_pair_rows().numpy()
    table = _fp8_table_bits(torch.float32)
    for rows, streams in ((4096, arithmetic), (4095, False)):  # 4 MiB of float32 rows, and a row less
        picks = np.arange(rows) % 512
        out = _aligned_out(rows)
        assert _native_decode()(raw, 256, table, out, picks, 1) is streams
        assert np.array_equal(out, _native_decode_cached(raw, table, picks))


def _native_decode_cached(raw: np.ndarray, table: np.ndarray, picks: np.ndarray) -> np.ndarray:
    out = np.empty((picks.size, 256), np.int32)
    assert _native_decode()(raw, 256, table, out, picks, 0, 0, 1) is False  # lookups, cached stores
    return out


def test_two_byte_decodes_never_stream_and_a_bad_stores_value_is_refused():
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    raw = _every_pair_rows().numpy()
    out = _aligned_out(512)[:, :128].copy()  # [512, 128] int32: the bytes of [512, 256] bfloat16
    out16 = out.view(np.int16)
    assert _native_decode()(raw, 256, _fp8_table_bits(torch.bfloat16), out16, None, 0, 0, 2) is False
    with pytest.raises(ValueError, match=r"stores must be 0 \(auto\), 1 \(cached\) or 2 \(streaming\), got 3"):
        _native_decode()(raw, 256, _fp8_table_bits(torch.float32), _aligned_out(512), None, 1, 0, 3)


def test_a_decode_asks_for_the_automatic_stores(monkeypatch):
    """The float32 decode's stores are the C helper's automatic choice; two-byte decodes are
    asked for cached ones. The rows are the reference's."""
    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    assert _asked_of_the_c_helper(monkeypatch, 7) == [0, 1]  # a[7], the stores: bfloat16's cached


def test_a_large_decode_into_recycled_buffers_streams(monkeypatch):
    """A step's rows decoded into the Prefetcher's recycled buffers (4 MiB and more) take
    streaming stores: the buffers are aligned for them. The rows are the reference's."""
    from engram_offload.buffers.recycle import RecycledArrays

    if _native_decode() is None:
        pytest.skip("the C decoder is not built")
    from engram_offload.engram import _rowdecode

    streamed = []
    real = _native_decode()
    monkeypatch.setattr("engram_offload.engram.rows._native_decode", lambda: lambda *a: streamed.append(real(*a)))
    raw = _every_pair_rows()
    index = np.arange(6000).reshape(250, 24) % 512  # [T, C]: 6,000 rows, 5.9 MiB of float32
    got = decode_rows(raw, FMT, 256, torch.float32, index=index, shape=(250, 24), buffers=RecycledArrays())
    assert streamed == [_rowdecode.arithmetic_path() != "table"]
    want = dequantize_fp8_ue8m0(raw[:, :256].contiguous().view(torch.float8_e4m3fn), raw[:, 256:], torch.float32)
    assert torch.equal(_bits(got.reshape(6000, 256)), _bits(want[torch.from_numpy(index.reshape(-1))]))


@pytest.mark.parametrize("native", [True, False], ids=["C helper", "NumPy"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_ue8m0", "bf16", "int8"])
def test_decode_through_slots_reads_the_rows_the_slots_name(monkeypatch, native, fmt):
    """``slots``: position p is the raw row ``raw[slots[p]]`` (rows left in a cache's arena),
    with and without an index and its base; the rows those of the gathered copy."""
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    arena = encode_rows(torch.randn(40, 64), fmt)  # [40, row_bytes]
    slots = np.array([31, 4, 17, 4, 0, 39], np.int64)  # a slot twice: two positions, one row
    index = np.array([[5, 2], [3, 5], [7, 3]], np.int64)  # positions + 2
    for dtype in (torch.float32, torch.bfloat16):
        want = decode_rows(arena[torch.from_numpy(slots[index.reshape(-1) - 2])], fmt, 64, dtype)
        got = decode_rows(arena.numpy(), fmt, 64, dtype, index=index, index_base=2, shape=(3, 2), slots=slots)
        assert torch.equal(_bits(got.reshape(6, 64)), _bits(want))
        every = decode_rows(arena, fmt, 64, dtype, slots=slots.astype(np.int32), shape=(2, 3))  # [2, 3, 64]
        assert torch.equal(_bits(every.reshape(6, 64)), _bits(decode_rows(arena[torch.from_numpy(slots)], fmt, 64, dtype)))


@pytest.mark.parametrize("native", [True, False], ids=["C helper", "NumPy"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_ue8m0", "bf16"])
def test_an_index_outside_the_slots_or_a_slot_outside_the_rows_is_refused(monkeypatch, native, fmt):
    from engram_offload.engram.rows import encode_rows

    if native and _native_decode() is None:
        pytest.skip("the C decoder is not built")
    if not native:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    arena = encode_rows(torch.randn(8, 64), fmt).numpy()
    with pytest.raises(IndexError, match="index 6 .*outside the 3 slots"):
        decode_rows(arena, fmt, 64, index=np.array([3, 6]), index_base=3, slots=np.array([1, 2, 3]))
    for index in (np.array([0, 1]), None):  # slot 0 is a row, 8 is not
        with pytest.raises(IndexError, match="slot 8 .*outside the 8 raw rows"):
            decode_rows(arena, fmt, 64, index=index, slots=np.array([0, 8]))
