"""Every tier returns exactly the table's rows: formats, duplicates, edges, threads, bad ids."""

from __future__ import annotations

import ctypes
import shutil
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_offload.bench.cold import evict_file_pages
from engram_offload.table import read_header
from engram_offload.tiers import TIERS, as_row_ids, get_tier_class, is_resident, open_tier, tier_names
from engram_offload.tiers.mmap import guarded_copy_available

from tier_cases import FORMATS, TIER_CASES, read, skip_unavailable

CASE_IDS = [f"{t}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for t, o in TIER_CASES]


def opened(tier, options, path):
    skip_unavailable(tier, options, path.parent)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pinned without CUDA
        return open_tier(tier, read_header(path), **options)


@pytest.mark.parametrize("tier,options", TIER_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=[f"{f}-{d}" for f, d in FORMATS])
def test_every_row_of_every_format(tables, tier, options, fmt):
    path, expected = tables[fmt]
    with opened(tier, options, path) as t:
        n = t.num_rows
        ids = np.concatenate([np.arange(n), [0, n - 1, n - 1, 0], np.arange(n)[::-7]])
        np.testing.assert_array_equal(read(t, ids), expected[ids])
        assert len(read(t, [])) == 0


@pytest.fixture
def fp8_tier(request, tables):
    """The fp8 table opened on the tier case ``request.param``, and its rows; one per test."""
    tier, options = request.param
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    with opened(tier, options, path) as t:
        yield t, expected


@pytest.mark.parametrize("fp8_tier", TIER_CASES, ids=CASE_IDS, indirect=True)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_with_duplicates_match_memory(fp8_tier, data):
    t, expected = fp8_tier  # one open tier serves every example, as a store would
    n = len(expected)
    ids = data.draw(st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from([0, 1, n - 2, n - 1])),
                             min_size=1, max_size=300))
    ids += data.draw(st.lists(st.sampled_from(ids), max_size=50))  # duplicates
    np.testing.assert_array_equal(read(t, ids), expected[ids])


@pytest.mark.parametrize("tier,options", TIER_CASES, ids=CASE_IDS)
def test_threads_gathering_at_once(tables, tier, options):
    path, expected = tables[("bf16", 80)]
    with opened(tier, options, path) as t:
        barrier, failures = threading.Barrier(6), []

        def worker(seed):
            rng = np.random.default_rng(seed)
            barrier.wait()
            for _ in range(20):
                ids = rng.integers(0, t.num_rows, int(rng.integers(1, 400)))
                got = read(t, ids)
                if not np.array_equal(got, expected[ids]):
                    failures.append(seed)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert failures == []
        assert t.stats()["requests"] == 120


@pytest.mark.parametrize("tier,options", TIER_CASES, ids=CASE_IDS)
def test_out_of_range_ids_raise_index_error(tables, tier, options):
    path, _ = tables[("fp8_e4m3_ue8m0", 64)]
    with opened(tier, options, path) as t:
        n = t.num_rows
        for bad in (-1, n, n + 1000):
            with pytest.raises(IndexError, match=rf"row id {bad} \(at position 2\)"):
                read(t, [0, 1, bad, 3])
        with pytest.raises(ValueError, match="out must be uint8"):
            t.read_rows(np.zeros(3, np.int64), torch.empty((2, t.row_bytes), dtype=torch.uint8))
    with pytest.raises(ValueError, match="closed"):
        read(t, [0])


def test_registry_is_lazy_and_complete():
    assert tier_names() == tuple(TIERS) == ("memory", "pinned", "mmap", "direct", "shared", "remote")
    assert [name for name in tier_names() if is_resident(name)] == ["memory", "pinned", "shared"]
    for name in tier_names():
        assert get_tier_class(name).name == name
    with pytest.raises(ValueError, match="unknown tier 'nvme'.*memory"):
        get_tier_class("nvme")
    with pytest.raises(ValueError, match="unknown tier 'nvme'"):
        is_resident("nvme")


@pytest.mark.parametrize("sorted_distinct", [True, False])
def test_row_ids_one_past_the_end_are_refused(sorted_distinct):
    n = 100
    for ids in ([3, 50, n], [n], [0, n - 1, n]):
        with pytest.raises(IndexError, match=rf"row id {n} \(at position {len(ids) - 1}\)"):
            as_row_ids(ids, n, sorted_distinct=sorted_distinct)
    with pytest.raises(IndexError, match=rf"row id {n} \(at position 0\)"):  # unsorted: the full check
        as_row_ids([n, 3], n)
    with pytest.raises(IndexError, match=r"row id -1"):
        as_row_ids([-1, 5], n, sorted_distinct=sorted_distinct)
    assert as_row_ids([0, n - 1], n, sorted_distinct=sorted_distinct).tolist() == [0, n - 1]


