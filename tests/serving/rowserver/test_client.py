"""``RowClient`` against a row server in a thread of this process: the store's interface
(gather, decode, read_raw, fetch, stats) value for value, and rows checked against a
damaged copy of the table file."""

from __future__ import annotations

import fcntl
import shutil

import numpy as np
import pytest
import torch

from engram_offload.errors import ChecksumError
from engram_offload.serving.rowserver import RowClient
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table, random_rows, read_header

from row_servers import serving
from tiny_tables import tiny_config


def damaged_copy(path, tmp_path):
    """A copy of the table whose every data byte is flipped (its header and checksum trailer kept)."""
    copy = tmp_path / "copy.table"
    shutil.copyfile(path, copy)
    layout = read_header(path).layout
    start, end = layout.data_offset, layout.trailer_offset
    data = bytearray(copy.read_bytes())
    data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    copy.write_bytes(bytes(data))
    return copy


def test_gather_and_decode_are_the_stores(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    ids = np.array([[5, 9, 5], [690, 3, 9]])
    with serving(path, sock, max_rows=100), RowClient(sock) as client, open_table(path, "memory") as local:
        for dtype in (torch.float32, torch.bfloat16):
            got, want = client.gather(ids, dtype), local.gather(ids, dtype)
            assert got.dtype == dtype and got.shape == (2, 3, local.config.head_dim)
            assert torch.equal(got, want)
        assert torch.equal(client.gather(ids), local.gather(ids, torch.float32))
        assert client.gather(7).shape == local.gather(7).shape == (1, local.config.head_dim)  # a single id
        assert torch.equal(client.gather(7), local.gather(7))
        before = client.stats()["store"]
        client.gather(ids)
        after = client.stats()["store"]
        assert (after["rows_requested"] - before["rows_requested"], after["rows_unique"] - before["rows_unique"]) \
            == (6, 4)  # the lookups before deduplication are counted, not the distinct ids
        raw = client.read_raw([3, 5, 9])
        index = np.array([12, 10, 11, 10])
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(client.decode(raw, dtype, index=index, index_base=10),
                               local.decode(raw, dtype, index=index, index_base=10))
        assert torch.equal(client.decode(raw, index=np.array([2, 0])), local.decode(raw, index=np.array([2, 0])))
        assert torch.equal(client.decode(raw), local.decode(raw))
        assert client.decode(raw).dtype == torch.float32
        assert torch.equal(client.decode(raw, shape=(3, 1)), local.decode(raw, shape=(3, 1)))


def test_rows_are_checked_against_the_table_files_page_checksums(table, socket_dir, tmp_path):
    path, expected = table
    sock = socket_dir / "rows.sock"
    copy = damaged_copy(path, tmp_path)
    with serving(path, sock, max_rows=100):
        with pytest.raises(ChecksumError, match=rf"^{copy}: data page \d+ fails its checksum \(or the file is "
                                                r"short\): the table file is damaged; check it with engram-offload "
                                                r"verify TABLE$"):
            RowClient(sock, table=copy, verify="all")
        with RowClient(sock, table=path, verify="all") as client:
            fd = client._file._fd
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # not inherited by the engine's children
            assert np.array_equal(client.read_raw([0, 690]).numpy(), expected[[0, 690]])


def test_a_version_1_copy_is_checked_by_its_blocks(tmp_path, socket_dir):
    config = tiny_config("int8", 64)
    path = make_random_table(tmp_path / "v1.table", config, seed=4, block_size=16384, version=1)
    expected = np.concatenate(list(random_rows(config, 4)))
    (tmp_path / "copy").mkdir()
    copy = damaged_copy(path, tmp_path / "copy")
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100):
        with pytest.raises(ChecksumError, match="copy.table"):  # the block check, before any comparison
            RowClient(sock, table=copy, verify="all")
        with RowClient(sock, table=path, verify="all") as client:
            assert np.array_equal(client.read_raw([1, 2]).numpy(), expected[[1, 2]])
