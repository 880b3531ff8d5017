"""Table files: format, writing (streaming, atomic), random tables, conversion, verification."""

from __future__ import annotations

from .format import FORMAT_VERSION, TableHeader, TableLayout, read_header
from .generate import make_random_table, random_rows
from .verify import verify_table
from .writer import TableWriter, write_table

__all__ = [
    "FORMAT_VERSION",
    "TableHeader",
    "TableLayout",
    "TableWriter",
    "read_header",
    "write_table",
    "make_random_table",
    "random_rows",
    "verify_table",
    "convert_checkpoint",
]


def __getattr__(name: str):
    if name == "convert_checkpoint":  # safetensors is imported only when converting
        from .convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(name)
