"""The engine-neutral lookups: vLLM's column split, ids to table rows, rows against
``rows.decode_rows``, and the host-read backend's ordering under ``TracingSync``."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engram_offload.engram.rows import decode_rows
from engram_offload.errors import PrefetchError
from engram_offload.gpu.device_table import DeviceTable
from engram_offload.gpu.sync import MAIN, ImmediateSync, OrderingError, poll
from engram_offload.integrations.lookup import ANSWERED, POISON, AddressableLookup, HostReadLookup, LayerShard, flat_ids
from engram_offload.serving.store import open_table

from engram_tables import same_bits, v41_config, write_v41_table
from tracing_sync import TracingSync

CONFIG = v41_config()  # 24 columns a layer, as V4.1-Flash
PADDED = v41_config(n_heads=11, max_ngram_size=3)  # 22 columns: TP 4 and 8 pad the last rank


def vllm_rule(config, layer_id, rank, world):
    """vLLM 0.33.0's ParallelEngramEmbedding.__init__, restated: part, head_start, vocab range."""
    sizes = config.head_sizes(layer_id)
    part = -(-len(sizes) // world)
    head_start = rank * part
    return part, head_start, sum(sizes[:head_start]), sum(sizes[:head_start + part])


def expected_rows(config, raw, layer_id, rank, world, ids, packed):
    """What vLLM's _engram_lookup_kernel writes, computed row by row from decode_rows."""
    part, head_start, vs, ve = vllm_rule(config, layer_id, rank, world)
    base = config.layer_row_bases[config.layer_ids.index(layer_id)]
    t, c = ids.shape
    rb, d = config.row_bytes, config.head_dim
    out = torch.zeros((t, part, rb), dtype=torch.uint8) if packed else torch.zeros((t, part, d), dtype=torch.bfloat16)
    for i in range(t):
        for j in range(part):
            head = head_start + j
            if head >= c:
                continue
            local = int(ids[i, head])
            if vs <= local < ve:
                row = torch.from_numpy(raw[base + local: base + local + 1].copy())
                out[i, j] = row[0] if packed else decode_rows(row, config.row_format, d, torch.bfloat16)[0]
    return out.reshape(t, part * rb) if packed else out


def step_ids(config, layer_id, tokens, seed):
    """Layer-local ids [T, C] as a strided view (vLLM passes gathered[:, layer]): the special
    rows, -1, ids past the layer and the owned rows of every head."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(config.head_sizes(layer_id))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ids = offsets + (rng.random((tokens, sizes.size)) * sizes).astype(np.int64)  # [T, C] each head's own rows
    ids[0, :3] = (3, 5, -1)
    ids[1, 0] = config.rows_per_layer[layer_id] + 7  # past the layer
    ids[1, -1] = config.rows_per_layer[layer_id] - 1  # the layer's last row
    both = np.stack([ids, ids[::-1]], axis=1).astype(np.int32)  # [T, 2, C]
    return torch.from_numpy(both)[:, 0]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("plugin") / "v41.table", CONFIG, seed=3)


@pytest.fixture(scope="module")
def padded_table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("plugin") / "padded.table", PADDED, seed=4)


# ---------------------------------------------------------------------- the split and the ids
@pytest.mark.parametrize("config", [CONFIG, PADDED], ids=["24-columns", "22-columns"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shard_is_vllms_split(config, world):
    for layer_id in config.layer_ids:
        for rank in range(world):
            shard = LayerShard.of(config, layer_id, rank, world)
            part, head_start, vs, ve = vllm_rule(config, layer_id, rank, world)
            assert (shard.part, shard.c0, shard.vocab_start, shard.vocab_end) == (part, head_start, vs, ve)
            assert shard.c1 == min(head_start + part, config.cols_per_layer)
    if config is PADDED and world >= 4:
        last = LayerShard.of(config, config.layer_ids[0], world - 1, world)
        assert last.c1 - last.c0 < last.part  # padding columns on the last rank


def test_shard_refuses_a_rank_without_columns():
    tiny = v41_config(n_heads=5, max_ngram_size=3)  # 10 columns: 8 ranks of 2 leave the last without any
    with pytest.raises(ValueError, match="without columns"):
        LayerShard.of(tiny, 1, 0, 8)


def test_flat_ids_layer_local_to_table_rows():
    layer_id = PADDED.layer_ids[1]
    shard = LayerShard.of(PADDED, layer_id, 3, 4)  # columns 18..22 and two padding columns
    ids = step_ids(PADDED, layer_id, 5, seed=1)
    flat, owned = flat_ids(shard, ids)
    assert flat.shape == owned.shape == (5, shard.part)
    base = PADDED.layer_row_bases[1]
    for t in range(5):
        for j in range(shard.part):
            col = shard.c0 + j
            local = int(ids[t, col]) if col < PADDED.cols_per_layer else -1
            inside = shard.vocab_start <= local < shard.vocab_end
            assert bool(owned[t, j]) == inside
            assert int(flat[t, j]) == (base + local if inside else 0)
    assert not owned[:, shard.c1 - shard.c0:].any()  # padding
    with pytest.raises(ValueError, match=r"\[T, 22\]"):
        flat_ids(shard, ids[:, :10])


# ---------------------------------------------------------------------- rows
def addressable(config, path, layer_id, rank, world, tier="memory"):
    options = {"shm_dir": path.parent} if tier == "shared" else {}  # the test's own folder, not /dev/shm
    shard = LayerShard.of(config, layer_id, rank, world)
    store = open_table(path, tier, columns=shard.columns, **options)
    rows, first = store.in_place_rows(layer_id)  # memory: the rank's share of the layer; shared: every row
    return AddressableLookup(shard, store, DeviceTable(rows, "cpu"), config, first_row=first)


def host_read(config, path, layer_id, rank, world, tier="direct", sync=None, **options):
    """A host-read lookup; under a trace the engine calls it on its own prefetch stream."""
    shard = LayerShard.of(config, layer_id, rank, world)
    store = open_table(path, tier, columns=shard.columns, **options)
    stream = "engine_prefetch" if isinstance(sync, TracingSync) else MAIN
    return HostReadLookup(shard, store, config, max_tokens=8, device="cpu", sync=sync or ImmediateSync(),
                          ids_stream=stream)


@contextmanager
def closed_after(lookup):
    """``lookup`` for the block; then its reader (a host-read lookup's) and its store closed."""
    try:
        yield lookup
    finally:
        if isinstance(lookup, HostReadLookup):
            lookup.close()
        lookup.store.close()


def out_buffer(config, shard, tokens, packed):
    if packed:
        return torch.full((tokens, shard.part * config.row_bytes), 0xAB, dtype=torch.uint8)
    return torch.full((tokens, shard.part, config.head_dim), 7.0, dtype=torch.bfloat16)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
@pytest.mark.parametrize("backend", ["memory", "shared", "direct+cache", "mmap"])
@pytest.mark.parametrize("case", [(CONFIG, 1, 0), (CONFIG, 4, 3), (PADDED, 4, 3), (PADDED, 8, 7), (PADDED, 2, 0)],
                         ids=["tp1", "tp4-r3", "pad-tp4-r3", "pad-tp8-r7", "pad-tp2-r0"])
def test_rows_equal_decode_rows(table, padded_table, packed, backend, case):
    config, world, rank = case
    path, raw = table if config is CONFIG else padded_table
    for layer_id in config.layer_ids:
        if backend in ("memory", "shared"):  # the Triton gather (the interpreter here) over the table in place
            lookup = addressable(config, path, layer_id, rank, world, tier=backend)
        elif backend == "mmap":
            lookup = host_read(config, path, layer_id, rank, world, tier="mmap")
        else:
            lookup = host_read(config, path, layer_id, rank, world, cache_bytes=64 * config.row_bytes)
        with closed_after(lookup):
            for step, tokens in enumerate((5, 2)):
                ids = step_ids(config, layer_id, tokens, seed=step)
                out = out_buffer(config, lookup.shard, tokens, packed)
                lookup.lookup(ids, out, background=step == 1)
                lookup.finish()
                assert same_bits(out, expected_rows(config, raw, layer_id, rank, world, ids, packed))


def test_scale_bytes_0_and_255(table):
    path, raw = table
    lookup = addressable(CONFIG, path, CONFIG.layer_ids[0], 0, 1)
    ids = torch.full((1, CONFIG.cols_per_layer), -1, dtype=torch.int32)
    ids[0, :2] = torch.tensor([3, 5])
    out = out_buffer(CONFIG, lookup.shard, 1, False)
    lookup.lookup(ids, out)
    assert torch.all(out[0, 0, :32] == 0)  # scale byte 0 -> 0.0
    values = torch.from_numpy(raw[5, 32:64].copy()).view(torch.float8_e4m3fn).float()
    got = out[0, 1, 32:64].float()
    assert torch.equal(torch.isinf(got), values != 0) and torch.isnan(got[values == 0]).all()  # x * inf
    assert torch.all(out[0, 2:] == 0)
    lookup.store.close()


def test_out_buffer_checked(table):
    path, _ = table
    lookup = addressable(CONFIG, path, CONFIG.layer_ids[0], 0, 2)
    ids = step_ids(CONFIG, CONFIG.layer_ids[0], 2, seed=0)
    with pytest.raises(ValueError, match=r"bf16 \[2, 12, 256\]"):
        lookup.lookup(ids, torch.empty((2, 24, 256), dtype=torch.bfloat16))
    wrong = [torch.empty((2, 24 * 264), dtype=torch.uint8),  # packed rows of every column, not the rank's
             torch.empty((2, 12 * 264), dtype=torch.bfloat16)]  # the packed shape in bf16
    for out in wrong:
        with pytest.raises(ValueError, match=r"^Engram rows of layer 1 go into bf16 \[2, 12, 256\] or uint8 "
                                             rf"\[2, 3168\], got {out.dtype} {re.escape(str(tuple(out.shape)))}$"):
            lookup.lookup(ids, out)
    lookup.store.close()


# ---------------------------------------------------------------------- the host-read ordering
class _Forgetful(list):
    """A slot-event list that forgets every event: the slots are reused without waiting."""

    def __getitem__(self, k):
        return None


class _NoDeviceWaits(TracingSync):
    """A trace whose device streams never wait for an event: the flag wait is missing."""

    def wait(self, stream, event):
        if stream == "host":
            super().wait(stream, event)


class _WorkerNeverWaits(TracingSync):
    """A trace where the reader thread never waits for an event: it reads ids not yet copied."""

    def synchronize(self, event):
        if not threading.current_thread().name.startswith("engram-offload"):
            super().synchronize(event)


def run_steps(lookup, config, layer_id, steps, tokens=3):
    outs = []
    for step in range(steps):
        ids = step_ids(config, layer_id, tokens, seed=step)
        out = out_buffer(config, lookup.shard, tokens, False)
        lookup.lookup(ids, out, background=True)
        lookup.finish()
        outs.append((ids, out))
    return outs


def test_host_read_order_under_tracing(table):
    path, raw = table
    sync = TracingSync()
    layer_id = CONFIG.layer_ids[1]
    lookup = host_read(CONFIG, path, layer_id, 1, 2, sync=sync)
    with closed_after(lookup):
        for ids, out in run_steps(lookup, CONFIG, layer_id, steps=5):  # the 2 slots are reused twice
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 1, 2, ids, False))
    # each step: ids copied (main), rows read (host), flag, rows copied and written (main)
    assert sync.log[:4] == ["engine_prefetch:copy", "host:read", "main:copy", "main:write_rows"]
    assert all(src.is_pinned() or src.device.type == "cpu" for _, src in sync.copies)


