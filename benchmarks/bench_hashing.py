"""Hashing speed: ours against DeepSeek's demo NumPy approach, side by side.

1. Batch: ``[16, 4096]`` random token ids, V4.1-Flash layout. The baseline re-implements
   the demo's ``NgramHashMapping`` approach (lookup-table compression, one ``np.pad`` per
   shift, the mix recomputed per order, one ``%`` per head, ``np.stack``), plus the head
   offsets its ``MultiHeadEmbedding`` adds. Target: ours >= 2x its throughput.
2. Decode: one new token for each of 256 sequences through the per-sequence state.
   Target: <= 100 us median.
3. Dedup of each decode step's flat table ids (``[256, L, C]``: what a ``Prefetcher`` step
   deduplicates): the native kernel against the NumPy path (``ENGRAM_OFFLOAD_NO_NATIVE``),
   step by step in turns; the rows must agree.

Usage: python benchmarks/bench_hashing.py [--repeats 7] [--out benchmarks/results/hashing.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from engram_offload._native import NO_NATIVE_ENV
from engram_offload.atomic import write_json_atomic
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.engram.tokenizer import cached_token_map
from engram_offload.machine import machine_facts
from engram_offload.serving.dedup import dedup


def demo_style_hash(config: EngramConfig, lookup: np.ndarray, pad_id: int, multipliers: dict,
                    input_ids: np.ndarray) -> dict[int, torch.Tensor]:
    """The demo's approach: head-local ids per layer, then offsets added as its embedding does."""
    x = lookup[input_ids]  # compressed tokenizer
    b, t = x.shape
    out = {}
    for layer in config.layer_ids:
        m = multipliers[layer]

        def shift_k(k: int) -> np.ndarray:
            if k == 0:
                return x
            return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad_id)[:, :t]

        shifts = [shift_k(k) for k in range(config.max_ngram_size)]
        hashes = []
        for n in range(2, config.max_ngram_size + 1):
            tokens = shifts[:n]
            mix = tokens[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, tokens[k] * m[k])
            for prime in config.primes[layer][n - 2]:
                hashes.append((mix % int(prime)).astype(np.int64, copy=False))
        local = torch.from_numpy(np.stack(hashes, axis=2))
        out[layer] = local + torch.tensor(config.head_offsets(layer))
    return out


def timed(fn, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def dedup_native_vs_numpy(hasher: NgramHasher, seqs: list[int], steps: np.ndarray) -> dict:
    """Seconds of ``dedup`` over each decode step's flat table ids, the native kernel and the
    NumPy path in turns (the same ids), and the ids a step."""
    history = hasher.new_history(len(seqs))
    times: dict = {"native": [], "numpy": [], "ids": 0}
    before = os.environ.get(NO_NATIVE_ENV)
    try:
        for tokens in steps:
            ids = hasher.decode_ids(history, seqs, tokens, flat=True)  # [S, L, C]
            results = []
            for way in ("native", "numpy"):
                os.environ[NO_NATIVE_ENV] = "1" if way == "numpy" else ""
                start = time.perf_counter()
                results.append(dedup(ids))
                times[way].append(time.perf_counter() - start)
            assert all(np.array_equal(getattr(results[0], k), getattr(results[1], k)) for k in ("unique", "inverse"))
            times["ids"] = int(ids.size)
    finally:
        if before is None:
            os.environ.pop(NO_NATIVE_ENV, None)
        else:
            os.environ[NO_NATIVE_ENV] = before
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-steps", type=int, default=500)
    parser.add_argument("--out", default="engram-bench/hashing.json",
                        help="the results JSON (default engram-bench/hashing.json; benchmarks/results/hashing.json is the committed record: write there only to update it)")
    args = parser.parse_args()

    config = EngramConfig.from_name("deepseek-v4.1-flash")
    token_map = cached_token_map()
    hasher = NgramHasher(config, token_map)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, token_map.size, (16, 4096))
    multipliers = {layer: config.multipliers(layer, hasher.compressed_vocab_size) for layer in config.layer_ids}

    ours_out = hasher.hash(ids)
    demo_out = demo_style_hash(config, token_map, hasher.pad, multipliers, ids)
    assert all(torch.equal(ours_out[i], demo_out[i]) for i in config.layer_ids), "results differ"

    # interleave the two so drift hits both alike
    ours_t, demo_t = [], []
    for _ in range(args.repeats):
        demo_t += timed(lambda: demo_style_hash(config, token_map, hasher.pad, multipliers, ids), 1)
        ours_t += timed(lambda: hasher.hash(ids), 1)
    positions = ids.size
    ours_med, demo_med = statistics.median(ours_t), statistics.median(demo_t)

    seqs = list(range(256))
    history = hasher.new_history(256)
    prompts = rng.integers(0, token_map.size, (256, 64))
    hasher.hash_pieces(history, seqs, list(prompts))
    steps = rng.integers(0, token_map.size, (args.decode_steps, 256))
    decode_t = []
    for s in range(args.decode_steps):
        start = time.perf_counter()
        hasher.hash_decode(history, seqs, steps[s])
        decode_t.append(time.perf_counter() - start)
    dedup_t = dedup_native_vs_numpy(hasher, seqs, steps)

    result = {
        "layout": config.name,
        "batch_shape": list(ids.shape),
        "batch_ours_ms_median": ours_med * 1e3,
        "batch_demo_ms_median": demo_med * 1e3,
        "batch_ours_positions_per_s": positions / ours_med,
        "batch_demo_positions_per_s": positions / demo_med,
        "batch_speedup": demo_med / ours_med,
        "batch_target_speedup": 2.0,
        "decode_sequences": 256,
        "decode_us_median": statistics.median(decode_t) * 1e6,
        "decode_us_p90": float(np.percentile(decode_t, 90) * 1e6),
        "decode_target_us": 100.0,
        "dedup_ids_per_step": dedup_t["ids"],
        "dedup_native_us_median": statistics.median(dedup_t["native"]) * 1e6,
        "dedup_numpy_us_median": statistics.median(dedup_t["numpy"]) * 1e6,
        "dedup_native_vs_numpy": statistics.median(dedup_t["native"]) / statistics.median(dedup_t["numpy"]),
        "repeats": args.repeats,
        "machine": machine_facts(),
    }
    write_json_atomic(args.out, result)
    print(f"batch [16, 4096]: ours {ours_med * 1e3:.1f} ms, demo approach {demo_med * 1e3:.1f} ms, "
          f"speed-up {demo_med / ours_med:.2f}x (target 2x)")
    print(f"decode, 256 sequences: median {result['decode_us_median']:.0f} us, "
          f"p90 {result['decode_us_p90']:.0f} us (target 100 us median)")
    print(f"dedup of a decode step's {dedup_t['ids']:,} ids: native {result['dedup_native_us_median']:.0f} us, "
          f"NumPy {result['dedup_numpy_us_median']:.0f} us ({result['dedup_native_vs_numpy']:.2f}x)")


if __name__ == "__main__":
    main()
