"""``format_stats_table``: a store's ``stats()`` as a table for the terminal (rich)."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["format_stats_table"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def format_stats_table(stats: dict[str, Any], title: str = "row store", width: int = 120) -> str:
    """Render ``TableStore.stats()`` (one row per level, then the store's totals) as text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("level", "requests", "rows", "hits", "misses", "hit rate", "bytes read",
                "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "level" else "right")
    for lv in stats.get("levels", []):
        table.add_row(str(lv["level"]), f"{lv['requests']:,}", f"{lv['rows']:,}", f"{lv['hits']:,}",
                      f"{lv['misses']:,}", f"{lv['hit_rate']:.1%}" if lv["level"] != "tier" else "-",
                      _bytes(lv["bytes_read"]), f"{lv['p50_ms']:.3f}", f"{lv['p90_ms']:.3f}", f"{lv['p99_ms']:.3f}")
    s = stats.get("store")
    if s:
        table.add_row("store", f"{s['fetches']:,}", f"{s['rows_requested']:,}",
                      f"unique {s['rows_unique']:,}", f"({s['unique_ratio']:.1%})", f"{s['hit_rate']:.1%}",
                      _bytes(s["bytes_read"]), f"{s['fetch_p50_ms']:.3f}", f"{s['fetch_p90_ms']:.3f}",
                      f"{s['fetch_p99_ms']:.3f}", end_section=True)
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()