def test_tracing_catches_a_missing_flag_wait(table):
    path, _ = table
    lookup = host_read(CONFIG, path, CONFIG.layer_ids[0], 0, 1, sync=_NoDeviceWaits())
    with closed_after(lookup):
        with pytest.raises(OrderingError):
            run_steps(lookup, CONFIG, CONFIG.layer_ids[0], steps=1)


def test_tracing_catches_a_read_before_the_ids_copy(table):
    path, _ = table
    lookup = host_read(CONFIG, path, CONFIG.layer_ids[0], 0, 1, sync=_WorkerNeverWaits())
    with closed_after(lookup):
        with pytest.raises(PrefetchError) as err:
            run_steps(lookup, CONFIG, CONFIG.layer_ids[0], steps=1)
        assert isinstance(err.value.__cause__, OrderingError) and "before its writer copy" in str(err.value)


def test_tracing_catches_a_slot_reused_before_its_consumer(table):
    path, _ = table
    lookup = host_read(CONFIG, path, CONFIG.layer_ids[0], 0, 1, sync=TracingSync())
    lookup.ring._events = _Forgetful(lookup.ring._events)
    with closed_after(lookup):
        with pytest.raises(PrefetchError) as err:  # the worker's write into the reused slot
            run_steps(lookup, CONFIG, CONFIG.layer_ids[0], steps=3)
        assert isinstance(err.value.__cause__, OrderingError)


def test_a_failing_read_raises_at_finish_and_frees_the_slot(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    lookup = host_read(CONFIG, path, layer_id, 0, 1, sync=TracingSync())
    store = lookup.store
    ids = step_ids(CONFIG, layer_id, 3, seed=0)
    out = out_buffer(CONFIG, lookup.shard, 3, False)
    store.close()  # every read now fails
    lookup.lookup(ids, out, background=True)
    with pytest.raises(PrefetchError, match=r"^reading Engram layer 1's rows failed \(\): ValueError: this store "
                                            r"is closed: open the table again$"):
        lookup.finish()
    assert torch.all(out == 7.0)  # nothing written into the engine's buffer
    assert lookup.counters.failures == 1
    lookup.lookup(ids, out, background=True)
    with pytest.raises(PrefetchError, match="store is closed"):
        lookup.finish()
    assert lookup.counters.failures == 2
    lookup.store = open_table(path, "direct", columns=lookup.shard.columns)  # the tier is back
    for ids, out in run_steps(lookup, CONFIG, layer_id, steps=2):
        assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, False))
    lookup.close()
    lookup.store.close()


