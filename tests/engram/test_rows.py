import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.engram import rows
from engram_offload.engram.rows import (
    ROW_FORMATS,
    decode_rows,
    dequantize_fp8_blocks,
    dequantize_fp8_ue8m0,
    encode_rows,
    quantize_fp8_ue8m0,
    row_bytes,
    ue8m0_exponents,
    ue8m0_scales,
)


@pytest.mark.parametrize("fmt", list(ROW_FORMATS))
def test_round_trip_shapes_and_bytes(fmt):
    x = torch.randn(17, 64) * 3
    raw = encode_rows(x, fmt)
    assert raw.dtype == torch.uint8 and raw.shape == (17, row_bytes(fmt, 64))
    y = decode_rows(raw, fmt, 64)
    assert y.shape == x.shape and y.dtype == torch.float32
    # decoded values are representable: encoding them again gives the same values
    assert torch.equal(decode_rows(encode_rows(y, fmt), fmt, 64), y)


def test_plain_formats_are_exact_or_rounded():
    x = torch.randn(5, 16)
    assert torch.equal(decode_rows(encode_rows(x, "fp32"), "fp32", 16), x)
    assert torch.equal(decode_rows(encode_rows(x, "bf16"), "bf16", 16), x.bfloat16().float())
    assert torch.equal(decode_rows(encode_rows(x, "fp16"), "fp16", 16), x.half().float())


def test_fp8_layout_and_scale_bytes():
    assert row_bytes("fp8_e4m3_ue8m0", 256) == 264
    x = torch.zeros(1, 64)
    x[0, :32] = 448.0  # exactly representable at scale 1 -> scale byte 127
    x[0, 32:] = 449.0  # needs scale 2 -> byte 128
    raw = encode_rows(x, "fp8_e4m3_ue8m0")
    assert raw[0, 64:].tolist() == [127, 128]
    assert torch.equal(raw[0, :32].view(torch.float8_e4m3fn).float(), torch.full((32,), 448.0))
    y = decode_rows(raw, "fp8_e4m3_ue8m0", 64)
    assert torch.equal(y[0, :32], x[0, :32])


@settings(max_examples=50, deadline=None)
@given(st.floats(1e-6, 1e6), st.integers(0, 2**31 - 1))
def test_fp8_error_bound(magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g) * magnitude
    raw = encode_rows(x, "fp8_e4m3_ue8m0")
    y = decode_rows(raw, "fp8_e4m3_ue8m0", 64)
    scale = torch.ldexp(torch.ones(4, 2), raw[:, 64:].to(torch.float32) - 127).repeat_interleave(32, dim=1)
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((x - y).abs() <= bound).all()
    # every block uses at most the full fp8 range and the smallest such power-of-two scale
    blocks = x.abs().reshape(4, 2, 32).amax(-1)
    s = scale[:, ::32]
    assert (blocks / s <= 448).all()
    assert ((blocks == 0) | (blocks / (s / 2) > 448)).all()


def test_int8_error_bound():
    x = torch.randn(8, 32)
    y = decode_rows(encode_rows(x, "int8"), "int8", 32)
    assert ((x - y).abs() <= x.abs().amax(1, keepdim=True) / 254 + 1e-7).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown row format"):
        row_bytes("fp4", 32)
    with pytest.raises(ValueError, match=r"uint8 \[n, 264\]"):
        decode_rows(torch.zeros(2, 100, dtype=torch.uint8), "fp8_e4m3_ue8m0", 256)
    with pytest.raises(ValueError, match="head_dim"):
        encode_rows(torch.zeros(3), "fp32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_decode_matches_the_reference_bit_for_bit(dtype, monkeypatch):
    monkeypatch.setattr(rows, "_FP8_TABLES", {})  # the decode table built here, not one made earlier
    # every (scale byte, fp8 byte) pair, in rows of 64 values (two blocks of 32)
    values = torch.arange(256, dtype=torch.uint8).repeat(256)  # [65536]
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(256)  # [65536]
    raw = torch.cat([values.view(-1, 64), scales.view(-1, 32)[:, 0].reshape(-1, 2)], dim=1)  # [1024, 66]
    assert raw.shape == (1024, 66)
    got = decode_rows(raw, "fp8_e4m3_ue8m0", 64, dtype)
    want = dequantize_fp8_ue8m0(raw[:, :64].contiguous().view(torch.float8_e4m3fn), raw[:, 64:], dtype)
    assert got.dtype == dtype and got.shape == (1024, 64)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


def test_fp8_decode_of_a_strided_view_and_of_no_rows():
    x = torch.randn(6, 64) * 5
    raw = encode_rows(x, "fp8_e4m3_ue8m0")  # [6, 66]
    wide = torch.zeros(6, 80, dtype=torch.uint8)
    wide[:, 3:69] = raw
    view = wide[:, 3:69]  # not contiguous
    assert torch.equal(decode_rows(view, "fp8_e4m3_ue8m0", 64), decode_rows(raw, "fp8_e4m3_ue8m0", 64))
    empty = decode_rows(raw[:0], "fp8_e4m3_ue8m0", 64, torch.bfloat16)
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16


def test_ue8m0_bytes_0_and_255_decode_like_vllm():
    # vLLM builds the scale as a float32 whose exponent field is the byte: 0 -> 0.0, 255 -> inf
    assert ue8m0_scales(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)).tolist() == [
        0.0, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, math.inf]
    values = torch.tensor([[0.0, 1.5] * 16, [0.0, -2.0] * 16])  # [2, 32]
    rows = dequantize_fp8_ue8m0(values.to(torch.float8_e4m3fn), torch.tensor([[0], [255]], dtype=torch.uint8))
    assert torch.equal(rows[0], torch.zeros(32))
    assert rows[1, 0].isnan() and rows[1, 1] == -math.inf  # 0 * inf and -2 * inf
    raw = torch.cat([values.to(torch.float8_e4m3fn).view(torch.uint8), torch.tensor([[0], [255]], dtype=torch.uint8)], 1)
    decoded = decode_rows(raw, "fp8_e4m3_ue8m0", 32)
    assert torch.equal(decoded[0], rows[0]) and decoded[1, 1] == -math.inf and decoded[1, 0].isnan()


