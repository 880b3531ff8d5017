"""Triton kernels of the row gathers. Imported only when a kernel runs (Triton is optional).

Conventions shared by both kernels:

- A persistent grid: program ``p`` handles row tiles ``p, p + grid, p + 2 * grid, ...``,
  so the launch size follows the SM count, not the batch.
- Batch sizes, row counts and strides are runtime arguments that are never specialised:
  one compiled variant serves every batch of a table.
- Every offset is int64, so tables far beyond 2**31 bytes are addressed correctly.
- Ids outside ``[0, num_rows)`` are not read and their output rows are written as zeros, as
  vLLM's lookup does (the host side of each call rejects them before launch when the ids
  are on the host). Slots outside ``[0, num_slots)`` are read as misses.
- Values are decoded with integer operations on their bits, so every result is exact,
  needs no fp8 hardware, and does not depend on how the device treats subnormals.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Row format codes (the FMT constexpr) and output codes (the OUT constexpr).
FP32, BF16, FP16, FP8_E4M3_UE8M0, INT8 = 0, 1, 2, 3, 4
OUT_FP32, OUT_BF16, OUT_FP16 = 0, 1, 2

_RUNTIME = ["n", "num_rows", "num_slots", "width", "src_stride", "cache_stride", "out_stride", "grid"]


@triton.jit
def _rows_of_tile(ids, slot_of_row, start, n, num_rows, num_slots, INDEXED: tl.constexpr,
                  TIERED: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_BY_POS: tl.constexpr):
    """The tile's rows: (output mask, valid-id mask, source row int64, HBM hit mask, slot
    int64), each [BLOCK_R]. Rows of the output mask are written; only valid ones are read.
    SLOT_BY_POS: ``slot_of_row`` holds a slot per position ``i`` (a step's slots), not per row."""
    r = start + tl.arange(0, BLOCK_R)
    live = r < n
    if INDEXED:
        row = tl.load(ids + r, mask=live, other=0).to(tl.int64)
        ok = live & (row >= 0) & (row < num_rows)
    else:
        row = r.to(tl.int64)
        ok = live
    if TIERED:
        if SLOT_BY_POS:
            slot = tl.load(slot_of_row + r, mask=ok, other=-1).to(tl.int64)
        else:
            slot = tl.load(slot_of_row + row, mask=ok, other=-1).to(tl.int64)
        hit = ok & (slot >= 0) & (slot < num_slots)
    else:
        slot = row
        hit = ok & (row < 0)  # no cache: never a hit
    return live, ok, row, hit, slot


@triton.jit
def _load_tiered(src, cache, row_off, slot_off, hit, offs, mask, TIERED: tl.constexpr):
    """Elements ``offs [BLOCK_R, K]`` of each row: from the cache slot on a hit, else the source."""
    from_src = tl.load(src + row_off[:, None] + offs, mask=mask & ~hit[:, None], other=0)
    if TIERED:
        from_cache = tl.load(cache + slot_off[:, None] + offs, mask=mask & hit[:, None], other=0)
        return tl.where(hit[:, None], from_cache, from_src)
    return from_src


@triton.jit(do_not_specialize=_RUNTIME)
def gather_words_kernel(src, ids, slot_of_row, cache, out, n, num_rows, num_slots, width, src_stride,
                        cache_stride, out_stride, grid, TIERED: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr, SLOT_BY_POS: tl.constexpr):
    """Copy rows of ``width`` words: ``out[i] = cache[slot_of_row[ids[i]]]`` on a hit, else
    ``src[ids[i]]``; zeros for an id outside the table."""
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    for start in tl.range(tl.program_id(0) * BLOCK_R, n, grid * BLOCK_R):
        live, ok, row, hit, slot = _rows_of_tile(ids, slot_of_row, start, n, num_rows, num_slots, True, TIERED,
                                                 BLOCK_R, SLOT_BY_POS)
        out_off = (start + tl.arange(0, BLOCK_R)).to(tl.int64) * out_stride
        for c0 in tl.range(0, width, BLOCK_W):
            c = c0 + cols
            in_row = (c < width)[None, :]
            mask = ok[:, None] & in_row
            words = _load_tiered(src, cache, row * src_stride, slot * cache_stride, hit, c[None, :], mask, TIERED)
            tl.store(out + out_off[:, None] + c[None, :], words, mask=live[:, None] & in_row)


@triton.jit
def _fp8_ue8m0_bits(v, s):
    """float32 bits (int32) of fp8 e4m3 byte ``v`` times the ue8m0 scale byte ``s`` (both int32).

    The value is ``M * 2**k`` with a 4-bit integer mantissa ``M``; its float32 bits are built
    directly, normal or subnormal. Scale byte 0 is 0.0 and 255 is inf (SPEC section 5), so
    0 * inf and the fp8 NaN codes give NaN.
    """
    e = (v >> 3) & 15
    m = v & 7
    M = tl.where(e > 0, m | 8, m)
    k = tl.maximum(e, 1) - 137 + s  # value = M * 2**k
    p = (M >= 2).to(tl.int32) + (M >= 4).to(tl.int32) + (M >= 8).to(tl.int32)  # floor(log2(M))
    biased = p + k + 127  # float32 exponent field of the result
    normal = ((biased - 1) << 23) + (M << (23 - p))  # M's leading one carries into the exponent
    subnormal = M << tl.minimum(tl.maximum(k + 149, 0), 31)
    mag = tl.where((biased >= 255) | (s == 255), 0x7F800000, tl.where(biased >= 1, normal, subnormal))
    mag = tl.where((M == 0) | (s == 0), 0, mag)
    nan = ((v & 0x7F) == 0x7F) | ((M == 0) & (s == 255))
    return tl.where(nan, 0x7FC00000, ((v >> 7) << 31) | mag)


@triton.jit
def _bf16_bits_rne(bits):
    """float32 bits (int32) -> bfloat16 bits (int16), rounded to nearest even; NaN -> 0x7FC0."""
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    half = (rounded >> 16) & 0xFFFF
    half = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, half)
    return half.to(tl.int16)


