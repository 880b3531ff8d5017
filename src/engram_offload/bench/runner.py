"""One benchmark run: a (tier, cache state, concurrency) point served for a fixed time.

``bench.sweep`` runs every point side by side; ``bench.ranks`` runs one point with several
rank processes, each of them this module's ``execute_run``.

A run opens the table on its tier with a fresh store, prepares the cache state, serves
requests for a fixed time and returns one flat dict of figures (``runs`` in the JSON).

Cache states:

- ``cold``: empty row caches, and the table file's pages evicted from the page cache
  (``posix_fadvise(DONTNEED)`` after an fsync; with ``drop_all_caches`` also the whole
  machine's page cache through ``/proc/sys/vm/drop_caches``, where permitted;
  ``cold_method`` says which);
- ``warm``: a warm-up pass over other documents of the same corpus, then the measurement;
- ``mixed``: a warm-up pass over another corpus (prose when measuring code), then the
  measurement.

A warm-up pass replays the warm-up requests' row accesses through the store for
``warmup_seconds`` (hashing, prefetching, waiting; no backbone), which warms the row
caches and the page cache as serving those requests would. The ``memory`` tier has
nothing to warm and skips it.

The measured requests are the same in every run, so tiers are compared on equal work.

Backbones: ``cpu`` computes a small real transformer here (it shares the cores with the
fetch path); ``modeled`` sleeps a GPU's roofline step time (``bench.modeled``), and each
run then also carries the planner's prediction for the same steps (``predicted_*``).

DRAM budget: the ``direct`` store holds its row caches (at most ``--cache-bytes``, itself
at most the budget) and reads with O_DIRECT, which bypasses the page cache: enforced by
construction. The ``remote`` store holds the same row caches in front of a Redis pool
(``settings.pool``; ``bench.remote``): the rest of the table is in the pool's servers, not
in this process. Its cold runs read from a freshly published copy (dropped, then published
again) with empty row caches. The ``mmap`` baseline lives in the page cache, so its runs go to a child
process in a memory cgroup, where the machine allows one, whose limit is kept at the
process's own memory (charged since it joined) plus the budget: the page cache it may
hold is the budget. ``memory`` holds the whole
table in DRAM: it is the unconstrained reference and never within a smaller budget.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from ..engram.config import EngramConfig
from ..engram.hashing import NgramHasher
from ..serving.layered import dram_bytes, is_layered, parse_placement
from ..serving.prefetch import Prefetcher
from ..serving.store import TableStore, open_table
from ..table.format import read_header
from ..tiers import TIERS, is_resident, tier_names
from .backbone import EngramBackbone
from .cold import make_cold
from .corpus import Corpus
from .drafts import Predictor, make_drafter
from .engine import EngineRun, ServingEngine
from .memcap import SLACK_BYTES, MemoryCap
from .metrics import summarize_run
from .modeled import EAGER_US, PLACEMENT_OF_TIER, ModeledBackbone, local_nvme, modeled_backbone, planner_prediction
from .remote import publish
from .workload import RequestStream, WorkloadShape

if TYPE_CHECKING:
    from .ranks import RankRole

__all__ = ["BACKBONES", "BenchSettings", "CACHED_TIERS", "Corpora", "CACHE_STATES", "CGROUP_ALLOWANCE", "build_backbone",
           "check_budget", "check_tiers", "execute_capped_run", "execute_run", "tiers_of"]

CACHE_STATES = ("cold", "warm", "mixed")
BACKBONES = ("cpu", "modeled")
CGROUP_ALLOWANCE = 256 << 20  # first limit above the budget, until the process's own memory is measured


@dataclass(frozen=True)
class BenchSettings:
    """Everything a run needs besides its (tier, cache state, concurrency)."""

    table: str
    seconds: float = 3.0
    warmup_seconds: float = 3.0
    cache_bytes: int = 0  # the DRAM row cache of the cached tiers (direct, remote)
    fast_cache_bytes: int = 0
    policy: str = "lfu"
    dram_budget: int | None = None
    shape: WorkloadShape = WorkloadShape()
    max_step_tokens: int = 256
    lookahead_tokens: int | None = None  # prefill tokens fetched ahead (default 2 steps' worth; 0: off)
    layers: int | None = None  # backbone layers (default: last Engram layer + 2)
    hidden: int = 256
    heads: int = 4
    threads: int = 1  # torch threads for the backbone; the rest of the cores fetch rows
    seed: int = 0
    drop_all_caches: bool = False  # cold runs also empty the whole machine's page cache
    backbone: str = "cpu"  # cpu: the small transformer computed here; modeled: a GPU's step time slept
    schedule: str = "prefetch"  # the modeled backbone's wait for rows (bench.modeled.SCHEDULES)
    eager_us: float = EAGER_US  # cpu-wait's cost per step against FULL graphs (host-read tiers)
    gpu: str = "b300"  # the modeled backbone's GPU (planner.hardware)
    tp: int = 1  # and its tensor-parallel degree
    model: str | None = None  # its planner model (default: the table's layout)
    nvme_iops: float | None = None  # this machine's NVMe reads/s for the planner's prediction (default: the server's)
    nvme_bytes_per_s: float | None = None  # and its read bandwidth (default: nvme_iops x 4 KiB)
    nvme_latency_us: float | None = None  # and a 4 KiB read's latency at queue depth 1 (default: the server's)
    pool: str | None = None  # the remote tier's pool URL (redis://host:port[,...])
    drafts: str = "none"  # draft tokens whose rows decode steps fetch a step early (bench.drafts: ngram[:K], model[:K])
    # what --drafts model[:K] predicts with (bench.drafts.Predictor; the command line loads the trained model)
    draft_predictor: Predictor | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        from ..pool.client import redact

        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "draft_predictor"}
        d["shape"] = asdict(self.shape)
        d["pool"] = redact(self.pool) if self.pool else None
        return d


@dataclass(frozen=True)
class Corpora:
    """Token streams of a sweep: measured requests, and the two warm-up sources."""

    measured: Corpus
    warm: Corpus  # other documents of the measured corpus
    mixed: Corpus  # another corpus

    def warmup_for(self, state: str) -> Corpus | None:
        return {"cold": None, "warm": self.warm, "mixed": self.mixed}[state]


def build_backbone(config: EngramConfig, settings: BenchSettings, vocab_size: int,
                   tier: str = "memory") -> EngramBackbone | ModeledBackbone:
    """The run's backbone: the seeded random-weight transformer (the same weights in every
    run), or the modeled GPU (``settings.eager_us`` charged under cpu-wait where ``tier``
    has a host-read layer: resident ones keep FULL graphs)."""
    if settings.backbone == "modeled":
        host_read = settings.schedule == "cpu-wait" and not all(is_resident(t) for t in tiers_of(tier))
        return modeled_backbone(config, settings.gpu, settings.tp, settings.model, schedule=settings.schedule,
                                eager_us=settings.eager_us if host_read else 0.0)
    if settings.schedule != "prefetch":
        raise ValueError(f"schedule {settings.schedule} needs the modeled backbone (--backbone modeled)")
    if settings.backbone != "cpu":
        raise ValueError(f"unknown backbone {settings.backbone!r}; choose from: {', '.join(BACKBONES)}")
    layers = settings.layers or max(config.layer_ids) + 2
    torch.manual_seed(settings.seed)
    bconfig = config.replace(hidden_size=settings.hidden, name=None)
    return EngramBackbone(bconfig, num_layers=layers, vocab_size=vocab_size, heads=settings.heads).eval()


def tiers_of(tier: str) -> list[str]:
    """The tiers a run's ``tier`` uses: itself, or each layer's of a per-layer placement
    (``"1=memory/14=direct"``, ``serving.layered``), in layer order."""
    if is_layered(tier):
        placement = parse_placement(tier)
        return [placement[layer] for layer in sorted(placement)]
    return [tier]


def check_tiers(text: str) -> list[str]:
    """``--tiers``: comma-separated tier names or per-layer placements -> the list; ``ValueError``
    in one line for an unknown tier or a malformed placement."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError("--tiers is empty")
    for item in items:
        if not is_layered(item) and item not in TIERS:
            raise ValueError(f"--tiers: unknown {item}; choose from {', '.join(TIERS)} or a per-layer placement "
                             "such as 1=memory/14=direct")
        tiers_of(item)
    return items