def test_a_failing_read_raises_at_the_next_lookup(table):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    lookup = host_read(CONFIG, path, layer_id, 0, 1)
    lookup.store.close()
    ids = step_ids(CONFIG, layer_id, 2, seed=0)
    lookup.lookup(ids, out_buffer(CONFIG, lookup.shard, 2, False), background=True)
    with pytest.raises(PrefetchError, match="layer 1's rows failed"):  # the engine skipped finish
        lookup.lookup(ids, out_buffer(CONFIG, lookup.shard, 2, False), background=True)
    lookup.close()


class _Paused:
    """A real store whose reads (with ``first_only``, its first read) wait for ``go`` (an injected pause)."""

    def __init__(self, store, first_only=False):
        self.store, self.go, self.first_only, self.reads = store, threading.Event(), first_only, 0
        self.entered = threading.Event()  # a read has begun

    def read_raw(self, ids):
        self.entered.set()
        self.reads += 1
        if self.reads == 1 or not self.first_only:
            assert self.go.wait(30), "the test never let the read go"
        return self.store.read_raw(ids)

    def stats(self):
        return self.store.stats()


def paused_lookup(path, layer_id, first_only=False, sync=None, **options):
    """A host-read lookup (traced unless ``sync`` is given) of rank 0 of 1 over a real store whose
    reads wait for ``go``; returns it, the paused store and the real one."""
    shard = LayerShard.of(CONFIG, layer_id, 0, 1)
    real = open_table(path, "direct", columns=shard.columns)
    paused = _Paused(real, first_only)
    lookup = HostReadLookup(shard, paused, CONFIG, max_tokens=4, device="cpu", sync=sync or TracingSync(),
                            ids_stream="engine_prefetch", **options)
    return lookup, paused, real


def test_a_stuck_read_times_out(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    lookup, paused, real = paused_lookup(path, layer_id, timeout_s=0.2)
    shard = lookup.shard
    ids = step_ids(CONFIG, layer_id, 2, seed=0)
    lookup.lookup(ids, out_buffer(CONFIG, shard, 2, False), background=True)
    with pytest.raises(TimeoutError, match="over 0.2 s"):
        lookup.finish()
    paused.go.set()
    for step in range(3):  # the stuck read ends; later steps are served, its slot reused in order
        ids = step_ids(CONFIG, layer_id, 2, seed=step)
        out = out_buffer(CONFIG, shard, 2, False)
        lookup.lookup(ids, out)
        assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, False))
    assert lookup.stats()["lookups"] == 3
    lookup.close()
    real.close()


def test_too_many_tokens_refused(table):
    path, _ = table
    lookup = host_read(CONFIG, path, CONFIG.layer_ids[0], 0, 1)
    ids = step_ids(CONFIG, CONFIG.layer_ids[0], 9, seed=0)
    with pytest.raises(ValueError, match="9 tokens"):
        lookup.lookup(ids, out_buffer(CONFIG, lookup.shard, 9, False))
    lookup.close()
    lookup.store.close()



def test_counters_and_the_periodic_log_line(table, caplog):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    shard = LayerShard.of(CONFIG, layer_id, 0, 2)
    store = open_table(path, "direct", cache_bytes=64 * CONFIG.row_bytes, columns=shard.columns)
    lookup = HostReadLookup(shard, store, CONFIG, max_tokens=4, device="cpu", sync=ImmediateSync(),
                            describe="v41.table on direct", log_every=2)
    with caplog.at_level(logging.INFO, "engram_offload.integrations"):
        run_steps(lookup, CONFIG, layer_id, steps=4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert re.fullmatch(r"engram-offload layer 1 \(host-read, v41.table on direct\): 2 lookups, 72 rows, "
                        r"hit rate 0\.\d{3}, stall \d+\.\d ms total, \d+\.\d ms max", lines[0]), lines[0]
    assert float(lines[0].split("hit rate ")[1][:5]) > 0
    stats = lookup.stats()
    assert stats["lookups"] == 4 and stats["rows"] == 4 * 3 * 12 and stats["failures"] == 0
    assert 0 < stats["hit_rate"] < 1 and stats["columns"] == [0, 12]
    lookup.close()
    store.close()


# ---------------------------------------------------------------------- buffers, stats and stuck reads
TINY = v41_config(n_heads=3, max_ngram_size=3)  # 6 columns a layer


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("plugin") / "tiny.table", TINY, seed=5)


def test_a_rank_needs_a_column_of_its_own_even_at_the_edge():
    with pytest.raises(ValueError, match=r"^6 Engram columns over 4 tensor-parallel ranks leave the last rank "
                                         r"without columns \(as vLLM refuses\): use fewer ranks$"):
        LayerShard.of(TINY, 1, 0, 4)  # parts of 2: the last rank would start at column 6 of 6
    last = LayerShard.of(TINY, 1, 2, 3)  # 3 ranks of 2 columns: the last has its 2
    assert (last.part, last.c0, last.c1) == (2, 4, 6)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
@pytest.mark.parametrize("backend", ["memory", "direct"])
def test_a_single_row_lookup_is_written(tiny_table, packed, backend):
    """One token on a rank of one column: a lookup of one row is not skipped as empty."""
    path, raw = tiny_table
    make = addressable if backend == "memory" else host_read
    for rank in range(6):
        with closed_after(make(TINY, path, 14, rank, 6)) as lookup:
            ids = step_ids(TINY, 14, 2, seed=rank)[1:]  # [1, 6]
            out = out_buffer(TINY, lookup.shard, 1, packed)
            lookup.lookup(ids, out)
            assert same_bits(out, expected_rows(TINY, raw, 14, rank, 6, ids, packed))


def strided_out(config, shard, tokens, packed):
    """An ``out`` that is a view into a wider buffer (not one block), and that buffer."""
    if packed:
        wide = torch.full((tokens, 2 * shard.part * config.row_bytes), 0xAB, dtype=torch.uint8)
        return wide[:, :shard.part * config.row_bytes], wide
    wide = torch.full((tokens, shard.part, 2 * config.head_dim), 7.0, dtype=torch.bfloat16)
    return wide[..., :config.head_dim], wide


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
@pytest.mark.parametrize("backend", ["memory", "direct"])
def test_a_strided_out_buffer_gets_the_rows_and_nothing_beside_them(table, packed, backend):
    path, raw = table
    layer_id = CONFIG.layer_ids[1]
    make = addressable if backend == "memory" else host_read
    with closed_after(make(CONFIG, path, layer_id, 1, 2)) as lookup:
        for step in range(3):  # the host-read slots are reused
            ids = step_ids(CONFIG, layer_id, 3, seed=step)
            out, wide = strided_out(CONFIG, lookup.shard, 3, packed)
            assert not out.is_contiguous()
            lookup.lookup(ids, out)
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 1, 2, ids, packed))
            beside = wide[:, out.shape[1]:] if packed else wide[..., CONFIG.head_dim:]
            assert torch.all(beside == (0xAB if packed else 7.0))


