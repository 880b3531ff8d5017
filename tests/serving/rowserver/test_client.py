"""``RowClient`` against a row server in a thread of this process: the store's interface
(gather, decode, read_raw, fetch, stats) value for value, and rows checked against a
damaged copy of the table file."""

from __future__ import annotations

import fcntl
import shutil

import numpy as np
import pytest
import torch

from engram_offload.errors import ChecksumError, TierError
from engram_offload.serving.rowserver import RowClient, start_row_server
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table, random_rows, read_header

from row_servers import ROW_BYTES, serving
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


class Tampered:
    """A store lease whose rows at ``positions`` (of the fetch) are flipped, as a faulty server sends them."""

    def __init__(self, lease, positions: list[int]) -> None:
        self._lease = lease
        self.host_raw = lease.host_raw.copy()
        self.host_raw[[p for p in positions if p < len(self.host_raw)]] ^= 0xFF  # read when the lease is made

    def release(self) -> None:
        self._lease.release()


def tampering(path, positions: list[int]):
    """A store whose every fetch comes back with the rows at ``positions`` flipped."""
    store = open_table(path, "direct")
    fetch = store.fetch
    store.fetch = lambda ids, **options: Tampered(fetch(ids, **options), positions)  # type: ignore[method-assign]
    return store


def test_a_wrong_row_is_named_with_how_many_of_those_checked_were_wrong(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, store=tampering(path, [1, 2]), max_rows=100):
        client = RowClient(sock, table=path, verify="none")  # connects without a check
        client.close()
        with pytest.raises(TierError, match=rf"^the row server at {sock} sent row (\d+) different from {path} "
                                            r"\(2 of (\d+) rows checked\): it serves wrong rows; stop it and start a "
                                            r"server for this table$") as err:
            RowClient(sock, table=path, verify="all")  # the connect's probe: every row compared
        assert int(err.value.args[0].split("(2 of ")[1].split(" ")[0]) >= 3


def test_a_sampled_fetch_checks_two_draws_of_its_rows_including_the_first(table, socket_dir):
    """After the connect's check, a fetch of more than two rows has two random draws of them
    compared, the first row among those that can be drawn; a fetch of two rows, both."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100), RowClient(sock, table=path) as client:
        assert client.verify == "sample"
        client.read_raw(np.arange(16))  # checked in full: 16 rows and more verified since the connect
        client._rng = np.random.default_rng(5)  # the draws, made repeatable
        for _ in range(10):
            before = client.rows_verified
            client.read_raw([8, 9])
            assert client.rows_verified - before == 2
        counts = []
        for _ in range(20):
            before = client.rows_verified
            assert np.array_equal(client.read_raw([20, 21, 22]).numpy(), expected[[20, 21, 22]])
            counts.append(client.rows_verified - before)
        assert set(counts) == {1, 2}  # two draws, at times the same row twice
    wrong: list[int] = []
    with serving(path, sock, store=tampering(path, wrong), max_rows=100):
        client = RowClient(sock, table=path)
        client.read_raw(np.arange(16))
        client._rng = np.random.default_rng(6)
        wrong.append(0)  # from now on the first row of every fetch is wrong, and only it
        with pytest.raises(TierError, match="sent row 40 different"):
            for _ in range(40):
                client.read_raw([40, 41, 42])
        client.close()


def test_fetch_takes_sorted_distinct_ids_holds_them_by_default_and_checks_requested(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100), RowClient(sock) as client:
        trips = client.stats()["client"]["round_trips"]
        with pytest.raises(ValueError, match="sorted"):
            client.fetch(np.array([5, 3]))
        with pytest.raises(ValueError, match=r"^a fetch of 3 ids stands for 3 to more lookups, not 2: pass requested= "
                                             r"as the lookups before deduplication$"):
            client.fetch(np.array([1, 2, 3]), requested=2)
        assert client.stats()["client"]["round_trips"] == trips + 1  # refused here, before any request
        ids = np.array([3, 5, 9])
        with client.fetch(ids) as lease:
            assert np.array_equal(lease.ids, ids) and lease.pinned_rows == 3
            assert np.array_equal(lease.host_raw, expected[ids])
            assert client.stats()["server"]["leases_held"] == 1
        assert client.stats()["server"]["leases_held"] == 0
        with client.fetch(ids, hold=False) as lease:
            assert lease.pinned_rows == 0 and client.stats()["server"]["leases_held"] == 0


def test_start_row_server_hands_its_options_to_the_server_process(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock, cache_bytes=100 * ROW_BYTES, max_rows=50, max_connections=3)
    try:
        with RowClient(sock) as client:
            stats = client.stats()
            assert (stats["server"]["max_rows"], stats["server"]["max_connections"]) == (50, 3)
            assert stats["levels"][0]["policy"] == "lru" and stats["levels"][0]["capacity_rows"] == 100
            assert client.tier == "direct" and client.max_rows == 50
            assert np.array_equal(client.read_raw(np.arange(120)).numpy(), expected[:120])  # in 3 round trips
            assert client.stats()["client"]["round_trips"] == 2 + 3
    finally:
        server.terminate()
        server.wait(timeout=30)
