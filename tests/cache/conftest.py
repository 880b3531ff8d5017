"""Fixtures for the cache tests (helpers live in cache_fakes.py)."""

from __future__ import annotations

import pytest

from engram_offload.engram.config import EngramConfig

from cache_fakes import FakeTier, small_config


@pytest.fixture
def config() -> EngramConfig:
    return small_config()


@pytest.fixture
def fake_tier(config) -> FakeTier:
    return FakeTier(config.num_rows, config.row_bytes)
