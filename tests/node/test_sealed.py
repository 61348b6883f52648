"""Sealed chunks stay sealed: an engine whose byte tiers seal their chunks (``encryption``) says so in its hello, and
from then on its namespace's chunks cross between nodes only over kvx's tcp channel, encrypted (AES-256-GCM under
keys each end derives from the cluster secret and the handshake's nonces: no key crosses); ciphertext crosses, never
the pool's plaintext, and a node serves no sealed slot in the clear nor takes a plain write into one. Over NIXL (its
one-sided transfers cannot encrypt) they stay on their host: no pull, push, peer ``have`` or lease. Other namespaces
of the same node keep moving as before."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import threading

import pytest
import torch

from kvx.connector.common import EngineGeometry
from kvx.connector.config import KVXConfig
from kvx.connector.scheduler import _first_level
from kvx.node import handshake
from kvx.node.client import NodeIndex
from kvx.node.connection import NodeError
from kvx.node.tcp import TcpTransport
from kvx.node.transport import Span, TransferError
from kvx.node.wire_seal import WireSession
from kvx.store.codec import crc32c_update
from tests.helpers import wait_for
from tests.node.cluster_helpers import NAMESPACE, SLOT_BYTES, Member, Relay, free_port, key, secret_file
from tests.node.daemon_helpers import NS_A, NS_B, NS_C, SLOT, Peer, check_invariants, make_state

SEALED_NS = bytes(range(1, 17))  # a second namespace on the same node, whose engine seals
PLAIN_NS = bytes(range(2, 18))  # a namespace no engine seals


def _cluster_state(seal_transit: bool = False):
    """A NodeState whose cluster hooks record what they are asked to move (``seal_transit``: as a tcp node's)."""
    state = make_state(8)
    state.seal_transit = seal_transit
    asked: list[tuple] = []
    state.on_pull = lambda cid, rid, ns, keys, nbytes, budget: asked.append(("pull", ns, keys)) or True
    state.on_push = lambda ns, keys, nbytes, to: asked.append(("push", ns, keys)) or True
    return state, asked


def test_a_sealed_namespace_stays_on_a_host_whose_transport_does_not_encrypt():
    """A NIXL node's index (seal_transit False): a sealed namespace is neither served, pulled, pushed nor taken."""
    state, asked = _cluster_state(seal_transit=False)
    a, other = Peer(state, 1), Peer(state, 2, ns=NS_B)
    keys = [key(0), key(1)]
    a.store(*keys)
    other.store(*keys)
    assert state.peer_have(NS_A, keys) == 2  # before a sealed engine: served as any namespace
    sealed = Peer(state, 3, sealed=True)
    assert sealed.hello["seal_transit"] is False  # its engine asks for no pull or push
    assert state.stats()["namespaces"][NS_A]["sealed"] and not state.stats()["namespaces"][NS_B]["sealed"]
    peer = state.open_internal()
    assert state.peer_have(NS_A, keys) == 0 and state.peer_lease(peer, NS_A, keys, SLOT) == []
    assert state.push_reserve(peer, "node-x", NS_A, [key(5)], SLOT) == [None]
    assert state.push_reserve(peer, "node-x", NS_C, [key(5)], SLOT, sealed=True) == [None]  # a sealed push: none
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


def test_with_seal_transit_a_sealed_namespace_moves_and_its_slots_are_known_sealed():
    """A tcp node's index: a sealed namespace is served, pulled, pushed and takes pushes; its slots (READY or
    reserved) are what the serving side refuses to move in the clear."""
    state, asked = _cluster_state(seal_transit=True)
    a, other = Peer(state, 1), Peer(state, 2, ns=NS_B)
    keys = [key(0), key(1)]
    slots = a.store(*keys)
    plain = other.store(key(2))
    sealed = Peer(state, 3, sealed=True)
    assert sealed.hello["seal_transit"] is True
    peer = state.open_internal()
    assert state.peer_have(NS_A, keys) == 2 and len(state.peer_lease(peer, NS_A, keys, SLOT)) == 2
    assert state.pull(state.client(3), 1, [key(7)], 1.0) is None and state.push(state.client(3), keys, "h:1")
    assert [op for op, _, _ in asked] == ["pull", "push"]
    assert state.push_lease(state.open_internal(role="push"), NS_A, keys)[1] == "end"
    span = lambda slot: (state.geom.slot_offset(slot), SLOT)  # noqa: E731
    assert state.sealed_spans([span(slots[0])]) and state.sealed_spans([span(plain[0]), span(slots[1])])
    assert not state.sealed_spans([span(plain[0])])
    inner = state.geom.slot_offset(slots[0]) + 100  # a span from inside a sealed run
    assert state.sealed_spans([(inner, 10)])
    [offset] = state.push_reserve(peer, "node-x", NS_C, [key(9)], SLOT, sealed=True)  # a sealed pusher
    assert offset is not None and state.is_sealed(NS_C)  # the namespace is sealed here too, from now on
    assert state.sealed_spans([(offset, SLOT)]) and state.writable("node-x", [(offset, SLOT)])
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


def test_a_sealed_engine_asks_nothing_of_a_node_that_does_not_say_it_encrypts():
    """A node on NIXL, or of a kvx before sealed transfers: its hello has no ``seal_transit``, and a sealed engine
    then asks it for no push or pull (its chunks stay on the host)."""
    index = NodeIndex("/nonexistent", NAMESPACE, "m", 16, SLOT_BYTES, sealed=True)
    try:
        index._cluster = True  # what the node's hello said: a cluster, and no seal_transit
        assert not index._may_move() and index.push([key(1)], "127.0.0.1:1") is False
        index._seal_transit = True
        assert index._may_move()
    finally:
        index.close()


@pytest.fixture
def tmp():
    with tempfile.TemporaryDirectory(prefix="kvxs", dir="/tmp") as d:
        yield d


def _chunks(seed: int, first: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key(first + i): torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for i in range(n)}


def test_sealed_chunks_are_pulled_and_pushed_between_tcp_nodes_bit_exact(tmp):
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    a = Member(tmp, "a", pa, [pb], secret, sealed=True)
    b = Member(tmp, "b", pb, [pa], secret, sealed=True)
    try:
        assert a.index._seal_transit and b.index._seal_transit  # the tcp nodes said so in their hello
        pulled = _chunks(0, 0, 5)
        for k, data in pulled.items():
            a.store(k, data)
        assert b.pull(list(pulled)) == [True] * 5
        for k, data in pulled.items():
            assert torch.equal(b.read(k), data), k
        sb, sa = b.node.stats(), a.node.stats()
        assert sb["namespaces"][NAMESPACE.hex()]["sealed"] and sb["cluster"]["bad_chunks"] == 0
        assert sb["cluster"]["peers"][0]["bytes_sealed_in"] == 5 * SLOT_BYTES
        assert sa["cluster"]["bytes_sealed_out"] == 5 * SLOT_BYTES

        pushed = _chunks(1, 20, 3)
        for k, data in pushed.items():
            a.store(k, data)
        assert a.index.push(list(pushed), f"127.0.0.1:{pb}")  # the sealed engine asks: its node encrypts
        wait_for(lambda: b.index.contains_many(list(pushed)) == [True] * 3, 30, lambda: f"pushes: {b.node.stats()}")
        for k, data in pushed.items():
            assert torch.equal(b.read(k), data), k
        wait_for(lambda: a.node.stats()["cluster"]["pushed"] == 3, 10, "the push's commit counted")
        # a's link to b (dialed by the push) counts what b read from a and what a pushed to b
        assert a.node.stats()["cluster"]["peers"][0]["bytes_sealed_out"] == 8 * SLOT_BYTES
        assert b.node.stats()["cluster"]["bytes_sealed_in"] == 3 * SLOT_BYTES
    finally:
        a.close()
        b.close()


def test_over_nixl_a_sealed_namespace_stays_on_its_host_and_others_still_move(tmp):
    """Two real nodes on NIXL: the sealed engine's node says no ``seal_transit``, so its engine asks for no pull or
    push, and a peer asking for the sealed namespace's chunks is told there are none; a plain namespace still moves."""
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    a = Member(tmp, "a", pa, [pb], secret, "--transport", "nixl", sealed=True)
    b = Member(tmp, "b", pb, [pa], secret, "--transport", "nixl", sealed=True)
    plain_a, plain_b = (
        NodeIndex(m.sock, PLAIN_NS, "m", 16, SLOT_BYTES, timeout=10, retry_s=0.05, pull_wait_ms=3000) for m in (a, b)
    )
    try:
        for idx in (plain_a, plain_b):
            wait_for(lambda i=idx: i.contains_many([key(0)]) is not None and i.pool is not None, 10, "the hello")
        assert not a.index._seal_transit and not a.index._may_move() and plain_b._may_move()
        sealed = _chunks(2, 40, 2)
        for k, data in sealed.items():
            a.store(k, data)
        assert not b.index.pulling(list(sealed))  # asks nothing: its chunks stay on the host
        assert a.index.push(list(sealed), f"127.0.0.1:{pb}") is False
        plain = _chunks(3, 50, 2)
        for k, data in plain.items():
            _store(a, plain_a, k, data)
        wait_for(lambda: not plain_b.pulling(list(plain)), 30, "the plain namespace's pull")
        assert plain_b.contains_many(list(plain)) == [True, True]
        assert b.index.contains_many(list(sealed)) == [False, False]
        sa = a.node.stats()
        assert sa["namespaces"][NAMESPACE.hex()]["sealed"] and sa["cluster"]["bytes_sealed_out"] == 0
        assert sa["cluster"]["served"] == 2  # the plain chunks' lease; none of the sealed namespace's
    finally:
        plain_a.close()
        plain_b.close()
        a.close()
        b.close()


def test_a_pull_from_a_node_whose_namespace_is_sealed_reads_sealed_and_seals_it_here(tmp):
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    a, b = Member(tmp, "a", pa, [pb], secret, sealed=True), Member(tmp, "b", pb, [pa], secret)
    try:
        chunks = _chunks(2, 40, 2)
        for k, data in chunks.items():
            a.store(k, data)
        assert not b.node.stats()["namespaces"][NAMESPACE.hex()]["sealed"]
        assert b.pull(list(chunks)) == [True] * 2  # the lease said sealed: read sealed
        for k, data in chunks.items():
            assert torch.equal(b.read(k), data), k
        s = b.node.stats()
        assert s["namespaces"][NAMESPACE.hex()]["sealed"]  # and served sealed from here on
        assert s["cluster"]["peers"][0]["bytes_sealed_in"] == 2 * SLOT_BYTES
    finally:
        a.close()
        b.close()


class _Visitor:
    """A member of ``node``'s cluster as a test dials it: its control connection, and a TcpTransport over ``relay``
    (a recording relay in front of the node's port) whose data connection carries its keys."""

    def __init__(self, node: Member, secret: bytes, relay: Relay, local: bytearray):
        self.secret = secret
        self.ctl, _ = handshake.dial(("127.0.0.1", node.port), secret, "visitor", "control", 10)
        self.t = TcpTransport(local, self._dial, lambda: (0, len(local)))
        self.t.connect("a", ("127.0.0.1", relay.port), b"")

    def _dial(self, address):
        sock, _, keying = handshake.dial_keyed(address, self.secret, "visitor", "data", 10)
        return sock, WireSession(self.secret, keying)

    def ask(self, **msg) -> dict:
        handshake.send(self.ctl, msg)
        return handshake.recv(self.ctl)

    def close(self) -> None:
        self.t.close()
        self.ctl.close()


@pytest.fixture
def sealed_node(tmp):
    """Node a with a plain namespace (its Member's engine) and a sealed one (a second engine, same pool), a relay
    in front of it, and a visiting member."""
    secret = secret_file(tmp)
    a = Member(tmp, "a", free_port(), [free_port()], secret)
    sealed = NodeIndex(a.sock, SEALED_NS, "m", 16, SLOT_BYTES, timeout=10, retry_s=0.05, sealed=True)
    wait_for(lambda: sealed.contains_many([key(0)]) is not None and sealed.pool is not None, 10, "the hello")
    relay = Relay(a.port)
    local = bytearray(4 * SLOT_BYTES)
    with open(secret, "rb") as f:
        visitor = _Visitor(a, f.read().strip(), relay, local)
    yield a, sealed, relay, visitor, local
    visitor.close()
    relay.close()
    sealed.close()
    a.close()


def _store(a: Member, index: NodeIndex, k: str, data: torch.Tensor) -> None:
    slot = index.allocate(k)
    a.pool.slot(slot).copy_(data)
    index.commit(k)


def _lease(v: _Visitor, ns: bytes, k: str) -> tuple[dict, int, int]:
    reply = v.ask(op="lease", namespace=ns.hex(), keys=k, nbytes=SLOT_BYTES)
    [(_, offset, _, crc)] = reply["chunks"]
    return reply, offset, crc


def _window(data: torch.Tensor) -> bytes:
    """A random 4 KiB of ``data``'s bytes."""
    at = random.Random(7).randrange(0, SLOT_BYTES - 4096)
    return bytes(data.numpy()[at : at + 4096])


def test_what_crosses_is_ciphertext_and_a_sealed_span_never_crosses_plain(sealed_node):
    a, sealed, relay, v, local = sealed_node
    plain, secret = _chunks(3, 60, 1)[key(60)], _chunks(4, 61, 1)[key(61)]
    a.store(key(60), plain)
    _store(a, sealed, key(61), secret)
    reply, plain_at, plain_crc = _lease(v, NAMESPACE, key(60))
    assert "sealed" not in reply
    reply, secret_at, secret_crc = _lease(v, SEALED_NS, key(61))
    assert reply["sealed"] is True  # the reader must read it sealed

    mark = len(relay.down)
    assert v.t.read("a", [Span(plain_at, 0, SLOT_BYTES)], 10, [plain_crc]) == [True]
    assert bytes(local[:SLOT_BYTES]) == bytes(plain.numpy())
    assert _window(plain) in bytes(relay.down[mark:])  # a plain namespace's bytes cross as they are

    with pytest.raises(TransferError, match=r"seal: expected a sealed read .* got a plain one"):
        v.t.read("a", [Span(secret_at, 0, SLOT_BYTES)], 10, [secret_crc])  # refused: nothing of it crossed
    assert _window(secret) not in bytes(relay.down)

    mark = len(relay.down)
    assert v.t.read("a", [Span(secret_at, SLOT_BYTES, SLOT_BYTES)], 10, [secret_crc], sealed=True) == [True]
    assert bytes(local[SLOT_BYTES : 2 * SLOT_BYTES]) == bytes(secret.numpy())  # decrypted into the slot
    down = bytes(relay.down[mark:])
    assert len(down) > SLOT_BYTES and _window(secret) not in down  # ciphertext crossed, never the plaintext
    assert bytes(secret.numpy()[:64]) not in down


def test_a_byte_changed_in_transit_fails_the_sealed_read(sealed_node):
    a, sealed, relay, v, local = sealed_node
    secret = _chunks(5, 70, 1)[key(70)]
    _store(a, sealed, key(70), secret)
    _, at, crc = _lease(v, SEALED_NS, key(70))
    assert v.t.read("a", [Span(at, 0, SLOT_BYTES)], 10, [crc], sealed=True) == [True]  # dialed, keyed
    relay.flip("down", 300 << 10)  # a byte of the next read's second piece
    with pytest.raises(TransferError, match="failed its GCM tag"):
        v.t.read("a", [Span(at, 0, SLOT_BYTES)], 10, [crc], sealed=True)
    local[:SLOT_BYTES] = bytes(SLOT_BYTES)
    assert v.t.read("a", [Span(at, 0, SLOT_BYTES)], 10, [crc], sealed=True) == [True]  # a new connection: whole
    assert bytes(local[:SLOT_BYTES]) == bytes(secret.numpy())


def test_a_plain_write_into_a_sealed_reservation_is_refused_and_a_sealed_one_lands(sealed_node):
    a, sealed, relay, v, local = sealed_node
    data = _chunks(6, 80, 1)[key(80)]
    local[:SLOT_BYTES] = bytes(data.numpy())
    reply = v.ask(op="reserve", namespace=SEALED_NS.hex(), keys=key(80) + key(81), nbytes=SLOT_BYTES)
    assert reply["sealed"] is True  # the writer must write sealed
    [off80, off81] = reply["offsets"]
    with pytest.raises(TransferError, match=r"seal: expected a sealed write"):
        v.t.write("a", [Span(off80, 0, SLOT_BYTES)], 10)
    mark = len(relay.up)
    v.t.write("a", [Span(off80, 0, SLOT_BYTES)], 10, sealed=True)
    assert _window(data) not in bytes(relay.up[mark:])
    relay.flip("up", 5000)  # a changed byte of a sealed write: refused, the connection closed
    with pytest.raises(TransferError):
        v.t.write("a", [Span(off81, 0, SLOT_BYTES)], 10, sealed=True)
    crc = crc32c_update(memoryview(local)[:SLOT_BYTES])
    done = v.ask(op="commit_pushed", namespace=SEALED_NS.hex(), keys=key(80), crcs=[crc], nbytes=SLOT_BYTES)
    assert done["committed"] == 1
    assert sealed.contains_many([key(80)]) == [True]
    slot = sealed.pin([key(80)])[0]
    assert torch.equal(a.pool.slot(slot), data)
    sealed.unpin([key(80)])


def test_a_sealed_read_takes_no_bytes_from_a_node_that_does_not_acknowledge_it(tmp):
    """A node of a kvx before sealed transfers ignores ``"seal"`` and would send plaintext after ``{"ok": true}``:
    the reader fails the read before taking a byte."""
    secret = b"kvx-cluster-secret-0123456789"
    listener = socket.create_server(("127.0.0.1", 0))

    def old_node() -> None:
        sock, _ = listener.accept()
        try:
            handshake.admit(sock, secret, "old", {})
            handshake.recv(sock)
            handshake.send(sock, {"ok": True})
            sock.sendall(bytes(SLOT_BYTES))
        except OSError:
            pass  # the reader closed on the reply: as it should
        finally:
            sock.close()

    threading.Thread(target=old_node, daemon=True).start()
    local = bytearray(SLOT_BYTES)

    def dial(address):
        sock, _, keying = handshake.dial_keyed(address, secret, "new", "data", 10)
        return sock, WireSession(secret, keying)

    t = TcpTransport(local, dial, lambda: (0, SLOT_BYTES))
    t.connect("old", listener.getsockname(), b"")
    try:
        with pytest.raises(TransferError, match="acknowledge a sealed read"):
            t.read("old", [Span(0, 0, SLOT_BYTES)], 10, [0], sealed=True)
    finally:
        t.close()
        listener.close()