def mapping_flags(path) -> list[list[str]]:
    """``VmFlags`` of this process's mappings of ``path`` (from /proc/self/smaps)."""
    flags, current = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = len(fields) >= 6 and fields[5] == str(path)
            elif current and line.startswith("VmFlags:"):
                flags.append(fields[1:])
    return flags


def test_mmap_advises_random_access(tables):
    path, _ = tables[("fp32", 64)]
    with open_tier("mmap", read_header(path)) as t:
        assert t.stats()["madv_random"] is True
        flags = mapping_flags(path)
        assert flags and all("rr" in f for f in flags)  # the kernel's mark of MADV_RANDOM


def test_mmap_counts_its_page_faults_as_drive_reads(tables, tmp_path):
    """Cold pages fault (drive reads); the same pages again are the page cache's (no fault)."""
    if not guarded_copy_available():
        pytest.skip("the pread fallback takes no page faults")
    src, _ = tables[("fp32", 64)]
    path = tmp_path / "cold.tbl"
    shutil.copyfile(src, path)
    evict_file_pages(path)
    with open_tier("mmap", read_header(path)) as t:
        per_page = t.layout.rows_per_page
        ids = np.arange(0, t.num_rows, per_page, dtype=np.int64)[:8]  # one row in each of 8 pages
        t.read_rows(ids, torch.empty((len(ids), t.row_bytes), dtype=torch.uint8))
        first = t.stats()
        assert first["pages_touched"] == len(ids)
        if first["page_faults"] == 0:
            pytest.skip(f"{tmp_path} keeps its pages in memory (tmpfs?): no drive reads to count")
        assert first["page_faults"] <= len(ids)
        t.read_rows(ids, torch.empty((len(ids), t.row_bytes), dtype=torch.uint8))
        again = t.stats()
        assert again["pages_touched"] == 2 * len(ids) and again["page_faults"] == first["page_faults"]


def test_mmap_through_pread_reports_no_page_faults(tables, monkeypatch):
    """The fallback reads with pread: no faults to count, so no page-cache figures at all."""
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    path, expected = tables[("fp32", 64)]
    with open_tier("mmap", read_header(path)) as t:
        ids = np.array([0, 3, t.num_rows - 1], np.int64)
        out = t.read_rows(ids, torch.empty((len(ids), t.row_bytes), dtype=torch.uint8))
        np.testing.assert_array_equal(out.numpy(), expected[ids])
        assert "page_faults" not in t.stats() and "pages_touched" not in t.stats()


def test_pinned_without_cuda_says_so(tables):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    path, _ = tables[("fp32", 64)]
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        t = open_tier("pinned", read_header(path))
    with t:
        assert t.stats()["pinned"] is False


@pytest.mark.gpu
def test_pinned_gathers_to_the_gpu(tables):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, expected = tables[("fp32", 64)]
    with open_tier("pinned", read_header(path)) as t:
        assert t.stats()["pinned"] is True and t.rows.is_pinned()
        mapping = t._mm  # registered in place: the rows are still the loaded mapping, no pinned copy
        assert mapping is not None
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        assert base <= t.rows.data_ptr() < base + len(mapping)
        ids = np.array([5, 0, 5, t.num_rows - 1], np.int64)
        out = torch.empty((4, t.row_bytes), dtype=torch.uint8, device="cuda")
        t.read_rows(ids, out)
        np.testing.assert_array_equal(out.cpu().numpy(), expected[ids])


def test_memory_tier_uses_dense_rows(tables):
    path, expected = tables[("int8", 64)]
    with open_tier("memory", read_header(path)) as t:
        assert t.rows.shape == expected.shape and t.rows.is_contiguous()
        np.testing.assert_array_equal(t.rows.numpy(), expected)


@pytest.mark.parametrize("name", ["memory", "mmap", "direct"])
def test_reversed_and_strided_id_views_read_like_their_copies(tables, name):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    ids = np.arange(len(expected))[::-3]  # a negative-stride view
    with open_tier(name, read_header(path)) as t:
        np.testing.assert_array_equal(read(t, ids), expected[ids.copy()])
