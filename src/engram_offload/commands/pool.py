"""``pool publish|status|drop|serve``: one copy of a table in a Redis pool for many machines."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import stat
import threading
from pathlib import Path

from ..units import format_bytes, int_in_range, positive_int
from .options import add_json, add_pool, add_pool_nodes, removed_option

DEFAULT_URL = "redis://127.0.0.1:7001"


def register(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser(
        "pool", help="publish tables into a Redis pool (the remote tier), list, drop, serve one",
        description="A pooled copy of a table in Redis Cluster (or one Redis server), read by the "
        "remote tier: open_table(TABLE, tier='remote', pool='redis://host:port[,...]').",
    )
    cmds = pool.add_subparsers(dest="pool_command", metavar="POOL_COMMAND", required=True)

    pub = cmds.add_parser("publish", help="load a table into the pool (resumes an interrupted publish)",
                          description="Stream a table into the pool, extent by extent, checking every page "
                          "of the file and storing a checksum with every row; extents already there with the right checksum are skipped, and the "
                          "table is marked complete only when every extent is in.")
    pub.add_argument("table", metavar="TABLE", help="the table file to publish")
    _add_url(pub)
    pub.add_argument("--extent-rows", type=positive_int, default=1 << 18,
                     help="rows per extent key (default 262,144; at most 512 MiB an extent)")
    pub.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(pub)
    pub.set_defaults(func=cmd_publish)

    stat = cmds.add_parser("status", help="the pool's nodes and tables",
                           description="List the pool's nodes (memory used) and every table in it, "
                           "with its pool layout version and whether it is complete.")
    _add_url(stat)
    add_json(stat)
    stat.set_defaults(func=cmd_status)

    drop = cmds.add_parser("drop", help="delete one table's keys from the pool",
                           description="Delete every key of the table with this fingerprint (see pool "
                           "status); keys of other tables are never touched.")
    drop.add_argument("fingerprint", metavar="FINGERPRINT", help="the table's fingerprint, as pool status lists it")
    _add_url(drop)
    drop.set_defaults(func=cmd_drop)

    serve = cmds.add_parser("serve", help="run a loopback Redis pool to try the remote tier",
                            description="Start N (--pool-nodes) redis-server processes on 127.0.0.1 from PORT on, "
                            "without persistence: one plain server, or a Redis Cluster for N > 1. "
                            "Runs until interrupted. For production use an existing Redis Cluster with "
                            "replicas (docs/pool.md).")
    add_pool_nodes(serve, 3, ": a Redis Cluster of 3 masters, the fewest Redis Cluster recommends")
    removed_option(serve, "--nodes", "--pool-nodes")
    serve.add_argument("--port", type=int_in_range(1, 65535), default=7001,
                       help="first TCP port on 127.0.0.1 (default 7001)")
    serve.add_argument("--dir", help="working folder for the servers' logs (default: a temporary one)")
    serve.add_argument("--requirepass", metavar="FILE",
                       help="require a password (default: none): read from FILE (yours, mode 0600), or generated and written "
                       "there 0600 when FILE does not exist; clients give it in the URL or in "
                       "$ENGRAM_OFFLOAD_POOL_PASSWORD. Without it any local user may rewrite the pool")
    serve.set_defaults(func=cmd_serve)


def _add_url(parser: argparse.ArgumentParser) -> None:
    add_pool(parser, DEFAULT_URL, DEFAULT_URL)
    removed_option(parser, "--redis", "--pool")


def cmd_publish(args: argparse.Namespace) -> int:
    from ..pool.client import redact
    from ..pool.publish import publish_table

    result = publish_table(args.table, args.pool, extent_rows=args.extent_rows,
                           progress=False if args.no_progress else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    url = redact(args.pool)
    print(f"table {result['fingerprint']} is in the pool ({result['nodes']} node(s)): "
          f"{result['extents']:,} extents, {result['sent']:,} sent ({format_bytes(result['bytes_sent'])}), "
          f"{result['skipped']:,} already there")
    print(f"open it with tier='remote', pool='{url}', or without the file as {url}/{result['fingerprint']}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..pool.publish import pool_status

    status = pool_status(args.pool)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    kind = "Redis Cluster" if status["cluster"] else "one Redis server"
    print(f"{kind}, {len(status['nodes'])} node(s):")
    for node in status["nodes"]:
        print(f"  {node['address']}  {format_bytes(node['used_memory'])} used")
    if not status["tables"]:
        print("no tables")
    for t in status["tables"]:
        state = "complete" if t["complete"] else "INCOMPLETE: " + "; ".join(t["problems"])
        if "rows" not in t:  # not readable as a table
            print(f"table {t['fingerprint']}: {state}")
            continue
        print(f"table {t['fingerprint']}: {t['rows']:,} rows of {t['row_bytes']} bytes ({t['row_format']}), "
              f"{format_bytes(t['bytes'])}, {t['extents']:,} extents of {t['extent_rows']:,} rows, "
              f"pool layout v{t['pool_layout']}, {state}")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    from ..pool.publish import drop_table

    deleted = drop_table(args.pool, args.fingerprint)
    print(f"dropped table {args.fingerprint}: {deleted:,} keys deleted" if deleted
          else f"table {args.fingerprint} was not in the pool; nothing deleted")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..pool.servers import start_local_pool

    password = _serve_password(Path(args.requirepass)) if args.requirepass else None
    stop = threading.Event()
    handled = (signal.SIGTERM, signal.SIGHUP)  # a closed terminal stops the servers too
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in handled}
    try:  # the servers die with this process, even when it is killed (PR_SET_PDEATHSIG)
        with start_local_pool(args.pool_nodes, args.port, args.dir, password=password, die_with_parent=True) as pool:
            kind = "a Redis Cluster" if pool.cluster else "one Redis server"
            print(f"serving {kind} on {pool.url} (no persistence, 127.0.0.1 only); Ctrl-C stops it", flush=True)
            if password:
                print(f"  password required: it is in {args.requirepass}; give it as redis://:PASSWORD@... or in "
                      "$ENGRAM_OFFLOAD_POOL_PASSWORD", flush=True)
            else:
                print("  no password: any local user may read and rewrite the pool (--requirepass FILE sets one)",
                      flush=True)
            print(f"  engram-offload pool publish TABLE --pool {pool.url}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _read_password(path: Path) -> str:
    """The password in ``path``, a file of this uid that no other uid may read."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} must be a file of yours that no other user may read (chmod 600 {path})")
        password = f.read().strip()
    if not password or any(c.isspace() for c in password):
        raise ValueError(f"{path} holds no password (one word on one line): remove it to have one generated")
    return password


def _serve_password(path: Path) -> str:
    """The password in ``path`` (a file of this uid, not readable by others), or a new one
    written there with mode 0600 when it does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_password(path)
    password = secrets.token_urlsafe(24)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password
