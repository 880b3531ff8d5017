"""Publishing into a real Redis server on 127.0.0.1: what a reader sees while a table is
rewritten, and a stored header that does not match its fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import threading

import pytest
import xxhash

from engram_offload.errors import ChecksumError, TableFormatError
from engram_offload.pool.client import PoolClient, PoolError
from engram_offload.pool.layout import POOL_LAYOUT_VERSION, PoolLayout, header_from_record, layout_version_problem
from engram_offload.pool.publish import (
    _complete_record,
    _hgetall,
    _info_field,
    _info_text,
    check_complete,
    check_extent_digests,
    drop_table,
    pool_status,
    publish_table,
    read_pool_table,
)
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers.remote import open_pool_table
from engram_offload.units import format_bytes

from redis_servers import fresh_pool, redis_single  # noqa: F401 (fixtures)
from tiny_tables import tiny_config

EXTENT_ROWS = 97


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_random_table(tmp_path_factory.mktemp("publish") / "t.tbl", tiny_config("int8", 64), seed=11)


def test_a_republish_never_shows_a_complete_table_while_it_rewrites(table, fresh_pool, pool_key):  # noqa: F811
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
        manifest = _hgetall(client, playout.manifest_key)
        client.call("SET", playout.complete_key, _complete_record(playout, manifest, pool_key))
        assert check_complete(client, playout, pool_key) == []  # consistent, though not this table's rows
        assert client.call("HDEL", playout.manifest_key, 0) == 1
        assert check_complete(client, playout, pool_key)  # the lost manifest entry
        seen: dict[int, list[str]] = {}
        with PoolClient(pool.url) as reader:
            def look(extent: int) -> None:  # a reader between two extents of the rewrite
                seen[extent] = check_complete(reader, playout, pool_key)
                assert reader.call("GET", playout.complete_key) is None, f"a complete marker at extent {extent}"

            result = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=look)
        assert (result["sent"], result["skipped"]) == (2, playout.num_extents - 2)
        assert sorted(seen) == list(range(playout.num_extents))
        assert all(seen.values()), [e for e, problems in seen.items() if not problems]
        assert check_complete(client, playout, pool_key) == [] and client.call("GET", playout.keys[last]) == good


def _tampered(record: bytes, how: str) -> bytes:
    meta = json.loads(record)
    if how == "page sums digest":
        meta["sums_digest"] = f"{int(meta['sums_digest'], 16) ^ 1:016x}"
    elif how == "row format":
        meta["table"]["config"]["row_format"] = "int8" if meta["table"]["config"]["row_format"] != "int8" else "bf16"
    else:
        meta["fingerprint"] = f"{int(meta['fingerprint'], 16) ^ 1:016x}"
    return json.dumps(meta, sort_keys=True).encode()


@pytest.mark.parametrize("how", ["page sums digest", "row format", "fingerprint"])
def test_a_stored_header_that_does_not_match_its_fingerprint_is_refused(table, redis_single, how):  # noqa: F811
    """The header record in the pool is believed only when it hashes to its fingerprint: a
    changed page sums digest or row format (rows read under another header) or a record naming
    another fingerprint is refused, by ``header_from_record`` and by opening the table by
    fingerprint without its file."""
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    record = playout.header_record()
    header, rows = header_from_record(record, "t")
    assert rows == EXTENT_ROWS and header.sums_digest == playout.header.sums_digest
    bad = _tampered(record, how)
    with pytest.raises(TableFormatError, match="^t: the stored table header does not match its fingerprint$"):
        header_from_record(bad, "t")
    publish_table(table, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    with PoolClient(redis_single.url) as client:
        client.call("SET", playout.header_key, bad)
        try:
            with pytest.raises(TableFormatError, match=f"^pool table {playout.fingerprint}: the stored table header "
                                                       "does not match its fingerprint$"):
                read_pool_table(client, playout.fingerprint)
            with pytest.raises(TableFormatError, match="does not match its fingerprint"):
                open_pool_table(f"{redis_single.url}/{playout.fingerprint}")
        finally:
            client.call("SET", playout.header_key, record)
    with open_pool_table(f"{redis_single.url}/{playout.fingerprint}") as remote:
        assert remote.fingerprint == playout.fingerprint


def _extent_values(url: str, playout: PoolLayout) -> list[bytes]:
    with PoolClient(url) as client:
        return [client.call("GET", key) for key in playout.keys]


def test_a_publish_read_in_small_chunks_stores_the_same_extents(table, fresh_pool, monkeypatch):  # noqa: F811
    """The file is read in chunks of whole pages: chunks of 20 pages (the table's
    56 pages end in a short chunk, and extents straddle chunks) store the extents a publish in
    one chunk stores."""
    from engram_offload.pool import publish

    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    assert playout.header.layout.num_pages % 20 != 0
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    whole = _extent_values(pool.url, playout)
    assert drop_table(pool.url, playout.fingerprint) == playout.num_extents + 3  # header, manifest, complete
    monkeypatch.setattr(publish, "READ_CHUNK_BYTES", 20 * playout.header.layout.page_bytes)
    result = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert (result["sent"], result["skipped"]) == (playout.num_extents, 0)
    assert _extent_values(pool.url, playout) == whole


def test_pool_status_reports_each_table_and_each_key_it_cannot_read(table, tmp_path, fresh_pool):  # noqa: F811
    """One complete table, one published under an older pool layout, a header record with a
    layout version but no table, and a header key that is not a table's (not even UTF-8)."""
    pool = fresh_pool(1)
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    old = make_random_table(tmp_path / "old.tbl", tiny_config("int8", 64), seed=12)
    publish_table(old, pool.url, extent_rows=500, progress=False)
    playout, old_layout = PoolLayout(read_header(table), EXTENT_ROWS), PoolLayout(read_header(old), 500)
    with PoolClient(pool.url) as client:
        record = json.loads(client.call("GET", old_layout.header_key))
        record["pool_layout"] = 2
        client.call("SET", old_layout.header_key, json.dumps(record).encode())
        client.call("SET", "{0123456789abcdef}:engram:header", json.dumps({"pool_layout": POOL_LAYOUT_VERSION}).encode())
        client.call("SET", b"{\xff}:engram:header", b"x")
        used = _info_field(client.each_node("INFO", "memory")[0], "used_memory")
    status = pool_status(pool.url)
    assert status["cluster"] is False
    [node] = status["nodes"]
    assert node["address"] == f"127.0.0.1:{pool.nodes[0].port}" and node["used_memory"] > used // 2 > 0
    tables = {t["fingerprint"]: t for t in status["tables"]}
    layout = playout.header.layout
    assert tables[playout.fingerprint] == {
        "fingerprint": playout.fingerprint, "pool_layout": POOL_LAYOUT_VERSION, "complete": True, "problems": [],
        "extents": playout.num_extents, "extent_rows": EXTENT_ROWS, "manifest_extents": playout.num_extents,
        "rows": layout.num_rows, "row_format": "int8", "row_bytes": layout.row_bytes,
        "bytes": layout.num_rows * playout.stride}
    assert isinstance(tables[playout.fingerprint]["bytes"], int)
    fp = old_layout.fingerprint
    assert tables[fp]["pool_layout"] == 2 and tables[fp]["complete"] is False
    assert tables[fp]["problems"] == [layout_version_problem(f"table {fp}", 2)]
    assert tables[fp]["manifest_extents"] == old_layout.num_extents
    assert tables["0123456789abcdef"] == {
        "fingerprint": "0123456789abcdef", "pool_layout": POOL_LAYOUT_VERSION, "complete": False,
        "problems": ["unreadable: table 0123456789abcdef: unreadable table header in the pool ('table'); drop it "
                     "(engram-offload pool drop 0123456789abcdef) and publish it again"]}
    assert tables[r"{\xff}:engram:header"] == {
        "fingerprint": r"{\xff}:engram:header", "pool_layout": None, "complete": False,
        "problems": [r"key '{\\xff}:engram:header' is not an engram-offload table's header (another program's key?)"]}


