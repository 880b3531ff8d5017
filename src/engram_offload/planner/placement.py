"""Evaluate each placement of the Engram table at each tensor-parallel degree.

Placements: ``hbm`` (table sharded over the TP group's HBM), ``dram`` (pinned host memory
read by the GPU over UVA), ``nvme`` (files on local NVMe behind a DRAM row cache sized from
a miss-ratio curve), ``remote`` (a pooled memory tier reached over the network or CXL).
For each: does it fit, how much HBM is left for KV cache and how many sequences that holds,
how many bytes cross the host link per step, the predicted stall (each Engram layer waits
for its own rows: ``step_stall_us``), and the best batch under the interactivity floor.

A step's fetch costs the host CPU too (``host_cpu_us``): the step's row ids are hashed
before anything is fetched, and every row the host serves from its DRAM cache or reads
from NVMe takes the fetch worker's CPU, which serves the rows side by side with the drives
(a table wholly in pinned DRAM is read by the GPU itself: hashing only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from .hardware import GpuSpec
from .models import ModelSpec
from .mrc import MissRatioCurve
from .perf import StepTime, decode_step, decode_window_us, layer_offsets_us, prefill_window_us
from .realtext import step_unique_fraction

__all__ = ["LAYER_PLACEMENTS", "PLACEMENTS", "Fetch", "Workload", "PlacementResult", "evaluate", "evaluate_all",
           "evaluate_layered", "fetch_time", "host_cpu_us", "host_core_share", "layer_placements", "layered_name",
           "layered_stall_us", "mixed_step_stall_us", "host_reads", "scheduled", "step_stall_us", "tp_degrees",
           "smallest_feasible_tp"]

PLACEMENTS = ("hbm", "dram", "nvme", "remote")
LAYER_PLACEMENTS = ("hbm", "dram", "nvme")  # what a per-layer placement mixes (each layer whole on one)
MAX_MIXED_LAYERS = 4  # up to this many Engram layers every mix is tried; beyond, early layers nearer the GPU only
GiB = 2**30


@dataclass(frozen=True)
class Workload:
    """What the operator serves: context length, batch (None: search), GPUs, targets."""

    context: int = 32768
    batch: int | None = None
    gpus: int = 8
    min_interactivity: float = 50.0  # decode tokens/s per user
    target_hit_rate: float = 0.9
    curve: MissRatioCurve | None = None
    curve_label: str = "none"
    cache_bytes: float | None = None  # the nvme placement's DRAM row cache per replica; None: by target_hit_rate

    def __post_init__(self) -> None:
        if self.context < 1:
            raise ValueError(f"--context must be a positive token count, got {self.context}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        if not 0 < self.target_hit_rate <= 1:
            raise ValueError(f"--target-hit-rate must be in (0, 1], got {self.target_hit_rate}")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError(f"--cache-bytes must be a size >= 0, got {self.cache_bytes}")


@dataclass
class PlacementResult:
    name: str
    tp: int
    fits: bool
    why_not: list[str] = field(default_factory=list)
    bytes_per_token_per_gpu: int = 0
    weight_bytes_per_gpu: float = 0.0
    table_hbm_bytes_per_gpu: float = 0.0
    host_bytes_per_gpu: float = 0.0
    hbm_free_bytes: float = 0.0  # per GPU, for KV cache
    kv_fraction: float = 0.0
    max_concurrent_seqs: int = 0  # per TP group (replica) at the context length
    batch: int = 0
    link: str = ""
    link_bytes_per_step: float = 0.0  # per GPU
    transfer_us: float = 0.0
    host_us: float = 0.0  # host CPU per step: hashing, plus the fetch worker's over its cores
    fetch_terms: dict[str, float] = field(default_factory=dict)  # Fetch.terms() of the chosen batch
    window_us: float = 0.0  # forward entry to the first Engram layer
    predicted_stall_us: float = 0.0
    prefill_transfer_us: float = 0.0
    prefill_window_us: float = 0.0
    prefill_stall_us: float = 0.0
    cache_bytes_per_gpu: float = 0.0
    cache_hit_rate: float | None = None
    cache_note: str = ""  # how the nvme cache was sized, when not simply by the target hit rate
    nvme_iops_needed: float = 0.0  # per server
    nvme_iops_available: float = 0.0
    step_us: float = 0.0
    bound: str = ""
    interactivity: float = 0.0  # tokens/s per user
    tokens_per_s_per_gpu: float = 0.0
    tokens_per_dollar: float = 0.0
    meets_interactivity: bool = False
    layers: list[dict[str, Any]] = field(default_factory=list)  # a per-layer placement's layers, in order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tp_degrees(gpus: int) -> list[int]:
    """Powers of two up to ``gpus``."""
    return [2**k for k in range(int(math.log2(gpus)) + 1)]


def _batches(max_seqs: int, fixed: int | None) -> list[int]:
    if max_seqs < 1:
        return []
    if fixed is not None:
        return [min(fixed, max_seqs)]
    out = [b for b in (2**k for k in range(31)) if b <= max_seqs]
    if out[-1] != max_seqs:
        out.append(max_seqs)
    return out


def _memory(model: ModelSpec, gpu: GpuSpec, tp: int, name: str, w: Workload,
            a: Assumptions, r: PlacementResult, hbm_share: float | None = None) -> None:
    """HBM, DRAM and NVMe needs of placement ``name``; ``hbm_share``: the share of the table in
    HBM (default: all of it for hbm, none otherwise), for a per-layer placement."""
    table = model.engram.table_bytes
    r.weight_bytes_per_gpu = model.weight_bytes / tp
    share = (1.0 if name == "hbm" else 0.0) if hbm_share is None else hbm_share
    r.table_hbm_bytes_per_gpu = table / tp * share
    budget = a.gpu_memory_utilization * gpu.hbm_bytes
    r.hbm_free_bytes = max(0.0, budget - r.weight_bytes_per_gpu - r.table_hbm_bytes_per_gpu
                           - a.runtime_overhead_bytes)
    r.kv_fraction = r.hbm_free_bytes / gpu.hbm_bytes
    kv_per_seq = w.context * model.kv_bytes_per_token
    if not model.kv_replicated_across_tp:
        kv_per_seq /= tp
    r.max_concurrent_seqs = int(r.hbm_free_bytes // kv_per_seq)
    need = r.weight_bytes_per_gpu + r.table_hbm_bytes_per_gpu + a.runtime_overhead_bytes
    if need > budget:
        r.why_not.append(
            f"weights {r.weight_bytes_per_gpu / GiB:.1f} GiB"
            + (f" + table {r.table_hbm_bytes_per_gpu / GiB:.1f} GiB" if r.table_hbm_bytes_per_gpu else "")
            + f" + runtime {a.runtime_overhead_bytes / GiB:.0f} GiB per GPU exceed "
            f"{a.gpu_memory_utilization:.0%} of {gpu.hbm_bytes / GiB:.0f} GiB HBM"
        )
    elif r.kv_fraction < a.min_kv_fraction:
        r.why_not.append(
            f"only {r.hbm_free_bytes / GiB:.1f} GiB ({r.kv_fraction:.1%} of HBM) left for KV "
            f"cache per GPU, under the {a.min_kv_fraction:.0%} minimum"
        )
    elif r.max_concurrent_seqs < 1:
        r.why_not.append(f"the KV cache cannot hold one sequence of {w.context:,} tokens")
    dram_cap = a.dram_usable_fraction * gpu.host_dram_per_gpu
    if name == "dram":
        r.host_bytes_per_gpu = table / tp
        if r.host_bytes_per_gpu > dram_cap:
            r.why_not.append(
                f"table share {r.host_bytes_per_gpu / GiB:.1f} GiB per GPU exceeds "
                f"{a.dram_usable_fraction:.0%} of {gpu.host_dram_per_gpu / GiB:.0f} GiB host DRAM per GPU"
            )
    if name == "nvme":
        if table > gpu.nvme_bytes_per_server:
            r.why_not.append(
                f"table {table / 1e12:.2f} TB exceeds the server's NVMe "
                f"{gpu.nvme_bytes_per_server / 1e12:.1f} TB"
            )
        _size_cache(model, tp, w, dram_cap, r)


def _size_cache(model: ModelSpec, tp: int, w: Workload, dram_cap: float, r: PlacementResult) -> None:
    """The nvme placement's DRAM row cache: ``w.cache_bytes`` when given, else the smallest
    reaching ``w.target_hit_rate``, within the host DRAM of the replica's GPUs; every way it
    falls short of what was asked is said in ``r.cache_note``."""
    curve, rows, row_bytes = w.curve, model.engram.num_rows, model.engram.row_bytes
    cap_rows = int(dram_cap * tp // row_bytes)
    want: int | None
    if w.cache_bytes is not None:
        want = int(w.cache_bytes // row_bytes)
        if want > cap_rows:
            r.why_not.append(f"a {w.cache_bytes / GiB:.1f} GiB cache exceeds the {cap_rows * row_bytes / GiB:.1f} GiB "
                             f"of host DRAM the replica's {tp} GPU(s) may use")
    else:
        want = curve.rows_for_hit_rate(w.target_hit_rate) if curve else rows
        if want is None:
            r.cache_note = (f"the {w.target_hit_rate:.0%} target is above what the curve reaches: the largest "
                            "cache host DRAM allows")
        elif want > cap_rows:
            r.cache_note = (f"the {w.target_hit_rate:.0%} target needs {want * row_bytes / GiB:.1f} GiB, over the "
                            "host DRAM allowed: the largest cache it allows")
    cache_rows = min(rows if want is None else want, cap_rows, rows)
    if cache_rows >= rows:
        r.cache_note = "the whole table: the dram placement, NVMe behind it"
    r.cache_bytes_per_gpu = cache_rows * row_bytes / tp
    r.host_bytes_per_gpu = r.cache_bytes_per_gpu
    r.cache_hit_rate = 1.0 if cache_rows >= rows else (curve.hit_ratio(cache_rows) if curve else 0.0)


@dataclass(frozen=True)
class Fetch:
    """Bringing one step's Engram rows to a GPU (per GPU): a fixed cost per step (latencies,
    the NVMe step overhead, hashing the step's row ids on the host) and a cost in proportion
    to the rows (the link, and the slowest of the drives and the host CPU that serves them),
    the NVMe reads it makes."""

    link_bytes: float
    fixed_us: float
    rows_us: float
    nvme_reads: float  # rows missed by the DRAM cache
    hash_us: float = 0.0  # host CPU hashing and deduplicating the row ids (in fixed_us)
    host_cpu_us: float = 0.0  # the fetch worker's CPU over its cores (within rows_us)
    link_us: float = 0.0  # the rows' bytes over the host link or the pool (within rows_us)
    device_us: float = 0.0  # the drives' reads of the misses (within rows_us)
    latency_us: float = 0.0  # the link's or pool's round trip, the drive's latency and step overhead

    def terms(self) -> dict[str, float]:
        """What the fetch time is made of (us): the fixed terms add, and of the row terms
        only the slowest of the drives and the fetch worker counts beside the link."""
        paced = "NVMe reads" if self.device_us >= self.host_cpu_us else "host fetch worker"
        return {"host hashing": self.hash_us, "latency": self.latency_us, "link": self.link_us,
                paced: max(self.device_us, self.host_cpu_us)}

    @property
    def transfer_us(self) -> float:
        return self.fixed_us + self.rows_us

    def per_layer_us(self, layers: int) -> list[float]:
        """The fetch of each of ``layers`` Engram layers, fetched one after another (each
        layer has the same number of rows; the fixed cost comes with the first)."""
        return [self.rows_us / layers + (self.fixed_us if k == 0 else 0.0) for k in range(layers)]


def host_cpu_us(model: ModelSpec, name: str, tokens: int, hits: float, misses: float,
                a: Assumptions, gpu: GpuSpec | None = None) -> tuple[float, float]:
    """Host CPU time of one GPU's fetch path for ``tokens`` tokens (``hits`` and ``misses``:
    the rows served from host DRAM and read from NVMe): hashing and dedup of every row id of
    the tokens (one thread, before the fetch starts: a cost per step and one per row id), and
    the fetch worker's per-row work over ``host_fetch_cores`` cores. ``hbm`` rows are gathered
    on the GPU, ``dram`` rows read by it from pinned memory (unless not ``dram_rows_by_gpu``)
    and the pool's measured rate holds its client's CPU: hashing only. With ``gpu``, both
    slow down when its server has fewer cores than its GPUs' fetch threads
    (``host_core_share``)."""
    if tokens <= 0:
        return 0.0, 0.0
    e = model.engram
    share = host_core_share(gpu, a) if gpu is not None else 1.0
    hash_us = (a.host_hash_us_per_step
               + tokens * len(e.layer_ids) * e.cols_per_layer * a.host_hash_us_per_row) / share
    if name in ("hbm", "remote") or (name == "dram" and a.dram_rows_by_gpu):
        return hash_us, 0.0
    per_miss = a.mmap_us_per_miss if name == "mmap" else a.host_us_per_miss
    return hash_us, (hits * a.host_us_per_hit + misses * per_miss) / a.host_fetch_cores / share


def host_core_share(gpu: GpuSpec, a: Assumptions) -> float:
    """The share of a core each fetch thread gets: every GPU of the server runs a hashing
    thread and ``host_fetch_cores`` of fetch worker; with fewer host cores than that, they
    share them (1.0: enough cores)."""
    need = gpu.gpus_per_server * (1.0 + a.host_fetch_cores)
    return min(1.0, gpu.host_cores / need) if gpu.host_cores > 0 else 1.0


def fetch_time(model: ModelSpec, gpu: GpuSpec, tp: int, name: str, tokens: int, hit_rate: float | None,
               a: Assumptions, unique: float = 1.0) -> Fetch:
    """The rows of ``tokens`` tokens for one GPU of the TP group, from placement ``name``
    (``hit_rate``: the DRAM cache's, for ``nvme``). ``unique``: the fraction of the step's
    row ids that are distinct (the fetch path reads and sends each distinct row once;
    ``realtext.step_unique_fraction``); hashing still costs every row id."""
    if not 0.0 < unique <= 1.0:
        raise ValueError(f"unique must be within (0, 1], got {unique}")
    bpt = model.engram.bytes_per_token_per_gpu(tp) * unique
    rows_per_token = model.engram.bytes_per_token_per_gpu(tp) // model.engram.row_bytes * unique
    link_bytes = tokens * bpt if name != "hbm" else 0.0
    fixed = rows = 0.0
    if name in ("dram", "nvme", "mmap"):
        fixed, rows = a.host_link_latency_us, link_bytes / (gpu.host_link_bw * a.host_link_efficiency) * 1e6
    elif name == "remote":
        fixed, rows = a.remote_latency_us, link_bytes / a.remote_bw * 1e6
    misses = tokens * rows_per_token * (1 - (hit_rate or 0.0)) if name in ("nvme", "mmap") else 0.0
    device = 0.0
    if misses > 0:
        iops_share = gpu.nvme_iops_per_server / gpu.gpus_per_server * a.nvme_path_efficiency
        fixed += gpu.nvme_latency_us + a.nvme_step_overhead_us
        bw_share = gpu.nvme_bw_per_drive * gpu.nvme_drives / gpu.gpus_per_server * a.nvme_path_efficiency
        if name == "mmap":  # page faults: one read in flight per faulting thread, whatever the drive,
            # and the thread handles its fault before it takes the next
            per_fault_s = (gpu.nvme_latency_us + a.mmap_fault_us) * 1e-6
            iops_share = min(iops_share, a.mmap_fault_threads / per_fault_s / gpu.gpus_per_server)
        # a drive's IOPS and its bandwidth are two limits on the same reads, not two costs
        device = max(misses / iops_share, misses * a.nvme_read_bytes / bw_share) * 1e6
    hash_us, cpu_us = host_cpu_us(model, name, tokens, tokens * rows_per_token - misses, misses, a, gpu)
    # the worker's CPU and the drives serve the same rows side by side (reads in flight while
    # others are decoded): the slower of the two paces them
    return Fetch(link_bytes=link_bytes, fixed_us=fixed + hash_us, rows_us=rows + max(device, cpu_us),
                 nvme_reads=misses, hash_us=hash_us, host_cpu_us=cpu_us, link_us=rows, device_us=device,
                 latency_us=fixed)


def layered_stall_us(fetch_us: list[float], offsets_us: list[float]) -> float:
    """The stall of a step whose Engram layers' rows are fetched one layer after another
    from forward entry (``fetch_us[k]``: layer k's), the GPU reaching layer k at
    ``offsets_us[k]`` plus the stall before it: a layer's rows arriving late stall the
    step, and the layers after it then have that much longer to arrive."""
    arrived = stall = 0.0
    for fetch, offset in zip(fetch_us, offsets_us):
        arrived += fetch
        stall += max(0.0, arrived - (offset + stall))
    return stall


def step_stall_us(due: Fetch, total: Fetch, offsets_us: list[float], step_us: float) -> float:
    """The Engram stall of one step of ``step_us`` with Engram layers at ``offsets_us``:
    the rows ``due`` in the step (its decode tokens', fetched from forward entry, one layer
    after another) must arrive by their layers, and everything the step's fetch brings
    (``total``: prefill rows fetched ahead of their step included) must fit in the step, or
    the fetch path falls behind by the difference every step."""
    latency = layered_stall_us(due.per_layer_us(len(offsets_us)), offsets_us)
    return max(latency, total.transfer_us - step_us)


def mixed_step_stall_us(due: dict[str, Fetch], total: dict[str, Fetch], names: tuple[str, ...],
                        offsets_us: list[float], step_us: float) -> tuple[float, list[float]]:
    """``step_stall_us`` for Engram layers on different placements (``names[k]``: layer k's;
    ``due``/``total``: each placement's fetch of the step's rows as if the whole table were
    there, of which each layer's rows are 1/len(names)). Layers on one placement are
    fetched one after another along its path; different placements' paths run side by
    side. Returns the step's stall and each layer's share of it."""
    n = len(names)
    arrived: dict[str, float] = {}
    stall, per_layer = 0.0, []
    for name, offset in zip(names, offsets_us):
        f = due[name]
        arrived[name] = arrived.get(name, f.fixed_us) + f.rows_us / n
        wait = max(0.0, arrived[name] - (offset + stall))
        per_layer.append(wait)
        stall += wait
    busy = max(total[p].fixed_us + total[p].rows_us * names.count(p) / n for p in set(names))
    return max(stall, busy - step_us), per_layer


def host_reads(names: tuple[str, ...] | list[str], a: Assumptions) -> bool:
    """Whether a placement has a layer whose rows a host thread reads (nvme, remote; dram when
    the host serves its rows): the layers whose wait ``a.schedule`` places."""
    return any(n in ("nvme", "remote") or (n == "dram" and not a.dram_rows_by_gpu) for n in names)


def scheduled(offsets_us: list[float], names: tuple[str, ...] | list[str], a: Assumptions) -> tuple[list[float], float]:
    """The Engram layers' offsets at which a step waits and the time it adds, under
    ``a.schedule``: ``cpu-wait`` with a host-read layer waits for every layer's rows at the
    first Engram layer and adds ``a.eager_us`` (eager or piecewise graphs); otherwise each
    layer waits at its own place, nothing added."""
    if a.schedule == "cpu-wait" and host_reads(names, a):
        return [offsets_us[0]] * len(offsets_us), a.eager_us
    return offsets_us, 0.0


def layered_name(layer_ids: tuple[int, ...] | list[int], names: tuple[str, ...]) -> str:
    """``(1, 14), ("dram", "nvme")`` -> ``"1=dram/14=nvme"`` (the tier spec's form)."""
    return "/".join(f"{layer}={name}" for layer, name in zip(sorted(layer_ids), names))


def layer_placements(model: ModelSpec) -> list[tuple[str, ...]]:
    """The per-layer placements to weigh (one name per Engram layer, in layer order; the
    uniform ones are the whole-table placements): every mix of ``LAYER_PLACEMENTS`` up to
    ``MAX_MIXED_LAYERS`` layers, else the first k layers on hbm and the rest on dram, and the
    first k on dram and the rest on nvme."""
    n = len(model.engram.layer_ids)
    if n < 2:
        return []
    if n <= MAX_MIXED_LAYERS:
        return [m for m in itertools.product(LAYER_PLACEMENTS, repeat=n) if len(set(m)) > 1]
    return [near * k + far * (n - k) for near, far in ((("hbm",), ("dram",)), (("dram",), ("nvme",)))
            for k in range(1, n)]


def evaluate_layered(model: ModelSpec, gpu: GpuSpec, names: tuple[str, ...], tp: int, workload: Workload,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> PlacementResult:
    """A per-layer placement (``names``: hbm, dram or nvme for each Engram layer, in layer
    order) at one TP degree: the hbm layers' rows whole in GPU memory (less KV cache), the
    dram layers' whole in host DRAM, the nvme layers' behind a DRAM row cache of their own
    (``workload.cache_bytes`` all theirs when given, else the share of the cache the target
    hit rate asks for), each layer waiting only for its own rows."""
    a, w, e = assumptions, workload, model.engram
    layer_ids = sorted(e.layer_ids)
    if len(names) != len(layer_ids) or any(n not in LAYER_PLACEMENTS for n in names):
        raise ValueError(f"a per-layer placement names one of {', '.join(LAYER_PLACEMENTS)} for each of the "
                         f"{len(layer_ids)} Engram layers, got {names}")
    share = {p: names.count(p) / len(names) for p in LAYER_PLACEMENTS}
    on_nvme = share["nvme"]
    r = PlacementResult(name=layered_name(layer_ids, names), tp=tp, fits=False,
                        bytes_per_token_per_gpu=e.bytes_per_token_per_gpu(tp))
    r.link = ", ".join(path for p, path in (("hbm", "GPU memory (hbm layers)"),
                                            ("dram", f"{gpu.host_link} (dram layers)"),
                                            ("nvme", f"NVMe -> DRAM cache -> {gpu.host_link} (nvme layers)"))
                       if share[p])
    if on_nvme:
        # the nvme layers' cache: the rows they stand for see the hit rate of a whole-table
        # cache 1/on_nvme as large
        sized = w if w.cache_bytes is None else replace(w, cache_bytes=w.cache_bytes / on_nvme)
        _memory(model, gpu, tp, "nvme", sized, a, r, hbm_share=share["hbm"])
        # the cache asked for is the nvme layers' own: only the DRAM it really holds is checked (below)
        r.why_not = [why for why in r.why_not if not (why.startswith("a ") and " cache exceeds the " in why)]
        r.cache_bytes_per_gpu *= on_nvme
    else:  # hbm and dram layers only: no cache, no hit rate
        _memory(model, gpu, tp, "hbm", w, a, r, hbm_share=share["hbm"])
    dram_share = e.table_bytes * share["dram"] / tp
    r.host_bytes_per_gpu = r.cache_bytes_per_gpu + dram_share
    dram_cap = a.dram_usable_fraction * gpu.host_dram_per_gpu
    if r.host_bytes_per_gpu > dram_cap:
        r.why_not.append(f"dram layers {dram_share / GiB:.1f} GiB + cache {r.cache_bytes_per_gpu / GiB:.1f} GiB "
                         f"per GPU exceed {a.dram_usable_fraction:.0%} of {gpu.host_dram_per_gpu / GiB:.0f} GiB "
                         "host DRAM per GPU")
    best: tuple[float, int, Any] | None = None
    fallback: tuple[float, int, Any] | None = None
    for batch in _batches(r.max_concurrent_seqs, w.batch):
        step = decode_step(model, gpu, tp, batch, w.context, a)
        offsets = layer_offsets_us(model, layer_ids, step.backbone_us)
        unique = step_unique_fraction(batch, 0)
        fetch = {p: fetch_time(model, gpu, tp, p, batch, r.cache_hit_rate, a, unique) for p in set(names)}
        waits, eager = scheduled(offsets, names, a)
        stall, per_layer = mixed_step_stall_us(fetch, fetch, names, waits, step.backbone_us)
        step_us = step.backbone_us + stall + eager
        inter = 1e6 / step_us
        point = (step, step_us, stall, per_layer, fetch, decode_window_us(model, step))
        if fallback is None or inter > fallback[0]:
            fallback = (inter, batch, point)
        if inter >= w.min_interactivity and (best is None or batch * inter / tp > best[0]):
            best = (batch * inter / tp, batch, point)
    chosen = best or fallback
    if chosen is not None:
        _, batch, (step, step_us, stall, per_layer, fetch, window) = chosen
        nvme = fetch.get("nvme")
        r.batch, r.step_us, r.predicted_stall_us, r.window_us, r.bound = batch, step_us, stall, window, step.bound
        r.link_bytes_per_step = sum(f.link_bytes * share[p] for p, f in fetch.items())
        r.transfer_us = max(f.transfer_us * names.count(p) / len(names) for p, f in fetch.items())
        r.host_us = sum(f.host_cpu_us * names.count(p) / len(names) for p, f in fetch.items()) + \
            fetch[names[0]].hash_us
        r.fetch_terms = (nvme or fetch[names[0]]).terms()
        r.interactivity = 1e6 / step_us
        r.tokens_per_s_per_gpu = batch * r.interactivity / tp
        r.tokens_per_dollar = r.tokens_per_s_per_gpu * 3600 / gpu.price_per_hour
        r.meets_interactivity = best is not None
        r.nvme_iops_needed = (nvme.nvme_reads * on_nvme / (step_us * 1e-6) * min(gpu.gpus_per_server, w.gpus)
                              if nvme is not None else 0.0)
        r.nvme_iops_available = gpu.nvme_iops_per_server
        rows = e.table_bytes / len(names) / tp
        r.layers = [{"layer": layer, "placement": name, "hbm_bytes_per_gpu": rows if name == "hbm" else 0.0,
                     "dram_bytes_per_gpu": (rows if name == "dram" else
                                            r.cache_bytes_per_gpu / names.count("nvme") if name == "nvme" else 0.0),
                     "stall_us": wait} for layer, name, wait in zip(layer_ids, names, per_layer)]
    # prefill: every row of a chunk on dram or nvme crosses the host link, as those placements say
    tokens = a.prefill_chunk_tokens
    r.prefill_window_us = prefill_window_us(model, gpu, tp, tokens, a)
    r.prefill_transfer_us = a.host_link_latency_us + tokens * r.bytes_per_token_per_gpu * (1 - share["hbm"]) / (
        gpu.host_link_bw * a.host_link_efficiency) * 1e6
    r.prefill_stall_us = max(0.0, r.prefill_transfer_us - r.prefill_window_us)
    r.fits = not r.why_not
    return r


@dataclass(frozen=True)
class _DecodePoint:
    """One decode step at one batch size: backbone time plus the Engram fetch around it."""

    step: StepTime
    window_us: float
    link_bytes: float
    transfer_us: float
    host_us: float
    stall_us: float
    step_us: float
    iops: float
    fetch: Fetch


def _decode(model: ModelSpec, gpu: GpuSpec, tp: int, name: str, batch: int, w: Workload,
            a: Assumptions, r: PlacementResult) -> _DecodePoint:
    step = decode_step(model, gpu, tp, batch, w.context, a)
    offsets = layer_offsets_us(model, sorted(model.engram.layer_ids), step.backbone_us)
    # the step's sequences share some n-grams (real text's repeats): each distinct row is read once
    fetch = fetch_time(model, gpu, tp, name, batch, r.cache_hit_rate, a, step_unique_fraction(batch, 0))
    # a decode step's rows are all due in the step, read from its forward entry: each Engram
    # layer waits for its own (cpu-wait: every layer's at the first)
    waits, eager = scheduled(offsets, (name,), a)
    stall = step_stall_us(fetch, fetch, waits, step.backbone_us)
    step_us = step.backbone_us + stall + eager
    iops = fetch.nvme_reads / (step_us * 1e-6) * min(gpu.gpus_per_server, w.gpus)
    return _DecodePoint(step=step, window_us=decode_window_us(model, step), link_bytes=fetch.link_bytes,
                        transfer_us=fetch.transfer_us, host_us=fetch.hash_us + fetch.host_cpu_us, stall_us=stall,
                        step_us=step_us, iops=iops, fetch=fetch)


def evaluate(model: ModelSpec, gpu: GpuSpec, name: str, tp: int, workload: Workload,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> PlacementResult:
    """One placement at one tensor-parallel degree."""
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; choose one of: {', '.join(PLACEMENTS)}")
    a, w = assumptions, workload
    r = PlacementResult(name=name, tp=tp, fits=False,
                        bytes_per_token_per_gpu=model.engram.bytes_per_token_per_gpu(tp))
    r.link = {"hbm": "HBM", "dram": gpu.host_link, "nvme": f"NVMe -> DRAM cache -> {gpu.host_link}",
              "remote": "pooled memory (network/CXL)"}[name]
    _memory(model, gpu, tp, name, w, a, r)
    best: tuple[float, int, _DecodePoint] | None = None
    fallback: tuple[float, int, _DecodePoint] | None = None
    for batch in _batches(r.max_concurrent_seqs, w.batch):
        d = _decode(model, gpu, tp, name, batch, w, a, r)
        inter = 1e6 / d.step_us
        tput = batch * inter / tp
        if fallback is None or inter > fallback[0]:
            fallback = (inter, batch, d)
        if inter >= w.min_interactivity and (best is None or tput > best[0]):
            best = (tput, batch, d)
    chosen = best or fallback
    if chosen is not None:
        _, batch, d = chosen
        r.batch = batch
        r.link_bytes_per_step = d.link_bytes
        r.transfer_us = d.transfer_us
        r.host_us = d.host_us
        r.fetch_terms = d.fetch.terms()
        r.window_us = d.window_us
        r.predicted_stall_us = d.stall_us
        r.step_us = d.step_us
        r.bound = d.step.bound
        r.interactivity = 1e6 / d.step_us
        r.tokens_per_s_per_gpu = batch * r.interactivity / tp
        r.tokens_per_dollar = r.tokens_per_s_per_gpu * 3600 / gpu.price_per_hour
        r.meets_interactivity = best is not None
        # the step time already holds the misses' reads at the drives' rate, so a server
        # never needs more IOPS than it has: a shortfall shows as stall, not as a misfit
        r.nvme_iops_needed = d.iops
        if name == "nvme":
            r.nvme_iops_available = gpu.nvme_iops_per_server
    # prefill: a chunk of tokens reads its rows while the layers before the first Engram
    # layer compute; every row of the chunk crosses the link (no deduplication assumed)
    if name != "hbm":
        tokens = a.prefill_chunk_tokens
        r.prefill_window_us = prefill_window_us(model, gpu, tp, tokens, a)
        bw = a.remote_bw if name == "remote" else gpu.host_link_bw * a.host_link_efficiency
        lat = a.remote_latency_us if name == "remote" else a.host_link_latency_us
        r.prefill_transfer_us = lat + tokens * r.bytes_per_token_per_gpu / bw * 1e6
        r.prefill_stall_us = max(0.0, r.prefill_transfer_us - r.prefill_window_us)
    r.fits = not r.why_not
    return r


def evaluate_all(model: ModelSpec, gpu: GpuSpec, workload: Workload,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> list[PlacementResult]:
    """Every placement at every power-of-two TP degree up to ``workload.gpus``."""
    return [evaluate(model, gpu, name, tp, workload, assumptions)
            for name in PLACEMENTS for tp in tp_degrees(workload.gpus)]


def smallest_feasible_tp(results: list[PlacementResult], name: str) -> int | None:
    """The smallest TP degree at which placement ``name`` fits, or None."""
    tps = [r.tp for r in results if r.name == name and r.fits]
    return min(tps) if tps else None
