"""A memory cgroup that caps a process's memory, page cache included.

The ``mmap`` baseline keeps its working set in the kernel's page cache, which no
in-process budget can bound; a memory cgroup can, because the page cache a process faults
in is charged to its cgroup and reclaimed when the cgroup reaches its limit. Both cgroup
v2 (``memory.max``) and v1 (``memory.limit_in_bytes``) are supported, when the process may
create a group (usually as root). ``MemoryCap.create`` returns the cap or the reason why
there is none, so a report can say whether the budget was enforced.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["MemoryCap", "memory_cgroup_root"]

CGROUP = Path("/sys/fs/cgroup")
SLACK_BYTES = 32 << 20  # room for the capped process to grow between two limit updates


def _own_v1_memory_group() -> str:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return path.lstrip("/")
    except OSError:
        pass
    return ""


def _own_v2_group() -> str:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].lstrip("/")
    except OSError:
        pass
    return ""


def memory_cgroup_root() -> tuple[Path, str] | None:
    """(folder under which to make a group, "v1" or "v2"), or None without a memory controller."""
    controllers = CGROUP / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return CGROUP / _own_v2_group(), "v2"
    v1 = CGROUP / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        own = v1 / _own_v1_memory_group()
        return (own if own.is_dir() else v1), "v1"
    return None


class MemoryCap:
    """A memory cgroup with a limit; ``join()`` moves the calling process into it."""

    def __init__(self, path: Path, version: str, limit_bytes: int) -> None:
        self.path = path
        self.version = version
        self.limit_bytes = limit_bytes

    @classmethod
    def create(cls, limit_bytes: int, name: str | None = None) -> tuple["MemoryCap | None", str]:
        """(cap, description) or (None, why not)."""
        found = memory_cgroup_root()
        if found is None:
            return None, "no memory cgroup controller on this machine"
        root, version = found
        path = root / (name or f"engram-offload-bench-{os.getpid()}")
        limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        try:
            path.mkdir(exist_ok=True)
            (path / limit_file).write_text(f"{int(limit_bytes)}\n")
        except OSError as exc:
            try:
                path.rmdir()
            except OSError:
                pass
            return None, f"cannot create a memory cgroup under {root} ({exc.strerror or exc}): run as root to cap the page cache"
        return cls(path, version, int(limit_bytes)), f"memory cgroup {version} {limit_file}={int(limit_bytes)}"

    def join(self, pid: int | None = None) -> None:
        """Move ``pid`` (default: this process) into the group; memory it touches from now on counts."""
        (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except OSError:
            return None

    def charged(self) -> dict[str, int]:
        """What the group holds now: ``anon`` (process memory) and ``file`` (page cache) bytes."""
        keys = {"v1": ("total_rss", "total_cache"), "v2": ("anon", "file")}[self.version]
        values = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            values[name] = int(value)
        return {"anon": values.get(keys[0], 0), "file": values.get(keys[1], 0)}

    def set_limit(self, limit_bytes: int) -> bool:
        """Change the limit (the kernel reclaims page cache to meet a lower one); False if refused."""
        name = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        try:
            (self.path / name).write_text(f"{int(limit_bytes)}\n")
        except OSError:
            return False
        self.limit_bytes = int(limit_bytes)
        return True

    def cap_page_cache(self, budget_bytes: int, slack_bytes: int = SLACK_BYTES,
                       interval: float = 0.02) -> threading.Event:
        """Keep the limit at the group's own process memory plus ``budget_bytes`` plus
        ``slack_bytes`` (room for the process to grow between two checks; process memory
        cannot be reclaimed, so without it a growing process would be killed), so that the
        page cache, not the process, is what the budget bounds. Returns an event: set it to stop."""
        stop = threading.Event()

        def follow() -> None:
            while not stop.wait(interval):
                try:
                    self.set_limit(self.charged()["anon"] + budget_bytes + slack_bytes)
                except OSError:
                    return

        self.set_limit(self.charged()["anon"] + budget_bytes + slack_bytes)
        threading.Thread(target=follow, name="engram-memcap", daemon=True).start()
        return stop

    def remove(self) -> None:
        """Delete the group (it must be empty: call after the processes in it have exited)."""
        try:
            self.path.rmdir()
        except OSError:
            pass
