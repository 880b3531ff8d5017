"""``PoolClient`` against a real Redis server on 127.0.0.1."""

from __future__ import annotations

import pytest

from engram_offload.pool.client import PoolClient, PoolError

from redis_servers import redis_single  # noqa: F401 (fixture)


def test_an_error_reply_names_a_bytes_key_as_text(redis_single):  # noqa: F811
    with PoolClient(redis_single.url) as client:
        client.call("SET", b"engram-test:counter", b"not a number")
        with pytest.raises(PoolError) as caught:
            client.call("INCR", b"engram-test:counter")
        client.call("DEL", b"engram-test:counter")
    message = str(caught.value)
    assert message.startswith("INCR engram-test:counter: "), message
    assert "not an integer" in message