def _ends_within(seconds: float, call) -> BaseException:
    """The error ``call()`` raised, which it must raise within ``seconds`` (run on a thread)."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            caught.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    assert caught, "no error raised"
    return caught[0]


def test_status_drop_and_publish_wait_for_a_stopped_node_no_longer_than_their_timeout(table, fresh_pool):  # noqa: F811
    """A node that accepts connections but never answers: ``pool_status``, ``drop_table`` and
    ``publish_table`` give up after the timeout they are given (0.5 s here; the client's own
    default is 5 s)."""
    pool = fresh_pool(1)
    process = pool.nodes[0].process
    process.send_signal(signal.SIGSTOP)
    try:
        for call in (lambda: pool_status(pool.url, timeout=0.5),
                     lambda: drop_table(pool.url, "0123456789abcdef", timeout=0.5),
                     lambda: publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False, timeout=0.5)):
            error = _ends_within(4.0, call)
            assert isinstance(error, PoolError) and "no pool node answers" in str(error), error
    finally:
        process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("fp", ["c993ba57e528765", "C993BA57E528765A", "c993ba57e528765a0", "table"])
def test_a_name_that_is_not_a_fingerprint_is_refused_before_the_pool_is_asked(fp):
    said = rf"^{re.escape(repr(fp))} is not a table fingerprint \(16 hex digits; see pool status\)$"
    with pytest.raises(ValueError, match=said):
        drop_table("redis://127.0.0.1:1", fp)  # no server there: the name is checked first
    with pytest.raises(ValueError, match=said):
        read_pool_table(None, fp)  # type: ignore[arg-type]


def test_a_drop_deletes_the_complete_marker_first(table, fresh_pool):  # noqa: F811
    """Readers stop at once: the marker goes before any other key. A user allowed to delete
    the marker only (Redis ACL) drops nothing else, and the error says which command failed."""
    pool = fresh_pool(1)
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    fp = playout.fingerprint
    with PoolClient(pool.url) as client:
        assert client.call("ACL", "SETUSER", "dropper", "on", ">pw", f"~{playout.complete_key}", "+@all") == b"OK"
        url = pool.url.replace("redis://", "redis://dropper:pw@")
        with pytest.raises(PoolError, match=rf"^DEL failed while dropping {fp}: NOPERM "):
            drop_table(url, fp)
        assert client.call("GET", playout.complete_key) is None
        assert client.call("GET", playout.header_key) is not None
        assert drop_table(pool.url, fp) == playout.num_extents + 2  # all but the marker were left
        assert list(client.scan("*")) == []


def test_a_publish_read_in_chunks_smaller_than_a_page_still_checks_whole_pages(table, fresh_pool, monkeypatch,  # noqa: F811
                                                                               pool_key):
    """A read chunk smaller than a page reads one whole page at a time: a part of a page
    would be checked against the whole page's checksum."""
    from engram_offload.pool import publish

    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    monkeypatch.setattr(publish, "READ_CHUNK_BYTES", playout.header.layout.page_bytes // 2)
    result = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert result["sent"] == playout.num_extents
    with PoolClient(pool.url) as client:
        assert check_complete(client, playout, pool_key) == []


def _copy(table, tmp_path, name: str = "copy.tbl"):
    copy = tmp_path / name
    copy.write_bytes(table.read_bytes())
    return copy


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_or_shortened_table_file_is_never_published(table, tmp_path, fresh_pool, monkeypatch):  # noqa: F811
    """A damaged page and a file cut short while it is read each stop the publish with the
    reason, and no complete marker is written."""
    from engram_offload.pool import publish
    from engram_offload.table.verify import page_checksum_error

    pool = fresh_pool(1)
    layout = read_header(table).layout
    damaged = _copy(table, tmp_path)
    _flip(damaged, layout.data_offset + 23 * layout.page_bytes + 100)
    with pytest.raises(ChecksumError) as caught:
        publish_table(damaged, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert str(caught.value) == str(page_checksum_error(read_header(damaged), 23, reread=False))

    short = _copy(table, tmp_path, "short.tbl")
    monkeypatch.setattr(publish, "READ_CHUNK_BYTES", 20 * layout.page_bytes)

    def cut(extent: int) -> None:  # the file changes under the publish, after its first chunk was read
        if extent == 0:
            with open(short, "r+b") as f:
                f.truncate(layout.data_offset + 10 * layout.page_bytes)

    with pytest.raises(EOFError, match=f"^{re.escape(str(short))} ended early while publishing; the file changed "
                                       "under us$"):
        publish_table(short, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=cut)
    with PoolClient(pool.url) as client:
        assert not list(client.scan("*:engram:complete"))


def test_the_complete_marker_is_the_documented_record(table, fresh_pool, pool_key):  # noqa: F811
    """``{"extent_rows", "extents", "fingerprint", "manifest_mac"}`` as sorted JSON, the last
    the keyed blake2b of the header record and of the extents' digests in order, one a line
    (each part after its length): readers compare it byte for byte."""
    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with PoolClient(pool.url) as client:
        digests = [xxhash.xxh3_64_hexdigest(client.call("GET", key)) for key in playout.keys]
        assert _hgetall(client, playout.manifest_key) == {str(e): d for e, d in enumerate(digests)}
        marker = client.call("GET", playout.complete_key)
    mac = hashlib.blake2b(key=hashlib.blake2b(b"records", key=pool_key.secret, digest_size=32,
                                              person=b"engram-pool").digest(), digest_size=16)
    for part in (playout.header_record(), "\n".join(digests).encode()):
        mac.update(len(part).to_bytes(8, "little") + part)
    assert marker == (f'{{"extent_rows": {EXTENT_ROWS}, "extents": {playout.num_extents}, "fingerprint": '
                      f'"{playout.fingerprint}", "manifest_mac": "{mac.hexdigest()}"}}').encode()


def test_what_keeps_a_table_from_being_served_is_named(table, fresh_pool, pool_key):  # noqa: F811
    """``check_complete``: no marker; a manifest entry lost; a marker of another manifest;
    extents of the wrong length, five named and the rest counted; an extent key of another
    type. ``check_extent_digests``: extents altered or gone."""
    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    keys, n = playout.keys, playout.num_extents
    with PoolClient(pool.url) as client:
        assert check_complete(client, playout, pool_key) == [] and check_extent_digests(client, playout, range(n)) == []
        marker = client.call("GET", playout.complete_key)
        client.call("DEL", playout.complete_key)
        assert check_complete(client, playout, pool_key) == ["no complete marker: the publish has not finished"]
        client.call("SET", playout.complete_key, marker)
        digest = client.call("HGET", playout.manifest_key, 3)
        client.call("HDEL", playout.manifest_key, 3)
        assert check_complete(client, playout, pool_key) == [f"the manifest lacks 1 of {n} extents"]
        client.call("HSET", playout.manifest_key, 3, b"0" * 16)
        assert check_complete(client, playout, pool_key) == [
            f"its complete marker does not hold under the pool key {pool_key.path} (written by someone without that "
            "key, by a publish with another key file, or a publish is under way)"]
        client.call("HSET", playout.manifest_key, 3, digest)
        values = [client.call("GET", key) for key in keys]
        lengths = [len(v) for v in values]
        assert lengths == (playout.counts * playout.stride).tolist()
        for wrong in (5, 6, 7):
            for e in range(wrong):
                client.call("SETRANGE", keys[e], lengths[e], b"x")  # one byte too many
            named = [f"extent {keys[e]} holds {lengths[e] + 1:,} bytes, expected {lengths[e]:,}" for e in range(5)]
            more = [f"... and {wrong - 5} more extents"] if wrong > 5 else []
            assert check_complete(client, playout, pool_key) == named + more
            for e in range(wrong):
                client.call("SET", keys[e], values[e])
        client.call("DEL", keys[2])
        assert check_complete(client, playout, pool_key) == [f"extent {keys[2]} holds 0 bytes, expected {lengths[2]:,}"]
        assert check_extent_digests(client, playout, [1, 2]) == [f"extent {keys[2]} does not match its manifest digest"]
        client.call("SET", keys[2], values[2][:-1] + bytes([values[2][-1] ^ 1]))
        assert check_extent_digests(client, playout, [2, 4]) == [f"extent {keys[2]} does not match its manifest digest"]
        client.call("DEL", keys[2])
        client.call("HSET", keys[2], "f", "v")
        with pytest.raises(PoolError, match="^STRLEN failed: WRONGTYPE "):
            check_complete(client, playout, pool_key)
        client.call("DEL", keys[2])
        client.call("SET", keys[2], values[2])
        assert check_complete(client, playout, pool_key) == []
        with pytest.raises(PoolError, match=("^table 0123456789abcdef is not in the pool: publish it "
                                             r"\(engram-offload pool publish TABLE\)$")):
            read_pool_table(client, "0123456789abcdef")


def test_a_publish_says_what_it_sent_and_what_it_found_in_place(table, fresh_pool, capsys):  # noqa: F811
    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    total = playout.header.layout.num_rows * playout.stride
    first = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=True)
    assert first == {"fingerprint": playout.fingerprint, "extents": playout.num_extents, "sent": playout.num_extents,
                     "skipped": 0, "bytes_sent": total, "nodes": 1}
    data = playout.header.layout.data_bytes
    assert capsys.readouterr().err.splitlines()[-1] == f"publishing {table.name}: {format_bytes(data)} of " \
                                                        f"{format_bytes(data)} (100%)"
    again = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert again == {**first, "sent": 0, "skipped": playout.num_extents, "bytes_sent": 0}
    with PoolClient(pool.url) as client:  # one extent lost: only it is sent again
        client.call("DEL", playout.keys[4])
    third = publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert third == {**first, "sent": 1, "skipped": playout.num_extents - 1, "bytes_sent": EXTENT_ROWS * playout.stride}


def test_a_publish_whose_pool_changed_under_it_fails_and_leaves_no_marker(table, fresh_pool):  # noqa: F811
    """Extents deleted after they were sent (a node flushed, evicted), or a manifest entry lost:
    the final check catches it, the complete marker is taken back and the error names what is wrong."""
    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    last = playout.num_extents - 1
    with PoolClient(pool.url) as client:
        def lose_the_first_two(extent: int) -> None:
            if extent == last:
                client.call("DEL", playout.keys[0], playout.keys[1])  # one plain server: one DEL

        lost = "; ".join(f"extent {playout.keys[e]} holds 0 bytes, expected {EXTENT_ROWS * playout.stride:,}"
                         for e in (0, 1))
        with pytest.raises(PoolError, match=f"^publish of {playout.fingerprint} did not hold: {re.escape(lost)}$"):
            publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=lose_the_first_two)
        assert client.call("GET", playout.complete_key) is None

        def lose_a_manifest_entry(extent: int) -> None:
            if extent == last:
                client.call("HDEL", playout.manifest_key, 0)

        with pytest.raises(PoolError, match=(f"^publish of {playout.fingerprint} did not hold: the manifest lacks 1 "
                                             f"of {playout.num_extents} extents$")):
            publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=lose_a_manifest_entry)
        assert client.call("GET", playout.complete_key) is None


