"""``bench --ranks N``: a run served by N rank processes on this machine, one table between them.

The parent starts N processes (``spawn``) that join one ``torch.distributed`` gloo group
through a file store. Each rank runs the ordinary run (``runner.execute_run``) with a
``RankRole``, which differs from a single process in four places:

- the table: a resident tier (``memory``, ``pinned``, ``shared``) is opened as ``shared``, one
  copy in ``/dev/shm`` for every rank (removed before the run, so the first rank loads it,
  and after); ``direct`` goes through one row server the parent starts (its row cache is
  ``--cache-bytes``; every rank is a client);
- the requests: ranks ``r`` with the same data-parallel index ``r // tp`` serve the
  requests ``i`` with ``i % dp == r // tp`` of the same stream (``dp = N / tp``);
- the columns (``tp`` > 1): rank ``r`` opens the table with the columns
  ``shard_columns(config, r % tp, tp)``, so its Prefetcher fetches only those, and the model's
  Engram layers get the full ``[T, C, d]`` from ``assemble_columns`` over its tensor
  parallel group. The ranks of a group run the same steps: lookahead is off (no schedule
  that depends on when rows arrive) and they agree before each step whether to go on;
- the figures: between two barriers every rank reads its PSS (and rank 0 the row server's),
  and rank 0 gathers every rank's figures with ``gather_object``.

The run's entry is rank 0's figures with the tokens summed over ranks, ``per_rank`` (rows/s,
stall, hit rate, PSS) and ``dram_used_bytes``: the summed PSS of the ranks and the server,
the machine's DRAM that serving took.
"""

from __future__ import annotations

import queue as queue_module
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engram.config import EngramConfig
from ..serving.sharding import Columns, assemble_columns, shard_columns
from ..table.format import read_header
from ..tiers import tier_names
from .engine import BackboneStep, EngineRun, RowsFor, StepShape
from .workload import Request, RequestStream

__all__ = ["RANK_TIERS", "RankRole", "RankRequests", "AssembledRows", "execute_ranked_run"]

# resident ones become one shared copy; the others read this machine's file per row
RANK_TIERS = tier_names(local=True, resident=True) + tier_names(local=True, row_reads=True)
PER_RANK = ("tokens", "throughput_tok_s", "rows_per_s", "stall_fraction", "hit_rate", "pss_bytes")


class RankRequests:
    """Every ``world``-th request of ``stream``, from the ``index``-th: one rank's share."""

    def __init__(self, stream: RequestStream, index: int, world: int) -> None:
        self.stream, self.index, self.world = stream, index, world

    def next(self) -> Request:
        drawn = [self.stream.next() for _ in range(self.world)]
        return drawn[self.index]

    @property
    def wrapped(self) -> int:
        return self.stream.wrapped


class AssembledRows:
    """A ``StepModel`` whose Engram layers get every column's ``[T, C, d]``, all-gathered
    over ``group`` from this rank's ``[T, c1 - c0, d]`` (the engine's ``rows_for``)."""

    def __init__(self, model: Any, config: EngramConfig, group: Any) -> None:
        self.model = BackboneStep(model, config.cols_per_layer, config.head_dim) \
            if isinstance(model, torch.nn.Module) else model
        self.columns, self.group = config.cols_per_layer, group

    def run_step(self, shape: StepShape, rows_for: RowsFor) -> None:
        self.model.run_step(shape, lambda layer_id: assemble_columns(rows_for(layer_id), self.columns, self.group))


