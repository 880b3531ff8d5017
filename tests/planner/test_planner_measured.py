"""The planner's stall formula as fixed against measurement (docs/planner.md, "Checked
against measurement"): NVMe IOPS and bandwidth are two limits on one set of reads, the
Engram layers' rows arrive one layer after another, and rows fetched ahead still have to
fit in the device's rate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engram_offload.planner import DEFAULT_ASSUMPTIONS, get_gpu, get_model
from engram_offload.planner.placement import Fetch, fetch_time, layered_stall_us, step_stall_us

V41 = get_model("deepseek-v4.1-flash")
A = replace(DEFAULT_ASSUMPTIONS, host_hash_us_per_step=0.0, host_hash_us_per_row=0.0, host_us_per_hit=0.0,
            host_us_per_miss=0.0)  # test_host_cpu.py


def one_drive(iops, bytes_per_s, gpus=2):
    return replace(get_gpu("b300"), nvme_drives=1, nvme_iops_per_drive=iops, nvme_bw_per_drive=bytes_per_s,
                   gpus_per_server=gpus)


@pytest.mark.parametrize("iops,bw,limit", [(40_000, 400e6, "iops"), (40_000, 40e6, "bandwidth")])
def test_nvme_reads_take_the_slower_of_the_iops_and_the_bandwidth_not_their_sum(iops, bw, limit):
    gpu = one_drive(iops, bw)
    fetch = fetch_time(V41, gpu, 2, "nvme", 100, 0.5, A)
    misses = 100 * 24 * 0.5  # 24 rows per token per GPU at TP 2, half of them missed
    assert fetch.nvme_reads == misses
    # the drive is shared by the 2 GPUs, at the share of its rate the fetch path reaches
    by_iops = misses / (iops / 2 * A.nvme_path_efficiency) * 1e6
    by_bw = misses * 4096 / (bw / 2 * A.nvme_path_efficiency) * 1e6
    link = 100 * V41.engram.bytes_per_token_per_gpu(2) / (gpu.host_link_bw * A.host_link_efficiency) * 1e6
    assert fetch.rows_us == pytest.approx(link + (by_iops if limit == "iops" else by_bw))
    assert fetch.fixed_us == A.host_link_latency_us + gpu.nvme_latency_us + A.nvme_step_overhead_us
    assert fetch.transfer_us < A.host_link_latency_us + gpu.nvme_latency_us + A.nvme_step_overhead_us + link + by_iops + by_bw


def test_a_layer_waits_only_for_its_own_rows_and_those_before_it():
    # rows of layer 1 take 3, of layer 14 another 3; the GPU reaches them at 1 and 10
    assert layered_stall_us([3.0, 3.0], [1.0, 10.0]) == 2.0  # the old formula: 6 - 1 = 5
    # layer 14 close behind: it waits too, from where the first stall left the GPU (1 + 2 = 3 -> 4)
    assert layered_stall_us([3.0, 3.0], [1.0, 2.0]) == 4.0
    assert layered_stall_us([0.5, 0.5], [1.0, 2.0]) == 0.0


def test_the_fixed_cost_comes_with_the_first_layer():
    fetch = Fetch(link_bytes=0, fixed_us=10.0, rows_us=6.0, nvme_reads=0)
    assert fetch.per_layer_us(2) == [13.0, 3.0] and fetch.transfer_us == 16.0


def test_rows_fetched_ahead_must_still_fit_in_the_step():
    due = Fetch(link_bytes=0, fixed_us=0.0, rows_us=4.0, nvme_reads=0)  # the decode tokens' rows
    assert step_stall_us(due, due, [1.0, 10.0], 30.0) == 1.0
    ahead = Fetch(link_bytes=0, fixed_us=0.0, rows_us=50.0, nvme_reads=0)  # with prefill rows: 50 > 30
    assert step_stall_us(due, ahead, [1.0, 10.0], 30.0) == 20.0


def test_the_fetch_path_reads_at_its_measured_share_of_the_drives_rate():
    # bench_fetch.py: a Prefetcher over a cold direct table reads 0.76-0.89x of fio's rate
    assert A.nvme_path_efficiency == 0.8
    gpu = one_drive(40_000, 400e6)
    at = {e: fetch_time(V41, gpu, 2, "nvme", 100, 0.5, replace(A, nvme_path_efficiency=e)) for e in (1.0, 0.5)}
    link = 100 * V41.engram.bytes_per_token_per_gpu(2) / (gpu.host_link_bw * A.host_link_efficiency) * 1e6
    assert at[0.5].rows_us - link == pytest.approx(2 * (at[1.0].rows_us - link))  # half the rate: twice the time
    assert at[0.5].nvme_reads == at[1.0].nvme_reads
