"""GPU smoke test and figures: one script, a few minutes on one GPU.

    python benchmarks/gpu_smoke.py [--table-gib 8] [--rows 1000000] [--json out.json]

Checks UVA coherence; builds a pinned fp8 table; checks the UVA gather and the tiered
gather against the reference; measures rows/s and GB/s of random 264-byte rows through UVA
and from HBM (full and half grid) beside the host link's bandwidth (a large pinned copy);
times a side-stream fetch overlapping a matmul; replays one captured graph with new ids;
runs a store that delivers rows to the GPU (HBM level over a direct tier, pinned staging)
and the device Prefetcher over it, checking their rows against the table.
Targets: UVA gather >= 70% of the link copy bandwidth; HBM hits >= 10x the UVA rows/s.
Without CUDA it prints one line, "no CUDA device", and exits.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch


def timed(fn, repeats: int = 5) -> float:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=8.0)
    parser.add_argument("--rows", type=int, default=1_000_000, help="random rows per gather")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0

    from engram_offload.engram import rows
    from engram_offload.engram.config import EngramConfig
    from engram_offload.gpu import CudaSync, RowSource, gather_raw, gather_rows, tiered_gather, uva_coherent
    from engram_offload.gpu.reference import gather_rows_ref, tiered_gather_ref

    fmt, head_dim = "fp8_e4m3_ue8m0", 256
    row_bytes = rows.row_bytes(fmt, head_dim)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "python": platform.python_version()}
    report["uva_coherent"] = coherent = uva_coherent()
    print(f"device {report['device']}; uva_coherent {coherent}", flush=True)
    if not coherent:
        print("UVA is not coherent on this machine: the UVA path must not be used")
        return 1

    num_rows = int(args.table_gib * 2**30) // row_bytes
    table = torch.empty((num_rows, row_bytes), dtype=torch.uint8, pin_memory=True)
    chunk = 1 << 20
    block = torch.randint(0, 0x7F, (chunk, row_bytes), dtype=torch.uint8)  # finite fp8 values
    for i, start in enumerate(range(0, num_rows, chunk)):  # one random block, scales differ by chunk
        n = min(chunk, num_rows - start)
        block[:, head_dim:] = 112 + i % 24
        table[start:start + n] = block[:n]
    report["table_bytes"] = num_rows * row_bytes
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, num_rows, (args.rows,), device="cuda", generator=gen)
    ids[0], ids[1] = 0, num_rows - 1

    # Correctness: the UVA gather and the tiered gather against the reference.
    check = ids[:4096]
    got = gather_rows(table, check, fmt, dtype=torch.float32)
    ok = torch.equal(got.cpu(), gather_rows_ref(table, check.cpu(), fmt, head_dim, torch.float32))
    capacity = 65536
    hot = torch.unique(ids[: capacity // 2]).cpu()
    slots = table[hot].cuda()
    slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device="cuda")
    slot_of_row[hot.cuda()] = torch.arange(hot.numel(), dtype=torch.int32, device="cuda")
    mixed = torch.cat([ids[: capacity // 4], ids[-capacity // 4:]])  # hits and misses
    out = torch.empty(mixed.numel(), row_bytes, dtype=torch.uint8, device="cuda")
    tiered_gather(table, slots, slot_of_row, mixed, out)
    ok &= torch.equal(out.cpu(), tiered_gather_ref(table, slots.cpu(), slot_of_row.cpu(), mixed.cpu()))
    report["correct"] = bool(ok)
    print(f"uva and tiered gathers equal the reference: {ok}", flush=True)

    # Bandwidth: the host link, UVA gathers, HBM gathers.
    big = table[: min(num_rows, (2 << 30) // row_bytes)]
    dst = torch.empty_like(big, device="cuda")
    link = big.numel() / timed(lambda: dst.copy_(big, non_blocking=True))
    report["link_copy_GBps"] = link / 1e9
    raw = torch.empty(args.rows, row_bytes, dtype=torch.uint8, device="cuda")
    hbm_table = table[: min(num_rows, (4 << 30) // row_bytes)].cuda()
    hbm_ids = ids % hbm_table.shape[0]
    for background in (False, True):
        name = "half" if background else "full"
        uva = timed(lambda: gather_raw(table, ids, out=raw, background=background))
        hbm = timed(lambda: gather_raw(hbm_table, hbm_ids, out=raw, background=background))
        report[f"uva_{name}_rows_per_s"] = args.rows / uva
        report[f"uva_{name}_GBps"] = args.rows * row_bytes / uva / 1e9
        report[f"hbm_{name}_rows_per_s"] = args.rows / hbm
        report[f"hbm_{name}_GBps"] = args.rows * row_bytes / hbm / 1e9
        print(f"{name} grid: UVA {args.rows / uva / 1e6:.1f} M rows/s {report[f'uva_{name}_GBps']:.1f} GB/s; "
              f"HBM {args.rows / hbm / 1e6:.1f} M rows/s; link copy {link / 1e9:.1f} GB/s", flush=True)
    report["uva_vs_link"] = report["uva_full_GBps"] / report["link_copy_GBps"]
    report["hbm_vs_uva_rows"] = report["hbm_full_rows_per_s"] / report["uva_full_rows_per_s"]
    report["targets_met"] = report["uva_vs_link"] >= 0.7 and report["hbm_vs_uva_rows"] >= 10
    del hbm_table, dst

    # Side-stream fetch beside a matmul; then a graph replayed with new ids.
    config = EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=8, head_dim=head_dim,
                          prime_starts=(num_rows // 40,) * 2, row_format=fmt)
    layer_table = table[: config.num_rows]
    source = RowSource.from_table(layer_table, config=config, device="cuda", sync=CudaSync())
    tokens = 4096
    local = torch.stack([torch.randint(0, config.rows_per_layer[i], (tokens, config.cols_per_layer), device="cuda")
                         for i in config.layer_ids], dim=1)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    alone = timed(lambda: a @ a)
    fetch = timed(lambda: source.start(local).rows(15))

    def fetch_beside_matmul() -> None:
        handle = source.start(local)  # side stream
        a @ a  # main stream, meanwhile
        handle.rows(15)  # main waits for the fetch

    both = timed(fetch_beside_matmul)
    report.update(matmul_s=alone, fetch_s=fetch, overlapped_s=both)
    flat = local[:, 1].reshape(-1) + config.layer_row_base(15)
    ok = torch.equal(source.start(local).rows(15).reshape(-1, head_dim).cpu(),
                     gather_rows_ref(layer_table, flat.cpu(), fmt, head_dim, torch.bfloat16))
    print(f"side-stream fetch {fetch * 1e3:.2f} ms, matmul {alone * 1e3:.2f} ms, both {both * 1e3:.2f} ms; "
          f"equal to the reference: {ok}", flush=True)
    rows_15 = source.start(local).rows(15)
    weight = torch.randn(head_dim, head_dim, device="cuda", dtype=torch.bfloat16)
    warm = torch.cuda.Stream()  # cuBLAS sets up outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        rows_15 @ weight
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        result = rows_15 @ weight
    replay_ok = True
    for seed in range(100):
        new = local.roll(seed + 1, dims=0)
        source.start(new).rows(15)
        graph.replay()
        if seed % 25 == 0:
            flat = new[:, 1].reshape(-1) + config.layer_row_base(15)
            want = gather_rows_ref(layer_table, flat.cpu(), fmt, head_dim, torch.bfloat16).cuda()
            replay_ok &= torch.allclose(result.float(), (want.view(tokens, -1, head_dim) @ weight).float(),
                                        rtol=1e-2, atol=1e-2)
    report["graph_replays_correct"] = bool(replay_ok) and bool(ok)
    print(f"graph replayed 100 times with new ids, correct: {replay_ok}; targets met: {report['targets_met']}")
    del table, a
    report["store_correct"] = store_and_prefetch(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["correct"] and report["graph_replays_correct"] and report["store_correct"] else 1


def store_and_prefetch(report: dict, steps: int = 50, batch: int = 64) -> bool:
    """A store on a direct tier delivering to the GPU (HBM level, DRAM level, pinned staging)
    and the device Prefetcher over it: rows equal the table's; rows/s, hit rates, step times."""
    import tempfile
    import time

    import numpy as np

    from engram_offload import open_table, write_table
    from engram_offload.engram import rows
    from engram_offload.engram.config import EngramConfig
    from engram_offload.engram.hashing import NgramHasher
    from engram_offload.gpu import CudaSync
    from engram_offload.serving.prefetch import Prefetcher

    config = EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=8, head_dim=256,
                          prime_starts=(6000, 6000), row_format="fp8_e4m3_ue8m0")  # ~50 MiB
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(0))
    raw = rows.encode_rows(x, config.row_format)
    rng = np.random.default_rng(0)
    hot = rng.choice(config.num_rows, config.num_rows // 20, replace=False)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = write_table(f"{tmp}/smoke.tbl", config, x)
        with open_table(path, "direct", device="cuda", sync=CudaSync(), cache_bytes=8 << 20,
                        fast_cache_bytes=4 << 20) as store:
            requested, start = 0, time.perf_counter()
            for step in range(steps):
                ids = np.r_[rng.choice(hot, 8 * batch), rng.integers(0, config.num_rows, 2 * batch)]
                got = store.read_raw(ids)
                requested += ids.size
                if step % 10 == 0:
                    ok &= torch.equal(got.cpu(), raw[ids])
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            levels = {lv["level"]: lv for lv in store.stats()["levels"]}
            report.update(store_rows_per_s=requested / seconds, store_hbm_hit_rate=levels["hbm"]["hit_rate"],
                          store_dram_hit_rate=levels["dram"]["hit_rate"])
            print(f"store (direct + DRAM + HBM) to the GPU: {requested / seconds / 1e6:.2f} M rows/s, HBM hit rate "
                  f"{levels['hbm']['hit_rate']:.2f}, DRAM {levels['dram']['hit_rate']:.2f}; equal: {ok}", flush=True)
            hasher = NgramHasher(config, np.arange(50_000, dtype=np.int64) % 40_000)
            tokens = rng.integers(0, 50_000, size=(batch, steps))
            with Prefetcher(store, hasher) as pf:
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
            report["prefetch_step_ms_p50"] = sorted(times)[len(times) // 2] * 1e3
            print(f"device Prefetcher, {batch} decode tokens a step: p50 {report['prefetch_step_ms_p50']:.2f} ms "
                  f"from begin_step to both layers' rows on the GPU; equal: {ok}", flush=True)
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
