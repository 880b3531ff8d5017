"""Sub-commands of the ``engram-offload`` command line (see ``cli``)."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad combination of command-line arguments: reported in one line, exit code 2."""
