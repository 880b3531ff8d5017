"""engram-offload: serve DeepSeek Engram conditional memory from tiered memory.

The public names below are imported on first use (module ``__getattr__``), so
``import engram_offload`` imports neither PyTorch nor NumPy and never initialises CUDA::

    from engram_offload import NgramHasher, EngramLayer, compress_tokenizer, cached_token_map, Prefetcher, open_table
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "EngramConfig": ".config",
    "PRESETS": ".config",
    "ROW_FORMATS": ".rows",
    "encode_rows": ".rows",
    "decode_rows": ".rows",
    "row_bytes": ".rows",
    "EngramError": ".errors",
    "TableFormatError": ".errors",
    "ChecksumError": ".errors",
    "TierError": ".errors",
    "NgramHasher": ".hashing",
    "EngramLayer": ".layer",
    "compress_tokenizer": ".tokenizer",
    "cached_token_map": ".tokenizer",
    "Prefetcher": ".prefetch",
    "open_table": ".store",
    "shard_columns": ".sharding",
    "assemble_columns": ".sharding",
    "write_table": ".table.writer",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from .config import PRESETS, EngramConfig
    from .errors import ChecksumError, EngramError, TableFormatError, TierError
    from .hashing import NgramHasher
    from .layer import EngramLayer
    from .prefetch import Prefetcher
    from .rows import ROW_FORMATS, decode_rows, encode_rows, row_bytes
    from .sharding import assemble_columns, shard_columns
    from .store import open_table
    from .table.writer import write_table
    from .tokenizer import cached_token_map, compress_tokenizer
