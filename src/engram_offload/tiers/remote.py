"""``remote`` tier: rows read from a table published in a Redis pool (Redis Cluster or one server).

The table lies in the pool as extents of packed rows, each followed by its checksum: a MAC
under the operator's pool key (``engram_offload.pool.layout``, ``engram_offload.pool.key``),
read from the key file at open.
Per request, the distinct ids are sorted, grouped by extent into runs (neighbouring rows
of one extent merge into one range when the gap is small), and the runs grouped by the
node owning their extent's slot. Each node gets ONE pipeline of ``GETRANGE`` commands,
encoded from per-extent key prefixes and per-offset argument tables built at open; all
nodes' pipelines are sent before any reply is read, so the nodes work in parallel.
Replies are parsed by ``hiredis``, checked (every byte asked for came back, and every
row against its MAC, with OpenSSL's AES), and the rows gathered into ``out`` in the caller's order.

Failures are never silent: a node that is down or times out, an error reply, or a
missing or short extent is retried ``retries`` times (re-reading the slot map between
tries), then the rows are read from the ``fallback`` tier when one is configured, else
``TierError`` names the node, the extent and what went wrong. A node that timed out (a
stopped or wedged server) is marked down for ``down_s`` seconds: its ranges go to the
fallback (or raise) at once, without a wait or a retry, until the mark ends and a read
tries it again (a circuit breaker). A row that fails its
checksum is read once more; failing again, it takes the same way (fallback, else
``TierError`` naming the node, the extent and the row). A wrong row is never returned.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Sequence

import numpy as np
import torch

from ..errors import TierError
from ..pool.client import NodeConnection, PoolClient, PoolError, encode_command, key_slot, parse_pool_url, redact
from ..pool.key import load_key
from ..pool.layout import PoolLayout, bad_rows, fingerprint, rows_with_sums
from ..pool.publish import check_complete, check_extent_digests, read_pool_table
from ..table.format import TableHeader, read_header
from .base import Tier

__all__ = ["RemoteTier", "open_pool_table"]

DEFAULT_MERGE_GAP_BYTES = 512
VERIFY_EXTENTS = ("sample", "all", "none")
VERIFY_SAMPLE_BYTES = 64 << 20  # extents read whole at open with verify_extents="sample" (at least one)


@lru_cache(maxsize=4)
def _offset_args(stride: int, rows: int) -> np.ndarray:
    """GETRANGE's start and end arguments, RESP encoded, for one row (and its checksum) at
    each extent position (object array ``[rows]`` of bytes)."""
    return _object_array([_range_args(start, start + stride - 1) for start in range(0, rows * stride, stride)])


def _range_args(start: int, end: int) -> bytes:
    a, b = str(start).encode(), str(end).encode()
    return b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(a), a, len(b), b)


_ASKING = encode_command("ASKING")


def _object_array(items: list) -> np.ndarray:
    """``items`` as a 1-D numpy object array (fancy indexing picks many at C speed)."""
    out = np.empty(len(items), object)
    out[:] = items
    return out


@dataclass
class _Job:
    """One node's pipeline: the runs it serves and where their bytes go."""

    address: str
    runs: np.ndarray        # run indices, in data order
    request: bytes
    nbytes: int
    dest: int | None        # byte offset in the data buffer when the runs are contiguous there
    pieces: np.ndarray      # the request's pieces: each run's key prefix, then its range arguments


