"""``row-server``: one process per machine that serves a table's rows to every rank over a Unix socket."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from ..units import positive_int
from .options import add_cache_bytes, add_policy, local_tier_arg


def register(sub: argparse._SubParsersAction) -> None:
    from ..tiers import tier_names

    p = sub.add_parser(
        "row-server", help="serve a table's rows to the ranks of this machine over a Unix socket",
        description="Open TABLE on a tier (with its row cache) and serve its rows to every rank of this machine "
        "that connects to SOCKET (same uid or root only). Runs until SIGTERM or SIGINT, then closes the "
        "connections, removes the socket and exits 0. Example systemd unit: docs/row-server.md.")
    p.add_argument("--table", required=True, help="the table file to serve (required)")
    p.add_argument("--socket", required=True, metavar="PATH",
                   help="the Unix socket to listen on, created 0600 (required; its folder should be yours only)")
    p.add_argument("--tier", default="direct", type=local_tier_arg(placements=False),
                   help=f"where the rows are read from: {', '.join(tier_names(local=True))} (default direct)")
    add_cache_bytes(p)
    add_policy(p)
    p.add_argument("--max-rows", type=positive_int, default=None, metavar="N",
                   help="row ids per round trip, the size of each connection's buffer (default 65,536)")
    p.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="connections served at once (default 64)")
    p.set_defaults(func=cmd_row_server)


def cmd_row_server(args: argparse.Namespace) -> int:
    from ..serving.rowserver.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_ROWS, RowServer, check_socket_path
    from ..serving.store import open_table
    from ..table.format import read_header
    from ..units import parse_size

    check_socket_path(args.socket)  # before the table is opened (a load may take minutes)
    layout = read_header(args.table).layout
    cache_bytes = parse_size(args.cache_bytes, whole=layout.num_rows * layout.row_bytes)
    store = open_table(args.table, args.tier, cache_bytes=cache_bytes or None, policy=args.policy)
    try:
        server = RowServer(store, args.socket, max_rows=args.max_rows or DEFAULT_MAX_ROWS,
                           max_connections=args.max_connections or DEFAULT_MAX_CONNECTIONS)
    except BaseException:
        store.close()
        raise
    stopped: list[str] = []
    closing: list[threading.Thread] = []

    def stop(signum: int, frame: Any) -> None:  # close from another thread: never block in a handler
        stopped.append(signal.Signals(signum).name)
        closing.append(threading.Thread(target=server.close, name="engram-rowserver-stop"))
        closing[-1].start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(f"serving {args.table} ({args.tier} tier) on {args.socket}; SIGTERM or Ctrl-C stops it", flush=True)
        server.serve_forever()
    finally:
        for thread in closing:
            thread.join()
        server.close()  # idempotent: the socket is removed whatever ended the loop
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"stopped ({stopped[0] if stopped else 'the server closed'}); removed {args.socket}", file=sys.stderr)
    return 0
