"""What a (possibly damaged) table file gives each reader: ``verify`` and every tier. Runs
inside the sandbox worker; returns plain data."""

from __future__ import annotations

from typing import Any

import numpy as np

# target name -> (tier, options); tier None is ``verify_table``
TARGETS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "verify": (None, {}),
    "memory": ("memory", {}),
    "pinned": ("pinned", {}),
    "mmap": ("mmap", {}),
    "direct": ("direct", {}),
    "direct/threads": ("direct", {"engine": "threads"}),
}


def warm_up() -> None:
    """Import everything once, so the first case is timed like the others."""
    import engram_offload.tiers  # noqa: F401
    from engram_offload import open_table  # noqa: F401


def read_everywhere(path: str) -> dict[str, tuple[str, Any]]:
    """target -> ``("ok", None)`` (verify passed), ``("rows", uint8 [num_rows, row_bytes])``,
    ``("refused", "TableFormatError: ...")`` or ``("error", "Type: ...")`` (anything else)."""
    import warnings

    from engram_offload import ChecksumError, TableFormatError, open_table
    from engram_offload.table import verify_table

    warnings.simplefilter("ignore")  # the pinned tier warns when there is no CUDA
    outcomes: dict[str, tuple[str, Any]] = {}
    for name, (tier, options) in TARGETS.items():
        try:
            if tier is None:
                verify_table(path, progress=False)
                outcomes[name] = ("ok", None)
                continue
            with open_table(path, tier, **options) as store:
                rows = store.read_raw(np.arange(store.num_rows, dtype=np.int64)).numpy().copy()
            outcomes[name] = ("rows", rows)
        except (TableFormatError, ChecksumError) as exc:
            outcomes[name] = ("refused", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported to the test as a failure
            outcomes[name] = ("error", f"{type(exc).__name__}: {exc}")
    return outcomes
