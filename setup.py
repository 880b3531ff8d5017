"""Build hook for the optional native helpers.

The package itself is pure Python.  ``engram_offload.tiers._uring`` is a small
C extension (batched O_DIRECT reads through io_uring, raw syscalls only, no
liburing).  It is declared ``optional=True``: when it cannot be compiled (no C
compiler, not Linux, missing kernel headers) the package still installs and
``engram_offload.tiers.uring.available()`` reports False.  The other helpers
(page checksums, SIGBUS-guarded mapping copies, the hash kernel, the caches'
hit path) are optional the same way, each with a Python fallback.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
# The page checksum's C sources: both extensions that compute it compile these.
PAGESUM_HEADERS = ["src/engram_offload/table/xxhash.h", "src/engram_offload/table/pagesum_dispatch.h"]
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "engram_offload.tiers._uring",
            # read_rows checks pages with the table's checksum: XXH3 from the vendored
            # xxhash.h, and the AVX2 loop of the page-checksum helper where the CPU has it.
            sources=["src/engram_offload/tiers/_uring.c", "src/engram_offload/table/_pagesum_avx2.c"],
            include_dirs=["src/engram_offload/table"],
            depends=PAGESUM_HEADERS,
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        )
    )

    # Copies out of a file mapping guarded against SIGBUS (the mmap tier; pread is the fallback).
    ext_modules.append(
        Extension(
            "engram_offload.tiers._safecopy",
            sources=["src/engram_offload/tiers/_safecopy.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            optional=True,
        )
    )

# Checksums of data pages (format version 2, XXH3 from the vendored xxhash.h); the xxhash
# package is the fallback.
ext_modules.append(
    Extension(
        "engram_offload.table._pagesum",
        sources=["src/engram_offload/table/_pagesum.c", "src/engram_offload/table/_pagesum_avx2.c"],
        depends=PAGESUM_HEADERS,
        extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
        optional=True,
    )
)

# The n-gram hash kernel: portable C, optional like the reader (NumPy is the fallback).
ext_modules.append(
    Extension(
        "engram_offload._hashkernel",
        sources=["src/engram_offload/_hashkernel.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
        optional=True,
    )
)

# The row caches' hit path (lookup, pins, policy stamps in one call): optional as well
# (the NumPy bookkeeping is the fallback).
ext_modules.append(
    Extension(
        "engram_offload.cache._hitpath",
        sources=["src/engram_offload/cache/_hitpath.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
        optional=True,
    )
)

# fp8 row decode by table lookup (NumPy is the fallback).
ext_modules.append(
    Extension(
        "engram_offload._rowdecode",
        sources=["src/engram_offload/_rowdecode.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall"],
        optional=True,
    )
)

setup(ext_modules=ext_modules)
