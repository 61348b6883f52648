"""Members from a Redis (``kvx node --membership URL``): nodes find each other by their heartbeats, pull from each
other, and drop a node that stops (at once) or dies (after its heartbeat expires); a node of another cluster (another
secret) in the same Redis is never a member."""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvx.testing.redis_server import RedisServer
from tests.helpers import wait_for
from tests.node.cluster_helpers import SLOT_BYTES, Member, free_port, key, secret_file


@pytest.fixture
def redis():
    server = RedisServer()
    yield server
    server.stop()


def peers(m: Member) -> list[str]:
    return sorted(p["address"] for p in m.node.stats()["cluster"]["peers"])


def test_members_find_each_other_pull_and_drop_the_ones_that_leave(redis):
    with tempfile.TemporaryDirectory(prefix="kvxm", dir="/tmp") as tmp:
        secret = secret_file(tmp)
        ports = [free_port() for _ in range(3)]
        flags = ("--membership", redis.url, "--membership-ttl-s", "1")
        members = [Member(tmp, f"m{i}", p, [], secret, *flags) for i, p in enumerate(ports)]
        other = Member(tmp, "x", free_port(), [], secret_file(tmp, "x", "another-cluster-secret-0123"), *flags)
        try:
            addrs = [f"127.0.0.1:{p}" for p in ports]
            for i, m in enumerate(members):
                want = sorted(a for j, a in enumerate(addrs) if j != i)
                wait_for(lambda m=m, want=want: peers(m) == want, 20, lambda m=m: f"the members: {peers(m)}")
            assert peers(other) == []
            members[2].store(key(1), torch.full((SLOT_BYTES,), 9, dtype=torch.uint8))
            assert members[0].pull([key(1)]) == [True]
            assert torch.equal(members[0].read(key(1)), torch.full((SLOT_BYTES,), 9, dtype=torch.uint8))
            members[2].close()  # stops: leaves the hash at once
            wait_for(lambda: peers(members[0]) == [addrs[1]], 20, lambda: f"m2 gone: {peers(members[0])}")
            members[1].node.kill()  # dies: its heartbeat expires
            wait_for(lambda: peers(members[0]) == [], 20, lambda: f"m1 gone: {peers(members[0])}")
        finally:
            for m in members[:2] + [other]:
                m.close()
