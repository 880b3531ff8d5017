"""``shared list`` and ``shared drop``: this uid's shared-tier segments in ``/dev/shm``."""

from __future__ import annotations

import argparse
import json

from ..units import format_bytes
from . import UsageError
from .options import add_json

DEFAULT_SHM_DIR = "/dev/shm"


def register(sub: argparse._SubParsersAction) -> None:
    shared = sub.add_parser(
        "shared", help="list or drop the shared tier's segments (one copy of a table per machine)",
        description="The shared tier keeps one copy of a table's rows per machine and uid in a shared-memory "
        "segment that outlives its processes: list them, and drop those no process uses.")
    cmds = shared.add_subparsers(dest="shared_command", metavar="SHARED_COMMAND", required=True)
    ls = cmds.add_parser("list", help="this uid's segments: size, table, ready or loading, in use or not",
                         description="List this uid's segments and the lock files left without their segment.")
    _add_shm_dir(ls)
    add_json(ls)
    ls.set_defaults(func=cmd_list)
    drop = cmds.add_parser("drop", help="remove segments no process uses (and their lock files)",
                           description="Remove the named segments, or with --all every segment no process "
                           "uses and every lock file left without its segment. A segment in use is kept (its "
                           "processes hold it until they exit); the exit code is 1 when one was kept.")
    drop.add_argument("names", nargs="*", metavar="NAME", help="segments to drop, as shared list names them")
    drop.add_argument("--all", action="store_true", help="every unused segment and orphan lock file")
    _add_shm_dir(drop)
    drop.set_defaults(func=cmd_drop)


def _add_shm_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shm-dir", default=DEFAULT_SHM_DIR, metavar="DIR",
                        help=f"the tmpfs folder the shared tier was given (default {DEFAULT_SHM_DIR})")


def cmd_list(args: argparse.Namespace) -> int:
    from ..tiers.segment_admin import list_segments
    from ..tiers.segments import uid_folder

    entries = list_segments(args.shm_dir)
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    if not entries:
        print(f"no segments in {uid_folder(args.shm_dir)}")
        return 0
    total = sum(e.bytes for e in entries)
    print(f"{len(entries)} segment file(s) of this uid in {args.shm_dir}, {format_bytes(total)}:")
    for e in entries:
        use = "in use" if e.in_use else "unused"
        what = f"{format_bytes(e.bytes)}, {e.state}, {use}" + (f", table {e.table}" if e.table else "")
        print(f"  {e.name}  {what}")
    if any(not e.in_use for e in entries):
        print("engram-offload shared drop NAME (or --all) removes unused ones")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    from ..tiers.segment_admin import drop_segments

    if bool(args.names) == bool(args.all):
        raise UsageError("give segment names (shared list names them) or --all, not both")
    dropped, kept = drop_segments(None if args.all else args.names, args.shm_dir)
    for name in dropped:
        print(f"dropped {name}")
    for name in kept:
        print(f"kept {name}: a process uses it; it goes when its processes exit (or stop them and drop it again)")
    if not dropped and not kept:
        print("nothing to drop")
    return 1 if kept else 0