def test_a_stored_header_that_cannot_be_read_is_named_when_publishing(table, fresh_pool):  # noqa: F811
    pool = fresh_pool(1)
    playout = PoolLayout(read_header(table), EXTENT_ROWS)
    with PoolClient(pool.url) as client:
        client.call("SET", playout.header_key, json.dumps({"pool_layout": POOL_LAYOUT_VERSION}).encode())
    with pytest.raises(TableFormatError, match=(rf"^pool table {playout.fingerprint}: unreadable table header in "
                                                r"the pool \('table'\)$")):
        publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)


def test_info_fields_are_read_as_redis_writes_them():
    info = b"# Memory\r\nused_memory:1234\r\nneg:-5\r\nword:abc\r\npath:/a:b\r\nodd:\xff\r\nx:X12\r\n"
    assert [_info_field(info, k) for k in ("used_memory", "neg", "word", "missing", "odd", "x")] == [
        1234, -5, -1, -1, -1, -1]
    assert [_info_text(info, k) for k in ("path", "word", "missing", "odd")] == ["/a:b", "abc", "", "\ufffd"]


def test_publish_refuses_a_pool_that_evicts_only_when_it_has_a_limit(fresh_pool, table):  # noqa: F811
    pool = fresh_pool(1)
    port = pool.nodes[0].port
    with PoolClient(pool.url) as client:
        client.each_node("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")  # maxmemory 0: no limit, no eviction
        assert publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)["sent"] > 0
        client.each_node("CONFIG", "SET", "maxmemory", "1")
    with pytest.raises(PoolError, match=(rf"^pool node 127.0.0.1:{port} evicts keys when full \(maxmemory 1 bytes, "
                                         r"maxmemory-policy allkeys-lru\): published extents would vanish; set "
                                         r"maxmemory-policy noeviction \(CONFIG SET maxmemory-policy noeviction\)$")):
        publish_table(table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
