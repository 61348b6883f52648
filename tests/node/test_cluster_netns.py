"""Three hosts, for real: each ``kvx node`` in a network namespace of its own with its own address on one bridge
(:mod:`kvx.testing.netns`), so a pull crosses a veth link and nothing passes through 127.0.0.1 by accident. Engines
talk to their own node through its unix socket (the test process, as the connector does).

- a chunk stored on one host is pulled by the two others, bit-exact, from whichever holds it;
- a host cut off (its link down: a partition, not a refusal) costs a miss within the wait, no slot or lease left
  behind; once its link is back, its chunks are pulled again;
- a host restarted with an empty pool is a miss, never a stale chunk.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvx.testing import netns
from tests.helpers import wait_for
from tests.node.cluster_helpers import NAMESPACE, SLOT_BYTES, Member, key, secret_file

PORT = 7411


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def hosts(request):
    """Three hosts and their nodes, on kvx's TCP channel or on NIXL (UCX over TCP: on one machine UCX would
    otherwise find shared memory or CMA between the namespaces, which share the machine)."""
    transport = request.param
    reason = netns.available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    with netns.Cluster(3) as cluster, tempfile.TemporaryDirectory(prefix="kvxc", dir="/tmp") as tmp:
        secret = secret_file(tmp)
        addrs = [f"{h.addr}:{PORT}" for h in cluster.hosts]
        members = []
        try:
            for i, h in enumerate(cluster.hosts):
                peers = [a for j, a in enumerate(addrs) if j != i]
                launch = (
                    h.argv if transport == "tcp" else (lambda argv, h=h: h.argv(["env", "UCX_TLS=tcp,self", *argv]))
                )
                extra = ("--transport", transport)
                members.append(Member(tmp, f"h{i}", PORT, peers, secret, *extra, addr=h.addr, launch=launch))
            yield cluster.hosts, members
        finally:
            for m in members:
                m.close()


def chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def idle(m: Member) -> None:
    s = m.node.stats()
    assert s["pool"]["pending"] == 0 and s["leases"] == 0, s["pool"]


def test_chunks_cross_hosts_from_whichever_holds_them(hosts):
    _, (a, b, c) = hosts
    keys = [key(100 + i) for i in range(4)]
    for i, k in enumerate(keys[:2]):
        a.store(k, chunk(i))
    for i, k in enumerate(keys[2:], 2):
        b.store(k, chunk(i))
    assert c.pull(keys[:2]) == [True, True]  # only a has them
    assert c.pull(keys) == [True] * 4  # the rest from b
    for i, k in enumerate(keys):
        assert torch.equal(c.read(k), chunk(i)), k
    peers = {p["address"].split(":")[0]: p for p in c.node.stats()["cluster"]["peers"]}
    assert all(p["state"] == "up" for p in peers.values()), peers
    assert sum(p["chunks_in"] for p in peers.values()) == 4
    for m in (a, b, c):
        idle(m)


def test_a_host_cut_off_is_a_miss_within_the_wait_and_its_chunks_return_with_its_link(hosts):
    (ha, _, _), (a, b, _) = hosts
    k = key(200)
    a.store(k, chunk(200))
    ha.cut()
    try:
        assert b.pull([k], timeout=20) == [False]
        idle(b)
        wait_for(lambda: b.node.stats()["cluster"]["peers"][0]["state"] == "down", 10, "a marked down")
    finally:
        ha.restore()
    b.index._tried.clear()  # the engine would ask again after a while; the test does not wait for it
    wait_for(lambda: b.pull([k], timeout=20) == [True], 60, "a pull once the link is back")
    assert torch.equal(b.read(k), chunk(200))
    idle(a)


def test_a_host_restarted_empty_is_a_miss_never_a_stale_chunk(hosts):
    _, (a, _, c) = hosts
    k = key(300)
    a.store(k, chunk(300))
    a.restart()
    assert c.pull([k], timeout=20) == [False]
    a.store(k, chunk(301))  # the new pool's chunk of the same key
    c.index._tried.clear()
    wait_for(lambda: c.pull([k], timeout=20) == [True], 60, "a pull from the restarted node")
    assert torch.equal(c.read(k), chunk(301))
    assert c.node.stats()["namespaces"][NAMESPACE.hex()]["pulled"] >= 1