def test_finish_writes_into_the_buffer_it_is_given(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    with closed_after(host_read(CONFIG, path, layer_id, 0, 2)) as lookup:
        ids = step_ids(CONFIG, layer_id, 3, seed=2)
        started = out_buffer(CONFIG, lookup.shard, 3, False)
        given = out_buffer(CONFIG, lookup.shard, 3, False)
        lookup.lookup(ids, started, background=True)
        lookup.finish(given)
        assert same_bits(given, expected_rows(CONFIG, raw, layer_id, 0, 2, ids, False))
        assert torch.all(started == 7.0)


class _Gone:
    """A real store whose counters can no longer be read (a row server gone)."""

    def __init__(self, store):
        self.store = store

    def read_raw(self, ids):
        return self.store.read_raw(ids)

    def stats(self):
        raise ConnectionError("the row server is gone")

    def close(self):
        self.store.close()


def test_stats_name_the_layer_the_backend_the_table_and_every_counter(table, caplog):
    path, _ = table
    layer_id = CONFIG.layer_ids[1]
    with closed_after(addressable(CONFIG, path, layer_id, 1, 2)) as lookup:  # describe and log_every left out
        with caplog.at_level(logging.INFO, "engram_offload.integrations"):
            run_steps(lookup, CONFIG, layer_id, steps=2)
        assert caplog.records == []  # no periodic line by default
        store = lookup.store.stats()
        assert lookup.stats() == {"layer": layer_id, "backend": "addressable", "table": "", "columns": [12, 24],
                                  "lookups": 2, "rows": 2 * 3 * 12, "stall_s": 0.0, "max_stall_s": 0.0,
                                  "failures": 0, "not_counted": ["stall_s", "max_stall_s"],
                                  "hit_rate": store["store"]["hit_rate"], "store": store}
        lookup.store = _Gone(lookup.store)
        gone = lookup.stats()
        assert gone["store"] == {} and gone["hit_rate"] is None and gone["lookups"] == 2


def test_the_stall_counters_add_up_each_wait(table):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    with closed_after(host_read(CONFIG, path, layer_id, 0, 1)) as lookup:
        t0 = time.perf_counter()
        run_steps(lookup, CONFIG, layer_id, steps=3)
        elapsed = time.perf_counter() - t0
        stats = lookup.stats()
    assert stats["backend"] == "host-read"
    assert 0 < stats["max_stall_s"] < stats["stall_s"] < elapsed  # three waits, each longer than none


@pytest.mark.parametrize("slots", [1, 4])
def test_a_stuck_read_holds_each_step_until_the_ring_comes_round_to_its_slot(table, slots):
    """The reader reads one step after another: while a read is stuck every later step's finish
    times out, until the step that would reuse the stuck read's slot, which waits for it in lookup."""
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    # not traced: the trace runs the stuck read under its lock, so every later step would wait there
    lookup, paused, real = paused_lookup(path, layer_id, first_only=True, sync=ImmediateSync(), slots=slots,
                                         timeout_s=0.25, describe="v41.table")
    shard = lookup.shard
    ids = step_ids(CONFIG, layer_id, 2, seed=0)
    for _ in range(slots):  # slot 0 (its read stuck), then the others (their reads behind it)
        lookup.lookup(ids, out_buffer(CONFIG, shard, 2, False), background=True)
        with pytest.raises(TimeoutError, match=r"took over 0.25 s \(v41.table\)"):
            lookup.finish()
    with pytest.raises(TimeoutError, match=r"^the host read of Engram layer 1's rows is still running after 0.5 s "
                                           r"\(v41.table\): check the tier$"):
        lookup.lookup(ids, out_buffer(CONFIG, shard, 2, False))  # slot 0 again
    paused.go.set()
    for step in range(1, slots + 2):  # every slot in turn (its abandoned read ended first), one twice
        ids = step_ids(CONFIG, layer_id, 2, seed=step)
        out = out_buffer(CONFIG, shard, 2, False)
        lookup.lookup(ids, out)
        assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, False))
    lookup.close()
    real.close()


def test_a_lookup_the_engine_never_finished_is_finished_by_the_next(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    with closed_after(host_read(CONFIG, path, layer_id, 0, 2, sync=TracingSync())) as lookup:
        first, second = step_ids(CONFIG, layer_id, 3, seed=0), step_ids(CONFIG, layer_id, 3, seed=1)
        out_first, out_second = (out_buffer(CONFIG, lookup.shard, 3, False) for _ in range(2))
        lookup.lookup(first, out_first, background=True)
        lookup.lookup(second, out_second, background=True)  # no finish in between
        assert same_bits(out_first, expected_rows(CONFIG, raw, layer_id, 0, 2, first, False))
        lookup.finish()
        assert same_bits(out_second, expected_rows(CONFIG, raw, layer_id, 0, 2, second, False))
        assert lookup.stats()["lookups"] == 2


def test_the_host_read_defaults_and_refusals(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    shard = LayerShard.of(CONFIG, layer_id, 0, 1)
    store = open_table(path, "direct", columns=shard.columns)
    for max_tokens, slots in ((0, 2), (8, 0)):
        with pytest.raises(ValueError, match=rf"^a host-read lookup needs max_tokens >= 1 and slots >= 1, got "
                                             rf"{max_tokens}, {slots}$"):
            HostReadLookup(shard, store, CONFIG, max_tokens=max_tokens, device="cpu", sync=ImmediateSync(),
                           slots=slots)
    lookup = HostReadLookup(shard, store, CONFIG, max_tokens=1, device="cpu", sync=ImmediateSync(), slots=1)
    with closed_after(lookup):
        assert (lookup.timeout_s, lookup.describe, lookup.log_every, len(lookup._ids)) == (60.0, "", 0, 1)
        ids = step_ids(CONFIG, layer_id, 2, seed=0)
        for step in range(2):  # one token, the most allowed, through the one slot twice
            out = out_buffer(CONFIG, shard, 1, False)
            lookup.lookup(ids[step:step + 1], out)
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids[step:step + 1], False))
        with pytest.raises(ValueError, match=r"^Engram ids must be \[T, 24\], got \(1, 10\)$"):
            lookup.lookup(ids[:1, :10], out)
    with pytest.raises(ValueError, match=r"^the Engram lookup of layer 1 is closed$"):
        lookup.lookup(ids[:1], out)