@triton.jit
def _fp8_ue8m0_bits_hw(v, s):
    """As ``_fp8_ue8m0_bits``, through the fp8 convert of sm_89+: e4m3 -> float32, then a
    multiply by the power of two ``s << 23`` (exact: the product is at least 2**-135, a
    float32 subnormal, and fp32 multiplies are not flushed). NaN codes are set apart, so the
    result does not depend on how a convert treats them."""
    x = v.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = (s << 23).to(tl.float32, bitcast=True)
    bits = (x * scale).to(tl.int32, bitcast=True)
    return tl.where((v & 0x7F) == 0x7F, 0x7FC00000, bits)


@triton.jit
def _decode_bits(src, cache, row_off, slot_off, hit, c, mask, head_dim, FMT: tl.constexpr,
                 TIERED: tl.constexpr, HW_FP8: tl.constexpr):
    """float32 bits (int32 [BLOCK_R, BLOCK_D]) of columns ``c`` of each row, in format FMT."""
    if FMT == 0:  # fp32: int32 words
        bits = _load_tiered(src, cache, row_off, slot_off, hit, c[None, :], mask, TIERED)
    elif FMT == 1:  # bf16: int16 words, the high half of a float32
        half = _load_tiered(src, cache, row_off, slot_off, hit, c[None, :], mask, TIERED)
        bits = (half.to(tl.int32) & 0xFFFF) << 16
    elif FMT == 2:  # fp16: int16 words, converted exactly
        half = _load_tiered(src, cache, row_off, slot_off, hit, c[None, :], mask, TIERED)
        bits = half.to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    elif FMT == 3:  # fp8 e4m3 values, then one ue8m0 scale byte per 32 values
        v = _load_tiered(src, cache, row_off, slot_off, hit, c[None, :], mask, TIERED)
        s = _load_tiered(src, cache, row_off, slot_off, hit, (head_dim + c // 32)[None, :], mask, TIERED)
        if HW_FP8:
            bits = _fp8_ue8m0_bits_hw(v.to(tl.int32), s.to(tl.int32))
        else:
            bits = _fp8_ue8m0_bits(v.to(tl.int32), s.to(tl.int32))
    else:  # int8 values, then one little-endian float32 scale
        q = _load_tiered(src, cache, row_off, slot_off, hit, c[None, :], mask, TIERED)
        scale_bits = tl.zeros_like(q.to(tl.int32))
        for b in tl.static_range(4):
            byte = _load_tiered(src, cache, row_off, slot_off, hit, (head_dim + b + 0 * c)[None, :], mask, TIERED)
            scale_bits = scale_bits | (byte.to(tl.int32) << (8 * b))
        value = q.to(tl.int8, bitcast=True).to(tl.float32) * scale_bits.to(tl.float32, bitcast=True)
        bits = value.to(tl.int32, bitcast=True)
    return bits


@triton.jit(do_not_specialize=_RUNTIME)
def gather_decode_kernel(src, ids, slot_of_row, cache, out, n, num_rows, num_slots, width, src_stride,
                         cache_stride, out_stride, grid, FMT: tl.constexpr, OUT: tl.constexpr,
                         INDEXED: tl.constexpr, TIERED: tl.constexpr, HW_FP8: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SLOT_BY_POS: tl.constexpr):
    """Decode rows of ``width`` (head_dim) values into ``out``: row ``ids[i]`` (INDEXED) or row
    ``i``, read from the cache slot on a hit (TIERED); zeros for an id outside the table.
    Strides are in elements of each view. HW_FP8: fp8 through the hardware convert."""
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    for start in tl.range(tl.program_id(0) * BLOCK_R, n, grid * BLOCK_R):
        live, ok, row, hit, slot = _rows_of_tile(ids, slot_of_row, start, n, num_rows, num_slots, INDEXED, TIERED,
                                                 BLOCK_R, SLOT_BY_POS)
        out_off = (start + tl.arange(0, BLOCK_R)).to(tl.int64) * out_stride
        for c0 in tl.range(0, width, BLOCK_D):
            c = c0 + cols
            in_row = (c < width)[None, :]
            mask = ok[:, None] & in_row
            bits = _decode_bits(src, cache, row * src_stride, slot * cache_stride, hit, c, mask, width, FMT, TIERED,
                                HW_FP8)
            bits = tl.where(ok[:, None], bits, 0)  # +0.0 for an id outside the table
            mask = live[:, None] & in_row
            dst = out + out_off[:, None] + c[None, :]
            if OUT == 0:
                tl.store(dst, bits, mask=mask)
            elif OUT == 1:
                tl.store(dst, _bf16_bits_rne(bits), mask=mask)
            else:
                tl.store(dst, bits.to(tl.float32, bitcast=True).to(tl.float16), mask=mask)
