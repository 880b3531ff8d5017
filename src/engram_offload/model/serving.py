"""Serve a trained model's Engram table from a tier: convert its checkpoint, open the table."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..cache.policy import DEFAULT_POLICY
from ..engram.config import EngramConfig
from ..serving.store import TableStore, open_table
from ..table.convert import convert_checkpoint
from ..tiers import tier_names

__all__ = ["served_table", "TIERS"]

TIERS = tier_names(local=True, private=True)  # the process's own copy of a model's table


@contextmanager
def served_table(model_dir: str | os.PathLike[str], tier: str, *, table: str | os.PathLike[str] | None = None,
                 cache_bytes: int = 0, policy: str = DEFAULT_POLICY) -> Iterator[TableStore]:
    """The model's table opened on ``tier``: ``table`` if given, else converted from the
    checkpoint into a temporary file (removed on exit)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)}")
    with tempfile.TemporaryDirectory(prefix="engram-table-") as tmp:
        if table is None:
            config = EngramConfig.from_hf_config(Path(model_dir) / "config.json")
            table = convert_checkpoint(model_dir, Path(tmp) / "table.engram", config, progress=False)
        store = open_table(table, tier, cache_bytes=cache_bytes or None, policy=policy)
        assert isinstance(store, TableStore)  # one tier of TIERS, not a per-layer placement
        try:
            yield store
        finally:
            store.close()
