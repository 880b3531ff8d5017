"""Real text's figures the planner keeps as constants (``planner/realtext.py``), measured again.

    python benchmarks/bench_real_text.py --steps   # DECODE_UNIQUE and PREFILL_UNIQUE, under a minute
    python benchmarks/bench_real_text.py --curve   # REAL_TEXT_HIT, _FIRST_TOUCH, _DISTINCT: minutes, ~1 GB

Both read CPython's standard library (the benchmark corpus) hashed into ``deepseek-v4.1-flash``'s
table; compare the figures with the constants and update them (and docs/planner.md) together.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from engram_offload.atomic import write_json_atomic
from engram_offload.engram.tokenizer import cached_token_map
from engram_offload.planner.models import get_model
from engram_offload.planner.mrc import shards_sample, stack_distances
from engram_offload.planner.realtext import PREFILL_TOKENS, REAL_TEXT_CACHE_TOKENS, REAL_TEXT_TOKENS, STEP_TOKENS
from engram_offload.planner.trace import serving_steps, stdlib_token_sequences


def measure_step_unique(files: int = 4000, steps: int = 200, model: str = "deepseek-v4.1-flash") -> dict[str, Any]:
    """Measure ``DECODE_UNIQUE`` and ``PREFILL_UNIQUE`` again (under a minute): the standard
    library through ``model``'s hasher, decode steps of each batch (the first 20 skipped:
    sequences just begun share their files' openings) and prefill chunks of each size."""
    config, token_map = get_model(model).engram, cached_token_map()
    sequences = stdlib_token_sequences(REAL_TEXT_TOKENS)

    def mean_unique(batch: int, chunk: int, pool: list[np.ndarray], skip: int) -> float:
        fractions = []  # of each step after the first ``skip``, and (prefill) of whole chunks only
        for k, ids in enumerate(serving_steps(config, token_map, pool, batch=batch, chunk=chunk, max_steps=steps)):
            if k >= skip and (chunk == 1 or ids.shape[0] == chunk):
                fractions.append(np.unique(ids).size / ids.size)
        return round(float(np.mean(fractions)), 4)

    decode = [mean_unique(b, 1, sequences[:files], 20) for b in STEP_TOKENS[1:]]
    prefill = [mean_unique(1, k, [s for s in sequences if s.size >= k][:steps], 0) for k in PREFILL_TOKENS[1:]]
    return {"model": model, "decode_sequences": list(STEP_TOKENS), "decode_unique": [1.0, *decode],
            "prefill_tokens": list(PREFILL_TOKENS), "prefill_unique": [1.0, *prefill]}


def measure_real_text_curve(tokens: int = REAL_TEXT_TOKENS, rate: float = 0.03,
                            model: str = "deepseek-v4.1-flash") -> dict[str, Any]:
    """Measure ``REAL_TEXT_HIT``, ``REAL_TEXT_FIRST_TOUCH`` and ``REAL_TEXT_DISTINCT`` again
    (a few minutes and about a GB of memory for the whole standard library): ``model``'s
    hasher over 32 sequences of 16-token pieces a step, each step's ids deduplicated and
    SHARDS-sampled at ``rate`` as they come, stack distances of the sample."""
    config = get_model(model).engram
    rows_per_token = len(config.layer_ids) * config.cols_per_layer
    sequences = stdlib_token_sequences(tokens)
    steps = serving_steps(config, cached_token_map(), sequences, batch=32, chunk=16)
    sampled = np.concatenate([shards_sample(np.unique(step.reshape(-1)), rate) for step in steps])
    distances = stack_distances(sampled) / rate  # rows; negative: a first access
    hit = [round(float(np.mean((distances >= 0) & (distances < c * rows_per_token))), 4)
           for c in REAL_TEXT_CACHE_TOKENS]
    return {"model": model, "tokens": int(sum(s.size for s in sequences)), "rows_per_token": rows_per_token,
            "rate": rate, "cache_tokens": list(REAL_TEXT_CACHE_TOKENS), "hit": hit,
            "first_touch": round(float(np.mean(distances < 0)), 4),
            "distinct_token_equivalents": int(np.sum(distances < 0) / rate / rows_per_token)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", action="store_true", help="measure the distinct share of a step's row ids")
    ap.add_argument("--curve", action="store_true", help="measure the hit-ratio curve of real text")
    ap.add_argument("--out", default="engram-bench/real_text.json", help="the results JSON (default engram-bench/real_text.json)")
    args = ap.parse_args(argv)
    if not (args.steps or args.curve):
        ap.error("give --steps, --curve or both")
    result = {**({"steps": measure_step_unique()} if args.steps else {}),
              **({"curve": measure_real_text_curve()} if args.curve else {})}
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
