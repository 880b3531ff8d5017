"""``plan`` told what the server is, cache sizes in front of NVMe, prices, the fetch's largest term, width."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engram_offload.cli import main
from engram_offload.planner import get_model

GiB = 2**30
V41 = ["plan", "--preset", "deepseek-v4.1-flash"]
B300_4 = [*V41, "--gpu", "b300", "--gpus", "4", "--min-interactivity", "20"]
TABLE = get_model("deepseek-v4.1-flash").engram.table_bytes
DATA = Path(__file__).resolve().parents[1] / "data"


def run_json(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def text(capsys) -> str:
    """The printed text with its line wrapping undone."""
    return " ".join(capsys.readouterr().out.split())


def row(d: dict, name: str, tp: int) -> dict:
    return next(p for p in d["placements"] if p["name"] == name and p["tp"] == tp)


def test_server_flags_are_applied_and_said_given(capsys):
    base = run_json(capsys, *B300_4)
    assert base["server"]["host_dram"]["given"] is False and "host_dram" in base["assumed"]
    assert base["server"]["host_dram"]["value"] == pytest.approx(2e12)
    d = run_json(capsys, *B300_4, "--host-dram", "128G", "--nvme-drives", "2", "--nvme-iops", "5e5",
                 "--nvme-bytes-per-s", "3e9", "--nvme-capacity", "3.5T", "--nvme-latency-us", "90", "--pcie", "4",
                 "--host-cores", "8")
    server = d["server"]
    assert server["host_dram"] == {"key": "host_dram", "value": 128 * GiB, "text": "128 GiB", "given": True,
                                   "source": "given: flag"}
    assert server["nvme_drives"]["value"] == 2 and server["nvme_iops"]["value"] == 5e5
    assert server["nvme_capacity"]["value"] == 3.5 * 2**40 and server["pcie"]["text"] == "Gen4 x16"
    assert d["assumed"] == ["gpus_per_server"]
    assert d["gpu"]["host_link"] == "PCIe Gen4 x16"
    # 128 GiB for 8 GPUs: the table's half per GPU at TP=2 no longer fits in DRAM
    assert row(base, "dram", 2)["fits"] and not row(d, "dram", 2)["fits"]
    assert any("host DRAM per GPU" in why for why in row(d, "dram", 2)["why_not"])
    # fewer drives, IOPS and cores, a slower link: every offloaded fetch takes longer
    assert row(d, "nvme", 4)["transfer_us"] > row(base, "nvme", 4)["transfer_us"]
    assert row(d, "remote", 4)["host_us"] > row(base, "remote", 4)["host_us"]  # 8 cores for 8 GPUs' 16 threads


def test_host_cores_share_the_fetch_threads(capsys):
    many = run_json(capsys, *B300_4)
    few = run_json(capsys, *B300_4, "--host-cores", "4")  # 8 GPUs x 2 threads on 4 cores: a quarter each
    assert row(few, "hbm", 4)["fetch_terms"]["host hashing"] == pytest.approx(
        4 * row(many, "hbm", 4)["fetch_terms"]["host hashing"], rel=1e-6)


def test_server_file_then_flags_and_the_pcie_preset(tmp_path, capsys):
    f = tmp_path / "server.json"
    f.write_text(json.dumps({"preset": "pcie", "host_dram": "1T", "nvme_drives": 2}))
    d = run_json(capsys, *B300_4, "--server", str(f), "--nvme-drives", "6")
    s = d["server"]
    assert s["host_dram"]["value"] == 2**40 and s["host_dram"]["source"] == "given: server file"
    assert s["nvme_drives"]["value"] == 6 and s["nvme_drives"]["source"] == "given: flag"
    assert s["host_cores"]["source"] == "assumed: generic PCIe server" and s["host_cores"]["value"] == 64
    pcie = run_json(capsys, *B300_4, "--server", "pcie")
    assert pcie["server"]["nvme_drives"]["value"] == 4 and pcie["server"]["host_dram"]["value"] == 2**40
    f.write_text(json.dumps({"host_ram": "1T"}))
    assert main([*B300_4, "--server", str(f)]) == 1
    assert "unknown server figure(s) host_ram" in capsys.readouterr().err
    assert main([*B300_4, "--server", str(tmp_path / "none.json")]) == 1
    assert "no server file" in capsys.readouterr().err
    assert main([*B300_4, "--host-dram", "lots"]) == 2


def test_text_says_which_figures_were_assumed(capsys):
    assert main([*B300_4, "--host-dram", "1T"]) == 0
    out = text(capsys)
    assert "given: host_dram 1.00 TiB" in out and "assumed: DGX (B300 (HGX) preset)" in out


def test_the_default_target_hit_rate_is_reached_below_the_whole_table(capsys):
    d = run_json(capsys, *B300_4)
    nvme = row(d, "nvme", 2)
    assert nvme["cache_hit_rate"] == pytest.approx(0.9, abs=0.005)
    assert 0.3 * TABLE < nvme["cache_bytes_per_gpu"] * 2 < 0.9 * TABLE
    assert "extrapolated" in d["workload"]["miss_ratio_curve"]
    # a lower target gives a smaller cache, never the 0.0-0.6 GiB of a curve that stops at the trace's reuse
    low = row(run_json(capsys, *B300_4, "--target-hit-rate", "0.7"), "nvme", 2)
    assert 1 * GiB < low["cache_bytes_per_gpu"] * 2 < nvme["cache_bytes_per_gpu"] * 2


def test_cache_bytes_and_the_table_of_cache_sizes(capsys):
    d = run_json(capsys, *B300_4, "--cache-bytes", "100G")
    assert row(d, "nvme", 2)["cache_bytes_per_gpu"] * 2 == pytest.approx(100 * GiB, rel=1e-6)
    sweep = d["cache_sweep"]
    sizes = [s["cache_bytes"] for s in sweep]
    assert sizes == sorted(sizes) and sizes[0] == pytest.approx(16 * GiB, rel=1e-6)
    assert sizes[-1] == pytest.approx(TABLE, rel=1e-6) and any(abs(s - 100 * GiB) < 1e4 for s in sizes)
    hits = [s["hit_rate"] for s in sweep]
    assert hits == sorted(hits) and hits[-1] == 1.0 and all(s["stall_us"] >= 0 for s in sweep)
    assert main([*B300_4, "--cache-bytes", "100G"]) == 0
    out = text(capsys)
    assert "NVMe behind a DRAM row cache of each size" in out and "--cache-bytes" in out
    # a cache larger than the host DRAM its GPUs may use does not fit
    small = run_json(capsys, *B300_4, "--cache-bytes", "100G", "--host-dram", "256G")
    assert not row(small, "nvme", 2)["fits"]


def test_memory_priced_beside_gpu_hours_and_the_dram_verdict(capsys):
    d = run_json(capsys, *B300_4, "--host-dram", "1T")
    dram = next(c for c in d["memory_costs"] if c["placement"] == "dram" and c["tp"] == 2)
    assert dram["dollars"] == pytest.approx(TABLE / GiB * 5.0)
    assert dram["gpu_hours"] == pytest.approx(dram["dollars"] / (2 * 6.0))
    assert "fits in this server's 1,024 GiB of DRAM" in d["dram_verdict"] and "NVMe pays only when DRAM is short" \
        in d["dram_verdict"]
    dear = run_json(capsys, *B300_4, "--host-dram", "1T", "--dram-price", "10", "--nvme-price", "0")
    assert next(c for c in dear["memory_costs"] if c["placement"] == "dram" and c["tp"] == 2)["dollars"] == \
        pytest.approx(2 * dram["dollars"])
    short = run_json(capsys, *B300_4, "--host-dram", "128G")
    assert "does not fit in this server's 128 GiB of DRAM" in short["dram_verdict"]
    assert main([*B300_4, "--host-dram", "1T"]) == 0
    assert "assumed list prices: DRAM $5/GiB, NVMe $120/TB" in text(capsys)


def test_the_recommendation_names_the_fetch_times_largest_term(capsys):
    d = run_json(capsys, *B300_4)
    rec = d["recommendation"]
    assert (rec["placement"], rec["tp"]) == ("dram", 2)
    terms = row(d, "dram", 2)["fetch_terms"]
    assert max(terms, key=terms.get) == "host hashing" and terms["host hashing"] > 0.8 * row(d, "dram", 2)["transfer_us"]
    moves = next(r for r in rec["reasons"] if r.startswith("Each decode step moves"))
    assert f"{terms['host hashing']:,.0f} us of it hashing and deduplicating the step's row ids on one host thread" \
        in moves


def test_the_table_fits_100_columns_and_wide_shows_all(capsys):
    assert main(B300_4) == 0
    narrow = capsys.readouterr().out
    assert max(len(line) for line in narrow.splitlines()) <= 100
    assert main([*B300_4, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "fetch term" in wide and "kIOPS" in wide and "fetch term" not in narrow
    assert max(len(line) for line in wide.splitlines()) > 100


def test_config_expert_precision_is_refused_without_experts_and_applied_with_a_share(capsys):
    args = ["plan", "--config", str(DATA / "deepseek-v4.1-flash-config.json"), "--gpu", "b300",
            "--total-params", "552e9", "--active-params", "16e9", "--kv-bytes-per-token", "1736",
            "--expert-precision", "fp4"]
    assert main(args) == 1
    assert "names no routed experts" in capsys.readouterr().err
    d = run_json(capsys, *args, "--routed-fraction", "0.985")
    assert d["model"]["weight_bytes"] / GiB == pytest.approx(278, abs=1.5)
    assert d["model"]["name"] == "deepseek-v4.1-flash-config (DeepseekV41ForCausalLM)"


def test_config_json_in_a_checkpoint_folder_is_named_after_the_folder_or_its_name(tmp_path, capsys):
    cfg = json.loads((DATA / "deepseek-v4.1-flash-config.json").read_text())
    folder = tmp_path / "DeepSeek-V4.1-Flash"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    args = ["plan", "--config", str(folder), "--gpu", "b300", "--total-params", "552e9", "--active-params", "16e9",
            "--kv-bytes-per-token", "1736"]
    assert run_json(capsys, *args)["model"]["name"] == "DeepSeek-V4.1-Flash (DeepseekV41ForCausalLM)"
    (folder / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "deepseek-ai/DeepSeek-V4.1-Flash"}))
    assert run_json(capsys, *args)["model"]["name"] == "DeepSeek-V4.1-Flash"


def test_the_documented_example_is_the_commands_real_output(capsys):
    guide = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    block = guide.split("## An example", 1)[1].split("```console\n", 1)[1].split("\n```", 1)[0]
    command, shown = block.split("\n", 1)
    assert command.startswith("$ engram-offload plan ") and "--host-dram 1T" in command
    assert main(command.split()[2:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown
