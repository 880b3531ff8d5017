"""Damaged table files against ``verify`` and every tier: refused, or the right rows.

Every case runs in a sandbox process with a time bound, so a hang or a crash fails the test.
The tables: fp8 rows packed 62 a page and wide rows one a page. What is asserted:

- a header or trailer that is damaged, a header whose fields are nonsense (even under a
  valid checksum), a truncated or extended file: refused at open with ``TableFormatError``
  (for a header whose change is harmless, such as its ``name``: the right rows);
- flipped data bytes (rows or a page's padding): ALWAYS refused with ``ChecksumError``, by
  ``verify`` and by every tier with its default options (direct and mmap check every page
  they read, memory and pinned every page they load);
- flipped bytes in the zero padding after the header JSON: nothing reads them, every
  reader returns the reference rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fuzz.read_everywhere import TARGETS, read_everywhere, warm_up
from fuzz.sandbox import Sandbox
from fuzz.table_damage import header_meta, rewrite_header, rows_on_disk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_offload.table import make_random_table, read_header
from engram_offload.table.format import PREFIX

from tiny_tables import tiny_config

CASE_SECONDS = 60  # two shared cores; a healthy case takes well under a second
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(timeout=CASE_SECONDS)
    box.run(warm_up, case="warm-up")
    yield box
    box.close()


class Table(SimpleNamespace):
    """A reference table: path, bytes, layout, rows, and the path its damaged copies go to."""

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing case
        return f"<table {self.path.name}>"


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Table]:
    """66-byte fp8 rows packed 62 a page, and 4400-byte rows one a page."""
    d = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name, config in (("fp8", tiny_config()), ("wide", tiny_config("fp32", 1100, starts=(20, 30)))):
        path = make_random_table(d / f"{name}.tbl", config, seed=1)
        layout = read_header(path).layout
        out[name] = Table(path=path, bytes=path.read_bytes(), layout=layout,
                          rows=rows_on_disk(path, layout), case=d / f"{name}.case.tbl")
    return out


def check(outcomes: dict, expect: dict[str, object], case: str) -> None:
    """``expect``: target -> ``"refused"``, ``"TableFormatError"``/``"ChecksumError"`` (refused
    with that), or an array of the rows it must return (or ``("rows or refused", rows)``)."""
    for target, (kind, value) in outcomes.items():
        want = expect[target]
        where = f"{case}: {target} gave {kind} {value if kind != 'rows' else ''}"
        assert kind != "error", where
        if isinstance(want, str):
            assert kind == "refused" and (want == "refused" or value.startswith(want + ":")), where
            continue
        either = isinstance(want, tuple)
        rows = want[1] if either else want
        if kind == "refused":
            assert either, where
        elif kind == "ok":
            assert target == "verify", where
        else:
            assert np.array_equal(value, rows), f"{case}: {target} returned WRONG ROWS"


def _json_values():
    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.sampled_from([0, -1, 1, 2, 4095, 4096, 4097, 8192, 2**31, 2**32, 2**63, 10**7])
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def header_changes(draw, meta: dict) -> tuple[str, object]:
    """A (field, new value) for a header: any field (top level or config, or a new one), any
    JSON value, often one near the field's own value; ``...`` deletes the field."""
    keys = [k for k in meta] + [f"config.{k}" for k in meta["config"]] + ["extra", "config.extra"]
    key = draw(st.sampled_from(sorted(keys)))
    old = meta["config"].get(key[7:]) if key.startswith("config.") else meta.get(key)
    near = []
    if isinstance(old, int) and not isinstance(old, bool):
        near = [old + 1, old - 1, old * 2, -old, old // 2, 0]
    elif isinstance(old, list) and old and isinstance(old[0], int):
        near = [old[:-1], old + old[-1:], [v + 1 for v in old], [0] * len(old), list(reversed(old))]
    odd = st.sampled_from([0, -1, 1, 2**31, 2**63, 10**7, 2.0, 0.5, "8", None, True, [], {}, math.nan, math.inf, ...])
    choices = [odd, _json_values()] + ([st.sampled_from(near)] if near else [])
    return key, draw(st.one_of(choices))


KNOWN_BAD_HEADERS = [  # each once divided by zero, hung, or raised something else
    ("config.n_heads", 10_000_000), ("config.n_heads", 2**69), ("config.n_heads", 2.0),
    ("config.head_dim", 2.5), ("config.layer_ids", "13"), ("config.prime_starts", [2.5, 500]),
    ("config.max_ngram_size", 10**9), ("config.seed", -1), ("config.rms_norm_eps", float("nan")),
    ("config", None), ("config", ...), ("data_offset", 0), ("checksum", "md5"),
]


def run_header_case(sandbox: Sandbox, table: Table, key: str, value: object) -> None:
    """Set (``...``: delete) one header field, keep the checksum valid, read everywhere."""
    meta = header_meta(table.path)
    target = meta["config"] if key.startswith("config.") else meta
    field = key[7:] if key.startswith("config.") else key
    if value is ...:
        target.pop(field, None)
    else:
        target[field] = value
    rewrite_header(table.path, table.case, meta)
    case = f"header {key}={value!r}"
    outcomes = sandbox.run(read_everywhere, str(table.case), case=case)
    check(outcomes, {t: ("rows or refused", table.rows) for t in TARGETS}, case)
    if any(kind == "refused" for kind, _ in outcomes.values()):  # refused by one, refused by all at open
        assert all(kind == "refused" and v.startswith("TableFormatError") for kind, v in outcomes.values()), case


@pytest.mark.parametrize("key,value", KNOWN_BAD_HEADERS)
def test_known_bad_headers(sandbox, tables, key, value):
    run_header_case(sandbox, tables["fp8"], key, value)


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_fuzzed_headers_with_valid_checksums(sandbox, tables, data):
    table = tables[data.draw(st.sampled_from(sorted(tables)), label="table")]
    key, value = data.draw(header_changes(header_meta(table.path)), label="change")
    run_header_case(sandbox, table, key, value)


def _region(layout, offset: int, json_end: int) -> str:
    if offset < json_end:
        return "header"
    if offset < layout.data_offset:
        return "padding"
    if offset < layout.trailer_offset:
        return "data"
    return "trailer"


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_flipped_bytes(sandbox, tables, data):
    table = tables[data.draw(st.sampled_from(sorted(tables)), label="table")]
    layout, original = table.layout, table.bytes
    size = len(original)
    json_end = PREFIX.size + PREFIX.unpack(original[:PREFIX.size])[2]
    # offsets: anywhere, or aimed at each region (the data region dominates a uniform pick)
    region_offset = st.one_of(st.integers(0, size - 1), st.integers(0, layout.data_offset - 1),
                              st.integers(layout.data_offset, layout.trailer_offset - 1),
                              st.integers(layout.trailer_offset, size - 1))
    flips = data.draw(st.dictionaries(region_offset, st.integers(1, 255), min_size=1, max_size=4), label="flips")
    damaged = bytearray(original)
    for offset, mask in flips.items():
        damaged[offset] ^= mask
    Path(table.case).write_bytes(bytes(damaged))
    regions = {_region(layout, offset, json_end) for offset in flips}
    case = f"flips {flips} in {sorted(regions)}"
    outcomes = sandbox.run(read_everywhere, str(table.case), case=case)
    if regions & {"header", "trailer"}:
        expect = {t: "TableFormatError" for t in TARGETS}
    elif "data" in regions:
        expect = {t: "ChecksumError" for t in TARGETS}
    else:
        expect = {t: table.rows for t in TARGETS}
    check(outcomes, expect, case)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_truncated_and_extended_files(sandbox, tables, data):
    table = tables[data.draw(st.sampled_from(sorted(tables)), label="table")]
    original = table.bytes
    size = len(original)
    new_size = data.draw(st.integers(0, size - 1) | st.integers(size + 1, size + 3 * 4096)
                         | st.sampled_from([size - 1, size - 8, table.layout.trailer_offset,
                                            table.layout.data_offset, PREFIX.size, 0]), label="size")
    Path(table.case).write_bytes(original[:new_size] + bytes(max(0, new_size - size)))
    case = f"file of {new_size} bytes instead of {size}"
    outcomes = sandbox.run(read_everywhere, str(table.case), case=case)
    check(outcomes, {t: "TableFormatError" for t in TARGETS}, case)


def test_the_sandbox_reports_a_crash_and_a_hang():
    """The harness itself: a dying or hanging case fails the test instead of stopping it."""
    box = Sandbox(timeout=5)
    assert box.run(math.factorial, 5) == 120  # the first call starts the worker
    with pytest.raises(pytest.fail.Exception, match="sleep: still running after 5 s"):
        box.run(_sleep, 120, case="sleep")
    with pytest.raises(pytest.fail.Exception, match="abort: the reading process died"):
        box.run(_abort, case="abort")
    assert box.run(math.factorial, 6) == 720  # a fresh worker after each
    box.close()


def _abort() -> None:
    import os

    os.abort()


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)
