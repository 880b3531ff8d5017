"""The pool tests' key fixtures (the session's key file: tests/conftest.py)."""

from __future__ import annotations

import pytest

from engram_offload.pool.key import KEY_ENV


@pytest.fixture
def pool_key(pool_key_file):
    """The session's pool key (its file written when missing)."""
    from engram_offload.pool.key import load_key

    return load_key(pool_key_file, create=True)


@pytest.fixture
def no_key_file(monkeypatch, tmp_path):
    """No pool key file (``$ENGRAM_OFFLOAD_POOL_KEY`` names one that does not exist)."""
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "no-such.key"))
