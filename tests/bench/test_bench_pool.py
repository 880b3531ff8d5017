"""The benchmark's pool: a loopback one for the run, and the table published into it."""

from __future__ import annotations

import socket

import pytest

from engram_offload.bench.remote import bench_pool, publish
from engram_offload.pool.publish import pool_status
from engram_offload.table import make_random_table

from redis_servers import skip_without_redis
from tiny_tables import tiny_config


def test_a_cold_run_gets_a_fresh_copy_and_a_warm_one_the_copy_there(tmp_path):
    skip_without_redis()
    table = tmp_path / "t.table"
    make_random_table(table, tiny_config(), seed=3)
    with bench_pool(None, 1) as url:
        first = publish(str(table), url)
        assert first["sent"] == first["extents"] > 0 and first["dropped_keys"] == 0
        again = publish(str(table), url)
        assert again["sent"] == 0 and again["skipped"] == again["extents"]
        fresh = publish(str(table), url, fresh=True)
        assert fresh["dropped_keys"] == fresh["extents"] + 3  # the extents and the three meta keys
        assert fresh["sent"] == fresh["extents"]
        [status] = pool_status(url)["tables"]
        assert status["complete"]
        port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):  # stopped on exit
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_given_pool_is_used_as_is():
    with bench_pool("redis://127.0.0.1:1", 3) as url:
        assert url == "redis://127.0.0.1:1"
