"""``pool publish|status|drop|serve``: one copy of a table in a Redis pool for many machines."""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import sys
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
                            "without persistence: one plain server, or a Redis Cluster for N > 1, requiring the "
                            "password of the pool key file. Runs until interrupted. For production use an existing "
                            "Redis Cluster with replicas (docs/pool.md).")
    add_pool_nodes(serve, 3, ": a Redis Cluster of 3 masters, the fewest Redis Cluster recommends")
    removed_option(serve, "--nodes", "--pool-nodes")
    serve.add_argument("--port", type=int_in_range(1, 65535), default=7001,
                       help="first TCP port (default 7001)")
    serve.add_argument("--bind", type=_ipv4, default="127.0.0.1", metavar="ADDRESS",
                       help="the IPv4 address of this machine the servers listen on (default 127.0.0.1)")
    serve.add_argument("--dir", help="working folder for the servers' logs (default: a temporary one)")
    access = serve.add_mutually_exclusive_group()
    access.add_argument("--requirepass", metavar="FILE",
                        help="the pool key file whose password the servers require (default: $ENGRAM_OFFLOAD_POOL_KEY, "
                        "else $XDG_CONFIG_HOME/engram-offload/pool.key), written with mode 0600 when missing; clients "
                        "read the password and the row key there")
    access.add_argument("--no-password", action="store_true",
                        help="require no password (loopback only): any local user may then read, delete and "
                        "overwrite the pool's values")
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


def _ipv4(text: str) -> str:
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address: give one of this machine's, "
                                         "such as 127.0.0.1") from None
    if address.is_unspecified:
        raise argparse.ArgumentTypeError(f"{text} would listen on every interface: give one address of this machine")
    return text


def cmd_serve(args: argparse.Namespace) -> int:
    from ..pool.key import KEY_ENV, key_path, load_key
    from ..pool.servers import start_local_pool

    path = key_path() if args.requirepass is None else Path(args.requirepass)
    if args.no_password:
        if not ipaddress.IPv4Address(args.bind).is_loopback:
            raise ValueError(f"--no-password with --bind {args.bind} would let any host that reaches it rewrite the "
                             "pool: drop --no-password, or bind a loopback address")
        password = None
    else:
        password = load_key(path, create=True).password
        if password is None:
            raise ValueError(f"the pool key file {path} holds no password: add a line 'password WORD', or remove "
                             "the file to have a new one written")
    stop = threading.Event()
    handled = (signal.SIGTERM, signal.SIGHUP)  # a closed terminal stops the servers too
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in handled}
    try:  # the servers die with this process, even when it is killed (PR_SET_PDEATHSIG)
        with start_local_pool(args.pool_nodes, args.port, args.dir, password=password, die_with_parent=True,
                              host=args.bind) as pool:
            kind = "a Redis Cluster" if pool.cluster else "one Redis server"
            print(f"serving {kind} on {pool.url} (no persistence, {args.bind} only); Ctrl-C stops it", flush=True)
            if password:
                where = "" if path == key_path() else f" (set {KEY_ENV}={path} for them)"
                print(f"  password required: it is in {path}, with the row key; clients read both there{where}",
                      flush=True)
            else:
                print("WARNING: --no-password: any local user may read, delete and overwrite the pool's values "
                      "(rows written without the pool key fail their checks: reads fall back or fail)",
                      file=sys.stderr, flush=True)
            print(f"  engram-offload pool publish TABLE --pool {pool.url}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
