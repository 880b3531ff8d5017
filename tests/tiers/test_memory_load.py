"""Where the resident tiers load their rows: ordinary private memory (not shmem), with
transparent huge pages asked for only with ``huge_pages=True``."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engram_offload.table import read_header
from engram_offload.tiers import open_tier

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")


def vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of this process's mapping holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header line: "start-end perms ..."
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.parametrize("tier", ["memory", "pinned"])
@pytest.mark.parametrize("huge_pages", [None, True, False])
@pytest.mark.filterwarnings("ignore:pinned tier. CUDA is not available")
def test_rows_load_into_private_memory_with_huge_pages_as_asked(tables, tier, huge_pages):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    options = {} if huge_pages is None else {"huge_pages": huge_pages}
    with open_tier(tier, read_header(path), **options) as t:
        flags = vm_flags(t.rows.data_ptr())
        assert "sh" not in flags  # a shared anonymous mapping is shmem: no huge pages, dearer faults
        assert ("hg" in flags) == t.stats()["huge_pages"]  # MADV_HUGEPAGE asked for and accepted
        if not huge_pages:  # 4 KiB pages by default
            assert t.stats()["huge_pages"] is False
        np.testing.assert_array_equal(t.rows.numpy(), expected)
