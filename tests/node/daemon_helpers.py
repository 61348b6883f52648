"""Helpers shared by the tests of ``kvx node``'s daemon (``tests/node/test_daemon_*.py``): :class:`Peer`, a
connection to a :class:`~kvx.node.daemon.NodeState` without sockets, and :func:`check_invariants`, what the index, the
table and the counters must agree on; :class:`Daemon`, a real ``kvx node`` process, and raw-socket helpers. The
fixtures ``short_dir`` and ``node`` (one daemon per test module) are in ``tests/node/conftest.py``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

from kvx.node.connection import Connection, NodeError
from kvx.node.daemon import NodeState, default_pool_path
from kvx.node.directory import Directory
from kvx.node.protocol import FREE, HEADER, PENDING, READY, VERSION, PoolGeometry, slot_entry
from kvx.node.requests import Requests
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
NS_A, NS_B, NS_C = "a1" * 8, "b2" * 8, "c3" * 8
SLOT = 4096  # bytes: the smallest slot (protocol.SLOT_ALIGN), so a few MiB hold hundreds
START_S = 30  # seconds a daemon may take to start on a loaded 2-core machine


def key(i: int) -> str:
    return f"{i:032x}"


# ------------------------------------------------------------------------------------------------ NodeState
class Peer:
    """One connection to a :class:`NodeState`, through :class:`~kvx.node.requests.Requests` (the path every frame
    takes)."""

    def __init__(
        self, state: NodeState, cid: int, role: str = "engine", ns: str = NS_A, slot_bytes: int = SLOT, **hello
    ):
        """``hello``: more fields of the engine's hello (``sealed``)."""
        self.state, self.cid, self._id = state, cid, 0
        self.requests = Requests(state)
        state.open(cid, pid=1000 + cid)
        extra = (
            {"namespace": ns, "model": f"m-{ns[:2]}", "chunk_size": 16, "slot_bytes": slot_bytes, **hello}
            if role == "engine"
            else {}
        )
        self.hello = self.call("hello", version=VERSION, role=role, pid=1000 + cid, **extra)

    def reply(self, op: str, **args) -> tuple[dict, bool]:
        self._id += 1
        reply, keep = self.requests.request(self.cid, {"op": op, "id": self._id, **args})
        assert reply["id"] == self._id
        return reply, keep

    def call(self, op: str, **args) -> dict:
        reply, keep = self.reply(op, **args)
        if not reply["ok"]:
            raise NodeError(reply["error"])
        assert keep
        return reply

    def store(self, *keys: str) -> list[int]:
        """Allocate and commit ``keys``; their slots."""
        slots = []
        for k in keys:
            slots.append(self.call("allocate", key=k)["slot"])
            self.call("commit", key=k)
        return slots

    def close(self) -> None:
        self.state.close(self.cid)


def make_state(num_slots: int = 4, quotas: dict[str, int] | None = None) -> NodeState:
    geom = PoolGeometry(num_slots, SLOT)
    return NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", bytes(range(16)), quotas)


def entry(state: NodeState, slot: int) -> tuple[bytes, int, int]:
    return slot_entry(state.table, state.geom, slot)


def ns_stats(state: NodeState, ns: str = NS_A) -> dict:
    return state.stats()["namespaces"][ns]


