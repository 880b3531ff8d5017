"""Every Triton kernel against its pure-torch reference (Triton's interpreter on a CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engram_offload.engram import rows
from engram_offload.gpu import dequant_rows, gather_raw, gather_rows, head_dim_of, runs_triton, tiered_gather
from engram_offload.gpu.reference import gather_rows_ref, tiered_gather_ref

from tiny_tables import tiny_config

pytest.importorskip("triton")

# `pytest -m gpu` runs every kernel test on a GPU; without one they run under the interpreter
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

FORMATS = list(rows.ROW_FORMATS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = "fp8_e4m3_ue8m0"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN, and the same sign on zeros."""
    a, b = a.float().cpu(), b.float().cpu()
    nan = a.isnan() & b.isnan()
    return bool((nan | ((a == b) & (a.signbit() == b.signbit()))).all())


def table_of(fmt: str, num_rows: int = 40, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    x = torch.randn(num_rows, head_dim, generator=torch.Generator().manual_seed(seed)) * 3
    return rows.encode_rows(x, fmt)


def all_fp8_pairs() -> torch.Tensor:
    """Raw fp8 rows covering all 65,536 (scale byte, value byte) pairs: row s has scale byte s
    on every block and value bytes 0..255."""
    values = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [scale, value]
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256 // rows.FP8_BLOCK)
    return torch.cat([values, scales], dim=1).contiguous()  # [256, 264]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels run on the GPU, not the interpreter")
def test_kernels_run_under_the_interpreter_here():
    assert runs_triton(torch.zeros(1)), "the tests must exercise the Triton kernels"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_every_scale_and_value_byte_matches_the_reference(device, dtype):
    raw = all_fp8_pairs()
    got = dequant_rows(raw.to(device), FP8, dtype=dtype)
    want = rows.decode_rows(raw, FP8, 256, dtype)
    assert same(got, want)


def test_fp8_scale_byte_0_matches_the_reference(device):
    raw = all_fp8_pairs()[:1]
    assert same(dequant_rows(raw.to(device), FP8, dtype=torch.float32), rows.decode_rows(raw, FP8, 256))


def test_fp8_scale_bytes_0_and_255_decode_as_vllm_does(device):
    """SPEC 5: ue8m0 byte 0 is a scale of 0.0 and 255 is inf (a bitcast of byte << 23)."""
    raw = all_fp8_pairs()[[0, 255]]
    got = dequant_rows(raw.to(device), FP8, dtype=torch.float32).cpu()
    values = raw[0, :256].view(torch.float8_e4m3fn).float()  # [256] every fp8 code
    assert same(got[0], values * 0.0)
    assert same(got[1], values * float("inf"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_rows_matches_the_reference_in_every_format(device, fmt, dtype):
    table = table_of(fmt)
    ids = torch.tensor([0, 39, 5, 5, 17, 39, 0])  # first and last rows, repeats
    got = gather_rows(table.to(device), ids, fmt, dtype=dtype)
    assert got.shape == (7, 64) and got.dtype == dtype
    assert same(got, gather_rows_ref(table, ids, fmt, 64, dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_raw_and_dequant_compose_to_gather_rows(device, fmt):
    table = table_of(fmt, seed=1).to(device)
    ids = torch.tensor([39, 0, 12])
    raw = gather_raw(table, ids)
    assert torch.equal(raw.cpu(), table.cpu()[ids])
    assert same(dequant_rows(raw, fmt, dtype=torch.float32), gather_rows(table, ids, fmt, dtype=torch.float32))


def test_gather_takes_a_config_and_writes_into_out(device):
    config = tiny_config(head_dim=64)
    table = table_of(config.row_format, head_dim=64).to(device)
    out = torch.full((2, 64), 7.0, device=device)
    ids = torch.tensor([1, 2])
    assert gather_rows(table, ids, config, out=out) is out
    assert same(out, gather_rows_ref(table.cpu(), ids, config.row_format, 64, torch.float32))


def test_odd_row_widths_gather_byte_by_byte(device):
    table = torch.randint(0, 256, (9, 13), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([8, 0, 4])
    assert torch.equal(gather_raw(table.to(device), ids).cpu(), table[ids])


@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_tiered_gather_reads_hits_from_slots_and_misses_from_the_table(device, out_dtype):
    table = table_of(FP8, num_rows=30, head_dim=64, seed=3)
    slot_of_row = torch.full((30,), -1, dtype=torch.int32)
    slot_of_row[[0, 29, 7]] = torch.tensor([2, 0, 1], dtype=torch.int32)
    slots = torch.zeros(3, table.shape[1], dtype=torch.uint8)
    slots[[2, 0, 1]] = table[[0, 29, 7]]
    slots[1, :4] = 0  # a stale slot byte shows whether row 7 came from the slot
    ids = torch.tensor([0, 29, 7, 3, 28, 7])
    width = table.shape[1] if out_dtype == torch.uint8 else 64
    out = torch.empty(6, width, dtype=out_dtype, device=device)
    tiered_gather(table.to(device), slots.to(device), slot_of_row.to(device), ids, out, config_or_format=FP8)
    want = tiered_gather_ref(table, slots, slot_of_row, ids)
    if out_dtype != torch.uint8:
        want = rows.decode_rows(want, FP8, 64, out_dtype)
    assert same(out, want) if out_dtype != torch.uint8 else torch.equal(out.cpu(), want)
    assert not torch.equal(want[2], table[7])  # the stale slot was read, not the table


def test_out_of_range_ids_raise_before_launch(device):
    table = table_of(FP8).to(device)
    for bad in ([40], [-1], [0, 3, 99]):
        with pytest.raises(IndexError, match="outside the table's 40 rows"):
            gather_rows(table, torch.tensor(bad), FP8)
        with pytest.raises(IndexError):
            gather_raw(table, torch.tensor(bad))


def test_bad_arguments_say_what_is_wrong():
    table = table_of(FP8)
    with pytest.raises(ValueError, match="uint8"):
        gather_raw(table.float(), torch.tensor([0]))
    with pytest.raises(ValueError, match="not rows of format"):
        gather_rows(table[:, :50], torch.tensor([0]), FP8)
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(table, torch.tensor([0]), FP8, out=torch.empty(2, 64))
    assert head_dim_of(FP8, 264) == 256 and head_dim_of("int8", 68) == 64


def test_empty_batches_launch_nothing():
    out = gather_rows(table_of(FP8), torch.empty(0, dtype=torch.int64), FP8)
    assert out.shape == (0, 64)


BIG_TABLE = textwrap.dedent(
    """
    import os, sys, numpy as np, torch
    from engram_offload.engram import rows
    from engram_offload.gpu import gather_raw, gather_rows
    path, row_bytes = sys.argv[1], 264
    num_rows = (2**31 + 40 * row_bytes) // row_bytes  # past 2**31 bytes
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    enc = rows.encode_rows(x, "fp8_e4m3_ue8m0").numpy()
    with open(path, "wb") as f:  # sparse: only three rows are written
        for i, row in zip((0, num_rows // 2 + 7, num_rows - 1), enc):
            f.seek(i * row_bytes); f.write(row.tobytes())
        f.truncate(num_rows * row_bytes)
    table = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(num_rows, row_bytes)))
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2 + 7, num_rows - 1])
    raw = gather_raw(table, ids)
    assert torch.equal(raw, torch.from_numpy(enc[[2, 0, 1, 2]])), "raw rows differ"
    got = gather_rows(table, ids, "fp8_e4m3_ue8m0", dtype=torch.float32)
    assert torch.equal(got, rows.decode_rows(raw, "fp8_e4m3_ue8m0", 256)), "decoded rows differ"
    print("ok")
    """
)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the interpreter on a CPU file")
def test_offsets_past_2_31_bytes_in_a_read_only_sparse_file(tmp_path):
    """An int32 offset would read the wrong row or crash, so this runs in a child process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", BIG_TABLE, str(tmp_path / "big.bin")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


BIG_TABLE_GPU = textwrap.dedent(
    """
    import numpy as np, torch
    from engram_offload.engram import rows
    from engram_offload.gpu import gather_raw, gather_rows, register_host
    row_bytes = 264
    num_rows = (2**31 + 40 * row_bytes) // row_bytes  # past 2**31 bytes
    picks = (0, num_rows // 2 + 7, num_rows - 1)
    enc = rows.encode_rows(torch.randn(3, 256, generator=torch.Generator().manual_seed(5)), "fp8_e4m3_ue8m0")
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2 + 7, num_rows - 1], device="cuda")
    want = enc[[2, 0, 1, 2]]
    host = torch.zeros((num_rows, row_bytes), dtype=torch.uint8)  # registered in place: read over UVA
    host[list(picks)] = enc
    device = host.cuda()  # in HBM
    with register_host(host):
        for table in (host, device):
            assert torch.equal(gather_raw(table, ids).cpu(), want), "raw rows differ"
            got = gather_rows(table, ids, "fp8_e4m3_ue8m0", dtype=torch.float32).cpu()
            assert torch.equal(got, rows.decode_rows(want, "fp8_e4m3_ue8m0", 256)), "decoded rows differ"
    print("ok")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real 64-bit addresses: host memory over UVA and HBM")
def test_offsets_past_2_31_bytes_on_the_gpu():
    """A table past 2**31 bytes registered in host memory and one in HBM (a child process)."""
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", BIG_TABLE_GPU], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_cpu_tensors_use_the_reference_without_the_interpreter():
    code = ("import sys, torch; from engram_offload.gpu import gather_rows, runs_triton; "
            "from engram_offload.engram import rows; t = rows.encode_rows(torch.ones(3, 32), 'fp8_e4m3_ue8m0'); "
            "assert not runs_triton(t); assert gather_rows(t, torch.tensor([2]), 'fp8_e4m3_ue8m0').eq(1).all(); "
            "assert 'triton' not in sys.modules; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_importing_the_package_needs_neither_triton_nor_cuda():
    code = ("import sys, engram_offload, engram_offload.gpu, torch; "
            "assert 'triton' not in sys.modules; assert not torch.cuda.is_initialized(); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_persistent_grid_follows_the_programs_not_the_batch():
    from engram_offload.gpu.kernels import BLOCK_R, INTERPRETER_PROGRAMS, _grid
    cpu = torch.device("cpu")
    assert _grid(cpu, 10**6, background=False) == INTERPRETER_PROGRAMS
    assert _grid(cpu, 10**6, background=True) == INTERPRETER_PROGRAMS // 2
    assert _grid(cpu, BLOCK_R, background=False) == 1  # never more programs than tiles


@pytest.mark.parametrize("fmt", [FP8, "int8", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_out_of_range_device_ids_give_zero_rows(device, fmt, out_dtype):
    """Ids already on the device are not checked on the host: the kernel writes zeros for the
    rows of bad ids (as vLLM does), never leaves what the buffer held before."""
    from engram_offload.gpu.kernels import _launch_decode, _launch_words
    table = table_of(fmt).to(device)
    ids = torch.tensor([3, -1, 40, 2**40, 39], device=device)  # rows 1-3 are outside the table
    width = table.shape[1] if out_dtype == torch.uint8 else 64
    out = torch.full((5, width), 7, dtype=out_dtype, device=device)
    if out_dtype == torch.uint8:
        _launch_words(table, ids, None, None, out, background=False)
        want = table.cpu()[[3, 0, 0, 0, 39]]
    else:
        _launch_decode(table, ids, None, None, out, fmt, 64, background=False)
        want = rows.decode_rows(table.cpu()[[3, 0, 0, 0, 39]], fmt, 64, out_dtype)
    want[1:4] = 0
    assert torch.equal(out.cpu(), want)


def test_the_reference_gives_zero_rows_for_bad_device_ids_too():
    from engram_offload.gpu.reference import gather_raw_ref
    table = table_of(FP8)
    ids = torch.tensor([1, 40, -2])
    got = gather_raw_ref(table, ids, zero_bad=True)
    assert torch.equal(got[0], table[1]) and not got[1:].any()
    with pytest.raises(IndexError):
        gather_raw_ref(table, ids)


def test_slots_beyond_the_cache_raise_on_the_host_and_read_as_misses_on_the_device(device):
    from engram_offload.gpu.kernels import _launch_words
    table = table_of(FP8, num_rows=30)
    slots = torch.zeros(2, table.shape[1], dtype=torch.uint8)
    slot_of_row = torch.full((30,), -1, dtype=torch.int32)
    slot_of_row[4] = 5  # beyond the 2 slots
    out = torch.empty(2, table.shape[1], dtype=torch.uint8, device=device)
    with pytest.raises(IndexError, match="slot 5 is outside the cache's 2 slots"):
        tiered_gather(table, slots, slot_of_row, torch.tensor([4, 1]), out)
    _launch_words(table.to(device), torch.tensor([4, 1], device=device), slot_of_row.to(device), slots.to(device),
                  out, background=False)
    assert torch.equal(out.cpu(), table[[4, 1]])  # the table's row, not memory past the cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_hardware_fp8_decode_is_exact_for_every_pair(device, dtype, monkeypatch):
    """The sm_89+ path (hardware e4m3 convert, then a power-of-two multiply) against the
    reference for all 65,536 (scale, value) pairs: under the interpreter here, on the GPU's
    convert when run with -m gpu on sm_89 or later."""
    from engram_offload.gpu import kernels
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 convert before sm_89")
    monkeypatch.setattr(kernels, "HW_FP8", True)
    raw = all_fp8_pairs()
    got = dequant_rows(raw.to(device), FP8, dtype=dtype)
    assert same(got, rows.decode_rows(raw, FP8, 256, dtype))


@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.bfloat16])
def test_tiered_gather_with_a_slot_per_id(device, out_dtype):
    """A step's slots (one per id, known on the host) instead of a map over every table row."""
    table = table_of(FP8, num_rows=30, seed=4)
    slots = torch.zeros(3, table.shape[1], dtype=torch.uint8)
    slots[[2, 0]] = table[[7, 29]]
    slots[2, :4] = 0  # stale bytes show the slot was read
    ids = torch.tensor([7, 3, 29, 7, 28])
    step_slots = torch.tensor([2, -1, 0, -1, -1], dtype=torch.int32)  # the second 7 reads the table
    width = table.shape[1] if out_dtype == torch.uint8 else 64
    out = torch.empty(5, width, dtype=out_dtype, device=device)
    tiered_gather(table.to(device), slots.to(device), step_slots.to(device), ids.to(device), out,
                  config_or_format=FP8, slots_by_position=True)
    want = torch.stack([slots[2], table[3], slots[0], table[7], table[28]])
    if out_dtype != torch.uint8:
        want = rows.decode_rows(want, FP8, 64, out_dtype)
    assert same(out, want) if out_dtype != torch.uint8 else torch.equal(out.cpu(), want)
    with pytest.raises(ValueError, match="one slot or -1 per id"):
        tiered_gather(table, slots, step_slots[:4], ids, out.cpu(), config_or_format=FP8, slots_by_position=True)
