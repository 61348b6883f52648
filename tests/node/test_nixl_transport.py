"""kvx.node.nixl.NixlTransport between two processes on this machine (CPU only: UCX over CMA by default, over TCP
with ``UCX_TLS=tcp,self``): each side its own pool file in /dev/shm, the peer's filled with seeded random bytes; the
peer's descriptor comes over its stdout pipe. Reads (and writes, read back) must be bit-exact; bad spans, unknown
peers, dead peers and stalled peers must raise (within their bounds, never hang).

The serving peer is this file run as a script (``python test_nixl_transport.py serve ...``); NIXL must be
installed (scripts/setup.sh does): without it this module fails to import, it is not skipped.
"""

from __future__ import annotations

import mmap
import os
import random
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

import pytest  # noqa: E402

from kvx.node.nixl import Descriptor, NixlTransport  # noqa: E402 - NIXL missing: this module fails, not skips
from kvx.node.transport import Span, TransferError  # noqa: E402

if __name__ != "__main__":  # not in the serving child: tests.helpers imports torch (seconds)
    from tests.helpers import stopped, wait_for

KiB, MiB = 1 << 10, 1 << 20
POOL = 24 * MiB
TCP = {"UCX_TLS": "tcp,self"}

# odd sizes, non-adjacent (both sides), local offsets unlike the remote ones; one of 8 MiB
SPANS = [
    Span(remote=4096 * 3 + 17, local=13 * MiB + 3, nbytes=4096 * 3 + 17),
    Span(remote=1 * MiB + 1, local=1, nbytes=8 * MiB),
    Span(remote=20 * MiB, local=15 * MiB, nbytes=1),
    Span(remote=12 * MiB + 999, local=9 * MiB + 4097, nbytes=3 * MiB + 5),
    Span(remote=POOL - 4093, local=POOL - 4093, nbytes=4093),  # the last byte of both pools
]
_ends = sorted((s.local, s.local + s.nbytes) for s in SPANS)
assert all(a[1] < b[0] for a, b in zip(_ends, _ends[1:])), "SPANS: local ranges must not touch"


def pool_bytes(seed: int) -> bytes:
    """The serving peer's pool contents (the same in every process)."""
    return random.Random(seed).randbytes(POOL)


def make_pool(path: str, data: bytes | None) -> mmap.mmap:
    """A pool file of :data:`POOL` bytes at ``path`` (zeros, or ``data``), mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, POOL)
        m = mmap.mmap(fd, POOL)
    finally:
        os.close(fd)
    if data is not None:
        m[:] = data
    return m


class Peer:
    """A serving node in a child process (this file as a script): its pool, its transport, its descriptor."""

    def __init__(self, node_id: str, seed: int, env: dict[str, str] | None = None):
        self.node_id = node_id
        self.seed = seed
        self.path = f"/dev/shm/kvx-test-nixl-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", self.path, node_id, str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {}), "PYTHONPATH": str(REPO)},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),  # an abort leaves no core file
        )
        try:
            for line in self.proc.stdout:  # NIXL logs to stdout too; the child times out on its own
                if line.startswith(b"descriptor "):
                    self.descriptor = bytes.fromhex(line.split()[1].decode())
                    break
            else:
                raise AssertionError(f"peer {node_id} exited with {self.proc.wait()} before sending its descriptor")
        except BaseException:
            self.proc.kill()
            self.stop()
            raise

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the child closes its transport and exits
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        if os.path.exists(self.path):  # the child's own, unless it died first
            os.unlink(self.path)


class Reader:
    """This process's side: a zeroed pool in /dev/shm and a transport over it."""

    def __init__(self, node_id: str = "reader", **kw):
        self.path = f"/dev/shm/kvx-test-nixl-{uuid.uuid4().hex}"
        self.pool = make_pool(self.path, None)
        try:
            self.t = NixlTransport(self.pool, node_id, **kw)
        except BaseException:
            self.pool.close()
            os.unlink(self.path)
            raise

    def close(self) -> None:
        self.t.close()
        self.pool.close()  # possible only once the transport has released its buffer export
        os.unlink(self.path)


def check_spans(reader: Reader, seed: int, spans: list[Span]) -> None:
    """Each span's bytes arrived."""
    src = pool_bytes(seed)
    for i, s in enumerate(spans):
        got = reader.pool[s.local : s.local + s.nbytes]
        assert got == src[s.remote : s.remote + s.nbytes], f"spans[{i}] = {s}: bytes differ"


