"""GPU smoke test and figures: one script, a few minutes on one GPU.

    python benchmarks/gpu_smoke.py [--table-gib 8] [--rows 1000000] [--json out.json] [--workdir DIR]

Sections, each timed and checked on its own; the JSON is written after every section (a
late failure keeps every earlier number, and a failed section records its error):

- env: device, SMs, capability, torch/Triton/CUDA versions, UVA coherence, read-only host
  registration, whether fp8 decodes in hardware, the work folder's file system;
- correct: UVA and tiered gathers against the reference; all 65,536 fp8 byte pairs through
  the integer and (sm_89+) hardware decode; zero rows for out-of-range device ids;
- bandwidth: the host link (pinned copy), random 264-byte rows over UVA and from HBM (raw
  and decoded, full and half grid) beside ``index_select``, and their ratios;
- step_latency: a step of 12,288 rows (384 tokens x 2 layers x 16 heads) through the engines'
  lookup (``integrations.lookup.AddressableLookup``): host time to enqueue it and GPU time
  to the last layer's rows, p50 and p99;
- overlap: the step's lookups on a side stream beside an 8192x8192 matmul, at default and
  high side-stream priority: the fraction of the lookups hidden, and their host time while
  the main stream is busy (they must not wait for the matmul);
- graphs: a layer's lookup and its consumer captured in one graph, replayed with new ids
  written into the static ids tensor;
- in_graph: the host-read lookup with the GPU waiting on a flag (``HostReadLookup`` in-graph):
  both layers' lookups and finishes captured in one CUDA graph as vLLM runs them (lookups on a
  prefetch stream), 1000 replays with new ids, rows checked against the same graph over the
  addressable lookup; the replay's GPU time beside that graph's (the wait's cost per layer),
  and a failed read (NaN rows, raised at ``check()``);
- store: a store on the ``direct`` tier delivering to the GPU (HBM level, DRAM level, pinned
  staging) and the device Prefetcher over it, in ``--workdir`` (O_DIRECT needs a real
  file system: tmpfs refuses it, so the default is a folder under the current directory).

Without CUDA it prints one line, "no CUDA device", and exits.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

FMT, HEAD_DIM = "fp8_e4m3_ue8m0", 256


def timed(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median seconds of ``fn()`` on the current stream, timed with events."""
    fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return sorted(samples)[len(samples) // 2]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts), or "unknown"."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if str(path.resolve()).startswith(fields[1]) and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


class Context:
    """What the sections share: the arguments, the pinned table, the random ids."""

    def __init__(self, args: argparse.Namespace) -> None:
        from engram_offload.engram import rows

        self.args = args
        self.row_bytes = rows.row_bytes(FMT, HEAD_DIM)
        self.num_rows = int(args.table_gib * 2**30) // self.row_bytes
        self.table = torch.empty((self.num_rows, self.row_bytes), dtype=torch.uint8, pin_memory=True)
        chunk = 1 << 20
        block = torch.randint(0, 0x7F, (chunk, self.row_bytes), dtype=torch.uint8)  # finite fp8 values
        for i, start in enumerate(range(0, self.num_rows, chunk)):  # scales differ by chunk
            n = min(chunk, self.num_rows - start)
            block[:, HEAD_DIM:] = 112 + i % 24
            self.table[start:start + n] = block[:n]
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.ids = torch.randint(0, self.num_rows, (args.rows,), device="cuda", generator=gen)
        self.ids[0], self.ids[1] = 0, self.num_rows - 1


def env(ctx: Context) -> dict:
    import triton  # noqa: F401 - its version is reported

    from engram_offload.buffers.hostmem import read_only_register_supported, uva_coherent
    from engram_offload.gpu import kernels

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"device": props.name, "capability": list(torch.cuda.get_device_capability(index)),
            "sms": props.multi_processor_count, "memory_bytes": props.total_memory, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": sys.modules["triton"].__version__,
            "python": platform.python_version(), "uva_coherent": uva_coherent(index),
            "read_only_host_register": read_only_register_supported(index),
            "hw_fp8_decode": kernels._use_hw_fp8(torch.device("cuda", index)),
            "table_bytes": ctx.num_rows * ctx.row_bytes, "workdir": str(ctx.args.workdir),
            "workdir_filesystem": filesystem(ctx.args.workdir)}


