"""Fixtures of the store tests: real ``redis-server`` processes (kvx.testing.redis_server), stopped at teardown
whatever the test did to them."""

from __future__ import annotations

import pytest

from kvx.store.redis import RedisConfig, RedisTier
from kvx.store.tier import TierContext
from kvx.testing.redis_server import RedisClusterServers, RedisServer
from tests.conftest import need_redis

FP = "fp-test-1"                  # the fingerprint of the Redis tests' tiers
MVS = 64 << 10                    # max_value_size of most Redis tests: small, so multi-part is cheap to exercise


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


@pytest.fixture
def open_tier():
    """``open_tier(url, fingerprint=FP, **config) -> RedisTier``, closed at teardown."""
    tiers = []

    def make(url: str, fingerprint: str = FP, **cfg) -> RedisTier:
        cfg.setdefault("max_value_size", MVS)
        cfg.setdefault("lookup_wait_ms", 1000)   # tests want answers; test_contains_many_none_then_answer sets 0
        t = RedisTier.open(RedisConfig(type="redis", url=url, **cfg), TierContext(fingerprint=fingerprint))
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()
