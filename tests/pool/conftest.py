"""The pool tests' key file: one of their own for the session, never the user's."""

from __future__ import annotations

import pytest

from engram_offload.pool.key import KEY_ENV


@pytest.fixture(scope="session", autouse=True)
def pool_key_file(tmp_path_factory):
    """``$ENGRAM_OFFLOAD_POOL_KEY``: a key file (written by the first publish) in a folder of the session's."""
    path = tmp_path_factory.mktemp("pool-key") / "pool.key"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, str(path))
        yield path


@pytest.fixture
def pool_key(pool_key_file):
    """The session's pool key (its file written when missing)."""
    from engram_offload.pool.key import load_key

    return load_key(pool_key_file, create=True)


@pytest.fixture
def no_key_file(monkeypatch, tmp_path):
    """No pool key file (``$ENGRAM_OFFLOAD_POOL_KEY`` names one that does not exist)."""
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "no-such.key"))
