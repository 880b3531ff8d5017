"""Loading a table into a Redis pool, listing the pool, dropping a table from it.

``publish_table`` streams the table file once, checking each page against its checksum, cuts
the rows into extents (``layout.PoolLayout``), each row followed by its MAC under the
operator's key (``key.load_key``) computed from those verified bytes, and writes each
extent that the pool lacks: ``SET`` the extent, then record its xxh3_64 in the manifest.
An extent already present with the right length and manifest digest is skipped, so an
interrupted publish resumes where it stopped. The ``complete`` marker is written last,
after every extent's length and digest has been checked, with a MAC of the header and
the manifest under the key; readers refuse a table without it, or whose marker does not
hold under their key. A table in the pool under an older pool layout version is dropped
and published afresh.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Iterator, Sequence, TypedDict

import numpy as np
import xxhash

from ..errors import TableFormatError
from ..table.format import TableHeader, read_header
from ..table.progress import byte_progress
from ..table.verify import bad_pages, page_checksum_error
from .client import PoolClient, PoolError
from .key import PoolKey, load_key
from .layout import (
    DEFAULT_EXTENT_ROWS,
    POOL_LAYOUT_VERSION,
    PoolLayout,
    header_from_record,
    layout_version_problem,
    meta_key,
    rows_with_sums,
    stored_layout_version,
)

__all__ = ["publish_table", "PublishResult", "pool_status", "drop_table", "read_pool_table", "check_complete",
           "check_extent_digests"]

READ_CHUNK_BYTES = 32 << 20


class PublishResult(TypedDict):
    """What ``publish_table`` did: extents sent, and extents already in the pool (skipped)."""

    fingerprint: str
    extents: int
    sent: int
    skipped: int
    bytes_sent: int
    nodes: int
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


def _dense_chunks(header: TableHeader, advance: Callable[[int], None]) -> Iterator[np.ndarray]:
    """The table's rows in order, as uint8 chunks ``[rows, row_bytes]``, each page verified."""
    layout = header.layout
    rb, rpp, page = layout.row_bytes, layout.rows_per_page, layout.page_bytes
    chunk_pages = max(1, READ_CHUNK_BYTES // page)
    staging = bytearray(chunk_pages * page)
    rows_left = layout.num_rows
    with open(header.path, "rb", buffering=0) as f:
        f.seek(layout.data_offset)
        for first_page in range(0, layout.num_pages, chunk_pages):
            pages = min(chunk_pages, layout.num_pages - first_page)
            view = memoryview(staging)[: pages * page]
            if f.readinto(view) != len(view):
                raise EOFError(f"{header.path} ended early while publishing; the file changed under us")
            bad = bad_pages(header, np.arange(first_page, first_page + pages), view)
            if bad.size:
                raise page_checksum_error(header, first_page + int(bad[0]), reread=False)
            rows = np.frombuffer(view, np.uint8).reshape(pages, page)[:, : rpp * rb].reshape(-1, rb)
            take = min(len(rows), rows_left)
            rows_left -= take
            advance(len(view))
            yield rows[:take]


def _extents(playout: PoolLayout, key: PoolKey,
             advance: Callable[[int], None]) -> Iterator[tuple[int, memoryview]]:
    """(extent index, its bytes) in order; the bytes are valid until the next item."""
    sizes = (playout.counts * playout.stride).tolist()
    buf = np.empty(max(sizes), np.uint8)
    extent, filled, first_row = 0, 0, 0
    for rows in _dense_chunks(playout.header, advance):
        ids = np.arange(first_row, first_row + len(rows))
        first_row += len(rows)
        flat, pos = rows_with_sums(rows, playout.fingerprint, ids, key).reshape(-1), 0
        while pos < len(flat):
            take = min(sizes[extent] - filled, len(flat) - pos)
            buf[filled: filled + take] = flat[pos: pos + take]
            filled, pos = filled + take, pos + take
            if filled == sizes[extent]:
                yield extent, memoryview(buf)[:filled]  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
                extent, filled = extent + 1, 0


def _hgetall(client: PoolClient, key: str) -> dict[str, str]:
    flat = client.call("HGETALL", key)
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}


def _lengths(client: PoolClient, playout: PoolLayout) -> np.ndarray:
    replies = client.execute([("STRLEN", key) for key in playout.keys])
    bad = next((r for r in replies if isinstance(r, Exception)), None)
    if bad is not None:
        raise PoolError(f"STRLEN failed: {bad}")
    return np.array(replies, np.int64)


def _complete_record(playout: PoolLayout, manifest: dict[str, str], key: PoolKey) -> bytes:
    digests = "\n".join(manifest.get(str(e), "") for e in range(playout.num_extents))
    return json.dumps({
        "fingerprint": playout.fingerprint,
        "extents": playout.num_extents,
        "extent_rows": playout.extent_rows,
        "manifest_mac": key.record_tag(playout.header_record(), digests.encode()),
    }, sort_keys=True).encode()


