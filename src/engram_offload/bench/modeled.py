"""``ModeledBackbone``: a real GPU's step time, slept, in place of the backbone's compute.

Each step sleeps for the planner's roofline time of its decode and prefill tokens on a GPU
and model (``planner.perf.step_time``), split at the Engram layers by the layers' share of
the step (``planner.perf.layer_offsets_us``): the time before Engram layer 1, then between
the Engram layers, then after the last. At each Engram layer it takes that layer's rows,
waiting for them if they are not there (the stall, measured by the prefetcher's ``Step``);
a wait pushes the rest of the step back, as it would on the GPU. Sleeping uses no CPU, so
hashing, dedup, caches and storage have this machine's cores to themselves, as on a GPU
server, at that GPU's step rate.

``schedule`` says where a step waits for its rows (``SCHEDULES``): ``prefetch`` (the
benchmark's own Prefetcher: decode rows from forward entry, each layer waiting for its own;
prefill rows fetched steps ahead), ``in-graph`` (the plugin under FULL CUDA graphs: every
row read from the step's own forward entry, ids known only then, and the GPU waits right
before each Engram layer for that layer's rows) and ``cpu-wait`` (the plugin's CPU wait
under eager or piecewise graphs: every row read from forward entry, the rows of every layer
waited for before the first Engram layer, so the read overlaps only the work before it; and
``eager_us`` more per step than FULL graphs take, ``EAGER_US``). ``in-graph`` and
``cpu-wait`` fetch nothing ahead (the runner turns the prefill lookahead off).

``planner_prediction`` is what the planner predicts for the same steps: its roofline step
time, the Engram layers' places in it, the fetch time of a placement
(``planner.placement.fetch_time``) and so the stall (``placement.step_stall_us``) and the
NVMe reads per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Iterable

from ..engram.config import EngramConfig
from ..planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from ..planner.hardware import GpuSpec, get_gpu
from ..planner.models import ModelSpec, get_model
from ..planner.perf import StepTime, layer_offsets_us, step_time
from ..planner.placement import fetch_time, mixed_step_stall_us, step_stall_us
from ..planner.realtext import step_unique_fraction
from ..serving.layered import is_layered, parse_placement
from .engine import RowsFor, StepShape

__all__ = ["EAGER_US", "SCHEDULES", "ModeledBackbone", "PLACEMENT_OF_TIER", "modeled_backbone", "planner_prediction", "local_nvme"]

# The planner's placement each tier stands for: the table whole in host DRAM, on NVMe
# behind a DRAM cache (mmap's is the page cache), or in a pool (the planner's remote
# placement has no DRAM cache in front: its prediction is the all-miss one).
PLACEMENT_OF_TIER = {"memory": "dram", "pinned": "dram", "shared": "dram", "direct": "nvme", "mmap": "mmap",
                     "remote": "remote"}
SCHEDULES = ("prefetch", "in-graph", "cpu-wait")
EAGER_US = DEFAULT_ASSUMPTIONS.eager_us  # cpu-wait's cost per step against FULL graphs (bench --eager-us)


@dataclass(frozen=True)
class ModeledBackbone:
    """Sleeps a step's roofline time on ``tp`` GPUs of ``gpu`` for ``model``, taking the
    rows of the Engram layers ``layer_ids`` at their place in the step."""

    model: ModelSpec
    gpu: GpuSpec
    tp: int
    layer_ids: tuple[int, ...]
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS
    schedule: str = "prefetch"
    eager_us: float = 0.0  # added at each step's end (cpu-wait with a host-read layer)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from: {', '.join(SCHEDULES)}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        beyond = [i for i in self.layer_ids if i >= self.model.num_layers]
        if beyond:
            raise ValueError(f"Engram layers {beyond} are beyond {self.model.name}'s {self.model.num_layers} layers")

    def step_time(self, shape: StepShape) -> StepTime:
        """The planner's roofline time of ``shape`` on this GPU and model."""
        return step_time(self.model, self.gpu, self.tp, shape.decode_tokens, shape.prefill_tokens,
                         shape.kv_tokens, self.assumptions)

    def segments_us(self, shape: StepShape) -> list[float]:
        """Compute before each Engram layer (since the previous one), then after the last:
        ``len(layer_ids) + 1`` pieces that add up to the step's roofline time."""
        total = self.step_time(shape).backbone_us
        offsets = layer_offsets_us(self.model, sorted(self.layer_ids), total)
        return [b - a for a, b in zip([0.0, *offsets], [*offsets, total])]

    def run_step(self, shape: StepShape, rows_for: RowsFor) -> None:
        """Sleep each segment, taking each Engram layer's rows between them. Time spent
        waiting for (and taking) rows delays the rest of the step; a sleep's own lateness
        does not add up (each segment ends at its deadline). Under ``cpu-wait`` every layer's
        rows are taken before the first Engram layer."""
        segments = self.segments_us(shape)
        layers = sorted(self.layer_ids)
        deadline = time.perf_counter()
        for k, (layer_id, segment) in enumerate(zip(layers, segments)):
            deadline += segment * 1e-6
            if self.schedule == "cpu-wait" and k:
                continue
            _sleep_until(deadline)
            asked = time.perf_counter()
            for taken in (layers if self.schedule == "cpu-wait" else [layer_id]):
                rows_for(taken)
            deadline += time.perf_counter() - asked  # the wait for rows, not the sleep's lateness
        _sleep_until(deadline + (segments[-1] + self.eager_us) * 1e-6)


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def modeled_backbone(table_config: EngramConfig, gpu: str, tp: int, model: str | None = None,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS, schedule: str = "prefetch",
                     eager_us: float = 0.0) -> ModeledBackbone:
    """The modeled backbone of a benchmark table: the planner's ``model`` (default: the
    table's layout, e.g. ``deepseek-v4.1-flash`` for a scaled ``deepseek-v4.1-flash@0.011``)
    with the table's own Engram layout."""
    name = model or (table_config.name or "").split("@")[0]
    if not name:
        raise ValueError("the table's layout has no name: pass --model (one of the planner's models)")
    spec = replace(get_model(name), engram=table_config)
    return ModeledBackbone(spec, get_gpu(gpu), tp, tuple(table_config.layer_ids), assumptions, schedule, eager_us)


