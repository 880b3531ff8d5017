"""Byte sizes on the command line: ``512M``, ``2G``, ``1.5GiB``, ``10%`` of a whole, plain ints."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, whole: int | None = None) -> int:
    """``"512M"`` -> 536870912 (binary units; ``K``/``KiB``/``KB`` alike), ``"10%"`` -> 10% of
    ``whole`` (when given). Raises ``ValueError`` naming the accepted forms."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip()
        if s.endswith("%"):
            if whole is None:
                raise ValueError(f"size {text!r}: a percentage needs something to be a percentage of here")
            try:
                value = int(float(s[:-1]) / 100 * whole)
            except ValueError:
                raise ValueError(f"size {text!r} is not a number followed by %") from None
        else:
            m = _PATTERN.match(s)
            if not m:
                raise ValueError(f"size {text!r} not understood: give bytes (1073741824), a unit (512M, 2G, 1.5GiB)"
                                 + (" or a percentage (20%)" if whole is not None else ""))
            value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return value


def format_bytes(n: float) -> str:
    """``2254857830`` -> ``"2.10 GiB"``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
