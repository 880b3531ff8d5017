"""The GPU package's tests run its Triton kernels: on a CUDA device when there is one, else on
the CPU under Triton's interpreter, which must be switched on before the kernels are imported
(so it is set here, for the whole test session)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"  # without Triton the tests below use the references

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE



def o_direct_works(folder: Path) -> bool:
    """Whether files in ``folder`` can be read with O_DIRECT (tmpfs refuses it)."""
    probe = folder / ".o_direct_probe"
    probe.write_bytes(bytes(4096))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A folder for table files the ``direct`` tier reads: the test's temporary folder, or,
    where that is tmpfs (common in containers), one under /var/tmp or the working folder."""
    folder = tmp_path_factory.mktemp("disk")
    if o_direct_works(folder):
        yield folder
        return
    for parent in (Path("/var/tmp"), Path.cwd()):
        try:
            candidate = Path(tempfile.mkdtemp(prefix="engram-direct-", dir=parent))
        except OSError:
            continue
        if o_direct_works(candidate):
            yield candidate
            shutil.rmtree(candidate, ignore_errors=True)
            return
        shutil.rmtree(candidate, ignore_errors=True)
    pytest.skip("no folder here accepts O_DIRECT (the direct tier): set --basetemp to a disk folder")