class _Runs:
    """Ranges of neighbouring rows of one extent: extent, first row in it, rows (None: one
    row each); and (after ``place``) each range's byte position in the fetched data, where
    each row takes ``stride`` bytes (the row and its checksum)."""

    def __init__(self, ext: np.ndarray, q0: np.ndarray, rows: np.ndarray | None, stride: int) -> None:
        self.ext, self.q0, self.stride = ext, q0, stride
        self.merged = rows is not None
        self.rows = rows if rows is not None else np.ones(len(ext), np.int64)
        self.nbytes = (int(rows.sum()) if rows is not None else len(ext)) * stride
        self.order: np.ndarray | None = None

    def place(self, order: np.ndarray | None) -> None:
        """Lay the runs out in ``order`` (grouped by node, so each node's bytes are
        contiguous); None keeps their own order."""
        self.order = order
        self.__dict__.pop("pos", None)

    def row_ids(self, starts: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table row id, data row) of every row of the runs ``sel``; ``starts``: the
        extents' first rows."""
        counts = self.rows[sel]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        ids = np.repeat(starts[self.ext[sel]] + self.q0[sel], counts) + within
        return ids, np.repeat(self.pos[sel] // self.stride, counts) + within

    @cached_property
    def pos(self) -> np.ndarray:
        """Byte position of every run in the data (int64 ``[runs]``)."""
        n = len(self.ext)
        if self.order is None and not self.merged:
            return np.arange(0, n * self.stride, self.stride)
        order = self.order if self.order is not None else np.arange(n)
        pos = np.empty(n, np.int64)
        if self.merged:
            nbytes = self.rows[order] * self.stride
            pos[order] = np.cumsum(nbytes) - nbytes
        else:
            pos[order] = np.arange(0, n * self.stride, self.stride)
        return pos


class RemoteTier(Tier):
    """A table's rows served from a Redis pool.

    Options: ``pool`` (``redis://host:port[,host:port...]``, required), ``fallback`` (a
    tier, or a local table path opened on ``mmap``, read when the pool fails), ``retries``
    (per request, after the first try), ``timeout_s`` (per socket operation),
    ``merge_gap_bytes`` (neighbouring rows of one extent this close share one range),
    ``down_s`` (how long a node that timed out is skipped),
    ``verify_extents`` (at open, extents read whole and checked against the manifest's
    digests: ``"sample"``, random ones up to 64 MiB; ``"all"``; ``"none"``).
    """

    name = "remote"

    def __init__(
        self,
        header: TableHeader,
        *,
        pool: str | Sequence[str],
        fallback: Tier | str | os.PathLike | None = None,
        retries: int = 2,
        timeout_s: float = 2.0,
        merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
        retry_backoff_s: float = 0.05,
        verify_extents: str = "sample",
        down_s: float = 10.0,
    ) -> None:
        super().__init__(header)
        if verify_extents not in VERIFY_EXTENTS:
            raise ValueError(f"verify_extents must be one of {', '.join(VERIFY_EXTENTS)}, got {verify_extents!r}")
        if retries < 0 or timeout_s <= 0:
            raise ValueError(f"retries must be >= 0 and timeout_s > 0, got {retries} and {timeout_s}")
        self.pool_url = redact(pool)  # for messages and stats
        self.retries, self.timeout_s, self.retry_backoff_s = retries, timeout_s, retry_backoff_s
        self.down_s = float(down_s)
        self._down: dict[str, float] = {}  # node address -> time.monotonic() until which it is skipped
        self._local = threading.local()
        self._conns_lock = threading.Lock()
        self._conns: list[NodeConnection] = []
        self._fallback: Tier | None = None
        self._owns_fallback = False
        self._client = PoolClient(pool, timeout=timeout_s)
        try:
            self._key = load_key()
            self.pool_layout = self._open_layout(verify_extents)
            self._open_fallback(fallback)
        except BaseException:
            self.close()
            raise
        playout = self.pool_layout
        self.stride = playout.stride  # bytes per row in the pool: the row, then its checksum
        self.fingerprint = playout.fingerprint
        self._starts = playout.starts
        self._prefix = _object_array([b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n" % (len(k), k.encode())
                                      for k in playout.keys])
        self._args = _offset_args(self.stride, int(playout.counts.max()))
        self._slots = np.array([key_slot(k) for k in playout.keys], np.int32)
        self._merge_rows = 1 + max(0, merge_gap_bytes) // self.stride
        self._topology_lock = threading.Lock()
        self._set_topology()

    # -- opening ------------------------------------------------------------------------
    def _open_layout(self, verify_extents: str) -> PoolLayout:
        fp = fingerprint(self.header)
        named = self._client.url_fingerprint
        if named is not None and named != fp:
            raise PoolError(f"the pool URL names table {named}, but {self.header.path} is table {fp}")
        playout = read_pool_table(self._client, fp)
        problems = check_complete(self._client, playout, self._key)
        if problems:
            raise PoolError(
                f"table {fp} in the pool at {self.pool_url} is not completely published: "
                f"{'; '.join(problems)}; run engram-offload pool publish TABLE --pool {self.pool_url}"
            )
        problems = check_extent_digests(self._client, playout, _extents_to_verify(playout, verify_extents))
        if problems:
            raise PoolError(
                f"table {fp} in the pool at {self.pool_url} was altered after it was published: "
                f"{'; '.join(problems[:3])}{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}; "
                f"drop it and publish it again (engram-offload pool drop {fp}; pool publish TABLE)"
            )
        return PoolLayout(self.header, playout.extent_rows)

    def _open_fallback(self, fallback: Tier | str | os.PathLike | None) -> None:
        if fallback is None:
            return
        if not isinstance(fallback, Tier):
            from . import get_tier_class

            fallback = get_tier_class("mmap")(read_header(fallback))
            self._owns_fallback = True
        self._fallback = fallback
        if fingerprint(fallback.header) != fingerprint(self.header):
            raise ValueError(
                f"the fallback table {fallback.header.path} is not the pooled table "
                f"{fingerprint(self.header)}: give a copy of the same table"
            )

    def _set_topology(self) -> None:
        client = self._client
        addresses = [client.address(i) for i in range(len(client.nodes))]
        self._topology = (addresses, client.owner[self._slots])  # node of every extent

    def _refresh(self) -> None:
        with self._topology_lock:
            try:
                self._client.refresh()
            except PoolError:
                return  # keep the last map; the retry reports the node that failed
            self._set_topology()

    # -- reading ------------------------------------------------------------------------
    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        # Few numpy calls on the way: at 1,536 rows a request, each call's fixed cost counts.
        stride = self.stride
        gaps = np.diff(ids)
        if len(ids) < 2 or gaps.min() > 0:
            uniq, inverse = ids, None  # already distinct and sorted
        else:
            uniq, inverse = np.unique(ids, return_inverse=True)
            gaps = np.diff(uniq)
        runs, run_of, q = self._runs(uniq, gaps)
        addresses, node_of = self._topology
        if len(addresses) == 1:
            order, nodes = None, None
        else:
            run_node = node_of[runs.ext]
            order = np.argsort(run_node, kind="stable")
            nodes = run_node[order]
        runs.place(order)
        data = self._fetch_with_retries(self._jobs(order, nodes, addresses, runs, contiguous=True), runs)
        in_order = order is None and len(data) == len(uniq) * stride  # data row i holds uniq[i]
        wanted = None if in_order else self._data_rows(runs, run_of, q)  # data row of each distinct id
        bad = bad_rows(data, self.row_bytes, stride, self.fingerprint, uniq if in_order else self._data_row_ids(runs),
                       self._key)
        if bad.size and wanted is not None and len(wanted) * stride != len(data):
            bad = bad[np.isin(bad, wanted)]  # rows between merged ones were not asked for
        if bad.size:
            data = self._reread(bad, runs, data)
        if inverse is not None:
            wanted = inverse if wanted is None else wanted[inverse]  # data row of each output row
        self._copy_rows(data, wanted, out)
        self._count(reads=len(runs.ext), bytes_read=len(data))

    def _runs(self, uniq: np.ndarray, gaps: np.ndarray) -> tuple["_Runs", np.ndarray | None, np.ndarray]:
        """The ranges to read for sorted distinct ids ``uniq`` (``gaps``: their differences):
        (runs, the run of each id or None when one run each, each id's row within its extent).

        Neighbouring rows of one extent merge into one range, but only when that saves at
        least 1/16 of the commands: for scattered ids, a few merges cost more numpy calls
        than the commands they save."""
        ext = self._starts.searchsorted(uniq, side="right") - 1
        q = uniq - self._starts[ext]  # row within its extent
        joins = (gaps <= self._merge_rows) & (ext[1:] == ext[:-1])  # row i+1 extends row i's range
        if np.count_nonzero(joins) * 16 < len(uniq):
            return _Runs(ext, q, None, self.stride), None, q
        starts_run = np.empty(len(uniq), bool)
        starts_run[0] = True
        np.logical_not(joins, out=starts_run[1:])
        first = np.flatnonzero(starts_run)
        last = np.empty_like(first)
        last[:-1], last[-1] = first[1:] - 1, len(uniq) - 1
        run_of = np.cumsum(starts_run) - 1
        return _Runs(ext[first], q[first], q[last] - q[first] + 1, self.stride), run_of, q

    def _data_rows(self, runs: "_Runs", run_of: np.ndarray | None, q: np.ndarray) -> np.ndarray:
        """The data row of each distinct id (``run_of``: its run, None when one run each;
        ``q``: its row within its extent)."""
        if run_of is None:
            return runs.pos // self.stride
        return runs.pos[run_of] // self.stride + (q - runs.q0[run_of])

    def _data_row_ids(self, runs: "_Runs") -> np.ndarray:
        """The table row id of every data row of ``runs`` (int64 ``[data rows]``)."""
        ids, slots = runs.row_ids(self._starts, np.arange(len(runs.ext)))
        row_of = np.empty_like(ids)
        row_of[slots] = ids
        return row_of

    def _copy_rows(self, data: np.ndarray, index: np.ndarray | None, out: torch.Tensor) -> None:
        """``out[i]`` = the row of data row ``index[i]`` (None: data row ``i``), without its
        checksum. NumPy copies: torch's would wake its thread pool on every fetch."""
        rows = data.reshape(-1, self.stride)[:, : self.row_bytes]  # [data rows, row_bytes], strided
        dest = out.numpy()
        if index is None:
            dest[:] = rows
        elif out.is_contiguous():  # "clip": the indices are ours; "raise" buffers the copy (10x slower)
            np.take(rows, index, axis=0, out=dest, mode="clip")
        else:
            dest[:] = rows[index]

    def _jobs(self, order: np.ndarray | None, nodes: np.ndarray | None, addresses: list[str], runs: "_Runs",
              contiguous: bool = False) -> list[_Job]:
        """One job per node for the runs ``order`` (None: all, in their order), grouped by
        node (``nodes``: the node of each, or None when one node serves them all).
        ``contiguous``: each node's runs lie back to back in the data, in order (so its
        bytes land with one copy)."""
        stride = self.stride
        if order is None:
            order, ext, q0, rows = np.arange(len(runs.ext)), runs.ext, runs.q0, runs.rows
        else:
            ext, q0, rows = runs.ext[order], runs.q0[order], runs.rows[order]
        request = np.empty(2 * len(order), object)  # key prefix, range arguments, ...
        request[0::2] = self._prefix[ext]
        request[1::2] = self._args[q0]
        if runs.merged:
            for i in np.flatnonzero(rows > 1).tolist():  # merged runs: one longer range
                start = int(q0[i]) * stride
                request[2 * i + 1] = _range_args(start, start + int(rows[i]) * stride - 1)
        if nodes is None:
            bounds, firsts = [0, len(order)], [0]
        else:
            cuts = (np.flatnonzero(nodes[1:] != nodes[:-1]) + 1).tolist()
            bounds, firsts = [0, *cuts, len(order)], nodes[[0, *cuts]].tolist()
        row_ends = np.cumsum(rows).tolist() if runs.merged else None
        jobs = []
        for a, b, node in zip(bounds[:-1], bounds[1:], firsts):
            count = (row_ends[b - 1] - (row_ends[a - 1] if a else 0)) if row_ends else b - a  # rows
            if not contiguous:
                dest = None
            else:  # in its own order, the data starts with the first (and only) node's bytes
                dest = 0 if runs.order is None else int(runs.pos[order[a]])
            jobs.append(_Job(addresses[node], order[a:b], b"".join(request[2 * a: 2 * b].tolist()), count * stride,
                             dest, request[2 * a: 2 * b]))
        return jobs

    def _connection(self, address: str) -> NodeConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(address)
        if conn is None:
            host, port = address.rsplit(":", 1)
            conn = conns[address] = NodeConnection(host, int(port), self.timeout_s, self._client.auth)
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _forget(self, address: str) -> None:
        """Drop this thread's connection to ``address`` (its stream state is unknown)."""
        conn = getattr(self._local, "conns", {}).pop(address, None)
        if conn is not None:
            conn.close()
            with self._conns_lock:
                self._conns.remove(conn)

    def _is_down(self, address: str) -> bool:
        """Whether ``address`` is marked down (it timed out less than ``down_s`` ago)."""
        until = self._down.get(address)
        return until is not None and time.monotonic() < until

    def _mark_down(self, address: str) -> None:
        self._down[address] = time.monotonic() + self.down_s
        self._count(timeouts=1)

    def _fetch(self, jobs: list[_Job]) -> tuple[list[tuple[_Job, list, bytes]], list[tuple[_Job, str]]]:
        """Send every job, then read every node's replies: (job, replies, joined bytes) for
        each that returned all its bytes, (job, reason) for each that failed. A node marked
        down fails at once; one that times out is marked down."""
        done, failures, sent, asked = [], [], [], []
        for job in jobs:
            if self._is_down(job.address):
                self._count(down_skips=1)
                failures.append((job, f"marked down for {self.down_s:g} s after it timed out"))
                continue
            try:
                conn = self._connection(job.address)
                conn.send(job.request)
                sent.append((job, conn))
            except OSError as exc:
                self._forget(job.address)
                if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
                    self._mark_down(job.address)
                failures.append((job, f"cannot send: {exc}"))
        for job, conn in sent:
            try:
                replies = conn.read_replies(len(job.runs))
            except OSError as exc:
                self._forget(job.address)
                if isinstance(exc, TimeoutError):
                    self._mark_down(job.address)
                what = f"timed out after {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
                failures.append((job, f"no reply ({what})"))
                continue
            try:
                blob = b"".join(replies)
            except TypeError:  # an error or nil reply (or ASK: the extent's slot is being migrated)
                asked.append((job, replies))  # followed once every node's replies are read
                continue
            if len(blob) == job.nbytes:
                done.append((job, replies, blob))
            else:
                failures.append((job, self._diagnose(job, replies)))
        for job, replies in asked:
            replies = self._follow_asks(job, replies)
            blob = b"".join(replies) if all(isinstance(r, bytes) for r in replies) else b""
            if len(blob) == job.nbytes:
                done.append((job, replies, blob))
            else:
                failures.append((job, self._diagnose(job, replies)))
        if asked:  # done in the jobs' order: the caller may join their bytes as they come
            position = {id(job): i for i, job in enumerate(jobs)}
            done.sort(key=lambda item: position[id(item[0])])
        return done, failures

    def _follow_asks(self, job: _Job, replies: list) -> list:
        """``replies`` with each ``ASK`` (the run's extent has moved to the node importing its
        slot, mid-reshard) replaced by that node's reply, asked after ``ASKING``; a node that
        fails leaves the ``ASK`` in place (the run fails and is retried)."""
        asked: dict[str, list[int]] = {}
        for i, reply in enumerate(replies):
            redirect = str(reply).split() if isinstance(reply, Exception) else []
            if redirect[:1] == ["ASK"] and len(redirect) == 3:
                asked.setdefault(redirect[2], []).append(i)
        if not asked:
            return replies
        replies = list(replies)
        for address, runs in asked.items():
            try:
                conn = self._connection(address)
                conn.send(b"".join(_ASKING + job.pieces[2 * i] + job.pieces[2 * i + 1] for i in runs))
                got = conn.read_replies(2 * len(runs))
            except (OSError, ValueError):
                self._forget(address)
                continue
            for i, reply in zip(runs, got[1::2]):
                replies[i] = reply
        return replies

    def _diagnose(self, job: _Job, replies: list) -> str:
        """Why a node's replies do not hold the bytes asked for (its first bad reply)."""
        for reply in replies:
            if isinstance(reply, Exception):
                return f"error reply {str(reply)!r}"
            if not isinstance(reply, bytes) or len(reply) % self.stride or not reply:
                got = f"{len(reply)} bytes" if isinstance(reply, bytes) and reply else "nothing"
                return (f"got {got} for a range of whole rows: the extent is missing or foreign "
                        "(the node lost its data? publish the table again)")
        return f"{sum(len(r) for r in replies if isinstance(r, bytes))} bytes for {job.nbytes}"

    def _fetch_with_retries(self, jobs: list[_Job], runs: "_Runs") -> np.ndarray:
        """The runs' bytes (uint8 ``[sum of run bytes]``, in ``runs.pos`` order): fetched,
        failed runs retried, then read from the fallback tier or raised as ``TierError``."""
        done, failures = self._fetch(jobs)
        if not failures:  # the usual case: node by node, the jobs tile the data in order
            return np.frombuffer(done[0][2] if len(done) == 1 else b"".join(blob for _, _, blob in done), np.uint8)
        data = np.empty(runs.nbytes, np.uint8)
        for attempt in range(self.retries + 1):
            for job, replies, blob in done:
                if job.dest is not None:
                    data[job.dest: job.dest + job.nbytes] = np.frombuffer(blob, np.uint8)
                else:
                    for run, reply in zip(job.runs.tolist(), replies):
                        data[runs.pos[run]: runs.pos[run] + len(reply)] = np.frombuffer(reply, np.uint8)
            if not failures:
                return data
            job, reason = failures[0]
            failed = np.sort(np.concatenate([j.runs for j, _ in failures]))
            why = (f"pool node {job.address} failed for extent {self.pool_layout.keys[int(runs.ext[job.runs[0]])]} "
                   f"({reason}); {len(failed)} ranges on {len(failures)} node(s) failed")
            if attempt == self.retries or all(self._is_down(j.address) for j, _ in failures):
                break  # retries spent, or every failed node is marked down: no wait
            self._count(retries=1)
            time.sleep(self.retry_backoff_s * (attempt + 1))
            self._refresh()
            addresses, node_of = self._topology
            nodes = node_of[runs.ext[failed]]
            order = np.argsort(nodes, kind="stable")
            done, failures = self._fetch(self._jobs(failed[order], nodes[order], addresses, runs))
        tries = f"after {attempt} retries" if attempt else "without a retry"
        self._serve_fallback(*runs.row_ids(self._starts, failed), f"{why}, {tries}", data)
        return data

    def _reread(self, bad: np.ndarray, runs: "_Runs", data: np.ndarray) -> np.ndarray:
        """``data`` with its rows at positions ``bad`` (their checksums failed) read once
        more; rows failing again come from the fallback tier, or raise ``TierError``."""
        ids = self._data_row_ids(runs)[bad]
        order = np.argsort(ids)
        ids, bad = ids[order], bad[order]
        self._count(checksum_rereads=len(ids))
        ext = self._starts.searchsorted(ids, side="right") - 1
        again = _Runs(ext, ids - self._starts[ext], None, self.stride)
        addresses, node_of = self._topology
        nodes = node_of[ext]
        by_node = np.argsort(nodes, kind="stable")
        again.place(by_node)
        got = self._fetch_with_retries(self._jobs(by_node, nodes[by_node], addresses, again, contiguous=True), again)
        got = got.reshape(-1, self.stride)[again.pos // self.stride]  # [bad rows, stride] in ``ids`` order
        data = data if data.flags.writeable else data.copy()
        data.reshape(-1, self.stride)[bad] = got
        still = bad_rows(got, self.row_bytes, self.stride, self.fingerprint, ids, self._key)
        if still.size:
            self._count(checksum_failures=len(still))
            first = int(still[0])
            why = (f"pool node {addresses[int(nodes[first])]}: row {int(ids[first])} of extent "
                   f"{self.pool_layout.keys[int(ext[first])]} failed its checksum, and again when read once "
                   f"more ({len(still)} row(s) so: the pool's copy is damaged or was written without the pool key; "
                   f"drop and publish the table again: engram-offload pool drop {self.fingerprint}, pool publish TABLE)")
            self._serve_fallback(ids[still], bad[still], why, data)
        return data

    def _serve_fallback(self, ids: np.ndarray, slots: np.ndarray, why: str, data: np.ndarray) -> None:
        """Fill data rows ``slots`` with table rows ``ids`` (and their MACs) from the
        fallback tier, or raise ``TierError`` saying ``why``."""
        if self._fallback is None:
            raise TierError(f"remote tier (table {self.fingerprint}, pool {self.pool_url}): {why}, "
                            "and no fallback tier is configured")
        got = self._fallback.read_rows(ids, torch.empty((len(ids), self.row_bytes), dtype=torch.uint8)).numpy()
        data.reshape(-1, self.stride)[slots] = rows_with_sums(got, self.fingerprint, ids, self._key)
        self._count(fallback_rows=len(ids), fallback_requests=1)

    # -- bookkeeping --------------------------------------------------------------------
    def stats(self) -> dict:
        addresses, _ = self._topology
        return {**super().stats(), "pool": self.pool_url, "nodes": len(addresses),
                "fingerprint": self.fingerprint, "extent_rows": self.pool_layout.extent_rows,
                "fallback": self._fallback.name if self._fallback is not None else None}

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._client.close()
        if self._fallback is not None and self._owns_fallback:
            self._fallback.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self.pool_url!r}, table={fingerprint(self.header)}, rows={self.num_rows:,})"


def _extents_to_verify(playout: PoolLayout, how: str) -> list[int]:
    """The extents ``verify_extents=how`` reads at open: none, all, or random ones up to
    ``VERIFY_SAMPLE_BYTES`` (at least one)."""
    if how == "none":
        return []
    if how == "all":
        return list(range(playout.num_extents))
    order = np.random.default_rng().permutation(playout.num_extents)
    sizes = playout.counts[order] * playout.stride
    return sorted(order[: max(1, int(np.searchsorted(np.cumsum(sizes), VERIFY_SAMPLE_BYTES, side="right")))].tolist())


def open_pool_table(url: str, **options) -> RemoteTier:
    """Open ``redis://host:port[,...]/FINGERPRINT`` without the table file (header from the pool)."""
    _, fp, _ = parse_pool_url(url)
    if fp is None:
        raise ValueError(f"{url!r} names no table: use redis://host:port[,host:port...]/FINGERPRINT "
                         "(fingerprints: engram-offload pool status)")
    with PoolClient(url, timeout=float(options.get("timeout_s", 2.0))) as client:
        header = read_pool_table(client, fp).header
    return RemoteTier(header, pool=url, **options)