def check_invariants(state: NodeState) -> None:
    """Every slot is free or held by one entry (in the index, or doomed and leased); the table says what the index
    says; every counter is what recounting gives."""
    holders: dict[int, object] = {}
    for ns in state._namespaces.values():
        assert ns.chunks == sum(e.state == READY for e in ns.entries.values())
        assert ns.pending == sum(e.state == PENDING for e in ns.entries.values())
        assert ns.admin_pinned == sum(e.admin > 0 for e in ns.entries.values())
        assert list(ns.lru) == [e for e in state.slots.lru if e.ns is ns]
        assert set(ns.lru) == {e for e in ns.entries.values() if e.state == READY and not e.admin}
        for k, e in ns.entries.items():
            assert e.key == k and not e.doomed and e.slot not in holders
            holders[e.slot] = e
            assert entry(state, e.slot) == (bytes.fromhex(k), state.slots.generation[e.slot], e.state)
    leases: Counter = Counter()
    for c in state._clients.values():
        for k, held in c.leases.items():
            assert held and all(e.key == k for e in held)
            leases.update(held)
        assert all(e.state == PENDING and e.owner == c.cid and e.ns.entries.get(k) is e for k, e in c.pending.items())
    for e, n in leases.items():
        assert e.pins == n
        if e.doomed:
            assert e.slot not in holders
            holders[e.slot] = e
    assert all(e.pins == leases[e] for e in holders.values())
    # the runs held, the free blocks and the quarantined runs cover the pool's slots once each (kvx.store.runs)
    held = [u for first, e in holders.items() for u in range(first, first + e.units)]
    free = [u for first, k in state.slots.runs._order.items() for u in range(first, first + (1 << k))]
    assert len(free) == state.slots.free_units
    quarantined = [u for _, first, n in state.slots.quarantine for u in range(first, first + n)]
    assert sorted([*held, *free, *quarantined]) == list(range(state.geom.num_slots))
    for slot in set(range(state.geom.num_slots)) - set(holders):
        assert entry(state, slot) == (bytes(16), state.slots.generation[slot], FREE)
    # the directory holds exactly the READY chunks, each found where a lookup probes for it (a key is one
    # namespace's in practice: keys are hash chains rooted in the namespace; the tests reuse keys across them)
    ready = [k for ns in state._namespaces.values() for k, e in ns.entries.items() if e.state == READY]
    others = [k for ns in state._namespaces.values() for k in ns.entries if k not in ready]
    d = Directory(state.table, state.geom, state.epoch)
    assert d.ready("".join(ready)) == [True] * len(ready)
    assert d.ready("".join(others + [key(10_000 + i) for i in range(8)])) == [False] * (len(others) + 8)
    assert int((d.dir["slot"] != 0).sum()) == len(ready)
    assert [d.state(k) for k in ready] == [READY] * len(ready)
    pending = [
        k for ns in state._namespaces.values() for k, e in ns.entries.items() if e.state == PENDING and k not in ready
    ]
    assert [d.state(k) for k in pending] == [PENDING] * len(pending)
    assert {d.state(k) for k in others if k not in pending} | {d.state(key(10_000))} <= {FREE}


# ------------------------------------------------------------------------------------------------ processes
class Daemon:
    """A ``kvx node`` process on a short temporary directory."""

    def __init__(self, root: Path, *args: str, pool: str | None = "pool", size: str = "8MiB"):
        self.root = root
        self.socket = str(root / "s")
        self.pool = str(root / pool) if pool else default_pool_path(self.socket)
        self.log = root / f"daemon-{len(list(root.glob('daemon-*')))}.log"
        cmd = [sys.executable, "-m", "kvx.node.cli", "--socket", self.socket, "--size", size, "--slot-size", str(SLOT)]
        cmd += ["--pool", self.pool] if pool else []
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*cmd, *args], cwd=REPO, stderr=log, stdout=log)

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> Daemon:
        def ready():
            assert self.proc.poll() is None, f"kvx node exited with {self.proc.returncode}: {self.stderr()}"
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return True
            except OSError:
                return False

        wait_for(ready, START_S, lambda: f"kvx node to listen on {self.socket}: {self.stderr()}")
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def control(self) -> Connection:
        c = Connection(self.socket, timeout=10)
        c.call("hello", version=VERSION, role="control", pid=os.getpid())
        return c

    def engine(self, ns: str, chunk_size: int = 16) -> Connection:
        """An engine's connection; its hello reply in ``.hello``."""
        c = Connection(self.socket, timeout=10)
        c.hello = c.call(
            "hello", version=VERSION, role="engine", namespace=ns, model="tiny", chunk_size=chunk_size, slot_bytes=SLOT
        )
        return c

    def stats(self) -> dict:
        c = self.control()
        try:
            return c.call("stats")
        finally:
            c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def read_reply(s: socket.socket) -> dict | None:
    """The next reply on a raw socket, or None if the daemon closed it."""
    try:
        header = recv_exact(s, HEADER.size)
        if header is None:
            return None
        return json.loads(recv_exact(s, HEADER.unpack(header)[3]))
    except ConnectionResetError:
        return None


def raw(node: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(node.socket)
    return s