def test_two_lookups_of_one_layer_under_one_trace_keep_their_buffers_apart(table):
    """Two ranks' lookups of the same layer (and one of another layer) in one process share a
    trace: each names its own staging buffers."""
    path, raw = table
    sync = TracingSync()
    cases = [(CONFIG.layer_ids[0], 0), (CONFIG.layer_ids[0], 1), (CONFIG.layer_ids[1], 0)]
    lookups = [host_read(CONFIG, path, layer_id, rank, 2, sync=sync) for layer_id, rank in cases]
    try:
        for step in range(3):
            started = []
            for lookup, (layer_id, _) in zip(lookups, cases):
                ids = step_ids(CONFIG, layer_id, 3, seed=step)
                out = out_buffer(CONFIG, lookup.shard, 3, False)
                lookup.lookup(ids, out, background=True)
                started.append((ids, out))
            for lookup, (layer_id, rank), (ids, out) in zip(lookups, cases, started):
                lookup.finish()
                assert same_bits(out, expected_rows(CONFIG, raw, layer_id, rank, 2, ids, False))
    finally:
        for lookup in lookups:
            lookup.close()
            lookup.store.close()


def test_a_lookup_left_open_does_not_keep_the_process_alive(table, tmp_path):
    """An engine that exits without closing its lookups still exits (the reader is a daemon thread)."""
    path, _ = table
    script = (
        "import sys, torch\n"
        "from engram_offload.gpu.sync import ImmediateSync\n"
        "from engram_offload.integrations.lookup import HostReadLookup, LayerShard\n"
        "from engram_offload.serving.store import open_table\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from engram_tables import v41_config\n"
        "config = v41_config()\n"
        "shard = LayerShard.of(config, 1, 0, 1)\n"
        "store = open_table(sys.argv[1], 'direct', columns=shard.columns)\n"
        "lookup = HostReadLookup(shard, store, config, max_tokens=2, device='cpu', sync=ImmediateSync())\n"
        "out = torch.empty((1, shard.part, config.head_dim), dtype=torch.bfloat16)\n"
        "lookup.lookup(torch.zeros((1, config.cols_per_layer), dtype=torch.int32), out)\n"
        "print('served', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "served\n", done.stderr


def test_owned_ids_run_from_vocab_start_to_before_vocab_end():
    layer_id = CONFIG.layer_ids[1]
    for rank in range(4):
        shard = LayerShard.of(CONFIG, layer_id, rank, 4)
        ids = torch.full((4, CONFIG.cols_per_layer), -1, dtype=torch.int32)
        edges = (shard.vocab_start - 1, shard.vocab_start, shard.vocab_end - 1, shard.vocab_end)
        ids[:, shard.c0] = torch.tensor(edges)
        flat, owned = flat_ids(shard, ids)
        assert flat.dtype == torch.int64 and owned.dtype == torch.bool
        assert owned[:, 0].tolist() == [False, True, True, False]
        base = CONFIG.layer_row_bases[1]
        assert flat[:, 0].tolist() == [0, base + shard.vocab_start, base + shard.vocab_end - 1, 0]


def test_the_log_line_of_a_store_without_a_hit_rate(table, caplog):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    shard = LayerShard.of(CONFIG, layer_id, 0, 1)
    store = _Gone(open_table(path, "memory", columns=shard.columns))
    rows, first = store.store.in_place_rows(layer_id)
    lookup = AddressableLookup(shard, store, DeviceTable(rows, "cpu"), CONFIG, first_row=first,
                               describe="v41.table in memory", log_every=1)
    lookup.counters.stall_s, lookup.counters.max_stall_s = 1.25, 0.75  # an addressable lookup never stalls
    with closed_after(lookup), caplog.at_level(logging.INFO, "engram_offload.integrations"):
        run_steps(lookup, CONFIG, layer_id, steps=1, tokens=2)
        assert caplog.records == []  # no Python runs per replay: the line comes with stats()
        lookup.stats()
        lookup.stats()  # no lookup since: no second line
    assert [r.getMessage() for r in caplog.records] == [
        "engram-offload layer 1 (addressable, v41.table in memory): 1 lookups, 48 rows, hit rate n/a, "
        "stall 1250.0 ms total, 750.0 ms max"]


class _Recorded(TorchDispatchMode):
    """The torch ops a call ran, each with the tensors it ran on: what a CUDA graph captures of
    the call, and ``replay`` runs them again without the call's Python (as a graph replay; the
    Triton interpreter's gather is Python, not a torch op, so it is not run again)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def replay(self):
        for func, args, kwargs in self.ops:
            func(*args, **kwargs)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
def test_replayed_lookups_are_counted_and_logged_at_stats(table, caplog, packed):
    path, raw = table
    layer_id = CONFIG.layer_ids[1]
    with closed_after(addressable(CONFIG, path, layer_id, 1, 2)) as lookup:
        lookup.log_every = 4
        part = lookup.shard.part
        eager = step_ids(CONFIG, layer_id, 3, seed=0)
        lookup.lookup(eager, out_buffer(CONFIG, lookup.shard, 3, packed))  # an eager call: 3 * 12 rows
        ids = step_ids(CONFIG, layer_id, 2, seed=1)
        out = out_buffer(CONFIG, lookup.shard, 2, packed)
        recorded = _Recorded()
        with recorded:
            lookup.lookup(ids, out)  # the captured call
        assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 1, 2, ids, packed))
        for _ in range(5):
            recorded.replay()  # five replays: no Python of the lookup runs
        with caplog.at_level(logging.INFO, "engram_offload.integrations"):
            stats = lookup.stats()
        assert (stats["lookups"], stats["rows"]) == (1 + 6, 3 * part + 6 * 2 * part)
        assert stats["not_counted"] == ["stall_s", "max_stall_s"]
        assert [r.getMessage() for r in caplog.records] == [
            f"engram-offload layer 14 (addressable, ): 7 lookups, {stats['rows']} rows, hit rate "
            f"{stats['hit_rate']:.3f}, stall 0.0 ms total, 0.0 ms max"]


def test_a_device_table_of_a_slice_reads_from_its_first_row(table):
    """A rank holding only its share of a layer's rows: flat row f is the slice's row f - first_row."""
    path, raw = table
    layer_id = CONFIG.layer_ids[1]
    shard = LayerShard.of(CONFIG, layer_id, 1, 2)
    lo, hi = shard.row_base + shard.vocab_start, shard.row_base + shard.vocab_end
    with open_table(path, "direct") as store:
        held = torch.from_numpy(raw[lo - 3:hi].copy())  # the rank's rows and three before them, alone
        lookup = AddressableLookup(shard, store, DeviceTable(held, "cpu"), CONFIG, first_row=lo - 3)
        for packed in (False, True):
            ids = step_ids(CONFIG, layer_id, 4, seed=7)  # -1, ids of other ranks and past the layer: zero rows
            out = out_buffer(CONFIG, shard, 4, packed)
            lookup.lookup(ids, out)
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 1, 2, ids, packed))
        for first in (lo + 1, hi - held.shape[0] - 1):  # the slice misses the rank's first or last row
            with pytest.raises(ValueError, match=rf"^the device table holds flat rows \[{first}, "
                                                 rf"{first + held.shape[0]}\), not rows \[{lo}, {hi}\) of layer "
                                                 rf"{layer_id}'s columns \[12, 24\]: give the rows holding them "
                                                 r"and the flat row of their row 0$"):
                AddressableLookup(shard, store, DeviceTable(held, "cpu"), CONFIG, first_row=first)


def test_close_waits_for_a_stuck_read_no_longer_than_the_timeout(table):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    lookup, paused, real = paused_lookup(path, layer_id, sync=ImmediateSync(), timeout_s=0.25)
    lookup.lookup(step_ids(CONFIG, layer_id, 2, seed=0), out_buffer(CONFIG, lookup.shard, 2, False),
                  background=True)
    lookup.close()  # the read is still stuck: close gives up on it after timeout_s
    assert lookup.closed and lookup._worker.is_alive()
    paused.go.set()
    lookup._worker.join(30)
    assert not lookup._worker.is_alive()  # the worker ends after the read it was on
    real.close()


# ---------------------------------------------------------------------- in-graph reads
def in_graph(config, path, layer_id, rank, world, sync=None, store=None, **options):
    """An in-graph host-read lookup (traced unless ``sync`` is given) over the direct tier."""
    shard = LayerShard.of(config, layer_id, rank, world)
    store = store or open_table(path, "direct", columns=shard.columns)
    sync = TracingSync() if sync is None else sync
    stream = "engine_prefetch" if isinstance(sync, TracingSync) else MAIN
    return HostReadLookup(shard, store, config, max_tokens=8, device="cpu", sync=sync, ids_stream=stream,
                          in_graph=True, **options)


def static_ids(config, tokens):
    """A static ids buffer as vLLM's: a strided view ``[T, C]`` of the step's gathered ids."""
    return torch.zeros((tokens, 2, config.cols_per_layer), dtype=torch.int32)[:, 0]


def capture_step(lookups, ids, outs, between=None):
    """A graph of one engine step: the prefetch stream forked from main, every layer's lookup
    (background), then each layer's finish in turn (``between(i)`` enqueued before layer i's)."""
    sync = lookups[0].sync
    with sync.capture() as graph:
        sync.wait_stream("engine_prefetch", MAIN)
        for lookup, i, out in zip(lookups, ids, outs):
            lookup.lookup(i, out, background=True)
        for n, (lookup, out) in enumerate(zip(lookups, outs)):
            if between is not None:
                between(n)
            lookup.finish(out)
    return graph


def poisoned(out):
    return bool(torch.all(out == POISON)) if out.dtype == torch.uint8 else bool(torch.isnan(out).all())


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
@pytest.mark.parametrize("case", [(CONFIG, 1, 0), (PADDED, 4, 3)], ids=["tp1", "pad-tp4-r3"])
def test_in_graph_replays_read_new_ids_into_the_addressable_lookups_rows(table, padded_table, packed, case):
    config, world, rank = case
    path, raw = table if config is CONFIG else padded_table
    layer_id = config.layer_ids[1]
    with closed_after(in_graph(config, path, layer_id, rank, world)) as lookup, \
            closed_after(addressable(config, path, layer_id, rank, world)) as gpu_reads:
        sync = lookup.sync
        for step in range(3):  # eager steps through the two eager slots, as piecewise graphs run them
            ids = step_ids(config, layer_id, 3, seed=step)
            out = out_buffer(config, lookup.shard, 3, packed)
            lookup.lookup(ids, out, background=True)
            lookup.finish()
            assert same_bits(out, expected_rows(config, raw, layer_id, rank, world, ids, packed))
        assert sync.log[:12] == [
            "engine_prefetch:copy", "engine_prefetch:stamp", "engine_prefetch:write_value",
            "engine_prefetch:write_value", "host:take_ids", "host:place", "host:write_value", "host:write_value",
            "main:wait_value", "main:copy", "main:check", "main:write_rows"]
        ids, out = static_ids(config, 4), out_buffer(config, lookup.shard, 4, packed)
        graph = capture_step([lookup], [ids], [out])
        for replay in range(6):  # the Python of lookup and finish does not run: new ids each time
            ids.copy_(step_ids(config, layer_id, 4, seed=10 + replay))
            graph.replay()
            want = out_buffer(config, lookup.shard, 4, packed)
            gpu_reads.lookup(ids, want)
            assert same_bits(out, want)
            assert same_bits(out, expected_rows(config, raw, layer_id, rank, world, ids, packed))
        stats = lookup.stats()
        assert (stats["lookups"], stats["rows"]) == (3 + 6, (3 * 3 + 6 * 4) * lookup.shard.part)
        assert stats["not_counted"] == ["stall_s", "max_stall_s"] and stats["failures"] == 0
        assert lookup._last == [4, 2, 18]  # slot k's n-th request is k + 1 + (n - 1) * 3


def test_each_layer_waits_for_its_own_rows_only(table):
    """Layer 14's read still running does not hold layer 1's rows: each finish waits for its own."""
    path, raw = table
    layers = CONFIG.layer_ids
    sync = TracingSync()
    shard = LayerShard.of(CONFIG, layers[1], 0, 1)
    real = open_table(path, "direct", columns=shard.columns)
    paused = _Paused(real, first_only=True)
    lookups = [in_graph(CONFIG, path, layers[0], 0, 1, sync=sync), in_graph(CONFIG, path, layers[1], 0, 1,
                                                                            sync=sync, store=paused)]
    ids = [static_ids(CONFIG, 2) for _ in layers]
    outs = [out_buffer(CONFIG, lookup.shard, 2, False) for lookup in lookups]
    at_layer = [threading.Event() for _ in layers]

    def between(n):
        sync.run(MAIN, at_layer[n].set)  # the layers before layer n ran

    graph = capture_step(lookups, ids, outs, between)
    for i, layer_id in zip(ids, layers):
        i.copy_(step_ids(CONFIG, layer_id, 2, seed=layer_id))
    replay = threading.Thread(target=graph.replay)
    replay.start()
    assert at_layer[1].wait(30)  # layer 1 has its rows while layer 14's read is held
    assert same_bits(outs[0], expected_rows(CONFIG, raw, layers[0], 0, 1, ids[0], False))
    assert torch.all(outs[1] == 7.0)
    paused.go.set()
    replay.join(30)
    assert not replay.is_alive()
    assert same_bits(outs[1], expected_rows(CONFIG, raw, layers[1], 0, 1, ids[1], False))
    for lookup in lookups:
        lookup.close()
    lookups[0].store.close()
    real.close()


class _FailingStore:
    """A real store whose reads raise while ``failing`` is set (a tier gone)."""

    def __init__(self, store):
        self.store, self.failing = store, False

    def read_raw(self, ids):
        if self.failing:
            raise OSError("the tier is gone")
        return self.store.read_raw(ids)

    def stats(self):
        return self.store.stats()

    def close(self):
        self.store.close()


def _dies(req):
    raise SystemExit  # the reader thread ends without answering


FAILURES = {  # where a step fails -> how, and the message the lookup raises next
    "tier": (lambda lookup, store, paused: setattr(store, "failing", True), r"OSError: the tier is gone"),
    "place": (lambda lookup, store, paused: setattr(lookup, "_place", None),
              r"TypeError: 'NoneType' object is not callable"),
    "ids": (lambda lookup, store, paused: setattr(lookup, "_ids", None), r"TypeError: 'NoneType' object is not"),
    "late": (lambda lookup, store, paused: setattr(lookup, "store", paused),
             r"TimeoutError: the host read of Engram layer 14's rows took over 1 s \(v41.table\): check the tier, "
             r"or raise wait_timeout_s"),
    "reader dies": (lambda lookup, store, paused: setattr(lookup, "_serve", _dies),
                    r"RuntimeError: the reader thread of Engram layer 14's lookup has ended \(its error is in the "
                    r"log\): restart the engine"),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the reader that dies
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
@pytest.mark.parametrize("point", list(FAILURES))
def test_a_failed_step_is_poisoned_and_raised_never_zeros(table, packed, point):
    """A step that fails anywhere releases the device at once (late: at the timeout), its rows
    are NaN, and the lookup raises at its next call; the steps after it are served again."""
    path, raw = table
    layer_id = CONFIG.layer_ids[1]
    shard = LayerShard.of(CONFIG, layer_id, 0, 1)
    real = open_table(path, "direct", columns=shard.columns)
    store, paused = _FailingStore(real), _Paused(real, first_only=True)
    lookup = in_graph(CONFIG, path, layer_id, 0, 1, store=store, timeout_s=1.0, describe="v41.table")
    ids, out = static_ids(CONFIG, 3), out_buffer(CONFIG, shard, 3, packed)
    graph = capture_step([lookup], [ids], [out])
    saved = dict(vars(lookup))
    inject, message = FAILURES[point]
    for replay, fails in enumerate((False, True, False)):
        ids.copy_(step_ids(CONFIG, layer_id, 3, seed=replay))
        if fails:
            inject(lookup, store, paused)
        graph.replay()  # never a hang: the device is answered whatever failed
        if not fails:
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, packed))
            lookup.check()
            continue
        assert poisoned(out)
        with pytest.raises(PrefetchError, match=rf"^reading Engram layer 14's rows failed \(v41.table\): {message}"):
            lookup.stats() if point == "tier" else lookup.check()
        lookup.check()  # raised once
        assert lookup.counters.failures == 1
        if point == "reader dies":  # no reader: every later step is poisoned and raised
            graph.replay()
            assert poisoned(out)
            with pytest.raises(PrefetchError, match="reader thread"):
                lookup.lookup(ids, out_buffer(CONFIG, shard, 3, packed))
            break
        paused.go.set()  # a late read ends: its rows are dropped
        store.failing = False
        vars(lookup).pop("_place", None)
        lookup._ids, lookup.store = saved["_ids"], saved["store"]
    lookup.close()
    real.close()


def test_an_eager_in_graph_failure_raises_at_finish_with_nan_rows(table):
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    lookup = in_graph(CONFIG, path, layer_id, 0, 1, sync=ImmediateSync())
    ids = step_ids(CONFIG, layer_id, 3, seed=0)
    out = out_buffer(CONFIG, lookup.shard, 3, False)
    lookup.store.close()
    lookup.lookup(ids, out, background=True)
    with pytest.raises(PrefetchError, match=r"^reading Engram layer 1's rows failed \(\): ValueError: this store "
                                            r"is closed: open the table again$"):
        lookup.finish()
    assert torch.isnan(out).all()  # the step's rows: NaN, never zeros
    lookup.store = open_table(path, "direct", columns=lookup.shard.columns)
    for ids, out in run_steps(lookup, CONFIG, layer_id, steps=3):
        assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, False))
    lookup.close()
    lookup.store.close()


class _NoValueWaits(TracingSync):
    """A trace whose streams never wait on a word: the consumer takes rows not yet answered."""

    def wait_value(self, stream, word, value):
        pass


class _HostNeverSees(TracingSync):
    """A trace where the host's reads of words order nothing: the reader takes ids not yet copied."""

    def _acquire(self, stream, word, value):
        if stream != "host":
            super()._acquire(stream, word, value)