def check_complete(client: PoolClient, playout: PoolLayout, key: PoolKey) -> list[str]:
    """What keeps the table from being served (empty when complete): the complete marker
    (its MAC of the header and manifest, under ``key``), the manifest and every extent's
    length are checked."""
    marker = client.call("GET", playout.complete_key)
    if marker is None:
        return ["no complete marker: the publish has not finished"]
    manifest = _hgetall(client, playout.manifest_key)
    missing = [str(e) for e in range(playout.num_extents) if str(e) not in manifest]
    if missing:
        return [f"the manifest lacks {len(missing)} of {playout.num_extents} extents"]
    if marker != _complete_record(playout, manifest, key):
        return [f"its complete marker does not hold under the pool key {key.path} (written by someone without that "
                "key, by a publish with another key file, or a publish is under way)"]
    expected = playout.counts * playout.stride
    lengths = _lengths(client, playout)
    wrong = np.flatnonzero(lengths != expected)
    return [f"extent {playout.keys[int(e)]} holds {int(lengths[e]):,} bytes, expected {int(expected[e]):,}"
            for e in wrong[:5]] + ([f"... and {len(wrong) - 5} more extents"] if len(wrong) > 5 else [])


def check_extent_digests(client: PoolClient, playout: PoolLayout, extents: Sequence[int]) -> list[str]:
    """The ``extents`` whose bytes in the pool differ from their manifest digest (empty when
    all match): each is read whole and hashed here."""
    manifest = _hgetall(client, playout.manifest_key)
    problems = []
    for extent in extents:
        value = client.call("GET", playout.keys[extent])
        if value is None or xxhash.xxh3_64_hexdigest(value) != manifest.get(str(extent)):
            problems.append(f"extent {playout.keys[extent]} does not match its manifest digest")
    return problems


def publish_table(
    path: str | os.PathLike[str],
    url: str | Sequence[str],
    *,
    extent_rows: int = DEFAULT_EXTENT_ROWS,
    progress: bool | None = None,
    on_extent: Callable[[int], None] | None = None,
    timeout: float = 60.0,
) -> PublishResult:
    """Load the table at ``path`` into the pool at ``url``; resume an interrupted publish.

    ``on_extent(extent)`` is called after each extent is in place. Returns the
    fingerprint, extent count and how many extents were sent or already there.
    """
    playout = PoolLayout(read_header(path), extent_rows)
    key = load_key(create=True)
    with PoolClient(url, timeout=timeout) as client:
        _refuse_evicting_nodes(client)
        stored = client.call("GET", playout.header_key)
        if stored is not None and stored_layout_version(stored) != POOL_LAYOUT_VERSION:
            _drop_keys(client, playout.fingerprint)  # another layout's extents: start afresh
            stored = None
        if stored is not None:
            _, rows = header_from_record(stored, f"pool table {playout.fingerprint}")
            if rows != extent_rows:
                raise PoolError(
                    f"table {playout.fingerprint} is already in the pool with extents of {rows:,} rows: "
                    f"publish with extent rows {rows:,}, or drop it first (pool drop {playout.fingerprint})"
                )
        else:
            client.call("SET", playout.header_key, playout.header_record())
        result: PublishResult = {"fingerprint": playout.fingerprint, "extents": playout.num_extents, "sent": 0,
                  "skipped": 0, "bytes_sent": 0, "nodes": len(client.nodes)}
        if not check_complete(client, playout, key):
            result["skipped"] = playout.num_extents
            return result
        client.call("DEL", playout.complete_key)  # readers refuse the table until it is whole again
        manifest = _hgetall(client, playout.manifest_key)
        lengths = _lengths(client, playout).tolist()
        layout = playout.header.layout
        with byte_progress(f"publishing {playout.header.path.name}", layout.data_bytes, progress) as advance:
            for extent, data in _extents(playout, key, advance):
                digest = xxhash.xxh3_64_hexdigest(data)
                if manifest.get(str(extent)) == digest and lengths[extent] == len(data):
                    result["skipped"] += 1
                else:
                    client.call("SET", playout.keys[extent], data)
                    client.call("HSET", playout.manifest_key, extent, digest)
                    result["sent"] += 1
                    result["bytes_sent"] += len(data)
                if on_extent is not None:
                    on_extent(extent)
        manifest = _hgetall(client, playout.manifest_key)
        client.call("SET", playout.complete_key, _complete_record(playout, manifest, key))
        problems = check_complete(client, playout, key)
        if problems:
            client.call("DEL", playout.complete_key)
            raise PoolError(f"publish of {playout.fingerprint} did not hold: {'; '.join(problems)}")
    return result


