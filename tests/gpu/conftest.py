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

