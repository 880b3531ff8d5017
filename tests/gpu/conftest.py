"""The GPU package's tests run its Triton kernels: on a CUDA device when there is one, else on
the CPU under Triton's interpreter, which must be switched on before the kernels are imported
(so it is set here, for the whole test session)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"  # without Triton the tests below use the references

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The top-level conftest skips items whose keywords include "gpu", and a directory's name is
    one of its items' keywords; keep that skip only on tests that carry the ``gpu`` marker."""
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here) and item.get_closest_marker("gpu") is None:
            item.own_markers = [m for m in item.own_markers
                                if not (m.name == "skip" and m.kwargs.get("reason") == "needs CUDA")]