def check_pool(reader: Reader, seed: int, spans: list[Span]) -> None:
    """The whole local pool is the spans' bytes where they landed and zeros elsewhere."""
    src = pool_bytes(seed)
    want = bytearray(POOL)
    for s in spans:
        want[s.local : s.local + s.nbytes] = src[s.remote : s.remote + s.nbytes]
    check_spans(reader, seed, spans)  # names the span that differs, if one does
    assert reader.pool[:] == want, "bytes outside the spans were written"


def _bit_exact(env: dict[str, str], monkeypatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # before this process's agents are made: UCX reads it then
    peer = Peer("peer-a", seed=11, env=env)
    reader = Reader()
    try:
        reader.t.connect("peer-a", ("127.0.0.1", 0), peer.descriptor)
        reader.t.connect("peer-a", ("127.0.0.1", 0), peer.descriptor)  # the same again: nothing
        reader.t.read("peer-a", SPANS, timeout=20.0)
        check_pool(reader, peer.seed, SPANS)
        # a write (a P/D push) of other bytes into the same spans of the peer, checked by reading them back
        mine = random.Random(99).randbytes(POOL)
        reader.pool[:] = mine
        reader.t.write("peer-a", SPANS, timeout=20.0)
        reader.pool[:] = bytes(POOL)
        reader.t.read("peer-a", SPANS, timeout=20.0)
        for i, sp in enumerate(SPANS):
            got = reader.pool[sp.local : sp.local + sp.nbytes]
            assert got == mine[sp.local : sp.local + sp.nbytes], f"spans[{i}] = {sp}: written bytes differ"
    finally:
        reader.close()
        peer.stop()


def test_reads_are_bit_exact(monkeypatch):
    """UCX's defaults (CMA between two processes of one host)."""
    _bit_exact({}, monkeypatch)


def test_reads_are_bit_exact_over_tcp(monkeypatch):
    """``UCX_TLS=tcp,self`` in both processes: UCX's software GET over a TCP connection."""
    _bit_exact(TCP, monkeypatch)


def test_bad_reads_raise_and_move_nothing():
    peer = Peer("peer-b", seed=12)
    reader = Reader()
    try:
        t = reader.t
        with pytest.raises(TransferError, match="'nobody' is not connected"):
            t.read("nobody", SPANS[:1], timeout=5.0)
        with pytest.raises(TransferError, match="write: peer 'nobody' is not connected"):
            t.write("nobody", SPANS[:1], timeout=5.0)
        t.connect("peer-b", ("127.0.0.1", 0), peer.descriptor)
        for spans, match in [
            ([SPANS[0], Span(POOL - 10, 0, 11)], r"spans\[1\] .*remote: expected .*within the peer's pool \[0, "),
            ([Span(0, POOL, 1)], r"spans\[0\] .*local: expected .*within this pool's \[0, "),
            ([Span(0, -1, 1)], r"spans\[0\] .*local"),
            ([Span(0, 0, 0)], r"spans\[0\] .*nbytes: expected > 0, got 0"),
        ]:
            with pytest.raises(ValueError, match=match):
                t.read("peer-b", spans, timeout=5.0)
            with pytest.raises(ValueError, match=match):
                t.write("peer-b", spans, timeout=5.0)
        with pytest.raises(ValueError, match="timeout: expected > 0"):
            t.read("peer-b", SPANS[:1], timeout=0)
        assert reader.pool[:].count(0) == POOL  # nothing moved
        t.read("peer-b", [], timeout=5.0)  # no spans: nothing to do
        with pytest.raises(ValueError, match="descriptor: expected a kvx NIXL descriptor"):
            t.connect("peer-x", ("127.0.0.1", 0), b"X" * 64)
        with pytest.raises(ValueError, match="'peer-b' has too"):
            t.connect("peer-c", ("127.0.0.1", 0), peer.descriptor)  # another peer id, the same node
        with pytest.raises(ValueError, match="this node's own id"):
            t.connect("me", ("127.0.0.1", 0), t.descriptor())
        t.forget("peer-b")
        t.forget("peer-b")  # unknown now: nothing
        with pytest.raises(TransferError, match="not connected"):
            t.read("peer-b", SPANS[:1], timeout=5.0)
        t.connect("peer-b", ("127.0.0.1", 0), peer.descriptor)  # back
        t.read("peer-b", SPANS[:1], timeout=20.0)
        check_spans(reader, peer.seed, SPANS[:1])
    finally:
        reader.close()
        peer.stop()
    d = Descriptor.parse(peer.descriptor)
    assert d.agent == "peer-b" and d.length == POOL and len(d.metadata) > 0


def test_close_is_idempotent_and_releases_the_mapping():
    reader = Reader()
    with pytest.raises(BufferError):
        reader.pool.close()  # the transport holds a buffer export while it is open
    reader.t.close()
    reader.t.close()
    with pytest.raises(TransferError, match="is closed"):
        reader.t.read("anyone", SPANS[:1], timeout=1.0)
    reader.close()  # closes the mapping: possible now


def test_a_dead_peer_raises_within_the_timeout():
    peer = Peer("peer-d", seed=13)
    reader = Reader()
    try:
        reader.t.connect("peer-d", ("127.0.0.1", 0), peer.descriptor)
        reader.t.read("peer-d", SPANS[:2], timeout=20.0)  # connected, once
        peer.proc.kill()
        peer.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="peer-d"):
            reader.t.read("peer-d", SPANS, timeout=5.0)
        assert time.monotonic() - t0 < 5.0 + 10.0  # a hang guard only, not a speed check
    finally:
        reader.close()
        peer.stop()


