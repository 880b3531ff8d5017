"""Table format: layout, round trips, streaming writes, atomicity, damaged files."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from fuzz.table_damage import deadline, header_meta, rewrite_header
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_offload.engram.rows import decode_rows, encode_rows
from engram_offload.errors import ChecksumError, TableFormatError
from engram_offload.table import (
    TableLayout,
    TableWriter,
    make_random_table,
    random_rows,
    read_header,
    verify_table,
    write_table,
)
from engram_offload.table.format import FORMAT_VERSION, MAGIC, PAGE_BYTES, PREFIX, SECTOR_BYTES
from engram_offload.table.writer import boot_id, clean_temp_files, dead_temp_files


def raw_rows_of(config, seed=0) -> np.ndarray:
    return np.concatenate(list(random_rows(config, seed)))  # [num_rows, row_bytes]


def read_all_rows(path) -> np.ndarray:
    header = read_header(path)
    layout = header.layout
    data = np.fromfile(path, np.uint8)
    ids = np.arange(layout.num_rows)
    offs = layout.row_offsets(ids)
    return data[offs[:, None] + np.arange(layout.row_bytes)]


@pytest.mark.parametrize("fmt,head_dim", [("fp8_e4m3_ue8m0", 64), ("fp32", 64), ("bf16", 80),
                                          ("fp16", 48), ("int8", 64), ("fp32", 1100)])
def test_layout_rows_never_straddle_a_page(fmt, head_dim, tiny_config):
    config = tiny_config(fmt, head_dim)
    layout = TableLayout.for_config(config)
    offs = layout.row_offsets(np.arange(config.num_rows))
    rb = config.row_bytes
    assert layout.data_offset % PAGE_BYTES == 0
    if rb <= PAGE_BYTES:
        assert layout.rows_per_page == PAGE_BYTES // rb
        assert np.all((offs % PAGE_BYTES) + rb <= PAGE_BYTES)
        # one direct read: the sector span holding a row stays inside its page
        span_end = (offs + rb + SECTOR_BYTES - 1) // SECTOR_BYTES * SECTOR_BYTES
        assert np.all((span_end - 1) // PAGE_BYTES == offs // PAGE_BYTES)
    else:
        assert layout.rows_per_page == 1 and np.all(offs % PAGE_BYTES == 0)
    assert len(np.unique(offs)) == config.num_rows


def test_v41_row_packing_is_dense(tiny_config):
    config = tiny_config("fp8_e4m3_ue8m0", 256)  # 264-byte rows, as DeepSeek-V4.1
    layout = TableLayout.for_config(config)
    assert config.row_bytes == 264 and layout.rows_per_page == 15 and layout.page_bytes == 4096


@pytest.mark.parametrize("fmt,head_dim", [("fp8_e4m3_ue8m0", 64), ("bf16", 80), ("fp32", 1100), ("int8", 64)])
def test_round_trip_raw_rows(tmp_path, fmt, head_dim, tiny_config):
    config = tiny_config(fmt, head_dim)
    raw = raw_rows_of(config)
    path = write_table(tmp_path / "t.tbl", config, torch.from_numpy(raw))
    header = read_header(path)
    assert header.config == config
    assert os.path.getsize(path) == header.layout.file_bytes
    np.testing.assert_array_equal(read_all_rows(path), raw)
    verify_table(path)


def test_float_rows_are_encoded(tmp_path, tiny_config):
    config = tiny_config("bf16", 80)
    x = torch.randn(config.num_rows, 80)
    path = write_table(tmp_path / "t.tbl", config, x)
    got = torch.from_numpy(read_all_rows(path))
    assert torch.equal(got, encode_rows(x, "bf16"))
    assert torch.equal(decode_rows(got, "bf16", 80), x.to(torch.bfloat16).float())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 900), min_size=1, max_size=12))
def test_chunked_writes_match_one_write(tmp_path_factory, sizes, tiny_config):
    config = tiny_config()
    raw = raw_rows_of(config, seed=3)
    bounds = np.cumsum([0] + sizes)
    bounds = np.unique(np.clip(np.append(bounds, config.num_rows), 0, config.num_rows))
    chunks = [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    d = tmp_path_factory.mktemp("chunks")
    one = write_table(d / "one.tbl", config, raw)
    many = write_table(d / "many.tbl", config, iter(chunks))
    np.testing.assert_array_equal(read_all_rows(many), read_all_rows(one))
    assert read_header(many).fingerprint() == read_header(one).fingerprint()  # the same rows, the same table


def test_wrong_row_count_leaves_no_file(tmp_path, config):
    raw = raw_rows_of(config)
    with pytest.raises(ValueError, match="needs .* rows"):
        write_table(tmp_path / "t.tbl", config, raw[:-1])
    with pytest.raises(ValueError, match="too many rows"):
        write_table(tmp_path / "t.tbl", config, iter([raw, raw[:1]]))
    with pytest.raises(ValueError, match=r"\[n, 66\]"):
        write_table(tmp_path / "t.tbl", config, raw[:, :-1])
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic(tmp_path, config):
    path = make_random_table(tmp_path / "t.tbl", config, seed=1)
    before = path.read_bytes()

    def failing():
        yield raw_rows_of(config)[:100]
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError):
        write_table(path, config, failing())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.tbl"]
    with TableWriter(path, config) as w:  # the old file stays until close() renames
        w.write(raw_rows_of(config, seed=2))
        assert path.read_bytes() == before
    assert path.read_bytes() != before


def test_seeded_tables_are_reproducible(tmp_path, config):
    a = make_random_table(tmp_path / "a.tbl", config, seed=5).read_bytes()
    b = make_random_table(tmp_path / "b.tbl", config, seed=5).read_bytes()
    c = make_random_table(tmp_path / "c.tbl", config, seed=6).read_bytes()
    assert a == b and a != c


@pytest.mark.parametrize("fmt,head_dim", [("fp8_e4m3_ue8m0", 64), ("fp32", 64), ("bf16", 80),
                                          ("fp16", 48), ("int8", 64)])
def test_random_rows_are_finite(fmt, head_dim, tiny_config):
    config = tiny_config(fmt, head_dim)
    rows = decode_rows(torch.from_numpy(raw_rows_of(config)), fmt, head_dim)
    assert torch.isfinite(rows).all() and rows.abs().max() > 0


# ---------------------------------------------------------------- damaged and foreign files
@pytest.fixture
def table(tmp_path, config):
    return make_random_table(tmp_path / "t.tbl", config, seed=0)


def test_truncated_file_fails_at_open(table):
    size = os.path.getsize(table)
    for keep in (size - 1, size // 2, 100, 10, 0):
        with open(table, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(TableFormatError, match="truncated|too short"):
            read_header(table)


def test_foreign_file_fails_at_open(tmp_path):
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(struct.pack("<Q", 2) + b"{}" + bytes(5000))
    with pytest.raises(TableFormatError, match="not an engram-offload table"):
        read_header(foreign)


def test_other_version_fails_at_open(table):
    with open(table, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(TableFormatError, match="version 99"):
        read_header(table)


def test_damaged_header_and_trailer_fail_at_open(table, tmp_path):
    data = bytearray(table.read_bytes())
    header = bytearray(data)
    header[40] ^= 0xFF
    (tmp_path / "h.tbl").write_bytes(bytes(header))
    with pytest.raises(TableFormatError, match="header does not match"):
        read_header(tmp_path / "h.tbl")
    trailer = bytearray(data)
    trailer[-12] ^= 0x01
    (tmp_path / "tr.tbl").write_bytes(bytes(trailer))
    with pytest.raises(TableFormatError, match="trailer"):
        read_header(tmp_path / "tr.tbl")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no table file"):
        read_header(tmp_path / "nope.tbl")


def test_flipped_byte_fails_verify_naming_the_page(table):
    header = read_header(table)
    layout = header.layout
    page = layout.num_pages // 2
    start = layout.data_offset + page * layout.page_bytes
    with open(table, "r+b") as f:
        f.seek(start + 1234)
        byte = f.read(1)
        f.seek(start + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    first, last = layout.page_rows(page)
    with pytest.raises(ChecksumError, match=rf"data page {page} \(rows {first:,}\.\.{last:,}\)"):
        verify_table(table)


def test_header_is_json_with_the_layout(table):
    data = table.read_bytes()
    (length,) = struct.unpack("<I", data[12:16])
    meta = json.loads(data[24:24 + length])
    assert meta["magic"] == "engram-offload-table" and meta["version"] == 3
    assert meta["data_offset"] % 4096 == 0 and meta["checksum"] == "xxh3_64"
    assert meta["page_checksum"] == "xxh3_64_low32" and meta["page_checksums_offset"] == meta["trailer_offset"]
    assert meta["config"]["row_format"] == "fp8_e4m3_ue8m0"
    assert set(meta) >= {"layer_ids", "head_sizes", "row_bytes", "stride", "trailer_offset"}


# ---------------------------------------------------------------- headers with a valid checksum
@pytest.mark.parametrize("key,value", [
    ("data_offset", 8192), ("data_offset", 0), ("num_rows", 5), ("data_bytes", 0), ("file_bytes", 2.0),
    ("head_sizes", {}), ("checksum", "md5"), ("version", 2), ("version", 4), ("magic", "x"),
    ("page_checksum", "crc32c"), ("page_checksums_offset", 0),
    ("config.n_heads", 10_000_000), ("config.n_heads", 0), ("config.n_heads", 2.0),
    ("config.head_dim", 0), ("config.head_dim", -64), ("config.layer_ids", []),
    ("config.layer_ids", "13"), ("config.layer_ids", [1, 1]), ("config.prime_starts", [-5, 3]),
    ("config.prime_starts", [2**80, 500]), ("config.prime_starts", [300]),
    ("config.max_ngram_size", 10**9), ("config.row_format", "fp64"), ("config.row_format", 7),
    ("config.rms_norm_eps", float("nan")), ("config.seed", -1), ("config.variant", None),
    ("config", None), ("config", [1, 2]), ("config.unknown_field", 1), ("config.layer_ids", None),
])
def test_nonsense_header_fields_are_refused(table, tmp_path, key, value):
    """A header whose checksum is valid but whose fields are nonsense is refused at open,
    quickly (no division by zero, no endless prime search)."""
    meta = header_meta(table)
    if key.startswith("config."):
        meta["config"][key[len("config."):]] = value
    else:
        meta[key] = value
    rewrite_header(table, tmp_path / "bad.tbl", meta)
    with deadline(20), pytest.raises(TableFormatError):
        read_header(tmp_path / "bad.tbl")


def test_header_that_is_not_an_object_is_refused(table, tmp_path):
    rewrite_header(table, tmp_path / "bad.tbl", [1, 2, 3])
    with pytest.raises(TableFormatError, match="JSON list"):
        read_header(tmp_path / "bad.tbl")


def test_a_header_nested_too_deeply_to_parse_is_one_line(table, tmp_path):
    """JSON nested deeper than the parser goes, under a valid checksum: the table's own error, not
    a RecursionError."""
    body = b"[" * 100_000 + b"]" * 100_000
    data = bytearray(table.read_bytes())
    data[:PREFIX.size + len(body)] = PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body
    (tmp_path / "deep.tbl").write_bytes(bytes(data))
    with pytest.raises(TableFormatError) as caught:
        read_header(tmp_path / "deep.tbl")
    assert str(caught.value) == (f"{tmp_path / 'deep.tbl'}: unreadable table header (the header nests JSON too "
                                 "deeply to read: give a flat object); the file is damaged")


def test_rewritten_header_with_the_same_fields_still_opens(table, tmp_path):
    """The damage helper itself: an unchanged header rewritten opens and verifies."""
    rewrite_header(table, tmp_path / "same.tbl", header_meta(table))
    assert verify_table(tmp_path / "same.tbl").layout == read_header(table).layout


def test_directory_is_not_a_table(tmp_path):
    with pytest.raises(TableFormatError, match="is a directory"):
        read_header(tmp_path)


# ---------------------------------------------------------------- atomic writes
def test_table_is_complete_and_synced_when_renamed(tmp_path, config, monkeypatch):
    """The temporary file is fsynced after its last byte (trailer included) and before the
    rename; the directory is fsynced after the rename."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        events.append(("fsync", target, os.fstat(fd).st_size))

    def replace(src, dst):
        src = os.path.realpath(src)
        synced = [e for e in events if e[0] == "fsync" and e[1] == src]
        assert synced and synced[-1][2] == os.path.getsize(src), "renamed before an fsync of its last bytes"
        verify_table(src)  # header, data and trailer complete under the temporary name
        real_replace(src, dst)
        events.append(("replace", src, str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = make_random_table(tmp_path / "t.tbl", config, seed=1)
    kinds = [e[0] for e in events]
    assert kinds.count("replace") == 1
    after = events[kinds.index("replace") + 1:]
    assert ("fsync", str(tmp_path.resolve())) in [(e[0], e[1]) for e in after], "directory not synced after rename"
    verify_table(path)


# ---------------------------------------------------------------- temporary files
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporary_file_names_its_writer(tmp_path, config):
    with TableWriter(tmp_path / "t.tbl", config) as w:
        (tmp,) = tmp_path.iterdir()
        assert tmp.name.startswith(".t.tbl.") and tmp.name.endswith(".tmp")
        assert f".{boot_id()}.{os.getpid()}." in tmp.name
        assert boot_id() == open("/proc/sys/kernel/random/boot_id").read().strip().replace("-", "")
        w.write(raw_rows_of(config))
    assert [p.name for p in tmp_path.iterdir()] == ["t.tbl"]


def test_next_write_removes_dead_writers_leftovers(tmp_path, config):
    me, dead = os.getpid(), _dead_pid()
    names = {
        "dead": f".t.tbl.{boot_id()}.{dead}.0123abcd.tmp",
        "other_boot": f".t.tbl.{'f' * 32}.{me}.0123abcd.tmp",
        "live": f".t.tbl.{boot_id()}.{me}.0123abcd.tmp",
        "other_table": f".u.tbl.{boot_id()}.{dead}.0123abcd.tmp",
        "unknown": ".t.tbl.0123456789ab.tmp",
        "no_such_pid": f".t.tbl.{boot_id()}.{2**70}.0123abcd.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial table")
    assert {p.name for p in dead_temp_files(tmp_path)} == \
        {names["dead"], names["other_boot"], names["other_table"], names["no_such_pid"]}
    write_table(tmp_path / "t.tbl", config, raw_rows_of(config))
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"t.tbl", names["live"], names["other_table"], names["unknown"]}
    assert clean_temp_files(tmp_path) == [tmp_path / names["other_table"]]


def test_directory_or_empty_output_is_refused_before_writing(tmp_path, config):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        TableWriter(tmp_path / "d", config)
    with pytest.raises(ValueError, match="empty"):
        TableWriter("", config)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


# ---------------------------------------------------------------- what a damaged file's error says
def test_open_errors_say_what_is_wrong(table, tmp_path):
    data = table.read_bytes()
    size = len(data)
    short = tmp_path / "short.tbl"
    short.write_bytes(data[:23])
    with pytest.raises(TableFormatError, match=rf"^{short} is not an engram-offload table: 23 bytes is too short "
                                               "for a header$"):
        read_header(short)
    foreign = tmp_path / "foreign.tbl"
    foreign.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(TableFormatError, match=rf"^{foreign} is not an engram-offload table \(starts with "
                                               r"b'GGUFAMTB', expected b'ENGRAMTB'\)$"):
        read_header(foreign)
    version = tmp_path / "v4.tbl"
    version.write_bytes(data[:8] + struct.pack("<I", 4) + data[12:])
    with pytest.raises(TableFormatError, match=rf"^{version} has table format version 4; this engram-offload "
                                               r"reads version 3 only: rewrite the table with engram-offload "
                                               r"convert \(or make-table\)$"):
        read_header(version)
    version.write_bytes(data[:8] + struct.pack("<I", 1) + data[12:])  # version 1: no page checksums
    with pytest.raises(TableFormatError, match=r"has table format version 1 \(block checksums only\); this "
                                               r"engram-offload reads version 3 only: rewrite the table with "
                                               r"engram-offload convert"):
        read_header(version)
    (length,) = struct.unpack("<I", data[12:16])
    for bad_length, message in [(1 << 24 | 1, r"header length 16777217 is implausible; the file is damaged$"),
                                (size, rf"is truncated inside its header \({size} bytes\)$")]:
        path = tmp_path / "length.tbl"
        path.write_bytes(data[:12] + struct.pack("<I", bad_length) + data[16:])
        with pytest.raises(TableFormatError, match=rf"^{path}: {message}" if "implausible" in message
                           else rf"^{path} {message}"):
            read_header(path)
    ok = tmp_path / "ok.tbl"
    ok.write_bytes(data[:12] + struct.pack("<I", 1 << 24) + data[16:])  # at the limit: read, then refused
    with pytest.raises(TableFormatError, match="truncated inside its header"):
        read_header(ok)
    damaged = tmp_path / "damaged.tbl"
    damaged.write_bytes(data[:30] + bytes([data[30] ^ 1]) + data[31:])
    with pytest.raises(TableFormatError, match=rf"^{damaged}: the header does not match its checksum; "
                                               "the file is damaged$"):
        read_header(damaged)
    for cut, what, expected in [(size - 1, "truncated", size), (size + 5, "longer than its header says", size)]:
        path = tmp_path / f"cut{cut}.tbl"
        path.write_bytes(data[:cut] + bytes(max(0, cut - size)))
        with pytest.raises(TableFormatError, match=rf"^{path} is {what}: {cut:,} bytes, expected {expected:,}; "
                                                   "rewrite or re-copy the table$"):
            read_header(path)
    trailer = tmp_path / "trailer.tbl"
    trailer.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(TableFormatError, match=rf"^{trailer}: the checksum trailer is damaged; rewrite the table$"):
        read_header(trailer)
    with pytest.raises(TableFormatError, match=rf"^{tmp_path} is a directory, not a table file: give the table's "
                                               "file$"):
        read_header(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^no table file at {tmp_path / 'none.tbl'}$"):
        read_header(tmp_path / "none.tbl")


def test_header_field_errors_name_the_field(table, tmp_path):
    meta = header_meta(table)
    rewrite_header(table, tmp_path / "bad.tbl", {**meta, "num_rows": 5})
    with pytest.raises(TableFormatError, match=rf"^{tmp_path / 'bad.tbl'}: header field num_rows=5 disagrees with "
                                               rf"the layout derived from its config \({meta['num_rows']}\); "
                                               "the file is damaged$"):
        read_header(tmp_path / "bad.tbl")
    rewrite_header(table, tmp_path / "bad.tbl", {**meta, "config": {**meta["config"], "head_dim": 0}})
    with pytest.raises(TableFormatError, match=rf"^{tmp_path / 'bad.tbl'}: unreadable table header \(.*head_dim.*\); "
                                               "the file is damaged$"):
        read_header(tmp_path / "bad.tbl")
    rewrite_header(table, tmp_path / "bad.tbl", {k: v for k, v in meta.items() if k != "page_checksum"})
    with pytest.raises(TableFormatError, match=r"header field page_checksum=None disagrees"):
        read_header(tmp_path / "bad.tbl")


def test_layout_geometry_of_a_small_table(tmp_path):
    from engram_offload.engram.config import EngramConfig
    config = EngramConfig(layer_ids=(1,), max_ngram_size=2, n_heads=1, head_dim=1000, prime_starts=(10,))
    layout = TableLayout.for_config(config)  # 4,000-byte rows: one a page
    assert (config.num_rows, layout.page_bytes, layout.rows_per_page) == (11, 4096, 1)
    assert (layout.num_pages, layout.data_bytes) == (11, 11 * 4096)
    assert layout.page_rows(0) == (0, 0) and layout.page_rows(10) == (10, 10)
    assert layout.trailer_offset == layout.data_offset + 11 * 4096
    assert layout.page_sums_bytes == 44 and layout.trailer_bytes == 44 + 8 + 8  # page sums, their digest, check
    assert layout.file_bytes == layout.trailer_offset + layout.trailer_bytes
    wide = TableLayout.for_config(config.replace(head_dim=1025))  # 4,100-byte rows: two pages each
    assert (wide.page_bytes, wide.rows_per_page) == (8192, 1)
    assert wide.row_offsets(np.array([0, 3])).tolist() == [wide.data_offset, wide.data_offset + 3 * 8192]
    packed = TableLayout.for_config(config.replace(head_dim=100))  # 400-byte rows: 10 a page
    assert packed.rows_per_page == 10 and packed.page_rows(1) == (10, 10) and packed.num_pages == 2
    assert packed.row_offsets(np.array([9, 10])).tolist() == [packed.data_offset + 3600, packed.data_offset + 4096]
    big = config.replace(layer_ids=tuple(range(200)))  # a header longer than one page
    layout = TableLayout.for_config(big)
    assert layout.data_offset > 4096 and layout.data_offset % 4096 == 0
    assert layout.data_offset == -(-(24 + len(layout.header_json())) // 4096) * 4096


def test_fingerprints_tell_tables_apart(tmp_path, config):
    """Two tables written from the same rows share a fingerprint; another seed, another layout
    or one changed data byte (through its page's checksum) gives another."""
    a = make_random_table(tmp_path / "a.tbl", config, seed=1)
    b = make_random_table(tmp_path / "b.tbl", config, seed=1)
    c = make_random_table(tmp_path / "c.tbl", config, seed=2)
    d = make_random_table(tmp_path / "d.tbl", config.replace(seed=config.seed + 1), seed=1)
    rows = read_all_rows(a)
    rows[7, 3] ^= 1
    e = write_table(tmp_path / "e.tbl", config, rows)
    prints = [read_header(p).fingerprint() for p in (a, b, c, d, e)]
    assert prints[0] == prints[1] and len(set(prints)) == 4
    assert all(isinstance(p, int) and 0 <= p < 2**64 for p in prints)


# ---------------------------------------------------------------- writer arguments and edges
def test_row_arguments_are_checked_with_their_messages(tmp_path, config):
    with pytest.raises(ValueError, match=r"^rows must be 2-D, got shape \(66,\)$"):
        write_table(tmp_path / "t.tbl", config, np.zeros(66, np.uint8))
    with pytest.raises(ValueError, match=r"^raw uint8 rows must be \[n, 66\] \(fp8_e4m3_ue8m0 at head_dim 64\), "
                                         r"got \(3, 65\)$"):
        write_table(tmp_path / "t.tbl", config, np.zeros((3, 65), np.uint8))
    with pytest.raises(ValueError, match=r"^rows must be float \[n, head_dim\] or uint8 \[n, row_bytes\], "
                                         r"got torch.int32$"):
        write_table(tmp_path / "t.tbl", config, torch.zeros((3, 64), dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^float rows must be \[n, 64\], got \(3, 66\)$"):
        write_table(tmp_path / "t.tbl", config, torch.zeros((3, 66)))
    n = config.num_rows
    with pytest.raises(ValueError, match=rf"^the table needs {n:,} rows, only {n - 1:,} were written; "
                                         "the file was not created$"):
        write_table(tmp_path / "t.tbl", config, raw_rows_of(config)[:-1])
    with pytest.raises(ValueError, match=rf"^too many rows: the table holds {n:,} rows, got at least {n + 1:,}$"):
        write_table(tmp_path / "t.tbl", config, iter([raw_rows_of(config), raw_rows_of(config)[:1]]))
    with pytest.raises(FileNotFoundError, match=rf"^directory {tmp_path / 'no'} does not exist$"):
        TableWriter(tmp_path / "no" / "t.tbl", config)
    with pytest.raises(ValueError, match=r"^the output path is empty: give a file name to write the table to$"):
        TableWriter("", config)
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match=rf"^{tmp_path / 'd'} is a directory: give a file name to write "
                                                "the table to$"):
        TableWriter(tmp_path / "d", config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_float_rows_in_more_than_one_encode_chunk(tmp_path):
    from engram_offload.engram.config import EngramConfig
    config = EngramConfig(layer_ids=(1,), max_ngram_size=2, n_heads=1, head_dim=2, prime_starts=(70_000,),
                          row_format="bf16")  # 70,001 rows, above the 65,536 encoded at a time
    x = np.random.default_rng(0).standard_normal((config.num_rows, 2)).astype(np.float32)[:, ::-1]  # strided
    path = write_table(tmp_path / "t.tbl", config, x)
    assert np.array_equal(read_all_rows(path), encode_rows(torch.from_numpy(x.copy()), "bf16").numpy())


def test_closing_twice_and_aborting_after_close(tmp_path, config):
    w = TableWriter(tmp_path / "t.tbl", config)
    w.write(raw_rows_of(config))
    assert w.close() == tmp_path / "t.tbl" and w.close() == tmp_path / "t.tbl"
    w.abort()  # after close: the table stays
    verify_table(tmp_path / "t.tbl")
    aborted = TableWriter(tmp_path / "u.tbl", config)
    aborted.write(raw_rows_of(config)[:10])
    aborted.abort()
    aborted.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tbl"]


def test_boot_id_without_the_kernel_file_and_writers_without_a_pid(tmp_path, monkeypatch):
    from engram_offload.table import writer
    live = f".t.tbl.{boot_id()}.{os.getpid()}.0123abcd.tmp"
    pid0 = f".t.tbl.{boot_id()}.0.0123abcd.tmp"
    for name in (live, pid0):
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / f".t.tbl.{boot_id()}.{os.getpid()}.0123abcd.tmp.d").mkdir()  # not a file: never touched
    assert [p.name for p in dead_temp_files(tmp_path, "t.tbl")] == [pid0]
    assert dead_temp_files(tmp_path, "other.tbl") == []
    made = writer.temp_path(tmp_path / "t.tbl")
    made.write_bytes(b"partial")
    monkeypatch.setattr(writer, "BOOT_ID_FILE", str(tmp_path / "missing"))
    assert boot_id() == "0" * 32
    assert writer.temp_path(tmp_path / "t.tbl").name.startswith(f".t.tbl.{'0' * 32}.{os.getpid()}.")
    assert {p.name for p in dead_temp_files(tmp_path)} == {live, pid0, made.name}  # another boot now
    # whatever the kernel file holds, the id is 32 characters: dashes dropped, cut or padded with 0
    for text, want in [("1234-abcd\n", "1234abcd" + "0" * 24), ("f" * 40, "f" * 32)]:
        (tmp_path / "boot").write_text(text)
        monkeypatch.setattr(writer, "BOOT_ID_FILE", str(tmp_path / "boot"))
        assert boot_id() == want


def test_the_fingerprint_is_its_documented_hash(table):
    """xxh3_64 of the header JSON then the page sums' digest (xxh3_64 of the page sums' bytes)
    as a little-endian u64: shared segments, row servers and pool keys are named by it, so it
    must not drift between versions."""
    import xxhash

    header = read_header(table)
    digest = xxhash.xxh3_64_intdigest(header.page_sums.astype("<u4").tobytes())
    assert header.sums_digest == digest
    assert header.fingerprint() == xxhash.xxh3_64_intdigest(header.layout.header_json() + struct.pack("<Q", digest))


def test_a_live_writer_is_never_disturbed_and_pid_1_is_alive(tmp_path):
    # the child restores SIGHUP's default (a parent started under nohup passes on "ignore"),
    # then says it is ready
    code = ("import signal, sys, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
            "print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        (tmp_path / f".t.tbl.{boot_id()}.{child.pid}.0123abcd.tmp").write_bytes(b"partial")
        assert dead_temp_files(tmp_path) == [] and clean_temp_files(tmp_path) == []
        with pytest.raises(subprocess.TimeoutExpired):  # looking for dead writers signalled a live one
            child.wait(timeout=0.5)
        # only once no signal but 0 is sent: pid 1 (a container's only process) is a live writer
        (tmp_path / f".t.tbl.{boot_id()}.1.0123abcd.tmp").write_bytes(b"partial")
        assert dead_temp_files(tmp_path) == []
    finally:
        child.kill()
        child.wait()


def test_abort_when_the_temporary_file_is_already_gone(tmp_path, config):
    w = TableWriter(tmp_path / "t.tbl", config)
    (tmp,) = tmp_path.iterdir()
    tmp.unlink()
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_close_after_abort_raises(tmp_path, config):
    w = TableWriter(tmp_path / "t.tbl", config)
    w.write(raw_rows_of(config))
    w.abort()
    with pytest.raises(ValueError):
        w.close()


def test_trailer_checksums_are_read_as_written(tmp_path, config):
    import xxhash

    path = make_random_table(tmp_path / "t.tbl", config, seed=3)
    header = read_header(path)
    layout = header.layout
    data = path.read_bytes()
    pages = [xxhash.xxh3_64_intdigest(data[layout.data_offset + p * 4096:][:4096]) & 0xFFFFFFFF
             for p in range(layout.num_pages)]
    assert header.page_sums.tolist() == pages
    sums = data[layout.trailer_offset:][:4 * layout.num_pages]
    digest, check = struct.unpack("<QQ", data[-16:])
    assert header.sums_digest == digest == xxhash.xxh3_64_intdigest(sums)
    assert check == xxhash.xxh3_64_intdigest(data[layout.trailer_offset:-8])
    # a digest that is not the page sums' is refused even under a valid trailer check
    wrong = data[:-16] + struct.pack("<Q", digest ^ 1)
    (tmp_path / "wrong.tbl").write_bytes(wrong + struct.pack("<Q", xxhash.xxh3_64_intdigest(wrong[layout.trailer_offset:])))
    with pytest.raises(TableFormatError, match=r"wrong\.tbl: the checksum trailer is damaged; rewrite the table$"):
        read_header(tmp_path / "wrong.tbl")


def format2_table(table, path):
    """``table`` as format 2 wrote it: ``block_size`` and ``num_blocks`` in the header, one u64
    xxh3_64 per block of data after the page sums, then the trailer's check."""
    import xxhash

    from engram_offload.table.format import MAGIC, PREFIX

    layout, data = read_header(table).layout, table.read_bytes()
    block, body = 1 << 20, data[layout.data_offset:layout.trailer_offset]
    meta = {**header_meta(table), "version": 2, "block_size": block, "num_blocks": -(-len(body) // block)}
    head = json.dumps(meta, sort_keys=True).encode()
    head = PREFIX.pack(MAGIC, 2, len(head), xxhash.xxh3_64_intdigest(head)) + head
    trailer = data[layout.trailer_offset:][:layout.page_sums_bytes] + b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(body[i:i + block])) for i in range(0, len(body), block))
    path.write_bytes(head.ljust(layout.data_offset, b"\0") + body + trailer
                     + struct.pack("<Q", xxhash.xxh3_64_intdigest(trailer)))
    return path


def test_a_format_2_table_is_refused_with_one_line_saying_how_to_rewrite_it(table, tmp_path, capsys):
    from engram_offload import cli

    old = format2_table(table, tmp_path / "old.tbl")
    want = (f"{old} has table format version 2 (page and block checksums); this engram-offload reads version 3 "
            "only: rewrite the table with engram-offload convert (or make-table)")
    with pytest.raises(TableFormatError) as caught:
        read_header(old)
    assert str(caught.value) == want
    assert cli.main(["verify", str(old)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"engram-offload verify: error: {want}"]


def test_a_header_config_is_read_as_a_config_is_built(table, tmp_path):
    """The header's config is compared through ``EngramConfig``, not as raw JSON: a config
    without the optional ``name`` (an older writer's) opens with the same layout."""
    meta = header_meta(table)
    del meta["config"]["name"]
    rewrite_header(table, tmp_path / "old.tbl", meta)
    assert read_header(tmp_path / "old.tbl").layout == read_header(table).layout


def test_progress_is_shown_when_asked(tmp_path, config, capfd):
    write_table(tmp_path / "quiet.tbl", config, raw_rows_of(config), progress=False)
    assert "writing" not in capfd.readouterr().err  # a tiny table: no bar by default either
    write_table(tmp_path / "shown.tbl", config, raw_rows_of(config), progress=True)
    err = capfd.readouterr().err
    assert "writing shown.tbl" in err
    # stderr is no terminal here: progress is plain lines, the last at the data's size
    assert re.search(r"writing shown.tbl: (\d+\.\d [KM]iB) of \1 \(100%\)", err), err


def test_bfloat16_tensors_are_written(tmp_path, tiny_config):
    config = tiny_config("bf16", 80)
    x = torch.randn(config.num_rows, 80).to(torch.bfloat16)  # a dtype NumPy has not
    path = write_table(tmp_path / "t.tbl", config, x)
    assert torch.equal(torch.from_numpy(read_all_rows(path)), encode_rows(x, "bf16"))


def test_cleaning_goes_on_when_another_cleaner_removed_a_file_first(tmp_path, monkeypatch):
    from engram_offload.table import writer
    dead = _dead_pid()
    names = [f".{t}.tbl.{boot_id()}.{dead}.0123abcd.tmp" for t in ("a", "b", "c")]
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    real = writer.dead_temp_files

    def listed_then_raced(directory, target=None):
        found = real(directory, target)
        found[0].unlink()  # another cleaner removes the first one after this one listed it
        return found

    monkeypatch.setattr(writer, "dead_temp_files", listed_then_raced)
    assert [p.name for p in writer.clean_temp_files(tmp_path)] == names[1:]
    assert list(tmp_path.iterdir()) == []


HEADER_KEYS = {"magic", "version", "config", "layer_ids", "head_sizes", "layer_row_bases", "num_rows", "head_dim",
               "row_format", "row_bytes", "stride", "rows_per_page", "data_offset", "data_bytes", "checksum", "trailer_offset", "file_bytes", "page_checksum",
               "page_checksums_offset"}  # docs/table-format.md, "Header keys"


def test_header_keys_are_the_documented_ones_sorted(tmp_path, config):
    path = make_random_table(tmp_path / "t.tbl", config, seed=0)
    meta = header_meta(path)
    assert set(meta) == HEADER_KEYS
    assert list(meta) == sorted(meta)  # written with sorted keys: the bytes (and fingerprint) are stable
    layout = read_header(path).layout
    assert (meta["layer_row_bases"], meta["head_dim"], meta["row_format"]) == \
        (list(config.layer_row_bases), config.head_dim, config.row_format)
    assert (meta["rows_per_page"], meta["data_bytes"], meta["file_bytes"]) == \
        (layout.rows_per_page, layout.data_bytes, os.path.getsize(path))
