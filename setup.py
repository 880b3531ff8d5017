"""Build hook for the optional native helpers.

The package itself is pure Python.  ``engram_offload.tiers._uring`` is a small
C extension (batched O_DIRECT reads through io_uring, raw syscalls only, no
liburing).  It is declared ``optional=True``: when it cannot be compiled (no C
compiler, not Linux, missing kernel headers) the package still installs and
``engram_offload.tiers.uring.available()`` reports False.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "engram_offload.tiers._uring",
            sources=["src/engram_offload/tiers/_uring.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
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

setup(ext_modules=ext_modules)
