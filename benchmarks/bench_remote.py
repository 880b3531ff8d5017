"""Remote tier vs a raw pipelined GETRANGE client, on one Redis server and a 3-node cluster.

    nice python benchmarks/bench_remote.py --table /tmp/engram-bench/remote.tbl \
        --out benchmarks/results/remote.json

Per step, 1,536 distinct uniformly random rows are read (issue 15's measurement):
(a) ``raw``, the raw client of issue 15's measurement: requests encoded before timing (one
    ``GETRANGE`` per row, grouped by node), then per step each node's pipeline sent and
    each reply taken from a ``hiredis.Reader`` with one ``gets()`` call, the bytes copied
    into an output buffer;
(b) ``raw_array``: the same, but the reader is fed an array header first so hiredis parses
    all of a node's replies in one ``gets()`` (the remote tier's way): the floor for a
    Python client;
(c) ``remote``: ``RemoteTier.read_rows`` on the same ids (grouping, encoding, checks).
The raw clients read what the remote tier reads: each row with the checksum stored after
it (pool layout 2), which they do not check.
All run in this process, alternating repeat by repeat, on their own sockets; rows/s is
rows over wall time, client CPU per row is this process's CPU time over rows. Targets
(issue 15): remote >= 0.8x the raw rows/s and <= 1.5x its CPU per row. Loopback servers start on free ports; the table is
made with the V4.1-Flash layout scaled down (``--scale``) when it does not exist.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hiredis
import numpy as np
import torch

from engram_offload.atomic import write_json_atomic
from engram_offload.engram.config import EngramConfig
from engram_offload.machine import machine_facts
from engram_offload.pool.client import PoolClient, encode_command
from engram_offload.pool.layout import PoolLayout
from engram_offload.pool.publish import publish_table
from engram_offload.pool.servers import free_port_base, start_local_pool
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers.remote import RemoteTier

TARGETS = {"rows_per_s_ratio_min": 0.8, "cpu_per_row_ratio_max": 1.5}


def raw_requests(playout: PoolLayout, client: PoolClient, steps: list[np.ndarray]) -> list[list[tuple]]:
    """Per step: (node address, encoded pipeline, replies expected) for each node."""
    stride = playout.stride  # a row and its checksum: the bytes the remote tier reads
    ext_node = np.array([client.node_of(k) for k in playout.keys])
    out = []
    for ids in steps:
        ext = np.searchsorted(playout.starts, ids, side="right") - 1  # the extent of each row
        offsets = (ids - playout.starts[ext]) * stride
        per_node: dict[int, list[bytes]] = {}
        for e, off in zip(ext.tolist(), offsets.tolist()):
            per_node.setdefault(int(ext_node[e]), []).append(
                encode_command("GETRANGE", playout.keys[e], off, off + stride - 1))
        out.append([(client.address(n), b"".join(reqs), len(reqs)) for n, reqs in per_node.items()])
    return out


class RawNode:
    """A bare socket and hiredis reader to one node."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        self.buf = bytearray(1 << 20)

    def replies(self, n: int, as_array: bool) -> list:
        reader, out = self.reader, []
        if as_array:
            reader.feed(b"*%d\r\n" % n)
        while True:
            if as_array:
                reply = reader.gets()
                if reply is not False:
                    return reply
            else:
                reply = reader.gets()
                while reply is not False:
                    out.append(reply)
                    if len(out) == n:
                        return out
                    reply = reader.gets()
            got = self.sock.recv_into(self.buf)
            reader.feed(self.buf, 0, got)


def run_raw(conns: dict[str, RawNode], requests: list[list[tuple]], out: np.ndarray, as_array: bool) -> list[float]:
    times = []
    for step in requests:
        t0 = time.perf_counter()
        for address, data, _ in step:
            conns[address].sock.sendall(data)
        pos = 0
        for address, _, n in step:
            blob = b"".join(conns[address].replies(n, as_array))
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
            conns = {client.address(i): RawNode(*client.nodes[i]) for i in range(len(client.nodes))}
            rows = args.rows * args.steps
            out_raw = np.empty(args.rows * tier.stride, np.uint8)
            out_tier = torch.empty((args.rows, header.layout.row_bytes), dtype=torch.uint8)
            run_raw(conns, requests[:5], out_raw, False), run_tier(tier, steps[:5], out_tier)  # warm up
            runs = {"raw": [], "raw_array": [], "remote": []}
            for _ in range(args.repeats):
                runs["raw"].append(timed(lambda: run_raw(conns, requests, out_raw, False), rows))
                runs["raw_array"].append(timed(lambda: run_raw(conns, requests, out_raw, True), rows))
                runs["remote"].append(timed(lambda: run_tier(tier, steps, out_tier), rows))
            for conn in conns.values():
                conn.sock.close()
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = {base: {k: median["remote"][k] / median[base][k] for k in ("rows_per_s", "cpu_us_per_row")}
             for base in ("raw", "raw_array")}
    # Load on a shared machine drifts within a run: ratios of the runs of one repeat (next
    # to each other in time), then their median, are steadier than ratios of medians.
    paired = {base: {k: statistics.median(r[k] / b[k] for r, b in zip(runs["remote"], runs[base]))
                     for k in ("rows_per_s", "cpu_us_per_row")} for base in ("raw", "raw_array")}
    return {"nodes": nodes, "publish_s": publish_s, "extents": published["extents"], "median": median,
            "remote_vs": ratio, "remote_vs_paired": paired, "runs": runs}


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
    machine = machine_facts(args.table)  # its loadavg: before the runs
    results = []
    with tempfile.TemporaryDirectory(prefix="engram-bench-remote-") as tmp:
        for nodes in (int(n) for n in args.nodes.split(",")):
            result = bench_pool(args.table, nodes, args, Path(tmp))
            results.append(result)
            for name, m in result["median"].items():
                print(f"{nodes} node(s) {name:9s} {m['rows_per_s']:>10,.0f} rows/s  {m['cpu_us_per_row']:.2f} us CPU/row  "
                      f"step p50 {m['step_ms_p50']:.2f} ms p99 {m['step_ms_p99']:.2f} ms", flush=True)
            for base, r in result["remote_vs"].items():
                p = result["remote_vs_paired"][base]
                print(f"  remote vs {base}: {r['rows_per_s']:.2f}x rows/s, {r['cpu_us_per_row']:.2f}x CPU/row "
                      f"(median of per-repeat ratios: {p['rows_per_s']:.2f}x, {p['cpu_us_per_row']:.2f}x)")
    report = {
        "benchmark": "remote tier vs raw pipelined GETRANGE client",
        "command": " ".join(["python", "benchmarks/bench_remote.py", *(argv if argv is not None else sys.argv[1:])]),
        "table": {"rows": header.layout.num_rows, "row_bytes": header.layout.row_bytes,
                  "row_format": header.layout.row_format},
        "params": {k: v for k, v in vars(args).items() if k not in ("table", "out")},
        "targets": TARGETS,
        "machine": {**machine, "loadavg_after": os.getloadavg()},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # torch's OpenMP pool spins unless PASSIVE
        "pools": results,
    }
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
