"""The planner's host-read schedules: where a step waits for its rows, as the plugin runs it."""

from __future__ import annotations

from dataclasses import replace

from engram_offload.cli import main
from engram_offload.planner import DEFAULT_ASSUMPTIONS, get_gpu, get_model
from engram_offload.planner.placement import Workload, evaluate, evaluate_layered, scheduled

V41 = get_model("deepseek-v4.1-flash")
CPU_WAIT = replace(DEFAULT_ASSUMPTIONS, schedule="cpu-wait")


def test_cpu_wait_moves_a_host_reads_wait_to_the_first_layer_and_adds_the_eager_cost():
    assert DEFAULT_ASSUMPTIONS.schedule == "in-graph"
    assert scheduled([400.0, 5600.0], ("nvme",), DEFAULT_ASSUMPTIONS) == ([400.0, 5600.0], 0.0)
    assert scheduled([400.0, 5600.0], ("dram", "nvme"), CPU_WAIT) == ([400.0, 400.0], CPU_WAIT.eager_us)
    # rows the GPU reads itself (pinned DRAM) never wait on the host: FULL graphs kept
    assert scheduled([400.0, 5600.0], ("dram", "hbm"), CPU_WAIT) == ([400.0, 5600.0], 0.0)


def test_cpu_wait_costs_a_host_read_placement_and_not_a_resident_one():
    gpu, w = get_gpu("b300"), Workload(batch=64, gpus=2)
    for name in ("nvme", "remote"):
        graph, eager = evaluate(V41, gpu, name, 2, w), evaluate(V41, gpu, name, 2, w, CPU_WAIT)
        assert eager.step_us >= graph.step_us + CPU_WAIT.eager_us
        assert eager.predicted_stall_us >= graph.predicted_stall_us
    assert evaluate(V41, gpu, "dram", 2, w, CPU_WAIT).step_us == evaluate(V41, gpu, "dram", 2, w).step_us
    graph = evaluate_layered(V41, gpu, ("dram", "nvme"), 2, w)
    assert evaluate_layered(V41, gpu, ("dram", "nvme"), 2, w, CPU_WAIT).step_us >= graph.step_us + CPU_WAIT.eager_us


def test_plan_says_which_schedule_a_host_read_recommendation_assumes(capsys):
    base = ["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--gpus", "2", "--host-dram", "256G"]
    assert main(base) == 0
    graph = " ".join(capsys.readouterr().out.split())  # one line: the text wraps at 100 columns
    assert "the in-graph schedule" in graph and "not a chunk ahead" in graph
    assert main([*base, "--schedule", "cpu-wait", "--eager-us", "300"]) == 0
    eager = " ".join(capsys.readouterr().out.split())
    assert "the CPU waits for every layer's rows before Engram layer 1" in eager and "300 us a step" in eager
