"""Shared fixtures: the reference vectors of DeepSeek's demo and small configs."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.pool.key import KEY_ENV

from tiny_tables import tiny_config as _tiny_config

DATA = Path(__file__).resolve().parent / "data"
VECTORS = DATA / "demo_small.safetensors"  # DeepSeek's demo, run on seeded parameters (data/README.md)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:  # "interpreter": runs under Triton's interpreter without CUDA, on the GPU with it
        if item.get_closest_marker("gpu") is not None and item.get_closest_marker("interpreter") is None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def demo_vectors() -> dict:
    """Tensors and metadata of ``tests/data/demo_small.safetensors``; a missing file fails."""
    if not VECTORS.is_file():
        pytest.fail(f"the reference vectors {VECTORS} are missing: they ship with the repository")
    from safetensors import safe_open

    with safe_open(str(VECTORS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["meta"])
    return {"meta": meta, **tensors}


@pytest.fixture
def tiny_config():
    """Factory: ``tiny_config(row_format, head_dim)`` -> a small EngramConfig for table files."""
    return _tiny_config


@pytest.fixture
def config() -> EngramConfig:
    return _tiny_config()


@pytest.fixture
def shm_dir():
    """A private folder on the machine's tmpfs (removed afterwards), where shared segments go."""
    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(prefix="engram-test-", dir=shm if shm.is_dir() else None))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def pool_key_file(tmp_path_factory):
    """``$ENGRAM_OFFLOAD_POOL_KEY`` for every test and the commands it starts: a key file (written
    by the first publish or serve) in a folder of the session's, never the user's."""
    path = tmp_path_factory.mktemp("pool-key") / "pool.key"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, str(path))
        yield path