def _resident(tier: str) -> bool:
    """Whether every row of ``tier`` is in DRAM from the start (nothing to warm)."""
    return all(is_resident(t) for t in tiers_of(tier))


def _check_run(tier: str, state: str) -> None:
    check_tiers(tier)
    if state not in CACHE_STATES:
        raise ValueError(f"unknown cache state {state!r}; choose from: {', '.join(CACHE_STATES)}")


MMAP_PAGE_BYTES = 4096  # what the mmap tier's page cache holds and a page fault reads
CACHED_TIERS = tier_names(row_reads=True)  # the tiers served through DRAM row caches (the others are baselines)


def _cache_options(tier: str, settings: BenchSettings) -> dict[str, Any]:
    """The row caches of a run: only the cached tiers have them."""
    if not set(tiers_of(tier)) & set(CACHED_TIERS) or not (settings.cache_bytes or settings.fast_cache_bytes):
        return {}
    return dict(cache_bytes=settings.cache_bytes, fast_cache_bytes=settings.fast_cache_bytes, policy=settings.policy)


def _tier_options(tier: str, settings: BenchSettings) -> dict[str, Any]:
    """What the tier itself needs to open: the pool's URL for ``remote``."""
    if "remote" not in tiers_of(tier):
        return {}
    if settings.pool is None:
        raise ValueError("a remote run needs a pool: give --pool redis://host:port, or let bench start one")
    return {"pool": settings.pool}


