"""The one switch that turns the optional C helpers off: ``ENGRAM_OFFLOAD_NO_NATIVE``.

Set to anything but ``""`` or ``"0"``, every module with a native fast path (the hash
kernel, the row caches' hit path, the io_uring reader) takes its pure-Python fallback.
Read on every call, so tests can flip it with ``monkeypatch.setenv``. ``env_choice`` reads
the settings that pick one fast path among several, to measure one against another.
"""

from __future__ import annotations

import os

__all__ = ["NO_NATIVE_ENV", "env_choice", "native_disabled"]

NO_NATIVE_ENV = "ENGRAM_OFFLOAD_NO_NATIVE"


def native_disabled() -> bool:
    """True when ``ENGRAM_OFFLOAD_NO_NATIVE`` is set to anything but ``""`` or ``"0"``."""
    return os.environ.get(NO_NATIVE_ENV, "") not in ("", "0")


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The setting ``name``: one of ``choices`` (case and surrounding spaces ignored; unset or
    empty: the first). Any other value raises one line saying it is not ``what``."""
    value = os.environ.get(name, "")
    choice = value.strip().lower() or choices[0]
    if choice not in choices:
        raise ValueError(f"{name}={value!r} is not {what}: set it to {', '.join(choices[:-1])} or {choices[-1]}, "
                         "or unset it")
    return choice
