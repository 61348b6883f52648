"""Fixtures of the store tests: real ``redis-server`` processes (kvx.redis_server), stopped at teardown
whatever the test did to them."""

from __future__ import annotations

import os

import pytest

from kvx.redis_server import RedisClusterServers, RedisServer, redis_cli_binary, redis_server_binary


def _need(*binaries) -> None:
    """Skip without redis-server on a developer's machine; in CI (CI=true), where scripts/setup.sh
    installs it, its absence is a broken setup and fails."""
    try:
        for find in binaries:
            find()
    except RuntimeError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {e}")
        pytest.skip(str(e))


@pytest.fixture
def redis_server():
    """A fresh standalone server (TCP and a unix socket, noeviction) for one test: tests may kill it."""
    _need(redis_server_binary)
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-node cluster shared by a test module (starting one takes ~2 s): tests must leave it serving."""
    _need(redis_server_binary, redis_cli_binary)
    with RedisClusterServers(3) as cluster:
        yield cluster
