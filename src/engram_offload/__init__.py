"""engram-offload: serve DeepSeek Engram conditional memory from tiered memory.

Importing the package never initialises CUDA.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import PRESETS, EngramConfig
from .errors import ChecksumError, EngramError, TableFormatError, TierError
from .rows import ROW_FORMATS, decode_rows, encode_rows, row_bytes
from .store import open_table
from .table.writer import write_table

__all__ = [
    "__version__",
    "EngramConfig",
    "PRESETS",
    "ROW_FORMATS",
    "encode_rows",
    "decode_rows",
    "row_bytes",
    "EngramError",
    "TableFormatError",
    "ChecksumError",
    "TierError",
    "open_table",
    "write_table",
]