def test_a_stalled_peer_is_abandoned_and_nothing_is_written_after(monkeypatch):
    """Over TCP the peer's UCX worker answers each read; a SIGSTOPped peer answers none. The read raises after its
    timeout and ``settle_s``, having remade its reading agent (the only way to stop the READ's bytes from landing
    later); the other peer is still readable, and when the stalled one goes on nothing more arrives from it."""
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    stalled, live = Peer("peer-s", seed=14, env=TCP), Peer("peer-l", seed=15, env=TCP)
    reader = Reader(settle_s=0.5)
    try:
        t = reader.t
        t.connect("peer-s", ("127.0.0.1", 0), stalled.descriptor)
        t.connect("peer-l", ("127.0.0.1", 0), live.descriptor)
        t.read("peer-s", [Span(0, 0, 4096)], timeout=20.0)  # connected, once
        reader.pool[:4096] = bytes(4096)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(stalled.proc.pid), 10, "the stalled peer to stop")
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="abandoned"):
            t.read("peer-s", SPANS, timeout=1.0)
        assert time.monotonic() - t0 < 1.0 + 0.5 + 10.0  # a hang guard only
        assert t.generation == 1
        os.kill(stalled.proc.pid, signal.SIGCONT)  # its answers (if it gets to send them) find no reader
        moved = [Span(s.remote, s.local, s.nbytes) for s in SPANS[:2]]
        reads = 0

        def stalled_peer_done_or_enough_reads() -> bool:
            nonlocal reads
            t.read("peer-l", moved, timeout=20.0)  # progresses this process's UCX (the new worker)
            reads += 1
            return stalled.proc.poll() is not None or reads >= 20

        wait_for(stalled_peer_done_or_enough_reads, 30, "the stalled peer to end or 20 reads", interval=0.05)
        check_spans(reader, live.seed, moved)
        untouched = [Span(s.remote, s.local, s.nbytes) for s in SPANS[2:]]  # where only peer-s's READ would write
        assert all(reader.pool[s.local : s.local + s.nbytes].count(0) == s.nbytes for s in untouched)
    finally:
        reader.close()
        for p in (stalled, live):
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


# ------------------------------------------------------------------------------------------ the serving peer
def serve(path: str, node_id: str, seed: int) -> None:
    """Make a pool file of :data:`POOL` seeded random bytes at ``path`` and a transport over it, write its
    descriptor (hex) to stdout, then serve until stdin closes (or 120 s pass: an orphan ends on its own)."""
    import select

    pool = make_pool(path, pool_bytes(seed))
    t = NixlTransport(pool, node_id)
    sys.stdout.write(f"descriptor {t.descriptor().hex()}\n")
    sys.stdout.flush()
    select.select([sys.stdin], [], [], 120.0)
    t.close()
    pool.close()


if __name__ == "__main__":
    serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
