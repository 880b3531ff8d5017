"""The memory cgroup that caps the mmap baseline's page cache (where the machine allows one)."""

from __future__ import annotations

import os

import pytest

from engram_offload.bench.memcap import MemoryCap


def test_a_cap_holds_the_page_cache_to_its_budget(tmp_path):
    cap, how = MemoryCap.create(512 << 20, name=f"engram-offload-test-{os.getpid()}")
    if cap is None:
        pytest.skip(how)
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(48 << 20))
    pid = os.fork()
    if pid == 0:  # the child joins the group, holds 16 MiB of page cache at most, reads 48 MiB
        code = 1
        try:
            cap.join()
            cap.set_limit(cap.charged()["anon"] + (16 << 20))
            with open(data, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                while f.read(1 << 20):
                    pass
            code = 0 if cap.charged()["file"] <= (17 << 20) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.WEXITSTATUS(status) == 0, "the page cache outgrew the cap"
    finally:
        cap.remove()
    assert not cap.path.exists()
