"""Values on the command line: byte sizes (``512M``, ``2G``, ``1.5GiB``, ``10%`` of a whole,
plain ints) and argparse ``type=`` validators for numbers that must be finite and in range.

A validator raises ``argparse.ArgumentTypeError`` with a message naming the accepted values,
so argparse reports a bad value as a usage error (exit code 2).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

__all__ = [
    "MAX_SIZE",
    "MAX_THREADS",
    "format_bytes",
    "parse_size",
    "size_arg",
    "size_or_percent_arg",
    "finite_float",
    "positive_float",
    "non_negative_float",
    "fraction",
    "unit_interval",
    "positive_int",
    "non_negative_int",
    "int_in_range",
]

MAX_SIZE = 1 << 60  # 1 EiB: any larger byte count is a typo
MAX_THREADS = 1024  # a --threads above it is a typo (torch's thread pool crashes the process far above it)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, whole: int | None = None) -> int:
    """``"512M"`` -> 536870912 (binary units; ``K``/``KiB``/``KB`` alike; a fraction of a unit
    to the nearest byte), ``"10%"`` -> 10% of ``whole`` (when given). Raises ``ValueError``
    naming the accepted forms for anything else: negative, a fraction of a byte (``0.5``,
    never silently 0), infinite, NaN or above ``MAX_SIZE`` (1 EiB)."""
    if isinstance(text, bool):
        raise ValueError(f"size {text!r} is not a number of bytes")
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip()
        if s.endswith("%"):
            if whole is None:
                raise ValueError(f"size {text!r}: a percentage needs something to be a percentage of here")
            try:
                percent = float(s[:-1])
            except ValueError:
                raise ValueError(f"size {text!r} is not a number followed by %") from None
            if not math.isfinite(percent) or percent < 0:
                raise ValueError(f"size {text!r}: the percentage must be a finite number >= 0, e.g. 20%")
            if percent > 100:
                raise ValueError(f"size {text!r}: a percentage must be at most 100%, e.g. 20%")
            value = int(percent / 100 * whole)
        else:
            m = _PATTERN.match(s.lstrip("-+"))
            if m and s.startswith("-"):
                raise ValueError(f"size {text!r} is negative: give a size >= 0")
            if not m:
                raise ValueError(f"size {text!r} not understood: give bytes (1073741824), a unit (512M, 2G, 1.5GiB)"
                                 + (" or a percentage (20%)" if whole is not None else ""))
            number, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
            if unit == 1 and not number.is_integer():
                raise ValueError(f"size {text!r} is not a whole number of bytes: give bytes (1024) or a unit (0.5K)")
            value = round(number * unit)  # 1.1G: to the nearest byte
            if value == 0 and number > 0:
                raise ValueError(f"size {text!r} is less than one byte: give bytes or a larger unit")
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    if value > MAX_SIZE:
        raise ValueError(f"size {text!r} is over {format_bytes(MAX_SIZE)}: check the unit")
    return value


def format_bytes(n: float) -> str:
    """A byte count in the largest binary unit it fills, one decimal: ``2254857830`` ->
    ``"2.1 GiB"``, ``4 << 20`` -> ``"4.0 MiB"`` (never ``"0.00 GiB"``), ``12`` -> ``"12 B"``.
    Every size the package prints goes through here."""
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30),
                       ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- argparse validators
def size_arg(text: str) -> int:
    """argparse type: a byte size (``512M``, ``2G``, ``1073741824``); no percentages."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_or_percent_arg(text: str) -> str:
    """argparse type: a byte size or a percentage (``20%``) of a whole known later; returns
    the text, checked, for ``parse_size(text, whole)`` once the whole is known."""
    try:
        parse_size(text, whole=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _float_arg(test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _int_arg(lo: int | None, hi: int | None, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what
    return parse


finite_float = _float_arg(lambda x: True, "a finite number")
positive_float = _float_arg(lambda x: x > 0, "a finite number > 0")
non_negative_float = _float_arg(lambda x: x >= 0, "a finite number >= 0")
fraction = _float_arg(lambda x: 0 < x <= 1, "a number in (0, 1]")
unit_interval = _float_arg(lambda x: 0 <= x <= 1, "a number in [0, 1]")
positive_int = _int_arg(1, None, "an integer >= 1")
non_negative_int = _int_arg(0, None, "an integer >= 0")


def int_in_range(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: an integer in ``[lo, hi]``."""
    return _int_arg(lo, hi, f"an integer in [{lo}, {hi}]")
