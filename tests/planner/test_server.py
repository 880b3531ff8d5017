"""The server around the GPUs: presets, a file, flags, and where every figure came from."""

from __future__ import annotations

import json

import pytest

from engram_offload.planner import get_gpu
from engram_offload.planner.hardware import PCIE_GEN5_X16
from engram_offload.planner.server import SERVER_KEYS, load_server_file, server_for


def test_the_reference_server_changes_nothing_and_is_all_assumed():
    for name in ("h100", "b300", "gb200", "mi355x"):
        gpu = get_gpu(name)
        out, figures = server_for(gpu)
        assert out == gpu
        assert [f.key for f in figures] == list(SERVER_KEYS) and not any(f.given for f in figures)
        assert all(f.source.startswith("assumed: ") and gpu.name in f.source for f in figures)


def test_a_grace_tray_given_a_pcie_generation_gets_a_pcie_link():
    gb200 = get_gpu("gb200")
    _, figures = server_for(gb200)
    assert next(f for f in figures if f.key == "pcie").text == "not PCIe"
    out, _ = server_for(gb200, given={"pcie": 4})
    assert out.host_link == "PCIe Gen4 x16" and out.host_link_bw == PCIE_GEN5_X16 / 2


def test_flags_override_the_file_which_overrides_the_preset():
    b300 = get_gpu("b300")
    out, figures = server_for(b300, "dgx", {"preset": "pcie", "host_dram": "512G", "host_cores": 32},
                              {"host_cores": 96, "nvme_iops": None})
    by = {f.key: f for f in figures}
    assert out.host_dram_per_gpu == 512 * 2**30 / 8 and by["host_dram"].source == "given: server file"
    assert out.host_cores == 96 and by["host_cores"].source == "given: flag"
    assert by["nvme_iops"].source == "assumed: generic PCIe server" and out.nvme_drives == 4
    assert out.server == "generic PCIe server" and out.hbm_bytes == b300.hbm_bytes  # the GPU itself is kept


@pytest.mark.parametrize("figures, message", [
    ({"gpus_per_server": 0}, "whole number >= 1"), ({"pcie": 3}, "PCIe generation"),
    ({"host_dram": "lots"}, "not understood"), ({"nvme_iops": -1}, "finite number >= 0"),
    ({"host_dram": 0}, "must be > 0"),
])
def test_bad_figures_say_what_is_wrong(figures, message):
    with pytest.raises(ValueError, match=message):
        server_for(get_gpu("b300"), file=figures)
    with pytest.raises(ValueError, match="unknown server preset"):
        server_for(get_gpu("b300"), "hgx")


def test_a_server_file_must_be_one_object_of_known_figures(tmp_path):
    f = tmp_path / "s.json"
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="one JSON object"):
        load_server_file(f)
    f.write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_server_file(f)
    f.write_text(json.dumps({"preset": "pcie", "host_dram": "1T"}))
    assert load_server_file(f) == {"preset": "pcie", "host_dram": "1T"}