def test_tracing_catches_in_graph_ordering_faults(table):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    with closed_after(in_graph(CONFIG, path, layer_id, 0, 1)) as lookup:  # the slots' consumers not waited for
        lookup._consumed = _Forgetful(lookup._consumed)
        with pytest.raises(OrderingError, match="engine_prefetch overwrites"):
            run_steps(lookup, CONFIG, layer_id, steps=3)
    shard = LayerShard.of(CONFIG, layer_id, 0, 1)
    with open_table(path, "direct", columns=shard.columns) as real:
        paused = _Paused(real)  # the read ends only after the consumer took the slot's rows
        lookup = in_graph(CONFIG, path, layer_id, 0, 1, sync=_NoValueWaits(), store=paused)
        lookup.lookup(step_ids(CONFIG, layer_id, 2, seed=0), out_buffer(CONFIG, shard, 2, False), background=True)
        assert paused.entered.wait(30)
        lookup.finish()
        paused.go.set()
        assert poll(lambda: int(lookup._state[0, 0]) == ANSWERED, 30)
        with pytest.raises(PrefetchError, match="place on host overwrites .* before its reader copy on main"):
            lookup.check()
        lookup.close()
    with closed_after(in_graph(CONFIG, path, layer_id, 0, 1, sync=_HostNeverSees())) as lookup:
        with pytest.raises(PrefetchError) as err:
            run_steps(lookup, CONFIG, layer_id, steps=1)
        assert isinstance(err.value.__cause__, OrderingError) and "take_ids on host touches" in str(err.value)