class _ServerStore:
    """A row server's client as a run's store: its counters are the server's, every rank's
    since the server started (a client cannot reset them)."""

    levels = ()

    def __init__(self, client: Any) -> None:
        self._client = client

    def reset_stats(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def __enter__(self) -> "_ServerStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()


@dataclass
class RankRole:
    """What one rank process does differently from a single-process run (see the module)."""

    rank: int
    world: int
    tp: int
    table: str
    config: EngramConfig
    row_server: str | None = None
    server_pid: int | None = None
    group: Any = None  # this rank's tensor-parallel process group (set once the world is up)

    @property
    def columns(self) -> Columns | None:
        return shard_columns(self.config, self.rank % self.tp, self.tp) if self.tp > 1 else None

    def requests(self, stream: RequestStream) -> Any:
        return RankRequests(stream, self.rank // self.tp, self.world // self.tp)

    def exchange(self, model: Any) -> Any:
        """The model, its Engram layers fed every column when this rank holds only some."""
        return model if self.tp == 1 else AssembledRows(model, self.config, self.group)

    def agree(self, more: bool) -> bool:
        """Go on only while every rank of the tensor-parallel group goes on."""
        if self.tp == 1:
            return more
        import torch.distributed as dist

        flag = torch.tensor([int(more)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def open(self, tier: str, options: dict[str, Any]) -> Any:
        from ..serving.store import open_table

        if tier == "direct":
            return _ServerStore(open_table(self.table, "direct", row_server=self.row_server, columns=self.columns))
        return open_table(self.table, "shared", columns=self.columns)

    def measure(self, run: EngineRun) -> dict[str, Any]:
        """This rank's PSS (and rank 0: the row server's), read while every rank holds its table."""
        import torch.distributed as dist

        from ..tiers.shared import process_pss

        dist.barrier()
        pss = process_pss()
        server = process_pss(self.server_pid) if self.rank == 0 and self.server_pid else 0
        dist.barrier()
        return {"rank": self.rank, "pss_bytes": pss, "server_pss_bytes": server,
                "rows_per_s": run.rows_unique / run.seconds if run.seconds else 0.0}


def _rank_main(role: RankRole, init_file: str, tier: str, state: str, concurrency: int, settings: Any,
               corpora: Any, token_map: np.ndarray, out: Any) -> None:
    """A rank process: join the group, run, and (rank 0) send every rank's figures back."""
    import torch.distributed as dist

    from .runner import execute_run

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=role.rank, world_size=role.world)
        groups = [dist.new_group(list(range(g * role.tp, (g + 1) * role.tp))) for g in range(role.world // role.tp)]
        role.group = groups[role.rank // role.tp]
        result = execute_run(tier, state, concurrency, settings, corpora, token_map, rank=role)
        gathered: list[Any] | None = [None] * role.world if role.rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if role.rank == 0:
            out.put(("ok", gathered))
        dist.destroy_process_group()
    except BaseException as exc:  # reported by the parent
        out.put(("error", f"rank {role.rank}: {type(exc).__name__}: {exc}"))


def combine_ranks(results: list[dict[str, Any]], tp: int) -> dict[str, Any]:
    """Every rank's figures -> one run entry (see the module)."""
    first = results[0]
    dp_results = results[::tp]  # one rank per data-parallel replica: its tokens are its group's
    entry = dict(first)
    for key in ("tokens", "prefill_tokens", "decode_tokens", "output_tokens", "throughput_tok_s", "output_tok_s",
                "requests_started", "requests_finished"):
        entry[key] = sum(r[key] for r in dp_results)
    entry["stall_fraction"] = float(np.mean([r["stall_fraction"] for r in results]))
    entry.pop("rank")
    entry.pop("rows_per_s")
    entry.pop("pss_bytes")
    entry["ranks"] = len(results)
    entry["tp_columns"] = tp
    entry["per_rank"] = [{"rank": r["rank"], **{k: r.get(k) for k in PER_RANK}} for r in results]
    entry["ranks_pss_bytes"] = sum(r["pss_bytes"] for r in results)
    entry["dram_used_bytes"] = entry["ranks_pss_bytes"] + first["server_pss_bytes"]
    return entry


def execute_ranked_run(tier: str, state: str, concurrency: int, settings: Any, corpora: Any,
                       token_map: np.ndarray, ranks: int, tp: int, timeout: float) -> dict[str, Any]:
    """One run served by ``ranks`` processes (``tp`` of them a tensor-parallel group)."""
    import multiprocessing

    from ..serving.rowserver import start_row_server
    from ..tiers.shared import remove_segment

    if tier not in RANK_TIERS:
        raise ValueError(f"--ranks runs the tiers {', '.join(RANK_TIERS)}, not {tier!r}")
    if ranks % tp:
        raise ValueError(f"--ranks ({ranks}) must be a multiple of --tp ({tp})")
    header = read_header(settings.table)
    if tp > 1:  # the ranks of a group must schedule the same steps: nothing may depend on timing
        settings = replace(settings, lookahead_tokens=0)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="engram-ranks-") as folder:
        server = None
        if tier == "direct":
            server = start_row_server(settings.table, Path(folder) / "rows.sock", tier="direct",
                                      cache_bytes=settings.cache_bytes, policy=settings.policy)
        else:
            remove_segment(header)  # the first rank loads it: its open time is the load
        roles = [RankRole(r, ranks, tp, settings.table, header.config,
                          str(Path(folder) / "rows.sock") if server else None, server.pid if server else None)
                 for r in range(ranks)]
        children = [ctx.Process(target=_rank_main, args=(role, str(Path(folder) / "init"), tier, state, concurrency,
                                                          settings, corpora, token_map, out)) for role in roles]
        try:
            for child in children:
                child.start()
            status, payload = _wait(out, children, time.monotonic() + timeout)
        finally:
            for child in children:
                child.join(timeout=30)
                if child.is_alive():
                    child.kill()
                    child.join()
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
            else:
                remove_segment(header)
    if status != "ok":
        raise RuntimeError(f"the {ranks}-rank {tier} run failed: {payload}")
    return combine_ranks(payload, tp)


def _wait(out: Any, children: list[Any], deadline: float) -> tuple[str, Any]:
    """The first report of the ranks; an error when one dies silently or time runs out."""
    while True:
        try:
            return out.get(timeout=1.0)
        except queue_module.Empty:
            dead = [c for c in children if not c.is_alive() and c.exitcode != 0]
            if dead:
                return "error", f"a rank exited with code {dead[0].exitcode} without a report"
            if time.monotonic() > deadline:
                return "error", "the ranks did not report in time"
