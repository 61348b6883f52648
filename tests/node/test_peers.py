"""Nodes as a cluster on one host's loopback (``kvx node --listen --peers --secret-file``): an engine's miss pulled
from the peer that holds the chunk, bit-exact, checked before it is served; the cluster secret; a peer stopped or
killed costs a miss, never a hang or a slot left behind. The same across network namespaces, with links cut:
``tests/node/test_cluster_netns.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest
import torch

from kvx.node.client import NodeIndex
from tests.helpers import wait_for
from tests.node.cluster_helpers import NAMESPACE, SLOT_BYTES, Member, free_port, key, secret_file


@pytest.fixture
def tmp():
    with tempfile.TemporaryDirectory(prefix="kvxp", dir="/tmp") as d:
        yield d


@pytest.fixture
def pair(tmp):
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    a = Member(tmp, "a", pa, [pb], secret)
    b = Member(tmp, "b", pb, [pa], secret)
    yield a, b
    a.close()
    b.close()


def test_a_miss_is_pulled_from_the_peer_that_has_it_bit_exact(pair):
    a, b = pair
    g = torch.Generator().manual_seed(0)
    chunks = {key(i): torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for i in range(5)}
    for k, data in chunks.items():
        a.store(k, data)
    keys = list(chunks)
    assert b.index.contains_many(keys) == [False] * 5
    assert b.pull(keys) == [True] * 5
    for k, data in chunks.items():
        assert torch.equal(b.read(k), data), k
    s = b.node.stats()
    assert s["namespaces"][NAMESPACE.hex()]["pulled"] == 5
    assert s["cluster"]["pulled"] == 5 and s["cluster"]["bad_chunks"] == 0
    peer = s["cluster"]["peers"][0]
    assert peer["state"] == "up" and peer["chunks_in"] == 5 and peer["bytes_in"] == 5 * SLOT_BYTES
    sa = a.node.stats()
    assert sa["namespaces"][NAMESPACE.hex()]["served"] == 5 and sa["cluster"]["bytes_out"] == 5 * SLOT_BYTES
    assert sa["leases"] == 0 and s["pool"]["pending"] == 0  # the peer's leases and the pull's slots are gone


def test_a_prefix_is_pulled_up_to_what_the_peer_holds_and_a_miss_is_not_asked_again(pair):
    a, b = pair
    data = torch.full((SLOT_BYTES,), 7, dtype=torch.uint8)
    a.store(key(1), data)
    a.store(key(3), data)  # after a gap: not part of the prefix
    keys = [key(1), key(2), key(3)]
    assert b.pull(keys) == [True, False, False]
    pulls = b.node.stats()["cluster"]["pulls"]
    assert not b.index.pulling(keys[1:])  # key 2 was asked for and found nowhere: not again for a while
    assert b.node.stats()["cluster"]["pulls"] == pulls


def test_chunks_of_a_namespace_the_peer_does_not_know_are_a_miss(pair):
    a, b = pair
    a.store(key(1), torch.zeros(SLOT_BYTES, dtype=torch.uint8))
    other = NodeIndex(b.sock, bytes(16), "other", 16, SLOT_BYTES, timeout=10, retry_s=0.05, pull_wait_ms=3000)
    try:
        wait_for(lambda: other.contains_many([key(1)]) is not None and other.pool is not None, 10, "hello")
        wait_for(lambda: not other.pulling([key(1)]), 30, "a pull")
        assert other.contains_many([key(1)]) == [False]
    finally:
        other.close()
    assert b.node.stats()["cluster"]["misses"] >= 1


def test_a_node_without_the_secret_gets_nothing_and_is_not_believed(tmp):
    good, bad = secret_file(tmp), secret_file(tmp, "other", "another-secret-of-enough-bytes")
    pa, pc = free_port(), free_port()
    a = Member(tmp, "a", pa, [pc], good)
    c = Member(tmp, "c", pc, [pa], bad)
    try:
        a.store(key(1), torch.ones(SLOT_BYTES, dtype=torch.uint8))
        assert c.pull([key(1)]) == [False]
        wait_for(lambda: a.node.stats()["cluster"]["refused_peers"] >= 1, 10, "a's refusal")
        peer = c.node.stats()["cluster"]["peers"][0]
        assert peer["state"] == "refused" and peer["chunks_in"] == 0, peer
        # and a pull the other way: c does not hold the secret, so a does not believe its answers either
        c.store(key(2), torch.ones(SLOT_BYTES, dtype=torch.uint8))
        assert a.pull([key(2)]) == [False]
        assert a.node.stats()["cluster"]["peers"][0]["state"] == "refused"
    finally:
        a.close()
        c.close()


@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_a_peer_stopped_or_killed_costs_a_miss_within_the_wait_and_leaves_no_slot(pair, how):
    a, b = pair
    a.store(key(1), torch.ones(SLOT_BYTES, dtype=torch.uint8))
    assert b.pull([key(1)]) == [True]  # the link is up
    a.store(key(2), torch.ones(SLOT_BYTES, dtype=torch.uint8))
    os.killpg(a.node.proc.pid, signal.SIGSTOP if how == "sigstop" else signal.SIGKILL)
    try:
        assert b.pull([key(2)], timeout=20) == [False]
        s = b.node.stats()
        assert s["pool"]["pending"] == 0 and s["pool"]["used"] - s["pool"]["quarantined"] >= 0
        assert s["namespaces"][NAMESPACE.hex()]["chunks"] == 1
        assert s["cluster"]["peers"][0]["state"] == "down"
    finally:
        if how == "sigstop":
            os.killpg(a.node.proc.pid, signal.SIGCONT)


def test_cluster_flags_are_checked_before_the_node_starts(tmp, capsys):
    from kvx.node import cli

    def run(*args: str) -> subprocess.CompletedProcess:
        """``kvx node`` in this process (its errors come before anything starts: nothing to stop)."""
        rc = cli.main(["--socket", os.path.join(tmp, "x.sock"), "--size", "16MiB", *args])
        return subprocess.CompletedProcess(args, rc, "", capsys.readouterr().err)

    short = secret_file(tmp, "short", "tiny")
    good = secret_file(tmp)
    cases = [
        (["--peers", "127.0.0.1:1"], "--peers: expected --listen HOST:PORT with it"),
        (["--listen", "127.0.0.1:9"], "--secret-file: expected the cluster's secret file with --listen"),
        (["--listen", "nohost", "--secret-file", good], "--listen: expected HOST:PORT"),
        (["--listen", "127.0.0.1:9", "--secret-file", short], "--secret-file: expected a secret of at least 16 bytes"),
        (["--listen", "127.0.0.1:9", "--secret-file", os.path.join(tmp, "none")], "--secret-file: expected a readable"),
        (["--listen", "127.0.0.1:9", "--secret-file", good, "--peers", "127.0.0.1:0"], "--peers: expected HOST:PORT"),
        (["--listen", "127.0.0.1:9", "--secret-file", good, "--peers", "127.0.0.1:9"], "this node's own --listen"),
        (["--membership", "redis://127.0.0.1:1"], "--membership: expected --listen HOST:PORT with it"),
        (
            ["--listen", "127.0.0.1:9", "--secret-file", good, "--peers", "h:1", "--membership", "redis://h:2"],
            "--membership: expected in place of --peers, got both",
        ),
        (["--listen", "127.0.0.1:9", "--secret-file", good, "--membership", "http://h:2"], "--membership: expected"),
        (["--listen", "127.0.0.1:9", "--secret-file", good, "--membership-ttl-s", "0"], "--membership-ttl-s"),
    ]
    for args, text in cases:
        r = run(*args)
        assert r.returncode == 2 and text in r.stderr, (args, r.returncode, r.stderr)


def test_a_push_lands_in_the_consumers_node_as_each_chunk_is_committed(pair):
    a, b = pair
    g = torch.Generator().manual_seed(1)
    chunks = {key(40 + i): torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for i in range(3)}
    keys = list(chunks)
    a.store(keys[0], chunks[keys[0]])
    slot = a.index.allocate(keys[1])  # being written when the push is asked for: it goes once committed
    assert a.index.push(keys, f"127.0.0.1:{b.port}")
    a.pool.slot(slot).copy_(chunks[keys[1]])
    a.index.commit(keys[1])
    a.store(keys[2], chunks[keys[2]])
    wait_for(lambda: b.index.contains_many(keys) == [True] * 3, 30, lambda: f"the pushes: {b.node.stats()}")
    for k, data in chunks.items():
        assert torch.equal(b.read(k), data), k
    s = b.node.stats()
    assert s["namespaces"][NAMESPACE.hex()]["pushed"] == 3 and s["cluster"]["received"] == 3
    wait_for(lambda: a.node.stats()["cluster"]["pushed"] == 3, 10, "the producer's count")
    assert a.node.stats()["leases"] == 0 and s["pool"]["pending"] == 0


def test_a_push_to_a_node_that_already_holds_a_chunk_sends_only_the_others(pair):
    a, b = pair
    data = torch.full((SLOT_BYTES,), 3, dtype=torch.uint8)
    for k in (key(50), key(51)):
        a.store(k, data)
    b.store(key(50), data)
    assert a.index.push([key(50), key(51)], f"127.0.0.1:{b.port}")
    wait_for(lambda: b.index.contains_many([key(51)]) == [True], 30, "the push")
    wait_for(lambda: a.node.stats()["cluster"]["pushes"] == 1 and a.node.stats()["leases"] == 0, 10, "the push's end")
    assert a.node.stats()["cluster"]["pushed"] == 1


def test_a_consumer_killed_before_its_pushes_land_leaves_the_producer_nothing_held(pair):
    a, b = pair
    a.store(key(60), torch.ones(SLOT_BYTES, dtype=torch.uint8))
    b.node.kill()
    assert a.index.push([key(60)], f"127.0.0.1:{b.port}")
    wait_for(lambda: a.node.stats()["cluster"]["push_failed"] == 1, 30, lambda: f"the failure: {a.node.stats()}")
    s = a.node.stats()
    assert s["leases"] == 0 and s["pool"]["pending"] == 0 and s["namespaces"][NAMESPACE.hex()]["chunks"] == 1


def test_a_push_to_a_node_outside_the_cluster_sends_nothing(tmp):
    pa, pc = free_port(), free_port()
    a = Member(tmp, "a", pa, [], secret_file(tmp))
    c = Member(tmp, "c", pc, [], secret_file(tmp, "other", "another-secret-of-enough-bytes"))
    try:
        a.store(key(70), torch.ones(SLOT_BYTES, dtype=torch.uint8))
        assert a.index.push([key(70)], f"127.0.0.1:{pc}")
        wait_for(lambda: a.node.stats()["cluster"]["push_failed"] == 1, 30, "the refusal")
        assert c.index.contains_many([key(70)]) == [False]
        assert c.node.stats()["cluster"]["refused_peers"] >= 1
    finally:
        a.close()
        c.close()


class GarbagePeer:
    """A member that holds the secret but answers with garbage: it claims every chunk, leases them at offsets of
    its own, and streams random bytes with CRC32Cs that do not match them (a broken or hostile node)."""

    def __init__(self, secret: bytes):
        from kvx.node import handshake

        self.h = handshake
        self.secret = secret
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock) -> None:
        try:
            _, role = self.h.admit(sock, self.secret, "garbage", {"transport": "tcp", "epoch": "00"})
            while True:
                msg = self.h.recv(sock)
                op = msg.get("op")
                keys = msg.get("keys", "")
                keys = [keys[i : i + 32] for i in range(0, len(keys), 32)] if isinstance(keys, str) else keys
                if op == "have":
                    self.h.send(sock, {"ok": True, "ready": len(keys)})
                elif op == "lease":
                    chunks = [[k, (1 << 30) + i * SLOT_BYTES, 1, None] for i, k in enumerate(keys)]
                    self.h.send(sock, {"ok": True, "chunks": chunks, "epoch": "00"})
                elif op == "release":
                    self.h.send(sock, {"ok": True, "intact": [True] * len(msg["keys"])})
                elif op == "read":
                    self.h.send(sock, {"ok": True})
                    for _, n in msg["spans"]:
                        sock.sendall(os.urandom(n))
                    self.h.send(sock, {"crcs": [12345] * len(msg["spans"])})
                else:
                    self.h.send(sock, {"ok": False, "error": "no"})
        except (OSError, ValueError):
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_peer_that_answers_garbage_is_never_served(tmp):
    secret = secret_file(tmp)
    with open(secret, "rb") as f:
        garbage = GarbagePeer(f.read().strip())
    b = Member(tmp, "b", free_port(), [garbage.port], secret)
    try:
        assert b.pull([key(80), key(81)]) == [False, False]
        s = b.node.stats()
        assert s["cluster"]["bad_chunks"] == 2 and s["cluster"]["pulled"] == 0
        assert s["pool"]["pending"] == 0 and s["namespaces"][NAMESPACE.hex()]["chunks"] == 0
    finally:
        b.close()
        garbage.close()


def test_the_leases_of_a_peer_that_goes_away_are_released(pair, tmp):
    from kvx.node import handshake

    a, _ = pair
    a.store(key(90), torch.ones(SLOT_BYTES, dtype=torch.uint8))
    with open(secret_file(tmp), "rb") as f:
        secret = f.read().strip()
    sock, _ = handshake.dial(("127.0.0.1", a.port), secret, "visitor", "control", 10)
    handshake.send(sock, {"op": "lease", "namespace": NAMESPACE.hex(), "keys": key(90), "nbytes": SLOT_BYTES})
    assert [c[0] for c in handshake.recv(sock)["chunks"]] == [key(90)]
    assert a.node.stats()["leases"] == 1
    sock.close()  # gone without a release: its leases go with its connection
    wait_for(lambda: a.node.stats()["leases"] == 0, 10, "the leases released")
    s = a.node.stats()
    assert s["namespaces"][NAMESPACE.hex()]["chunks"] == 1


def test_a_pull_after_the_peer_closed_an_idle_connection_dials_again(tmp):
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    a = Member(tmp, "a", pa, [pb], secret, "--lease-s", "0.5")  # a closes a peer's connection idle 0.5 s
    b = Member(tmp, "b", pb, [pa], secret)
    try:
        for i in (1, 2):
            a.store(key(100 + i), torch.ones(SLOT_BYTES, dtype=torch.uint8))
        assert b.pull([key(101)]) == [True]
        idle_until = time.monotonic() + 1.0
        wait_for(lambda: time.monotonic() > idle_until, 5, "the connection to sit idle past a's --lease-s")
        assert b.pull([key(102)]) == [True]  # its connection was closed by a: dialed again, not a miss
        assert b.node.stats()["cluster"]["peers"][0]["state"] == "up"
    finally:
        a.close()
        b.close()


def test_chunks_that_take_a_run_of_slots_are_pulled_bit_exact(tmp):
    """Slots smaller than the chunks (a host serving several models): each chunk a run of slots, pulled whole."""
    secret = secret_file(tmp)
    pa, pb = free_port(), free_port()
    small = ("--slot-size", "4KiB")  # after the Member's own --slot-size: the last one counts
    a = Member(tmp, "a", pa, [pb], secret, *small)
    b = Member(tmp, "b", pb, [pa], secret, *small)
    try:
        units = -(-SLOT_BYTES // 4096)
        assert units > 1 and a.node.stats()["pool"]["slot_bytes"] == 4096
        g = torch.Generator().manual_seed(1)
        chunks = {key(i): torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for i in range(5)}
        for k, data in chunks.items():
            a.store(k, data)
        assert b.pull(list(chunks)) == [True] * 5
        for k, data in chunks.items():
            assert torch.equal(b.read(k), data), k
        s = b.node.stats()
        assert s["cluster"]["bad_chunks"] == 0 and s["pool"]["used"] == 5 * units and s["pool"]["pending"] == 0
        assert a.node.stats()["cluster"]["bytes_out"] == 5 * SLOT_BYTES
        pushed = {key(60 + i): torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for i in range(3)}
        for k, data in pushed.items():
            a.store(k, data)
        assert a.index.push(list(pushed), f"127.0.0.1:{b.port}")  # P/D: pushed whole into runs of b's slots
        wait_for(lambda: b.index.contains_many(list(pushed)) == [True] * 3, 30, lambda: f"pushes: {b.node.stats()}")
        for k, data in pushed.items():
            assert torch.equal(b.read(k), data), k
    finally:
        a.close()
        b.close()


def test_a_chunk_evicted_on_the_peer_mid_read_keeps_its_bytes_until_released_and_is_not_served(pair, tmp):
    """An operator evicts a chunk a peer has leased, and the pool churns past its size, while the read is between
    its lease and its release: the slot is not reused (the bytes read are the chunk's, CRC32C as leased), the
    release says the chunk is not intact (a puller then serves nothing of it), and the slot is free afterwards."""
    from kvx.node import handshake
    from kvx.node.connection import Connection
    from kvx.node.protocol import VERSION
    from kvx.node.tcp import TcpTransport
    from kvx.node.transport import Span

    a, _ = pair
    data = torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    a.store(key(90), data)
    with open(secret_file(tmp), "rb") as f:
        secret = f.read().strip()
    sock, _ = handshake.dial(("127.0.0.1", a.port), secret, "visitor", "control", 10)
    handshake.send(sock, {"op": "lease", "namespace": NAMESPACE.hex(), "keys": key(90), "nbytes": SLOT_BYTES})
    [(k, offset, generation, crc)] = handshake.recv(sock)["chunks"]
    ctl = Connection(a.sock, timeout=10)
    try:
        ctl.call("hello", version=VERSION, role="control", pid=os.getpid())
        assert ctl.call("evict", namespace=NAMESPACE.hex(), keys=[key(90)])["evicted"] == 1
        pool_slots = a.node.stats()["pool"]["bytes"] // SLOT_BYTES  # chunks the pool holds
        for i in range(2 * pool_slots):  # the pool churns twice over: every other slot is reused
            a.store(key(200 + i), torch.full((SLOT_BYTES,), i % 251, dtype=torch.uint8))
        assert a.index.contains_many([key(90)]) == [False]  # evicted: no engine or peer finds it
        local = bytearray(SLOT_BYTES)
        reader = TcpTransport(
            local, lambda addr: (handshake.dial(addr, secret, "visitor", "data", 10)[0], None), lambda: (0, SLOT_BYTES)
        )
        reader.connect("a", ("127.0.0.1", a.port), b"")
        assert reader.read("a", [Span(offset, 0, SLOT_BYTES)], 10, [crc]) == [True]
        assert torch.equal(torch.frombuffer(local, dtype=torch.uint8), data)
        reader.forget("a")
        handshake.send(sock, {"op": "release", "keys": [k], "generations": [generation]})
        assert handshake.recv(sock)["intact"] == [False]  # doomed while leased: a puller would not serve it
        wait_for(lambda: a.node.stats()["leases"] == 0, 10, "the lease released")
        a.store(key(91), data)  # the doomed slot is free again: the pool holds as many chunks as before
        assert a.node.stats()["namespaces"][NAMESPACE.hex()]["chunks"] == pool_slots
    finally:
        ctl.close()
        sock.close()


def test_the_misses_of_several_requests_are_pulled_at_once(pair):
    a, b = pair
    g = torch.Generator().manual_seed(3)
    prompts = [[key(100 + 10 * r + i) for i in range(3)] for r in range(3)]
    chunks = {k: torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=g) for ks in prompts for k in ks}
    for k, data in chunks.items():
        a.store(k, data)
    # three requests miss at once: each waits for a pull of its own (before: the second and third computed theirs)
    assert [b.index.pulling(keys) for keys in prompts] == [True] * 3
    for keys in prompts:
        assert b.pull(keys) == [True] * 3
    for k, data in chunks.items():
        assert torch.equal(b.read(k), data), k
    s = b.node.stats()
    assert s["cluster"]["pulls"] == 3 and s["cluster"]["pulled"] == 9 and s["pool"]["pending"] == 0