def correct(ctx: Context) -> dict:
    from engram_offload.engram import rows
    from engram_offload.gpu import dequant_rows, gather_rows, kernels, tiered_gather
    from engram_offload.gpu.reference import gather_rows_ref, tiered_gather_ref

    out: dict[str, Any] = {}
    table, ids = ctx.table, ctx.ids
    check = ids[:4096]
    got = gather_rows(table, check, FMT, dtype=torch.float32)
    out["uva_gather_rows"] = torch.equal(got.cpu(), gather_rows_ref(table, check.cpu(), FMT, HEAD_DIM, torch.float32))
    capacity = 65536
    hot = torch.unique(ids[: capacity // 2]).cpu()
    slots = table[hot].cuda()
    slot_of_row = torch.full((ctx.num_rows,), -1, dtype=torch.int32, device="cuda")
    slot_of_row[hot.cuda()] = torch.arange(hot.numel(), dtype=torch.int32, device="cuda")
    mixed = torch.cat([ids[: capacity // 4], ids[-capacity // 4:]])  # hits and misses
    raw = torch.empty(mixed.numel(), ctx.row_bytes, dtype=torch.uint8, device="cuda")
    tiered_gather(table, slots, slot_of_row, mixed, raw)
    out["tiered_gather"] = torch.equal(raw.cpu(), tiered_gather_ref(table, slots.cpu(), slot_of_row.cpu(), mixed.cpu()))
    values = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every (scale, value) byte pair
    pairs = torch.cat([values, torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 8)], dim=1).contiguous()
    for hw in (False, True):
        if hw and torch.cuda.get_device_capability() < (8, 9):
            continue
        kernels.HW_FP8 = hw
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = dequant_rows(pairs.cuda(), FMT, dtype=dtype).float().cpu()
            b = rows.decode_rows(pairs, FMT, HEAD_DIM, dtype).float()
            same = (a.isnan() & b.isnan()) | ((a == b) & (a.signbit() == b.signbit()))
            out[f"fp8_all_pairs_{'hw' if hw else 'int'}_{str(dtype).split('.')[-1]}"] = bool(same.all())
    kernels.HW_FP8 = None
    bad = torch.tensor([5, -1, ctx.num_rows, 7], device="cuda")
    zeros = torch.full((4, HEAD_DIM), 3.0, device="cuda")
    gather_rows(table, bad, FMT, out=zeros)
    out["bad_device_ids_give_zero_rows"] = bool((zeros[1:3] == 0).all())
    out["ok"] = all(v for k, v in out.items())
    return out


def bandwidth(ctx: Context) -> dict:
    from engram_offload.gpu import gather_raw, gather_rows

    out: dict[str, Any] = {}
    table, ids, n, rb = ctx.table, ctx.ids, ctx.args.rows, ctx.row_bytes
    big = table[: min(ctx.num_rows, (2 << 30) // rb)]
    dst = torch.empty_like(big, device="cuda")
    out["link_h2d_GBps"] = big.numel() / timed(lambda: dst.copy_(big, non_blocking=True)) / 1e9
    hbm_table = table[: min(ctx.num_rows, (4 << 30) // rb)].cuda()
    out["hbm_copy_GBps"] = 2 * hbm_table.numel() / timed(lambda: hbm_table.clone()) / 1e9
    hbm_ids = ids % hbm_table.shape[0]
    raw = torch.empty(n, rb, dtype=torch.uint8, device="cuda")
    dec = torch.empty(n, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    for background in (False, True):
        grid = "half" if background else "full"
        cases = {
            "uva_raw": lambda bg=background: gather_raw(table, ids, out=raw, background=bg),
            "uva_decode": lambda bg=background: gather_rows(table, ids, FMT, out=dec, background=bg),
            "hbm_raw": lambda bg=background: gather_raw(hbm_table, hbm_ids, out=raw, background=bg),
            "hbm_decode": lambda bg=background: gather_rows(hbm_table, hbm_ids, FMT, out=dec, background=bg),
        }
        for name, fn in cases.items():
            seconds = timed(fn)
            out[f"{name}_{grid}_rows_per_s"] = n / seconds
            out[f"{name}_{grid}_GBps"] = n * rb / seconds / 1e9  # bytes of rows read
    out["hbm_index_select_GBps"] = n * rb / timed(lambda: torch.index_select(hbm_table, 0, hbm_ids, out=raw)) / 1e9
    out["uva_raw_vs_link"] = out["uva_raw_full_GBps"] / out["link_h2d_GBps"]
    out["uva_decode_vs_link"] = out["uva_decode_full_GBps"] / out["link_h2d_GBps"]
    out["hbm_vs_uva_rows"] = out["hbm_raw_full_rows_per_s"] / out["uva_raw_full_rows_per_s"]
    out["hbm_raw_vs_index_select"] = out["hbm_raw_full_GBps"] / out["hbm_index_select_GBps"]
    return out


def step_config(ctx: Context):
    from engram_offload.engram.config import EngramConfig

    # 2 layers x (3 - 1) orders x 8 heads = 32 rows a token: 384 tokens are 12,288 rows
    return EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=8, head_dim=HEAD_DIM,
                        prime_starts=(ctx.num_rows // 40,) * 2, row_format=FMT)


def local_ids(config, tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.stack([torch.randint(0, config.rows_per_layer[i], (tokens, config.cols_per_layer), device="cuda",
                                      generator=gen) for i in config.layer_ids], dim=1)  # [T, L, C]


def lookups(ctx: Context) -> tuple[Any, dict]:
    """The engines' path (``integrations.lookup``): one ``AddressableLookup`` a layer of
    ``step_config``, rank 0 of 1, over the pinned table read in place."""
    from engram_offload.gpu.device_table import DeviceTable
    from engram_offload.integrations.lookup import AddressableLookup, LayerShard

    config = step_config(ctx)
    table = DeviceTable(ctx.table[: config.num_rows], "cuda")
    return config, {layer: AddressableLookup(LayerShard.of(config, layer, 0, 1), None, table, config)  # type: ignore[arg-type]
                    for layer in config.layer_ids}


def out_buffers(config, tokens: int) -> dict:
    return {layer: torch.empty(tokens, config.cols_per_layer, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            for layer in config.layer_ids}


def run_step(layers: dict, ids: torch.Tensor, outs: dict) -> None:
    """Every layer's lookup of ``ids [T, L, C]`` into ``outs`` on the current stream."""
    for li, (layer, lookup) in enumerate(layers.items()):
        lookup.lookup(ids[:, li], outs[layer])


def step_latency(ctx: Context, tokens: int = 384, steps: int = 200) -> dict:
    config, layers = lookups(ctx)
    outs = out_buffers(config, tokens)
    batches = [local_ids(config, tokens, seed) for seed in range(8)]
    host, gpu = [], []
    for step in range(steps):
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        run_step(layers, batches[step % len(batches)], outs)
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu.append(begin.elapsed_time(end) / 1e3)
    rows = tokens * len(config.layer_ids) * config.cols_per_layer
    return {"rows_per_step": rows, "tokens": tokens,
            "lookup_host_ms_p50": quantile(host, 0.5) * 1e3, "lookup_host_ms_p99": quantile(host, 0.99) * 1e3,
            "step_gpu_ms_p50": quantile(gpu, 0.5) * 1e3, "step_gpu_ms_p99": quantile(gpu, 0.99) * 1e3,
            "rows_per_s_p50": rows / quantile(gpu, 0.5)}


def overlap(ctx: Context, tokens: int = 384) -> dict:
    """The step's lookups on a side stream (as an engine's prefetch stream runs them) beside a
    matmul on the main stream, at default and high side-stream priority."""
    config, layers = lookups(ctx)
    outs = out_buffers(config, tokens)
    ids = local_ids(config, tokens)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = timed(lambda: a @ a)
    out: dict[str, Any] = {"matmul_ms": matmul * 1e3}
    for name, priority in (("default", 0), ("high", -1)):
        side = torch.cuda.Stream(priority=priority)
        host_while_busy: list[float] = []

        def fetch(busy: bool, side: torch.cuda.Stream = side, host_while_busy: list = host_while_busy) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)  # the ids are ready
            if busy:
                a @ a  # main stream busy
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                run_step(layers, ids, outs)  # must return without waiting for the matmul
            if busy:
                host_while_busy.append(time.perf_counter() - t0)
            main.wait_stream(side)

        alone = timed(lambda: fetch(False))
        together = timed(lambda: fetch(True))
        hidden = (matmul + alone - together) / alone if alone > 0 else 0.0
        out.update({f"{name}_fetch_ms": alone * 1e3, f"{name}_with_matmul_ms": together * 1e3,
                    f"{name}_fetch_hidden_fraction": hidden,
                    f"{name}_lookup_host_ms_main_busy": quantile(host_while_busy, 0.5) * 1e3,
                    f"{name}_lookup_blocked_on_main": quantile(host_while_busy, 0.5) > 0.5 * matmul})
    return out


def graphs(ctx: Context, tokens: int = 256) -> dict:
    """A layer's lookup and its consumer captured in one graph with static ids and output;
    replays read whatever ids the engine wrote into the static tensor."""
    from engram_offload.gpu.reference import gather_rows_ref

    config, layers = lookups(ctx)
    layer, lookup = 15, layers[15]
    static_ids = local_ids(config, tokens)[:, 1].contiguous()  # [T, C]
    out = out_buffers(config, tokens)[layer]
    weight = torch.randn(HEAD_DIM, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lookup.lookup(static_ids, out)  # compile outside the capture
    warm = torch.cuda.Stream()  # cuBLAS sets up outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        out @ weight
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lookup.lookup(static_ids, out)
        result = out @ weight
    rows_ok, replay_ok = True, True
    for seed in range(10):
        new = local_ids(config, tokens, seed + 1)[:, 1]
        static_ids.copy_(new)
        graph.replay()
        flat = (new.reshape(-1) + config.layer_row_base(layer)).cpu()
        want = gather_rows_ref(ctx.table[: config.num_rows], flat, FMT, HEAD_DIM, torch.bfloat16).cuda()
        rows_ok &= torch.equal(out.reshape(-1, HEAD_DIM), want)
        replay_ok &= torch.allclose(result.float(), (want.view(tokens, -1, HEAD_DIM) @ weight).float(),
                                    rtol=1e-2, atol=1e-2)
    replay_s = timed(graph.replay)
    return {"lookup_captured_correct": bool(rows_ok), "consumer_replays_correct": bool(replay_ok),
            "captured_replay_ms": replay_s * 1e3, "ok": bool(rows_ok) and bool(replay_ok)}


class _PinnedRows:
    """The smoke table as a host-read tier: the host reads rows from the pinned table (``failing``: it raises)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table, self.failing = table, False

    def read_raw(self, ids: Any) -> torch.Tensor:
        if self.failing:
            raise OSError("a read failed on purpose")
        return self.table[torch.as_tensor(ids, dtype=torch.int64)]

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def in_graph(ctx: Context, tokens: int = 64, replays: int = 1000) -> dict:
    """Host-read lookups inside a CUDA graph, the GPU waiting on a flag per layer, against the
    same graph over the addressable lookups."""
    from engram_offload.gpu import CudaSync
    from engram_offload.gpu.stream_ops import supported
    from engram_offload.gpu.sync import poll
    from engram_offload.integrations.lookup import HostReadLookup, LayerShard

    if not supported():
        return {"stream_memops": False, "ok": False}
    config, addressable = lookups(ctx)
    rows = _PinnedRows(ctx.table[: config.num_rows])
    sync = CudaSync()
    host = {layer: HostReadLookup(LayerShard.of(config, layer, 0, 1), rows, config, max_tokens=tokens,  # type: ignore[arg-type]
                                  device="cuda", sync=sync, timeout_s=5.0) for layer in config.layer_ids}
    batches = [local_ids(config, tokens, seed) for seed in range(16)]  # [T, L, C] each
    ids = batches[0].clone()
    outs = {"host": out_buffers(config, tokens), "addressable": out_buffers(config, tokens)}
    side = torch.cuda.Stream()

    def step(layers: dict, out: dict) -> None:
        """vLLM's order: every layer's lookup on the prefetch stream at entry, each finish before its layer."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for li, (layer, lookup) in enumerate(layers.items()):
                lookup.lookup(ids[:, li], out[layer], background=True)
        torch.cuda.current_stream().wait_stream(side)
        for layer, lookup in layers.items():
            lookup.finish(out[layer])

    def finished() -> bool:
        event = torch.cuda.Event()
        event.record()
        return poll(event.query, 30.0)  # a protocol fault shows as False, never a hang

    graphs = {}
    for name, layers in (("host", host), ("addressable", addressable)):
        step(layers, outs[name])  # compile and warm up outside the capture
        assert finished()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            step(layers, outs[name])
    equal, times = True, {"host": [], "addressable": []}
    for i in range(replays):
        ids.copy_(batches[i % len(batches)])
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            if not poll(end.query, 30.0):
                return {"stream_memops": True, "error": f"replay {i} of the {name} graph did not end in 30 s",
                        "ok": False}
            times[name].append(start.elapsed_time(end) / 1e3)
        equal &= all(torch.equal(outs["host"][layer], outs["addressable"][layer]) for layer in config.layer_ids)
    for lookup in host.values():
        lookup.check()
    rows.failing = True
    graphs["host"].replay()
    poisoned = finished() and all(bool(torch.isnan(o).all()) for o in outs["host"].values())
    raised = 0
    for lookup in host.values():
        try:
            lookup.check()
        except Exception:  # noqa: BLE001 - the failure each layer must raise
            raised += 1
    rows.failing = False
    graphs["host"].replay()
    recovered = finished() and all(torch.equal(outs["host"][layer], outs["addressable"][layer])
                                   for layer in config.layer_ids)
    for lookup in host.values():
        lookup.close()
    layers = len(config.layer_ids)
    p50 = {name: quantile(t, 0.5) for name, t in times.items()}
    result = {"stream_memops": True, "tokens": tokens, "replays": replays, "rows_equal": bool(equal),
              "replay_ms_p50": p50["host"] * 1e3, "replay_ms_p99": quantile(times["host"], 0.99) * 1e3,
              "addressable_replay_ms_p50": p50["addressable"] * 1e3,
              # the host graph's replay less the addressable one's, per layer: the wait for the host
              # read and the staged copy, beside a gather from the pinned table
              "wait_cost_us_per_layer_p50": (p50["host"] - p50["addressable"]) / layers * 1e6,
              "failed_step_poisoned": bool(poisoned), "failed_step_raised_layers": raised,
              "recovered": bool(recovered), "lookups_counted": sum(h.stats()["lookups"] for h in host.values())}
    result["ok"] = bool(equal and poisoned and raised == layers and recovered)
    return result


def store(ctx: Context, steps: int = 50, batch: int = 64) -> dict:
    """A store on a direct tier delivering to the GPU (HBM level, DRAM level, pinned staging)
    and the device Prefetcher over it: rows equal the table's; rows/s, hit rates, step times."""
    import numpy as np

    from engram_offload import open_table, write_table
    from engram_offload.engram import rows
    from engram_offload.engram.config import EngramConfig
    from engram_offload.engram.hashing import NgramHasher
    from engram_offload.gpu import CudaSync
    from engram_offload.serving.prefetch import Prefetcher

    config = EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=8, head_dim=HEAD_DIM,
                          prime_starts=(6000, 6000), row_format=FMT)  # ~50 MiB
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(0))
    raw = rows.encode_rows(x, config.row_format)
    rng = np.random.default_rng(0)
    hot = rng.choice(config.num_rows, config.num_rows // 20, replace=False)
    ok, out = True, {}
    folder = ctx.args.workdir / "store"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        path = write_table(folder / "smoke.tbl", config, x)
        with open_table(path, "direct", device="cuda", sync=CudaSync(), cache_bytes=8 << 20,
                        fast_cache_bytes=4 << 20) as st:
            requested, start = 0, time.perf_counter()
            for step in range(steps):
                ids = np.r_[rng.choice(hot, 8 * batch), rng.integers(0, config.num_rows, 2 * batch)]
                got = st.read_raw(ids)
                requested += ids.size
                if step % 10 == 0:
                    ok &= torch.equal(got.cpu(), raw[ids])
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            levels = {lv["level"]: lv for lv in st.stats()["levels"]}
            out.update(store_rows_per_s=requested / seconds, hbm_hit_rate=levels["hbm"]["hit_rate"],
                       dram_hit_rate=levels["dram"]["hit_rate"])
            hasher = NgramHasher(config, np.arange(50_000, dtype=np.int64) % 40_000)
            tokens = rng.integers(0, 50_000, size=(batch, steps))
            with Prefetcher(st, hasher, max_tokens=batch) as pf:
                times = []
                for t in range(steps):
                    begin = time.perf_counter()
                    step = pf.begin_step(range(batch), list(tokens[:, t: t + 1]))
                    layer_rows = [pf.rows(layer, step) for layer in config.layer_ids]
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - begin)
                    if t % 10 == 0:
                        ids = step.table_ids[:, 1].reshape(-1).numpy()
                        want = rows.decode_rows(raw[ids], config.row_format, config.head_dim)
                        ok &= torch.equal(layer_rows[1].reshape(-1, config.head_dim).cpu(), want)
                    pf.end_step(step)
            out["prefetch_step_ms_p50"] = quantile(times, 0.5) * 1e3
            out["prefetch_step_ms_p99"] = quantile(times, 0.99) * 1e3
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["ok"] = bool(ok)
    return out


SECTIONS: list[tuple[str, Callable[[Context], dict]]] = [
    ("env", env), ("correct", correct), ("bandwidth", bandwidth), ("step_latency", step_latency),
    ("overlap", overlap), ("graphs", graphs), ("in_graph", in_graph), ("store", store)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--rows", type=int, default=1_000_000, help="random rows per gather")
    parser.add_argument("--json", help="write the figures here (after every section)")
    parser.add_argument("--workdir", type=Path, default=Path.cwd() / ".gpu_smoke_work",
                        help="scratch folder for table files, on a file system with O_DIRECT (not tmpfs)")
    parser.add_argument("--only", nargs="*", help="run only these sections")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}

    def save() -> None:
        if args.json:
            from engram_offload.atomic import write_json_atomic

            write_json_atomic(args.json, report)  # a reader never sees half a file

    failed = False
    try:
        ctx = Context(args)
    except Exception as exc:  # noqa: BLE001 - reported, then nothing else can run
        report["setup"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        print(f"setup failed: {exc}")
        return 1
    for name, section in SECTIONS:
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        try:
            result = section(ctx)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        result["seconds"] = time.perf_counter() - started
        report[name] = result
        failed |= "error" in result or result.get("ok") is False
        save()
        print(f"{name}: {json.dumps(result, default=str)[:600]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
