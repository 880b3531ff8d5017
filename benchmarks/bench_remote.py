"""Remote tier vs a raw pipelined GETRANGE client, on one Redis server and a 3-node cluster.

    nice python benchmarks/bench_remote.py --table /tmp/engram-bench/remote.tbl \
        --out benchmarks/results/remote.json

Per step, 1,536 distinct uniformly random rows are read (issue 15's measurement):
(a) the raw client: requests encoded before timing (one ``GETRANGE`` per row, grouped by
    node), then per step each node's pipeline sent, all replies parsed by ``hiredis``
    and copied into an output buffer;
(b) ``RemoteTier.read_rows`` on the same ids (grouping, encoding and checks included).
Both run in this process, alternating repeat by repeat; rows/s is rows over wall time,
client CPU per row is this process's CPU time over rows. Targets: remote >= 0.8x the raw
rows/s and <= 1.5x its CPU per row. Loopback servers start on free ports; the table is
made with the V4.1-Flash layout scaled down (``--scale``) when it does not exist.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engram_offload.config import EngramConfig
from engram_offload.machine import machine_facts
from engram_offload.pool.client import NodeConnection, PoolClient, encode_command
from engram_offload.pool.layout import PoolLayout
from engram_offload.pool.publish import publish_table
from engram_offload.pool.servers import free_port_base, start_local_pool
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers.remote import RemoteTier

TARGETS = {"rows_per_s_ratio_min": 0.8, "cpu_per_row_ratio_max": 1.5}


def raw_requests(playout: PoolLayout, client: PoolClient, steps: list[np.ndarray]) -> list[list[tuple]]:
    """Per step: (node address, encoded pipeline, replies expected) for each node."""
    rb = playout.header.layout.row_bytes
    ext_node = np.array([client.node_of(k) for k in playout.keys])
    out = []
    for ids in steps:
        ext = playout.extent_of(ids)
        offsets = (ids - playout.starts[ext]) * rb
        per_node: dict[int, list[bytes]] = {}
        for e, off in zip(ext.tolist(), offsets.tolist()):
            per_node.setdefault(int(ext_node[e]), []).append(
                encode_command("GETRANGE", playout.keys[e], off, off + rb - 1))
        out.append([(client.address(n), b"".join(reqs), len(reqs)) for n, reqs in per_node.items()])
    return out


def run_raw(conns: dict[str, NodeConnection], requests: list[list[tuple]], out: np.ndarray) -> list[float]:
    times = []
    for step in requests:
        t0 = time.perf_counter()
        for address, data, _ in step:
            conns[address].send(data)
        pos = 0
        for address, _, n in step:
            blob = b"".join(conns[address].read_replies(n))
            out[pos: pos + len(blob)] = np.frombuffer(blob, np.uint8)
            pos += len(blob)
        if pos != out.nbytes:
            raise RuntimeError(f"raw client got {pos} bytes, expected {out.nbytes}")
        times.append(time.perf_counter() - t0)
    return times


def run_tier(tier: RemoteTier, steps: list[np.ndarray], out: torch.Tensor) -> list[float]:
    times = []
    for ids in steps:
        t0 = time.perf_counter()
        tier.read_rows(ids, out)
        times.append(time.perf_counter() - t0)
    return times


def timed(fn, rows: int) -> dict:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    times = fn()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    ms = np.array(times) * 1e3
    return {"rows_per_s": rows / wall, "cpu_us_per_row": cpu / rows * 1e6,
            "step_ms_p50": float(np.percentile(ms, 50)), "step_ms_p99": float(np.percentile(ms, 99))}


def bench_pool(table: Path, nodes: int, args: argparse.Namespace, directory: Path) -> dict:
    header = read_header(table)
    rng = np.random.default_rng(args.seed)
    with start_local_pool(nodes, free_port_base(nodes), directory / f"pool-{nodes}") as pool:
        t0 = time.perf_counter()
        published = publish_table(table, pool.url, extent_rows=args.extent_rows, progress=False)
        publish_s = time.perf_counter() - t0
        with RemoteTier(header, pool=pool.url) as tier, PoolClient(pool.url) as client:
            steps = [np.sort(rng.choice(header.layout.num_rows, args.rows, replace=False)) for _ in range(args.steps)]
            requests = raw_requests(tier.pool_layout, client, steps)
            conns = {client.address(i): NodeConnection(*client.nodes[i], 10.0) for i in range(len(client.nodes))}
            rows = args.rows * args.steps
            out_raw = np.empty(args.rows * header.layout.row_bytes, np.uint8)
            out_tier = torch.empty((args.rows, header.layout.row_bytes), dtype=torch.uint8)
            run_raw(conns, requests[:5], out_raw), run_tier(tier, steps[:5], out_tier)  # warm up
            runs = {"raw": [], "remote": []}
            for _ in range(args.repeats):
                runs["raw"].append(timed(lambda: run_raw(conns, requests, out_raw), rows))
                runs["remote"].append(timed(lambda: run_tier(tier, steps, out_tier), rows))
            for conn in conns.values():
                conn.close()
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = {"rows_per_s": median["remote"]["rows_per_s"] / median["raw"]["rows_per_s"],
             "cpu_us_per_row": median["remote"]["cpu_us_per_row"] / median["raw"]["cpu_us_per_row"]}
    return {"nodes": nodes, "publish_s": publish_s, "extents": published["extents"], "median": median,
            "remote_vs_raw": ratio, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=Path(tempfile.gettempdir()) / "engram-bench" / "remote.tbl")
    parser.add_argument("--scale", type=float, default=0.004,
                        help="V4.1-Flash layout scale when making the table (0.004: about 3M rows)")
    parser.add_argument("--rows", type=int, default=1536, help="distinct rows per step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nodes", default="1,3", help="pool sizes to run, comma-separated")
    parser.add_argument("--extent-rows", type=int, default=1 << 18)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.table.exists():
        args.table.parent.mkdir(parents=True, exist_ok=True)
        config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(args.scale)
        make_random_table(args.table, config, seed=args.seed, progress=False)
    header = read_header(args.table)
    results = []
    with tempfile.TemporaryDirectory(prefix="engram-bench-remote-") as tmp:
        for nodes in (int(n) for n in args.nodes.split(",")):
            result = bench_pool(args.table, nodes, args, Path(tmp))
            results.append(result)
            m, r = result["median"], result["remote_vs_raw"]
            print(f"{nodes} node(s): raw {m['raw']['rows_per_s']:,.0f} rows/s {m['raw']['cpu_us_per_row']:.2f} us CPU/row "
                  f"p50 {m['raw']['step_ms_p50']:.2f} ms | remote {m['remote']['rows_per_s']:,.0f} rows/s "
                  f"{m['remote']['cpu_us_per_row']:.2f} us CPU/row p50 {m['remote']['step_ms_p50']:.2f} ms "
                  f"p99 {m['remote']['step_ms_p99']:.2f} ms | ratio {r['rows_per_s']:.2f}x rows/s, "
                  f"{r['cpu_us_per_row']:.2f}x CPU/row", flush=True)
    report = {
        "benchmark": "remote tier vs raw pipelined GETRANGE client",
        "command": " ".join(["python", "benchmarks/bench_remote.py", *(argv if argv is not None else sys.argv[1:])]),
        "table": {"rows": header.layout.num_rows, "row_bytes": header.layout.row_bytes,
                  "row_format": header.layout.row_format},
        "params": {k: v for k, v in vars(args).items() if k not in ("table", "out")},
        "targets": TARGETS,
        "machine": machine_facts(args.table),
        "pools": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