@dataclass
class _Measured:
    """What a run's serving did: the warm-up pass, the measurement, the store's counters."""

    warmup: dict[str, Any] | None
    run: EngineRun
    stream: RequestStream
    before: dict[str, Any]  # the store's stats() before the measurement
    after: dict[str, Any]  # and after
    drafts: dict[str, Any] | None = None  # Prefetcher.draft_stats() over the measurement (drafts on)


def _serve(store: TableStore, tier: str, state: str, concurrency: int, settings: BenchSettings,
           corpora: Corpora, model: EngramBackbone | ModeledBackbone, hasher: NgramHasher,
           on_step: Callable[[str, float], Any] | None, rank: RankRole | None = None) -> _Measured:
    """The warm-up pass (warm and mixed states, tiers that are not resident), then the measurement
    (``rank``: one of several rank processes, ``bench.ranks``)."""
    drafter = make_drafter(settings.drafts, settings.draft_predictor)
    with Prefetcher(store, hasher, dtype=torch.float32) as prefetcher:
        def engine_for(backbone: EngramBackbone | ModeledBackbone | None) -> ServingEngine:
            return ServingEngine(backbone, prefetcher, concurrency=concurrency,
                                 max_step_tokens=max(settings.max_step_tokens, concurrency),
                                 lookahead_tokens=0 if settings.schedule != "prefetch" else settings.lookahead_tokens,
                                 drafter=drafter)

        def progress(phase: str) -> Callable[[float], Any] | None:
            return (lambda t: on_step(phase, t)) if on_step else None

        warm = corpora.warmup_for(state)
        warmup = None
        if warm is not None and not _resident(tier):
            # a replay of the warm-up requests' row accesses (no backbone): fills the caches
            # as serving them would, in a fraction of the time
            w = engine_for(None).run(_requests(RequestStream(warm, settings.shape, settings.seed + 1), rank),
                                     settings.warmup_seconds, on_step=progress("warm-up"),
                                     agree=None if rank is None else rank.agree)
            warmup = {"corpus": warm.name, "seconds": w.seconds, "tokens": w.tokens,
                      "hit_rate": store.stats()["store"]["hit_rate"] if store.levels else None}
        store.reset_stats()
        before = store.stats()
        drafts_before = prefetcher.draft_stats()
        stream = _requests(RequestStream(corpora.measured, settings.shape, settings.seed), rank)
        run = engine_for(model if rank is None else rank.exchange(model)).run(
            stream, settings.seconds, on_step=progress("measure"),
                                    agree=None if rank is None else rank.agree)
        drafts = None
        if drafter is not None:
            after = prefetcher.draft_stats()
            drafts = {k: after[k] - drafts_before[k] for k in drafts_before if isinstance(after[k], int)}
        return _Measured(warmup, run, stream, before, store.stats(), drafts)


def _requests(stream: RequestStream, rank: RankRole | None) -> RequestStream:
    return stream if rank is None else rank.requests(stream)


