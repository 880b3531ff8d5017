"""Exceptions raised by engram-offload: every one of them is defined here.

    EngramError                 base of every error this package raises on purpose
    ├── TableFormatError        a table file is not a table, is truncated, or is of another version
    ├── ChecksumError           a block's checksum does not match its bytes
    ├── TierError               a storage tier failed to read (after its retries)
    └── PrefetchError           the background fetch of a step failed (cause attached)
        └── StepCancelled       rows were asked of a cancelled step

Bad arguments raise ``ValueError`` (and ``IndexError`` for row ids out of range),
as Python code expects.
"""

from __future__ import annotations

__all__ = ["EngramError", "TableFormatError", "ChecksumError", "TierError", "PrefetchError", "StepCancelled"]


class EngramError(Exception):
    """Base of every error engram-offload raises on purpose."""


class TableFormatError(EngramError):
    """A table file is not an Engram table, is truncated, or has an unsupported version."""


class ChecksumError(EngramError):
    """A block of a table file does not match its checksum."""


class TierError(EngramError):
    """A storage tier could not read rows, after retrying."""


class PrefetchError(EngramError):
    """The background fetch of a step failed; ``__cause__`` holds the original error."""


class StepCancelled(PrefetchError):
    """Rows were asked of a step that was cancelled."""
