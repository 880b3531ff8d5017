"""Publishing into a real Redis server on 127.0.0.1: what a reader sees while a table is
rewritten, and a stored header that does not match its fingerprint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xxhash

from engram_offload.errors import TableFormatError
from engram_offload.pool.client import PoolClient
from engram_offload.pool.layout import PoolLayout, header_from_record
from engram_offload.pool.publish import _complete_record, _hgetall, check_complete, publish_table, read_pool_table
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers.remote import open_pool_table

from redis_servers import fresh_pool, redis_single  # noqa: F401 (fixtures)
from tiny_tables import tiny_config

EXTENT_ROWS = 97


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_random_table(tmp_path_factory.mktemp("publish") / "t.tbl", tiny_config("int8", 64), seed=11,
                             block_size=16384)


def test_a_republish_never_shows_a_complete_table_while_it_rewrites(table, fresh_pool):  # noqa: F811
    """The last extent holds other bytes, with the manifest digest and complete marker to
    match them (as a publish of other rows would leave), and the manifest lost extent 0's
    entry. Published again, extent 0 is put right first: manifest and old marker agree
    again while the last extent still holds the other bytes. The old complete marker must
    be gone from the start of the rewrite, so a reader checking between any two extents
    sees an unfinished table, and a finished one only at the end."""
    pool = fresh_pool(1)
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    last = playout.num_extents - 1
    with PoolClient(pool.url) as client:
        good = client.call("GET", playout.keys[last])
        other = bytes([good[0] ^ 0xFF]) + good[1:]
        client.call("SET", playout.keys[last], other)
        client.call("HSET", playout.manifest_key, last, xxhash.xxh3_64_hexdigest(other))
        client.call("SET", playout.complete_key, _complete_record(playout, _hgetall(client, playout.manifest_key)))
        assert check_complete(client, playout) == []  # consistent, though not this table's rows
        assert client.call("HDEL", playout.manifest_key, 0) == 1
        assert check_complete(client, playout)  # the lost manifest entry
        seen: dict[int, list[str]] = {}
        with PoolClient(pool.url) as reader:
            def look(extent: int) -> None:  # a reader between two extents of the rewrite
                seen[extent] = check_complete(reader, playout)
                assert reader.call("GET", playout.complete_key) is None, f"a complete marker at extent {extent}"

            result = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=look)
        assert (result["sent"], result["skipped"]) == (2, playout.num_extents - 2)
        assert sorted(seen) == list(range(playout.num_extents))
        assert all(seen.values()), [e for e, problems in seen.items() if not problems]
        assert check_complete(client, playout) == [] and client.call("GET", playout.keys[last]) == good


def _tampered(record: bytes, how: str) -> bytes:
    meta = json.loads(record)
    if how == "block digest":
        digests = bytearray(bytes.fromhex(meta["block_digests"]))
        digests[0] ^= 1
        meta["block_digests"] = digests.hex()
    elif how == "row format":
        meta["table"]["config"]["row_format"] = "int8" if meta["table"]["config"]["row_format"] != "int8" else "bf16"
    else:
        meta["fingerprint"] = f"{int(meta['fingerprint'], 16) ^ 1:016x}"
    return json.dumps(meta, sort_keys=True).encode()


@pytest.mark.parametrize("how", ["block digest", "row format", "fingerprint"])
def test_a_stored_header_that_does_not_match_its_fingerprint_is_refused(table, redis_single, how):  # noqa: F811
    """The header record in the pool is believed only when it hashes to its fingerprint: a
    changed block digest or row format (rows read under another header) or a record naming
    another fingerprint is refused, by ``header_from_record`` and by opening the table by
    fingerprint without its file."""
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    record = playout.header_record()
    header, rows = header_from_record(record, "t")
    assert rows == EXTENT_ROWS and np.array_equal(header.block_digests, playout.header.block_digests)
    bad = _tampered(record, how)
    with pytest.raises(TableFormatError, match="does not match its fingerprint"):
        header_from_record(bad, "t")
    publish_table(table, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    with PoolClient(redis_single.url) as client:
        client.call("SET", playout.header_key, bad)
        try:
            with pytest.raises(TableFormatError, match="does not match its fingerprint"):
                read_pool_table(client, playout.fingerprint)
            with pytest.raises(TableFormatError, match="does not match its fingerprint"):
                open_pool_table(f"{redis_single.url}/{playout.fingerprint}")
        finally:
            client.call("SET", playout.header_key, record)
    with open_pool_table(f"{redis_single.url}/{playout.fingerprint}") as remote:
        assert remote.fingerprint == playout.fingerprint