def _run_figures(served: _Measured, cached: bool) -> dict[str, Any]:
    """Per-token device traffic and cache hit rates of a run, from the store's counters."""
    before, after, tokens = served.before["tier"], served.after["tier"], served.run.tokens

    def per_token(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / tokens if tokens else 0.0

    run = served.run
    steps = run.steps or 1
    layer_stall = {str(layer): seconds / steps * 1e6 for layer, seconds in sorted(run.layer_stall_seconds.items())}
    total = float(sum(run.step_seconds)) or 1.0
    first = min(run.layer_stall_seconds) if run.layer_stall_seconds else None
    return {
        "layer_stall_us": layer_stall,  # each Engram layer's wait for its rows, per step
        "first_layer_stall_fraction": run.layer_stall_seconds[first] / total if first is not None else None,
        **_draft_figures(served.drafts),
        "hit_rate": served.after["store"]["hit_rate"] if cached else None,
        "level_hit_rates": {lv["level"]: lv["hit_rate"] for lv in served.after["levels"]} if cached else None,
        "tier_rows_per_token": per_token("rows"),
        "device_bytes_per_token": per_token("bytes_read"),
        "device_reads": _device_reads(served),
    }


def _draft_figures(counts: dict[str, Any] | None) -> dict[str, Any]:
    """A run's drafts: the share of the rows of steps after drafts that the drafts had
    already fetched, and the draft rows those steps did not ask for, per row fetched ahead
    (the extra reads a right row costs, at most: some unused rows were cache hits)."""
    if counts is None:
        return {}
    fetched, unused = counts["next_rows_fetched"], counts["draft_rows_unused"]
    return {"draft_counts": counts,
            "draft_share_fetched": fetched / counts["next_rows"] if counts["next_rows"] else None,
            "draft_extra_rows_per_fetched": unused / fetched if fetched else None}


def _tier_delta(served: _Measured, key: str) -> int:
    return served.after["tier"].get(key, 0) - served.before["tier"].get(key, 0)


def _device_reads(served: _Measured) -> int:
    """Reads the drive served in the measurement: the tier's, or for a memory map its page
    faults (the pages the page cache missed)."""
    return _tier_delta(served, "page_faults" if "page_faults" in served.after["tier"] else "reads")


def _page_cache_hit_rate(served: _Measured) -> float | None:
    """The share of a memory map's touched pages that the page cache held (None for other tiers)."""
    touched = _tier_delta(served, "pages_touched")
    return 1.0 - _tier_delta(served, "page_faults") / touched if touched else None


def execute_run(tier: str, state: str, concurrency: int, settings: BenchSettings, corpora: Corpora,
                token_map: np.ndarray, *, budget_note: tuple[bool, str] | None = None,
                on_step: Callable[[str, float], Any] | None = None,
                before_open: Callable[[], Any] | None = None, rank: RankRole | None = None) -> dict[str, Any]:
    """One run in this process; returns its figures. ``before_open`` is called once the
    backbone is built, just before the table is opened (the capped child joins its cgroup there).
    ``rank``: this process is one of several ranks (``bench.ranks``), which opens the table."""
    _check_run(tier, state)
    torch.set_num_threads(settings.threads)
    republished = None
    if "remote" in tiers_of(tier):  # before make_cold: publishing reads the file (a no-op when it is there)
        republished = publish(settings.table, _tier_options(tier, settings)["pool"], fresh=state == "cold",
                              progress=False, on_step=on_step)
    cold_method = make_cold(settings.table, drop_all=settings.drop_all_caches)
    if state == "cold" and republished is not None:
        cold_method = [f"pool table dropped and published again ({republished['seconds']:.1f} s)", *cold_method]
    options = _cache_options(tier, settings)
    config = read_header(settings.table).config
    model = build_backbone(config, settings, token_map.size, tier)
    hasher = NgramHasher(config, token_map)
    if before_open is not None:
        before_open()
    t_open = time.perf_counter()
    opened = open_table(settings.table, tier, **options, **_tier_options(tier, settings)) if rank is None \
        else rank.open(tier, options)
    with opened as store:
        open_seconds = time.perf_counter() - t_open
        held = dram_bytes(store)
        served = _serve(store, tier, state, concurrency, settings, corpora, model, hasher, on_step, rank)
        rank_figures = {} if rank is None else rank.measure(served.run)
    if budget_note is None:
        budget_note = _budget_note(tier, settings)
    figures = _predicted(model, tier, served, settings, config) if isinstance(model, ModeledBackbone) else {}
    return {
        "tier": tier,
        "cache_state": state,
        "concurrency": concurrency,
        **summarize_run(served.run),
        **_run_figures(served, bool(options)),
        "budget_enforced": budget_note[0],
        "budget_method": budget_note[1],
        "cold_method": ", ".join(cold_method) if state == "cold" else None,
        "warmup": served.warmup,
        "corpus_wrapped": served.stream.wrapped,
        "open_seconds": open_seconds,
        "cache_bytes": settings.cache_bytes if options else 0,
        "dram_bytes": held,
        **figures,
        **rank_figures,
    }


def _predicted(model: ModeledBackbone, tier: str, served: _Measured, settings: BenchSettings,
               config: EngramConfig) -> dict[str, Any]:
    """The planner's stall and NVMe reads for the run's own steps, beside the measured ones:
    with its own inputs (``predicted_*``: the hit rate its curve (``curve_for``) gives the DRAM held,
    4 KiB per read, real text's repeats within a step), and with the run's measured ones
    (``predicted_*_at_measured_hit``, cached tiers on NVMe only: the hit rate, the bytes per
    device read and the share of each step's row ids that are distinct)."""
    from ..planner.plan import curve_for

    run = served.run
    gpu = model.gpu
    if settings.nvme_iops is not None:
        gpu = local_nvme(model.gpu, model.tp, settings.nvme_iops, settings.nvme_bytes_per_s, settings.nvme_latency_us)
    layers = tiers_of(tier)
    cached = set(layers) & set(CACHED_TIERS)
    held = settings.cache_bytes if cached else settings.dram_budget
    planner_hit = None
    if "nvme" in {PLACEMENT_OF_TIER[t] for t in layers}:
        # a per-layer placement's cache serves its cached layers' rows only: the hit rate of a
        # whole-table cache as many times larger as those layers are a share of the table
        share = sum(t in CACHED_TIERS for t in layers) / len(layers)
        planner_hit = curve_for(model.model)[0].hit_ratio(int((held or 0) / share) // config.row_bytes)
    elif PLACEMENT_OF_TIER.get(tier) == "mmap":
        # the page cache, held to the budget, keeps 4 KiB pages; a page's other rows belong to
        # unrelated n-grams (hashing spreads them), so a cached page holds about one row worth keeping
        planner_hit = curve_for(model.model)[0].hit_ratio((held or 0) // MMAP_PAGE_BYTES)
    own = planner_prediction(model, tier, run.step_tokens, planner_hit, gpu)
    reads = _device_reads(served)
    step_us = float(sum(run.step_seconds)) / run.steps * 1e6 if run.steps else 0.0
    stall_us = float(sum(run.stall_seconds)) / run.steps * 1e6 if run.steps else 0.0
    out = {
        "modeled": {"gpu": model.gpu.name, "tp": model.tp, "model": model.model.name, "schedule": model.schedule,
                    "eager_us": model.eager_us,
                    "nvme": "the server's drives" if settings.nvme_iops is None
                    else f"this machine's: {gpu.nvme_iops_per_drive:,.0f} reads/s, {gpu.nvme_bw_per_drive:,.0f} B/s"},
        "measured_stall_us": stall_us,
        # step time beyond the roofline and the stall: the serving thread's own work (hashing
        # the step's and the look-ahead tokens, scheduling), which a GPU would wait for too
        "host_us_per_step": step_us - stall_us - (own["step_us"] - own["stall_us"]),
        "measured_iops": reads / run.seconds if run.seconds else 0.0,
        "predicted_placement": own["placement"],
        "predicted_hit_rate": own["hit_rate"],
        "predicted_stall_us": own["stall_us"],
        "predicted_stall_us_all_at_first_layer": own["stall_us_all_at_first_layer"],
        "predicted_step_us": own["step_us"],
        "predicted_stall_fraction": own["stall_fraction"],
        "predicted_iops": own["nvme_iops"],
    }
    on_nvme = "nvme" in {PLACEMENT_OF_TIER[t] for t in layers}  # the planner's remote placement has no row cache
    measured_hit = served.after["store"]["hit_rate"] if on_nvme and _cache_options(tier, settings) else None
    a = model.assumptions
    if PLACEMENT_OF_TIER.get(tier) == "mmap":  # the page cache's hits, from the page faults
        measured_hit = _page_cache_hit_rate(served)
        out.update(page_cache_hit_rate=measured_hit, tier_pages_touched=_tier_delta(served, "pages_touched"))
    elif measured_hit is not None and reads:
        a = replace(a, nvme_read_bytes=_tier_delta(served, "bytes_read") // reads)
    if measured_hit is not None:
        at = planner_prediction(model, tier, run.step_tokens, measured_hit, gpu, a,
                                unique=served.after["store"]["unique_ratio"] or None)
        out.update(predicted_stall_us_at_measured_hit=at["stall_us"],
                   predicted_stall_us_all_at_first_layer_at_measured_hit=at["stall_us_all_at_first_layer"],
                   predicted_stall_fraction_at_measured_hit=at["stall_fraction"],
                   predicted_iops_at_measured_hit=at["nvme_iops"])
    return out


def _budget_note(tier: str, settings: BenchSettings) -> tuple[bool, str]:
    if settings.dram_budget is None:
        return False, "no budget given"
    if is_layered(tier):
        return False, ("per-layer placement: the DRAM it holds is dram_bytes (its resident layers' slices and "
                       "the row caches of the others)")
    if is_resident(tier):
        return False, "the whole table is in DRAM (the unconstrained reference)"
    held = settings.cache_bytes + settings.fast_cache_bytes
    if tier == "direct":
        return held <= settings.dram_budget, f"row caches {held} B <= budget; O_DIRECT bypasses the page cache"
    if tier == "remote":
        return held <= settings.dram_budget, f"row caches {held} B <= budget; the rest of the table is in the pool"
    return False, "page cache not capped"


def _child(tier: str, state: str, concurrency: int, settings: BenchSettings, corpora: Corpora,
           token_map: np.ndarray, cap_path: str, cap_version: str, limit: int, note: str,
           out: Any) -> None:
    """Entry of the capped child: join the cgroup, run, send the figures (or the error) back."""
    budget = settings.dram_budget
    assert budget is not None  # only a run with a DRAM budget starts a capped child
    cap = MemoryCap(Path(cap_path), cap_version, limit)
    stop = None

    def join() -> None:
        nonlocal stop
        cap.join()
        stop = cap.cap_page_cache(budget)

    try:
        result = execute_run(tier, state, concurrency, settings, corpora, token_map,
                             budget_note=(True, note), before_open=join)
        result["cgroup_peak_bytes"] = cap.peak_bytes()
        result["cgroup_charged_bytes"] = cap.charged()
        out.put(("ok", result))
    except BaseException as exc:  # reported by the parent
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if stop is not None:
            stop.set()


def execute_capped_run(tier: str, state: str, concurrency: int, settings: BenchSettings, corpora: Corpora,
                       token_map: np.ndarray, timeout: float) -> dict[str, Any]:
    """An ``mmap`` run under the DRAM budget: in a child process inside a memory cgroup when
    one can be made, else in this process with ``budget_enforced`` false and the reason."""
    assert settings.dram_budget is not None
    limit = settings.dram_budget + CGROUP_ALLOWANCE
    cap, how = MemoryCap.create(limit)
    if cap is None:
        return execute_run(tier, state, concurrency, settings, corpora, token_map, budget_note=(False, how))
    note = (f"{how}, then kept at the process's own memory + the budget ({settings.dram_budget} B) + "
            f"{SLACK_BYTES} B of slack, every 20 ms: the page cache is what the budget bounds")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(tier, state, concurrency, settings, corpora, token_map,
                                             str(cap.path), cap.version, limit, note, out))
    try:
        child.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, payload = out.get(timeout=1.0)
                break
            except queue_module.Empty:
                if not child.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the capped {tier} run ended without a result (exit code {child.exitcode}; -9 is "
                        "a kill, e.g. out of memory in the cgroup)" if not child.is_alive() else
                        f"the capped {tier} run did not report within {timeout:.0f} s") from None
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        cap.remove()
    if status != "ok":
        raise RuntimeError(f"the capped {tier} run failed: {payload}")
    return payload


def check_budget(settings: BenchSettings) -> None:
    """Raise ``ValueError`` when the row caches would not fit in the DRAM budget."""
    held = settings.cache_bytes + settings.fast_cache_bytes
    if settings.dram_budget is not None and held > settings.dram_budget:
        raise ValueError(
            f"the row caches ({held:,} B: --cache-bytes plus --fast-cache-bytes) exceed --dram-budget "
            f"({settings.dram_budget:,} B): lower the cache or raise the budget"
        )
