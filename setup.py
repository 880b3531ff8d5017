"""Build hook for the optional native helpers.

The package itself is pure Python.  ``engram_offload.tiers._uring`` is a small
C extension (batched O_DIRECT reads through io_uring, raw syscalls only, no
liburing).  It is declared ``optional=True``: when it cannot be compiled (no C
compiler, not Linux, missing kernel headers) the package still installs and
``engram_offload.tiers.uring.available()`` reports False.  The other helpers
(page checksums, SIGBUS-guarded mapping copies, the hash kernel, the caches'
hit path, the row copies) are optional the same way, each with a Python fallback.
"""

import sys

from setuptools import Extension, setup

# The page checksum's C sources: both extensions that compute it compile these.
PAGESUM_HEADERS = ["src/engram_offload/table/xxhash.h", "src/engram_offload/table/pagesum_dispatch.h"]
# Reading a strided int64 NumPy view in place: the dedup and row-decode helpers include it.
STRIDED_HEADER = ["src/engram_offload/include/strided.h"]
# Taking 1-d integer arrays from Python buffers: the caches' hit path and the row copies include it.
INT_ARRAYS_HEADER = ["src/engram_offload/include/int_arrays.h"]
# Headers shared by helpers of several layers.
SHARED_INCLUDE = ["src/engram_offload/include"]


def optional_helper(name: str, sources: list[str], *, opt: str = "-O3", warnings: tuple[str, ...] = (),
                    **options) -> Extension:
    """A native helper that may fail to build: the package then uses its Python fallback."""
    return Extension(name, sources=sources, extra_compile_args=[opt, "-std=gnu11", "-Wall", *warnings],
                     optional=True, **options)


ext_modules = []
if sys.platform.startswith("linux"):
    # read_rows checks pages with the table's checksum: XXH3 from the vendored xxhash.h, and
    # the AVX2 loop of the page-checksum helper where the CPU has it.
    ext_modules.append(optional_helper(
        "engram_offload.tiers._uring",
        ["src/engram_offload/tiers/_uring.c", "src/engram_offload/table/_pagesum_avx2.c"],
        opt="-O2", warnings=("-Wno-unused-parameter",),
        include_dirs=["src/engram_offload/table"], depends=PAGESUM_HEADERS))
    # Copies out of a file mapping guarded against SIGBUS (the mmap tier; pread is the fallback).
    ext_modules.append(optional_helper("engram_offload.tiers._safecopy",
                                       ["src/engram_offload/tiers/_safecopy.c"], opt="-O2"))

ext_modules += [
    # Checksums of data pages (format version 2, XXH3 from the vendored xxhash.h); the xxhash
    # package is the fallback.
    optional_helper("engram_offload.table._pagesum",
                    ["src/engram_offload/table/_pagesum.c", "src/engram_offload/table/_pagesum_avx2.c"],
                    depends=PAGESUM_HEADERS),
    # The n-gram hash kernel: portable C (NumPy is the fallback).
    optional_helper("engram_offload.engram._hashkernel", ["src/engram_offload/engram/_hashkernel.c"]),
    # Dedup of a step's row ids in one call that keeps the GIL (NumPy is the fallback).
    optional_helper("engram_offload.serving._dedupkernel", ["src/engram_offload/serving/_dedupkernel.c"],
                    include_dirs=SHARED_INCLUDE, depends=STRIDED_HEADER),
    # The row caches' hit path (lookup, pins, policy stamps in one call; the NumPy bookkeeping
    # is the fallback).
    optional_helper("engram_offload.cache._hitpath", ["src/engram_offload/cache/_hitpath.c"],
                    include_dirs=SHARED_INCLUDE, depends=INT_ARRAYS_HEADER),
    # Row copies between host buffers (NumPy is the fallback).
    optional_helper("engram_offload.buffers._rowcopy", ["src/engram_offload/buffers/_rowcopy.c"],
                    include_dirs=SHARED_INCLUDE, depends=INT_ARRAYS_HEADER),
    # fp8 row decode by table lookup (NumPy is the fallback).
    optional_helper("engram_offload.engram._rowdecode", ["src/engram_offload/engram/_rowdecode.c"],
                    include_dirs=SHARED_INCLUDE, depends=STRIDED_HEADER),
]

setup(ext_modules=ext_modules)
