"""Free memory and disk checks of ``machine``, against the real /proc/meminfo and statvfs."""

from __future__ import annotations

import os

import pytest

from engram_offload.machine import (
    NotEnoughResources,
    available_memory_bytes,
    check_free_disk,
    check_free_memory,
    free_disk_bytes,
)


def test_available_memory_is_meminfo():
    fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    expected = int(fields["MemAvailable"].split()[0]) * 1024
    got = available_memory_bytes()
    assert got is not None and 0 < got
    assert abs(got - expected) < max(expected // 10, 64 << 20)  # memory moves between the two reads


def test_free_disk_is_statvfs(tmp_path):
    st = os.statvfs(tmp_path)
    assert abs(free_disk_bytes(tmp_path) - st.f_bavail * st.f_frsize) < 256 << 20
    # a path not yet created is measured on its nearest existing parent
    assert abs(free_disk_bytes(tmp_path / "not" / "yet" / "t.tbl") - free_disk_bytes(tmp_path)) < 256 << 20


def test_check_free_disk_refuses_more_than_is_free(tmp_path):
    free = free_disk_bytes(tmp_path)
    assert check_free_disk(tmp_path, 4096, "a small table") >= 4096
    with pytest.raises(NotEnoughResources) as exc:
        check_free_disk(tmp_path, free + (1 << 40), "make-table of t.tbl")
    message = str(exc.value)
    assert "make-table of t.tbl needs" in message and "is free" in message and "--force" in message
    assert "\n" not in message
    assert check_free_disk(tmp_path, free + (1 << 40), "t", force=True) == pytest.approx(free, abs=256 << 20)


def test_check_free_memory_refuses_more_than_is_available():
    available = available_memory_bytes()
    assert check_free_memory(1 << 20, "a tiny table") is not None
    with pytest.raises(NotEnoughResources, match=r"the memory tier needs .* of memory, only .* is available.*--insist"):
        check_free_memory(available + (1 << 40), "the memory tier", flag="--insist")
    assert check_free_memory(available + (1 << 40), "the memory tier", force=True) is not None


def test_the_machine_facts_name_the_cpu_and_its_flags():
    from pathlib import Path

    from engram_offload.machine import CPU_FLAGS, machine_facts

    facts = machine_facts()
    assert facts["cpu"] and set(facts["cpu_flags"]) <= set(CPU_FLAGS)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), [])
        assert facts["cpu_flags"] == [f for f in CPU_FLAGS if f in flags]


def test_the_machine_facts_tell_cpu_generations_apart(monkeypatch, tmp_path):
    """A VM's model name may be only "AMD EPYC": the family, model and stepping of the first
    CPU tell Zen 3 from Zen 4; None where /proc/cpuinfo says nothing of them."""
    from pathlib import Path

    from engram_offload import machine

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\nstepping\t: 0\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    real_path = Path

    def fake_path(p, *a):
        return cpuinfo if str(p) == "/proc/cpuinfo" else real_path(p, *a)

    monkeypatch.setattr(machine, "Path", fake_path)
    assert machine._cpu_id() == "family 25 model 17 stepping 0"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some ARM core\n")
    assert machine._cpu_id() is None
    cpuinfo.unlink()
    assert machine._cpu_id() is None
    monkeypatch.undo()
    assert "cpu_id" in machine.machine_facts()
