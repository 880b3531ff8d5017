"""Host DRAM per machine with ``--dp`` replicas: host copy x (1 if shared else dp) + row
cache x (1 with a row server else dp) + each replica's step buffers x dp."""

from __future__ import annotations

import json

import pytest

from engram_offload.cli import main
from engram_offload.planner.placement import PlacementResult
from engram_offload.planner.ranks import machine_dram


def placement(name: str) -> PlacementResult:
    return PlacementResult(name, tp=2, fits=True, host_bytes_per_gpu=50.0 if name == "dram" else 30.0,
                           cache_bytes_per_gpu=30.0 if name == "nvme" else 0.0, batch=8, bytes_per_token_per_gpu=10)


@pytest.mark.parametrize("name, shared, server, total", [
    # host copy 2 x 50 = 100; buffers 2 steps x 8 tokens x 10 B x 2 GPUs = 320 a replica
    ("dram", True, True, 100 + 4 * 320),
    ("dram", False, True, 4 * 100 + 4 * 320),
    # row cache 2 x 30 = 60
    ("nvme", True, True, 60 + 4 * 320),
    ("nvme", True, False, 4 * 60 + 4 * 320),
    ("remote", False, False, 4 * 320),
    ("hbm", False, False, 0),  # nothing in host DRAM
])
def test_dram_per_machine_follows_the_formula(name, shared, server, total):
    m = machine_dram(placement(name), 4, shared, server)
    assert m.total_bytes == total
    assert (m.dp, m.shared_host_copy, m.row_server) == (4, shared, server)


def test_one_replica_needs_one_of_everything():
    for name in ("dram", "nvme"):
        assert machine_dram(placement(name), 1, False, False).total_bytes == \
            machine_dram(placement(name), 1, True, True).total_bytes


def test_dp_must_be_positive():
    with pytest.raises(ValueError, match="--dp must be >= 1"):
        machine_dram(placement("dram"), 0, True, True)


def plan_json(capsys, *extra):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "h200", "--gpus", "4", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_gives_dram_per_machine_shared_by_default_with_dp(capsys):
    d = plan_json(capsys, "--dp", "4")
    by = {(p["name"], p["tp"]): p for p in d["placements"]}
    assert len(d["dram_per_machine"]) == len(d["placements"])
    for m in d["dram_per_machine"]:
        assert m["dp"] == 4 and m["shared_host_copy"] and m["row_server"]
        p = by[(m["placement"], m["tp"])]
        buffers = 0 if p["name"] == "hbm" else 2 * p["batch"] * p["bytes_per_token_per_gpu"] * p["tp"]
        host = d["table_bytes"] if p["name"] == "dram" else 0
        cache = p["cache_bytes_per_gpu"] * p["tp"] if p["name"] == "nvme" else 0
        assert m["total_bytes"] == pytest.approx(host + cache + 4 * buffers)
    private = plan_json(capsys, "--dp", "4", "--no-shared-host-copy", "--no-row-server")
    for shared, alone in zip(d["dram_per_machine"], private["dram_per_machine"]):
        assert alone["total_bytes"] == pytest.approx(
            shared["total_bytes"] + 3 * (alone["host_copy_bytes"] + alone["cache_bytes"]))
    assert any(m["placement"] == "dram" and m["host_copy_bytes"] > 0 for m in private["dram_per_machine"])


def test_plan_text_prints_dram_per_machine(capsys):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "h200", "--gpus", "4", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "/machine" in out and "DRAM per machine at --dp 2" in out and "(shared)" in out