def local_nvme(gpu: GpuSpec, tp: int, iops: float, bytes_per_s: float | None = None,
               latency_us: float | None = None) -> GpuSpec:
    """``gpu`` in a server whose only NVMe drive is this machine's (``iops``: random reads
    per second at the tier's read size, e.g. fio's; ``bytes_per_s``: its read bandwidth,
    default ``iops`` x 4 KiB; ``latency_us``: a 4 KiB read's at queue depth 1, default the
    server's drives') and which holds just one TP group: ``tp`` GPUs share it."""
    return replace(gpu, nvme_drives=1, nvme_iops_per_drive=iops, gpus_per_server=tp,
                   nvme_bw_per_drive=bytes_per_s or iops * 4096, nvme_latency_us=latency_us or gpu.nvme_latency_us)


def planner_prediction(backbone: ModeledBackbone, tier: str, steps: Iterable[tuple[int, int, int]],
                       hit_rate: float | None, gpu: GpuSpec | None = None,
                       assumptions: Assumptions | None = None, unique: float | None = None) -> dict[str, Any]:
    """What the planner predicts for ``steps`` (``(decode, prefill, KV tokens)`` each) served
    from ``tier`` at a DRAM-cache ``hit_rate``: mean stall and step time per step (us), the
    stall's share of step time, the NVMe reads per second of the TP group and the host CPU
    of the fetch path per step (``host_cpu_us``: hashing plus the fetch worker's, which
    ``fetch_time`` charges; this machine's one fetch path serves all ``tp`` GPUs' columns,
    so each GPU's gets ``host_fetch_cores / tp`` of its cores, and it serves the ``memory``
    tier's rows itself: ``dram_rows_by_gpu`` off).

    ``stall_us`` is ``placement.step_stall_us``: decode rows due layer by layer, prefill
    rows fetched ahead but within the device's rate. ``stall_us_all_at_first_layer`` is
    the earlier formula, every row of the step due at the first Engram layer. Each step reads
    its distinct rows only: ``unique`` of its row ids (a run's measured share), or by default
    real text's (``realtext.step_unique_fraction`` of its decode and prefill tokens).

    Under the plugin's schedules (``backbone.schedule``: ``in-graph``, ``cpu-wait``) every
    row of the step, prefill's included, is due from forward entry (nothing fetched ahead);
    under ``cpu-wait`` every layer's rows are due at the first Engram layer and each step
    takes ``backbone.eager_us`` more.

    A per-layer placement (``"1=memory/14=direct"``) has each layer wait for its own rows
    along its own medium (``placement.mixed_step_stall_us``); ``hit_rate`` is then its cached
    layers' and ``nvme_iops`` counts their reads only."""
    if is_layered(tier):
        spec = parse_placement(tier)
        names = tuple(PLACEMENT_OF_TIER[spec[layer]] for layer in sorted(spec))
    else:
        names = (PLACEMENT_OF_TIER[tier],) * len(backbone.layer_ids)
    placement = names[0] if len(set(names)) == 1 else "/".join(names)
    gpu = gpu or backbone.gpu
    model, tp, a = backbone.model, backbone.tp, assumptions or backbone.assumptions
    # one fetch path on this machine serves the whole TP group's columns: its cores are shared
    # and with no GPU here, the host serves the memory tier's rows too (lookup, copy, decode)
    a = replace(a, host_fetch_cores=a.host_fetch_cores / tp, dram_rows_by_gpu=False)
    layers = sorted(backbone.layer_ids)
    plugin = backbone.schedule != "prefetch"  # every row read from the step's own forward entry
    stall = first_only = step_total = reads = host = 0.0
    n = 0
    for decode, prefill, kv in steps:
        roofline = backbone.step_time(StepShape((), decode, prefill, kv)).backbone_us
        offsets = layer_offsets_us(model, layers, roofline)
        if backbone.schedule == "cpu-wait":
            offsets = [offsets[0]] * len(offsets)
        total = {p: fetch_time(model, gpu, tp, p, decode + prefill, hit_rate, a,
                               unique or step_unique_fraction(decode, prefill)) for p in set(names)}
        due = total if plugin else {
            p: fetch_time(model, gpu, tp, p, decode, hit_rate, a, unique or step_unique_fraction(decode, 0))
            for p in set(names)}
        if len(due) == 1:
            s = max(0.0, step_stall_us(due[names[0]], total[names[0]], offsets, roofline))
        else:
            s = max(0.0, mixed_step_stall_us(due, total, names, offsets, roofline)[0])
        share = {p: names.count(p) / len(names) for p in total}
        first_only += max(0.0, max(f.fixed_us + f.rows_us * share[p] for p, f in total.items()) - offsets[0])
        stall += s
        step_total += roofline + s + backbone.eager_us
        reads += sum(f.nvme_reads * share[p] for p, f in total.items()) * tp
        host += next(iter(total.values())).hash_us + sum(f.host_cpu_us * share[p] for p, f in total.items())
        n += 1
    return {
        "placement": placement,
        "hit_rate": hit_rate,
        "stall_us": stall / n if n else 0.0,
        "stall_us_all_at_first_layer": first_only / n if n else 0.0,
        "step_us": step_total / n if n else 0.0,
        "stall_fraction": stall / step_total if step_total else 0.0,
        "nvme_iops": reads / step_total * 1e6 if step_total else 0.0,
        "host_cpu_us": host / n if n else 0.0,
    }