def _refuse_evicting_nodes(client: PoolClient) -> None:
    """``PoolError`` when a node may evict keys when full: extents would vanish silently."""
    for node, info in enumerate(client.each_node("INFO", "memory")):
        limit, policy = _info_field(info, "maxmemory"), _info_text(info, "maxmemory_policy")
        if limit > 0 and policy not in ("noeviction", ""):
            raise PoolError(f"pool node {client.address(node)} evicts keys when full (maxmemory {limit:,} bytes, "
                            f"maxmemory-policy {policy}): published extents would vanish; set maxmemory-policy "
                            "noeviction (CONFIG SET maxmemory-policy noeviction)")


def read_pool_table(client: PoolClient, fp: str) -> PoolLayout:
    """The layout of table ``fp`` as stored in the pool (``PoolError`` when it is not there)."""
    if not FINGERPRINT.match(fp):
        raise ValueError(f"{fp!r} is not a table fingerprint (16 hex digits; see pool status)")
    stored = client.call("GET", meta_key(fp, "header"))
    if stored is None:
        raise PoolError(f"table {fp} is not in the pool: publish it (engram-offload pool publish TABLE)")
    header, extent_rows = header_from_record(stored, f"pool table {fp}")
    return PoolLayout(header, extent_rows)


def pool_status(url: str | Sequence[str], timeout: float = 10.0) -> dict[str, Any]:
    """The pool's nodes (with their memory use) and every table in it, complete or not
    (checked under the pool key, ``load_key``)."""
    key = load_key()
    with PoolClient(url, timeout=timeout) as client:
        memory = [_info_field(info, "used_memory") for info in client.each_node("INFO", "memory")]
        nodes = [{"address": client.address(i), "used_memory": memory[i]} for i in range(len(client.nodes))]
        tables = [_table_status(client, name, key) for name in sorted(set(client.scan("{*}:engram:header")))]
    return {"cluster": client.cluster, "nodes": nodes, "tables": tables}


def _table_status(client: PoolClient, key: bytes, pool_key: PoolKey) -> dict[str, Any]:
    """One table's entry of ``pool_status``; a key or header that is not a table's gives an
    entry saying so (the other tables are still listed)."""
    name = key.decode(errors="backslashreplace")
    match = re.fullmatch(r"\{([0-9a-f]{16})\}:engram:header", name)
    if match is None:
        return {"fingerprint": name, "pool_layout": None, "complete": False,
                "problems": [f"key {name!r} is not an engram-offload table's header (another program's key?)"]}
    fp = match.group(1)
    record = client.call("GET", key)
    try:
        header, extent_rows = header_from_record(record, f"table {fp}", any_version=True)
        playout = PoolLayout(header, extent_rows)
    except (TableFormatError, PoolError, ValueError, TypeError) as exc:
        version = stored_layout_version(record or b"")
        problem = (layout_version_problem(f"table {fp}", version) if version not in (None, POOL_LAYOUT_VERSION)
                   else f"unreadable: {exc}; drop it (engram-offload pool drop {fp}) and publish it again")
        return {"fingerprint": fp, "pool_layout": version, "complete": False, "problems": [problem]}
    version = stored_layout_version(record)
    problems = (check_complete(client, playout, pool_key) if version == POOL_LAYOUT_VERSION
                else [layout_version_problem(f"table {fp}", version)])
    layout = playout.header.layout
    return {
        "fingerprint": fp, "pool_layout": version, "complete": not problems, "problems": problems,
        "extents": playout.num_extents, "extent_rows": playout.extent_rows,
        "manifest_extents": int(client.call("HLEN", playout.manifest_key)),
        "rows": layout.num_rows, "row_format": layout.row_format, "row_bytes": layout.row_bytes,
        "bytes": layout.num_rows * playout.stride,
    }


def _info_text(info: bytes, name: str) -> str:
    for line in info.decode(errors="replace").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _info_field(info: bytes, name: str) -> int:
    text = _info_text(info, name)
    return int(text) if text.lstrip("-").isdigit() else -1


def drop_table(url: str | Sequence[str], fp: str, timeout: float = 30.0) -> int:
    """Delete every key of table ``fp`` (and no other key); return how many were deleted."""
    if not FINGERPRINT.match(fp):
        raise ValueError(f"{fp!r} is not a table fingerprint (16 hex digits; see pool status)")
    with PoolClient(url, timeout=timeout) as client:
        return _drop_keys(client, fp)


def _drop_keys(client: PoolClient, fp: str) -> int:
    """Delete the complete marker (first: readers stop at once), then every other key of table ``fp``."""
    deleted = int(client.call("DEL", meta_key(fp, "complete")))
    extents = sorted(set(client.scan(f"{fp}:engram:*")))
    meta = sorted(set(client.scan(f"{{{fp}}}:engram:*")))
    keys = [k.decode() for k in extents + meta]
    replies = client.execute([("DEL", k) for k in keys])
    bad = next((r for r in replies if isinstance(r, Exception)), None)
    if bad is not None:
        raise PoolError(f"DEL failed while dropping {fp}: {bad}")
    return deleted + int(sum(replies))