def test_a_slot_is_written_again_only_after_its_consumer_ran(table):
    """A graph that captured a lookup without its finish: the next replay's ids would overwrite
    the slot (the trace stops it); without a trace the reader finds the slot not consumed and
    answers with the error value."""
    path, raw = table
    layer_id = CONFIG.layer_ids[0]
    with closed_after(in_graph(CONFIG, path, layer_id, 0, 1)) as lookup:
        sync, ids = lookup.sync, static_ids(CONFIG, 2)
        with sync.capture() as graph:
            sync.wait_stream("engine_prefetch", MAIN)
            lookup.lookup(ids, out_buffer(CONFIG, lookup.shard, 2, False), background=True)
            lookup._pending = None  # the engine lost it
            sync.wait_stream(MAIN, "engine_prefetch")
        graph.replay()
        assert poll(lambda: int(lookup._state[2, 0]) == ANSWERED, 30)  # the reader took the ids
        with pytest.raises(OrderingError, match="engine_prefetch overwrites"):
            graph.replay()
    with closed_after(in_graph(CONFIG, path, layer_id, 0, 1, sync=ImmediateSync(), slots=1,
                               timeout_s=1.0)) as lookup:
        ids = step_ids(CONFIG, layer_id, 2, seed=0)
        lookup.lookup(ids, out_buffer(CONFIG, lookup.shard, 2, False), background=True)
        lookup._pending = None
        assert poll(lambda: int(lookup._state[0, 0]) == ANSWERED, 30)
        out = out_buffer(CONFIG, lookup.shard, 2, False)
        lookup.lookup(ids, out, background=True)  # slot 0 again, its rows never consumed
        with pytest.raises(PrefetchError, match=r"TimeoutError: request 1's rows of Engram layer 1 were never "
                                                r"consumed, so the next cannot use its slot: call finish after "
                                                r"every lookup$"):
            lookup.finish()
        assert torch.isnan(out).all()
        for ids, out in run_steps(lookup, CONFIG, layer_id, steps=2):  # consumed since: served again
            assert same_bits(out, expected_rows(CONFIG, raw, layer_id, 0, 1, ids, False))


