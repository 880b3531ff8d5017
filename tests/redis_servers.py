"""Real Redis servers on 127.0.0.1 for the pool tests: a single node and a 3-node cluster.

Each fixture starts ``redis-server`` processes on free ports in a temporary folder and
kills them at teardown. Without ``redis-server`` (or the ``redis``/``hiredis`` packages)
the tests that use them skip with the reason.
"""

from __future__ import annotations

import importlib.util

import pytest

from engram_offload.pool.client import PoolClient
from engram_offload.pool.servers import LocalPool, redis_server_missing, start_local_pool


def skip_without_redis() -> None:
    reason = redis_server_missing()
    if reason is None:
        missing = [m for m in ("redis", "hiredis") if importlib.util.find_spec(m) is None]
        if missing:
            reason = f"the {' and '.join(missing)} package(s) are not installed: pip install -e '.[pool]'"
    if reason:
        pytest.skip(reason)


def start_pool(nodes: int, directory) -> LocalPool:
    skip_without_redis()
    return start_local_pool(nodes, None, directory)  # free ports, retried when one is taken meanwhile


@pytest.fixture(scope="module")
def redis_single(tmp_path_factory):
    """One plain Redis server shared by a module's tests."""
    pool = start_pool(1, tmp_path_factory.mktemp("redis-single"))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A 3-node Redis Cluster shared by a module's tests."""
    pool = start_pool(3, tmp_path_factory.mktemp("redis-cluster"))
    yield pool
    pool.stop()


@pytest.fixture
def fresh_pool(tmp_path):
    """Factory: ``fresh_pool(nodes)`` starts a pool of the test's own (it may kill nodes)."""
    pools = []

    def start(nodes: int) -> LocalPool:
        pools.append(start_pool(nodes, tmp_path / f"pool-{len(pools)}"))
        return pools[-1]

    yield start
    for pool in pools:
        pool.stop()


def migrate_slot(pool, slot: int) -> tuple:
    """Start moving ``slot`` from its owner to another node of ``pool`` (IMPORTING on the
    target, MIGRATING on the source, as redis-cli --cluster reshard does); -> (source,
    target, their node ids)."""
    with PoolClient(pool.url) as client:
        source_port = client.nodes[int(client.owner[slot])][1]
    source = next(n for n in pool.nodes if n.port == source_port)
    target = next(n for n in pool.nodes if n.port != source_port)
    src, dst = source.connect(5.0), target.connect(5.0)
    src_id, dst_id = src.call("CLUSTER", "MYID").decode(), dst.call("CLUSTER", "MYID").decode()
    assert dst.call("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id) == b"OK"
    assert src.call("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id) == b"OK"
    src.close()
    dst.close()
    return source, target, src_id, dst_id
