"""The one switch that turns the optional C helpers off: ``ENGRAM_OFFLOAD_NO_NATIVE``.

Set to anything but ``""`` or ``"0"``, every module with a native fast path (the hash
kernel, the row caches' hit path, the io_uring reader) takes its pure-Python fallback.
Read on every call, so tests can flip it with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import os

__all__ = ["NO_NATIVE_ENV", "native_disabled"]

NO_NATIVE_ENV = "ENGRAM_OFFLOAD_NO_NATIVE"


def native_disabled() -> bool:
    """True when ``ENGRAM_OFFLOAD_NO_NATIVE`` is set to anything but ``""`` or ``"0"``."""
    return os.environ.get(NO_NATIVE_ENV, "") not in ("", "0")