def test_a_replay_after_close_is_answered_with_the_error_value(table):
    path, _ = table
    layer_id = CONFIG.layer_ids[0]
    lookup = in_graph(CONFIG, path, layer_id, 0, 1)
    ids, out = static_ids(CONFIG, 2), out_buffer(CONFIG, lookup.shard, 2, False)
    graph = capture_step([lookup], [ids], [out])
    lookup.close()
    graph.replay()
    assert torch.isnan(out).all()
    with pytest.raises(PrefetchError, match=r"RuntimeError: the Engram lookup of layer 1 is closed: close it only "
                                            r"once the engine replays no graph that captured it$"):
        lookup.check()
    lookup.store.close()


def test_the_mode_of_a_host_read_lookup(table):
    path, _ = table
    shard = LayerShard.of(CONFIG, CONFIG.layer_ids[0], 0, 1)
    with open_table(path, "direct", columns=shard.columns) as store:
        cpu_wait = HostReadLookup(shard, store, CONFIG, max_tokens=2, device="cpu", sync=TracingSync(),
                                  ids_stream="engine_prefetch")
        assert not cpu_wait.in_graph and cpu_wait.not_counted == () and len(cpu_wait.ring.buffers) == 2
        ids = static_ids(CONFIG, 1)
        with pytest.raises(RuntimeError, match=r"^the host read of Engram layer 1 waits on the CPU, which a CUDA "
                                               r"graph would replay stale for ever: turn off graph capture for this "
                                               r"layer, or use a driver with stream memory operations \(in-graph "
                                               r"reads\)$"):
            with cpu_wait.sync.capture():
                cpu_wait.lookup(ids, out_buffer(CONFIG, shard, 1, False))
        cpu_wait.close()

        class _OldDriver(ImmediateSync):
            def stream_memops(self):
                return False

        with pytest.raises(ValueError, match=r"^this CUDA driver has no stream memory operations "
                                             r"\(cuStreamWaitValue32_v2\), so the GPU cannot wait for host reads: "
                                             r"leave in_graph unset to have the CPU wait$"):
            HostReadLookup(shard, store, CONFIG, max_tokens=2, device="cpu", sync=_OldDriver(), in_graph=True)
        lookup = HostReadLookup(shard, store, CONFIG, max_tokens=2, device="cpu", sync=ImmediateSync(), in_graph=True)
        assert lookup.in_graph and len(lookup.ring.buffers) == 3  # two eager slots and the graphs' slot
        lookup.close()


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True], ids=["one-stream", "prefetch-stream"])
def test_in_graph_reads_in_a_real_cuda_graph(table, prefetch):
    """A CUDA graph capturing the host-read lookup (ids on vLLM's prefetch stream or the current
    one), replayed with new ids: rows equal the addressable lookup's; a failed step is NaN and
    raised; a late read releases the GPU at the timeout."""
    from engram_offload.gpu.sync import CudaSync, poll

    path, raw = table
    layer_id = CONFIG.layer_ids[1]
    shard = LayerShard.of(CONFIG, layer_id, 1, 2)
    real = open_table(path, "mmap", columns=shard.columns)
    store = _FailingStore(real)
    lookup = HostReadLookup(shard, store, CONFIG, max_tokens=8, device="cuda", sync=CudaSync(), timeout_s=0.5)
    assert lookup.in_graph
    memory = open_table(path, "memory", columns=shard.columns)
    rows, first = memory.in_place_rows(layer_id)
    gpu_reads = AddressableLookup(shard, memory, DeviceTable(rows, "cuda"), CONFIG, first_row=first)
    ids = torch.zeros((4, 2, CONFIG.cols_per_layer), dtype=torch.int32, device="cuda")[:, 0]
    out = torch.full((4, shard.part, CONFIG.head_dim), 7.0, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def step():
        if prefetch:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                lookup.lookup(ids, out, background=True)
            lookup.finish()
        else:
            lookup.lookup(ids, out)

    def done():
        event = torch.cuda.Event()
        event.record()
        return poll(event.query, 30)  # never a hang

    step()  # eager, as vLLM warms up
    assert done()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    want = torch.empty_like(out)
    for replay in range(20):
        ids.copy_(step_ids(CONFIG, layer_id, 4, seed=replay).cuda())
        graph.replay()
        gpu_reads.lookup(ids, want)
        assert done() and same_bits(out.cpu(), want.cpu())
        assert same_bits(out.cpu(), expected_rows(CONFIG, raw, layer_id, 1, 2, ids.cpu(), False))
    store.failing = True
    graph.replay()
    assert done() and torch.isnan(out).all()
    with pytest.raises(PrefetchError, match="the tier is gone"):
        lookup.check()
    store.failing = False
    paused = _Paused(real, first_only=True)
    lookup.store = paused
    graph.replay()
    assert done() and torch.isnan(out).all()  # released at the timeout
    with pytest.raises(PrefetchError, match="took over 0.5 s"):
        lookup.check()
    paused.go.set()
    graph.replay()
    assert done() and same_bits(out.cpu(), expected_rows(CONFIG, raw, layer_id, 1, 2, ids.cpu(), False))
    assert lookup.stats()["lookups"] == 1 + 20 + 1
    lookup.close()
    real.close()
    memory.close()