def test_a_tiny_nonzero_block_never_takes_scale_byte_0():
    x = torch.zeros(2, 32)
    x[0, 0] = 2.0**-130  # would want a scale below 2**-127
    raw = encode_rows(x, "fp8_e4m3_ue8m0")
    assert raw[:, 32].tolist() == [1, 0]  # the zero block keeps byte 0: it decodes to zeros either way
    assert torch.equal(decode_rows(raw, "fp8_e4m3_ue8m0", 32), x)


def test_block_dequantization_of_a_matrix_with_a_partial_block():
    g = torch.Generator().manual_seed(0)
    fp8 = (torch.randn(70, 40, generator=g) * 30).to(torch.float8_e4m3fn)
    scales = torch.randint(100, 140, (3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    out = dequantize_fp8_blocks(fp8, scales.view(torch.float8_e8m0fnu))
    assert out.shape == (70, 40) and out.dtype == torch.float32
    for o in range(70):
        for i in range(0, 40, 7):
            assert float(out[o, i]) == float(fp8[o, i].float()) * 2.0 ** (int(scales[o // 32, i // 32]) - 127)
    with pytest.raises(ValueError, match=r"must be \[3, 2\], got \[2, 2\]"):
        dequantize_fp8_blocks(fp8, scales[:2])


def test_row_sizes_of_every_format():
    assert [row_bytes(f, 64) for f in ("fp32", "bf16", "fp16", "fp8_e4m3_ue8m0", "int8")] == [256, 128, 128, 66, 68]
    assert row_bytes("fp8_e4m3_ue8m0", 32) == 33 and row_bytes("int8", 1) == 5 and row_bytes("fp32", 3) == 12


def test_messages_name_what_was_wrong():
    with pytest.raises(ValueError, match=r"^unknown row format 'fp4'; choose one of: fp32, bf16, fp16, "
                                         r"fp8_e4m3_ue8m0, int8$"):
        row_bytes("fp4", 32)
    with pytest.raises(ValueError, match=r"^fp8_e4m3_ue8m0 needs head_dim divisible by 32, got 48$"):
        row_bytes("fp8_e4m3_ue8m0", 48)
    with pytest.raises(ValueError, match=r"^fp8_e4m3_ue8m0 needs head_dim divisible by 32, got 48$"):
        encode_rows(torch.zeros(2, 48), "fp8_e4m3_ue8m0")
    with pytest.raises(ValueError, match=r"^raw rows for int8 at head_dim 32 must be uint8 \[n, 36\], "
                                         r"got torch.int8 \(2, 36\)$"):
        decode_rows(torch.zeros(2, 36, dtype=torch.int8), "int8", 32)
    with pytest.raises(ValueError, match=r"^raw rows for fp32 at head_dim 2 must be uint8 \[n, 8\], "
                                         r"got torch.uint8 \(8,\)$"):
        decode_rows(torch.zeros(8, dtype=torch.uint8), "fp32", 2)
    with pytest.raises(ValueError, match=r"^rows must be \[n, head_dim\], got shape \(2, 3, 4\)$"):
        encode_rows(torch.zeros(2, 3, 4), "fp32")
    with pytest.raises(ValueError, match=r"^unknown row format 'fp64'"):
        encode_rows(torch.zeros(2, 4), "fp64")
    with pytest.raises(ValueError, match=r"^block scales for a \[70, 40\] weight with 32x32 blocks must be "
                                         r"\[3, 2\], got \[3, 3\]$"):
        dequantize_fp8_blocks(torch.zeros(70, 40).to(torch.float8_e4m3fn), torch.zeros(3, 3, dtype=torch.uint8))


def test_int8_layout_and_an_all_zero_row():
    x = torch.tensor([[0.0] * 8, [1.0, -2.0, 0.5, 0.0, 127.0, -127.0, 3.0, 2.0]])
    raw = encode_rows(x, "int8")
    assert raw.shape == (2, 12)
    assert raw[0, 8:].view(torch.float32).item() == 1.0  # a zero row keeps scale 1, not 0/127
    assert raw[1, 8:].view(torch.float32).item() == 1.0  # amax 127 -> scale 1
    assert raw[1, :8].view(torch.int8).tolist() == [1, -2, 0, 0, 127, -127, 3, 2]  # 0.5 rounds to even
    assert torch.equal(decode_rows(raw, "int8", 8), torch.tensor([[0.0] * 8, [1, -2, 0, 0, 127, -127, 3, 2]]))
    big = encode_rows(torch.tensor([[254.0, -254.0, 1.0, 100.0]]), "int8")
    assert big[0, 4:].view(torch.float32).item() == 2.0 and big[0, :4].view(torch.int8).tolist() == [127, -127, 0, 50]


@pytest.mark.parametrize("fmt", list(ROW_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_gives_the_asked_dtype(fmt, dtype):
    x = torch.randn(3, 64)
    raw = encode_rows(x, fmt)
    out = decode_rows(raw, fmt, 64, dtype)
    assert out.dtype == dtype and torch.equal(out, decode_rows(raw, fmt, 64).to(dtype))


def test_ue8m0_exponents_at_powers_of_two():
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 224.0, 449.0, 1.0, 0.0, 448.0 * 2.0**-120, 3e38])
    assert ue8m0_exponents(amax).tolist() == [0, 1, -1, 1, -8, -127, -120, 120]
    values, scales = quantize_fp8_ue8m0(torch.tensor([[3e38] + [0.0] * 31, [-448.0] + [1.0] * 31]))
    assert scales.tolist() == [[247], [127]]
    assert values[1].float().tolist() == [-448.0] + [1.0] * 31 and values[0, 0].float().item() == 224.0  # 225.6 rounded
    assert torch.equal(dequantize_fp8_ue8m0(values, scales), dequantize_fp8_ue8m0(values, scales, torch.float32))


def test_non_finite_values_saturate_and_exponents_stay_in_range():
    x = torch.ones(1, 32)
    x[0, :2] = torch.tensor([float("inf"), -float("inf")])
    raw = encode_rows(x, "fp8_e4m3_ue8m0")
    assert raw[0, 32] == 127  # the block keeps scale 1: the finite values are exact
    assert decode_rows(raw, "fp8_e4m3_ue8m0", 32)[0, :3].tolist() == [448.0, -448.0, 1.0]
    # exponents never leave the ue8m0 range, whatever the block maxima's dtype
    assert ue8m0_exponents(torch.tensor([1e300, 1e-300], dtype=torch.float64)).tolist() == [127, -126]


def test_block_dequantization_gives_the_asked_dtype():
    fp8 = torch.full((32, 32), 1.5).to(torch.float8_e4m3fn)
    out = dequantize_fp8_blocks(fp8, torch.tensor([[128]], dtype=torch.uint8), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and (out == 3.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_decode_on_the_gpu_matches_the_cpu_bit_for_bit(dtype):
    values = torch.arange(256, dtype=torch.uint8).repeat(256)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(256)
    raw = torch.cat([values.view(-1, 64), scales.view(-1, 32)[:, 0].reshape(-1, 2)], dim=1)  # [1024, 66]
    got = decode_rows(raw.cuda(), "fp8_e4m3_ue8m0", 64, dtype)
    want = decode_rows(raw, "fp8_e4m3_ue8m0", 64, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert got.device.type == "cuda" and torch.equal(got.cpu().view(bits), want.view(bits))


def test_int8_rows_of_small_magnitude_and_of_other_float_dtypes():
    x = torch.tensor([[0.5, -0.25, 0.125, 0.0], [1e-3, 0.0, -1e-3, 5e-4]])
    raw = encode_rows(x, "int8")
    assert raw[:, 4:].contiguous().view(torch.float32).flatten().tolist() == [
        torch.tensor(0.5 / 127).item(), torch.tensor(1e-3 / 127).item()]  # amax / 127, also below 1
    assert (decode_rows(raw, "int8", 4) - x).abs().max() <= 0.5 / 254
    for dtype in (torch.bfloat16, torch.float16, torch.float64):  # encoded from float32 values
        y = (torch.randn(3, 64) * 3).to(dtype)
        assert torch.equal(encode_rows(y, "int8"), encode_rows(y.float(), "int8")), dtype
