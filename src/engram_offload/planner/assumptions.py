"""The planner's stated assumptions: every constant that is a judgement, not a datasheet fact.

Change them with ``dataclasses.replace`` (the CLI exposes the ones operators ask about).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Assumptions", "DEFAULT_ASSUMPTIONS", "POOL_ROWS_PER_S", "POOL_ROW_BYTES"]

GiB = 2**30
POOL_ROWS_PER_S = 808e3  # loopback, one client, one Redis master (issue 15)
POOL_ROW_BYTES = 264  # DeepSeek-V4.1-Flash's packed row


@dataclass(frozen=True)
class Assumptions:
    # Share of HBM a serving engine lets itself use: vLLM's default
    # gpu_memory_utilization is 0.9 (docs.vllm.ai, engine arguments).
    gpu_memory_utilization: float = 0.9
    # Per-GPU HBM for activations, CUDA graphs, communication buffers and the allocator's
    # slack, on top of weights, table and KV cache (typical vLLM profiling result).
    runtime_overhead_bytes: float = 4 * GiB
    # A placement is feasible only if the KV cache gets at least this share of HBM: below a
    # tenth, an engine runs a handful of sequences and the GPUs idle. (For B300 and
    # DeepSeek-V4.1-Flash the smallest-TP answer is the same for any value in 1.1%..36%.)
    min_kv_fraction: float = 0.10
    # Share of host DRAM the table (or its cache) may pin; the rest stays with the OS,
    # the engine and the page cache.
    dram_usable_fraction: float = 0.8
    # Achieved fraction of link bandwidth for row-sized (~256 B) scattered reads by a
    # gather kernel over UVA: PCIe TLP and completion overheads roughly halve it.
    host_link_efficiency: float = 0.5
    host_link_latency_us: float = 2.0  # one round trip to host memory plus launch
    # Achieved fractions of datasheet peaks in decode (roofline derating).
    hbm_efficiency: float = 0.8
    flops_efficiency: float = 0.5
    # One small all-reduce across a tensor-parallel group (one-shot NVLink kernels).
    allreduce_latency_us: float = 8.0
    allreduces_per_layer: int = 2  # after attention and after the MoE/MLP
    # NVMe path: one 4 KiB read per missing row, plus the software cost of a step that
    # reads from NVMe (gathering ids, submitting, copying back): the article's first
    # mmap prototype did this on the CPU between GPU segments.
    nvme_read_bytes: int = 4096
    nvme_step_overhead_us: float = 50.0
    # The share of a drive's random-read rate (fio, 4 KiB, QD 128) the fetch path reaches:
    # a Prefetcher over a cold ``direct`` table read 0.76-0.89x of fio's rate on the same
    # file (benchmarks/bench_fetch.py, medians of the runs in docs/planner.md and README).
    nvme_path_efficiency: float = 0.8
    # A table read through a memory map (the ``mmap`` tier: the article's first prototype):
    # each missed row is a page fault, a synchronous 4 KiB read at queue depth 1 per
    # faulting thread (the Prefetcher's two workers): the thread waits the drive's
    # queue-depth-1 latency, then ``mmap_fault_us`` more before its next fault (the kernel's
    # fault path, the wake-up, the copy and page check: ``bench-tier --tier mmap --cold
    # --callers 2 --queue-depth 2 --batch 64`` read 14.6k rows/s where fio's QD 1 latency
    # was 74 us, 63 us more a fault; page faults counted). The fault costs the host 30 us
    # of CPU (``bench_tier.py``: cold ``mmap`` 30.3 us a row against ``direct``'s 3.0).
    # Used by the modeled benchmark's prediction for its ``mmap`` runs; ``plan`` never
    # proposes it.
    mmap_fault_threads: int = 2
    mmap_fault_us: float = 60.0
    mmap_us_per_miss: float = 30.0
    # The pooled remote tier (a table published to Redis, the ``remote`` tier), measured
    # on loopback with one client and one master: 808k rows/s of 264 B through pipelined
    # GETRANGE (issue 15's measurement) is 1.7 Gb/s; rows/s grows with the number of
    # masters (the nodes are read in parallel), so a cluster of N masters gives up to N
    # times this. One round trip: the median of one pipelined 264-byte GETRANGE on
    # loopback, 18 us (docs/planner.md). ``plan --pool-gbps/--pool-rtt-us`` override them.
    remote_bw: float = POOL_ROWS_PER_S * POOL_ROW_BYTES  # bytes/s
    remote_latency_us: float = 18.0
    # Tokens per prefill chunk when checking the prefill prefetch window.
    prefill_chunk_tokens: int = 8192
    # The host CPU of the fetch path (the Prefetcher), measured on the development machine
    # (2-core AMD EPYC). Hashing and deduplicating a step's row ids on the serving thread
    # (``begin_step``: a rank hashes every column, an n-gram's hash needs the whole n-gram):
    # a fixed cost per step plus a cost per row id, fitted to begin_step at decode batches
    # of 8 to 512 (0.11, 0.16-0.17, 0.24-0.35, 0.86-0.88 ms a step in two runs: fits of 94
    # and 120 us a step, 0.031 us a row id; docs/planner.md). Then, on the fetch
    # worker, per row served from host DRAM (cache lookup, copy, decode) and per row read
    # from NVMe (the same plus the io_uring read's submission and completion): medians of
    # ``bench-tier --tier direct --cache-bytes 10% --prefetcher --cold --json``. The rows of
    # a table in pinned host DRAM are read by the GPU itself (``dram_rows_by_gpu``: the
    # pinned tier's unified addressing), with no host CPU a row; ``hbm`` rows are gathered
    # on the GPU. ``plan --host-*`` override them.
    host_hash_us_per_step: float = 110.0
    host_hash_us_per_row: float = 0.031
    host_us_per_hit: float = 0.26
    host_us_per_miss: float = 6.2
    dram_rows_by_gpu: bool = True
    host_fetch_cores: float = 1.0
    # Where a host-read placement's step (nvme, remote; dram when the host serves its rows)
    # waits for its rows, as the vLLM plugin runs it: ``in-graph`` (FULL CUDA graphs, the GPU
    # waiting before each Engram layer for that layer's rows, read from the step's forward
    # entry: drivers with stream memory operations) or ``cpu-wait`` (eager or piecewise
    # graphs: the CPU waits for every layer's rows before the first Engram layer, and the
    # step takes ``eager_us`` more than under FULL graphs). ``eager_us`` is a modeled
    # constant, not a measurement: about 10 us of launches and Python for each of a V4.1
    # backbone's 40-odd layers that piecewise graphs leave outside the graphs. ``plan
    # --schedule``/``--eager-us`` and ``bench --schedule``/``--eager-us`` set them.
    schedule: str = "in-graph"
    eager_us: float = 400.0
    # List prices of the memory a placement buys, beside the GPU-hours (``plan --dram-price``,
    # ``--nvme-price``): server DDR5 RDIMMs about $5 a GiB (64 GB modules at about $300
    # in 2025 distributor list prices; they rose steeply in late 2025: give today's), and
    # enterprise TLC NVMe about $120 a TB (7.68 TB Gen4/Gen5 U.2 drives at about $900).
    # The hardware is paid off over ``hardware_years`` to compare it with GPU-hours.
    dram_price_per_gib: float = 5.0
    nvme_price_per_tb: float = 120.0
    hardware_years: float = 3.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_ASSUMPTIONS = Assumptions()
