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
    "EngramConfig": ".engram.config",
    "PRESETS": ".engram.config",
    "ROW_FORMATS": ".engram.rows",
    "encode_rows": ".engram.rows",
    "decode_rows": ".engram.rows",
    "row_bytes": ".engram.rows",
    "EngramError": ".errors",
    "TableFormatError": ".errors",
    "ChecksumError": ".errors",
    "TierError": ".errors",
    "NgramHasher": ".engram.hashing",
    "EngramLayer": ".engram.layer",
    "compress_tokenizer": ".engram.tokenizer",
    "cached_token_map": ".engram.tokenizer",
    "Prefetcher": ".serving.prefetch",
    "open_table": ".serving.store",
    "shard_columns": ".serving.sharding",
    "assemble_columns": ".serving.sharding",
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
    from .engram.config import PRESETS, EngramConfig
    from .engram.hashing import NgramHasher
    from .engram.layer import EngramLayer
    from .engram.rows import ROW_FORMATS, decode_rows, encode_rows, row_bytes
    from .engram.tokenizer import cached_token_map, compress_tokenizer
    from .errors import ChecksumError, EngramError, TableFormatError, TierError
    from .serving.prefetch import Prefetcher
    from .serving.sharding import assemble_columns, shard_columns
    from .serving.store import open_table
    from .table.writer import write_table
