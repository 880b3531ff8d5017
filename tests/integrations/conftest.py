"""The plugins' lookups run the project's Triton gathers: on the CPU under Triton's interpreter,
which must be on before the kernels are imported (as in tests/gpu)."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"
