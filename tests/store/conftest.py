"""Fixtures of the store tests: real ``redis-server`` processes (kvx.redis_server), stopped at teardown
whatever the test did to them."""

from __future__ import annotations

import pytest

from kvx.redis_server import RedisClusterServers, RedisServer
from tests.conftest import need_redis


@pytest.fixture
def redis_server():
    """A fresh standalone server (TCP and a unix socket, noeviction) for one test: tests may kill it."""
    need_redis()
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-node cluster shared by a test module (starting one takes ~2 s): tests must leave it serving."""
    need_redis()
    with RedisClusterServers(3) as cluster:
        yield cluster
