"""A sealed namespace stays on its host: an engine whose byte tiers seal their chunks (``encryption``) says so in its
hello, and from then on its node moves none of the namespace's chunks to or from another host (no pull served or
asked for, no push sent or taken): the pool holds chunks in the clear, and the cluster's channels would carry them
so. Other namespaces of the same node keep moving."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from kvx.connector.common import EngineGeometry
from kvx.connector.config import KVXConfig
from kvx.connector.scheduler import _first_level
from kvx.node.client import NodeIndex
from kvx.node.connection import NodeError
from tests.helpers import wait_for
from tests.node.cluster_helpers import NAMESPACE, SLOT_BYTES, Member, free_port, key, secret_file
from tests.node.daemon_helpers import NS_A, NS_B, SLOT, Peer, check_invariants, make_state


def _cluster_state():
    """A NodeState whose cluster hooks record what they are asked to move."""
    state = make_state(8)
    asked: list[tuple] = []
    state.on_pull = lambda cid, rid, ns, keys, nbytes, budget: asked.append(("pull", ns, keys)) or True
    state.on_push = lambda ns, keys, nbytes, to: asked.append(("push", ns, keys)) or True
    return state, asked


def test_a_sealed_engine_keeps_its_namespaces_chunks_on_the_host():
    state, asked = _cluster_state()
    a, other = Peer(state, 1), Peer(state, 2, ns=NS_B)
    keys = [key(0), key(1)]
    a.store(*keys)
    other.store(*keys)
    assert state.peer_have(NS_A, keys) == 2  # before a sealed engine: served as any namespace
    sealed = Peer(state, 3, sealed=True)
    assert state.stats()["namespaces"][NS_A]["sealed"] and not state.stats()["namespaces"][NS_B]["sealed"]
    peer = state.open_internal()
    assert state.peer_have(NS_A, keys) == 0 and state.peer_lease(peer, NS_A, keys, SLOT) == []
    assert state.push_reserve(peer, "node-x", NS_A, [key(5)], SLOT) == [None]
    assert state.push_lease(state.open_internal(role="push"), NS_A, keys) == ([], "absent")
    for c in (state.client(1), state.client(3)):  # the sealed engine, and an engine of the same namespace
        assert state.pull(c, 1, [key(7)], 1.0) == 0
        assert state.push(c, keys, "10.0.0.2:7400") is False
    assert asked == []
    assert state.peer_have(NS_B, keys) == 2 and len(state.peer_lease(peer, NS_B, keys, SLOT)) == 2
    assert state.pull(state.client(2), 1, [key(7)], 1.0) is None and state.push(state.client(2), keys, "h:1")
    assert [op for op, ns, _ in asked] == ["pull", "push"] and all(ns == NS_B for _, ns, _ in asked)
    sealed.close()
    assert state.stats()["namespaces"][NS_A]["sealed"]  # for good: its chunks are still the tenant's
    assert state.peer_have(NS_A, keys) == 0
    state.unlease_all(peer)
    check_invariants(state)


def test_a_hello_with_sealed_not_a_bool_is_refused_naming_it():
    state, _ = _cluster_state()
    with pytest.raises(NodeError, match=r"sealed: expected a bool .*got 'yes'"):
        Peer(state, 1, sealed="yes")


def _geom() -> EngineGeometry:
    return EngineGeometry(
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        use_mla=False,
        opaque=False,
        isa="",
        page_bytes=2 * 16 * 2 * 64 * 2,
    )


@pytest.mark.parametrize("encryption", [False, True])
def test_an_engine_is_sealed_when_a_byte_tier_seals(tmp_path, encryption):
    key_file = tmp_path / "t.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    disk = {"type": "disk", "path": str(tmp_path / "kv")}
    if encryption:
        disk["encryption"] = {"key_file": str(key_file)}
    node = {"type": "node", "socket": "/nonexistent"}
    config = KVXConfig.from_extra_config({"chunk_size": 16, "tiers": [node, disk]})
    index = _first_level(config, _geom(), bytes(16), "m")
    try:
        assert isinstance(index, NodeIndex) and index.sealed is encryption
        assert index.hello.get("sealed", False) is encryption
    finally:
        index.close()


def test_a_sealed_namespace_is_neither_pulled_from_nor_pushed_by_its_node():
    with tempfile.TemporaryDirectory(prefix="kvxs", dir="/tmp") as tmp:
        secret = secret_file(tmp)
        pa, pb = free_port(), free_port()
        a, b = Member(tmp, "a", pa, [pb], secret), Member(tmp, "b", pb, [pa], secret)
        try:
            data = torch.arange(SLOT_BYTES, dtype=torch.int64).to(torch.uint8)
            a.store(key(1), data)
            sealed = NodeIndex(a.sock, NAMESPACE, "m", 16, SLOT_BYTES, timeout=10, retry_s=0.05, sealed=True)
            wait_for(lambda: sealed.contains_many([key(1)]) == [True], 10, "the sealed engine's hello")
            assert a.node.stats()["namespaces"][NAMESPACE.hex()]["sealed"]
            assert b.pull([key(1)]) == [False]  # asked, and a's node answered that it holds none
            assert b.node.stats()["cluster"]["pulls"] >= 1 and b.node.stats()["cluster"]["pulled"] == 0
            assert not sealed.push([key(1)], f"127.0.0.1:{pb}")  # the engine does not ask
            assert a.node.stats()["namespaces"][NAMESPACE.hex()]["served"] == 0
            assert torch.equal(a.read(key(1)), data)  # on its own host, served as before
            sealed.close()
        finally:
            a.close()
            b.close()
