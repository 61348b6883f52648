"""kvx's own byte channel between nodes: a :class:`~.transport.Transport` over plain TCP.

A reader dials the peer's listen port as a cluster member (:mod:`.handshake`, role ``data``), sends one frame ``{"op":
"read", "spans": [[offset, nbytes], ...]}`` and receives one frame ``{"ok": true}`` followed by the spans' bytes end to
end, straight from the peer's pool file into its own (``recv_into`` the mapped slots): no copy in between, no
serialisation; then a frame of the CRC32Cs the peer computed as it sent them, unless the read said ``"crc": false`` (a
pull holds its lease's CRC32Cs, computed when each chunk was committed, and checks against those). A writer (a P/D push)
sends ``{"op": "write", "spans": ...}``, the bytes, and receives ``{"ok": true}`` once they are in the peer's slots,
which must be slots the peer reserved for this node (``writable``). The connection stays open for the next transfer.

**Sealed** (a sealed namespace's chunks: :mod:`.wire_seal`): a read or write that says ``"seal": true`` moves each
span as AES-256-GCM pieces under the connection's own keys (derived by both ends from the cluster secret and the
handshake's nonces: no key crosses), decrypted straight into the receiving slots. The serving side refuses a plain
read of any span in a sealed namespace's slot (an error frame naming why) and a plain write into one (and closes),
so such a chunk never crosses in the clear, whichever side asked. A sealed read accepts bytes only after a reply
that says ``"seal": true`` (a node of a kvx before sealed transfers ignores the field and would send plaintext), and
a sealed write is done only when the reply says so too.

Why a channel of its own beside NIXL: UCX's TCP lane (a software GET the serving process answers) moved 0.66x of a plain
socket stream between two processes here where this channel moved 0.88x (``benchmarks/results/peer_transfer_cpu.md``),
and it opens no UCX port to whoever can reach the host.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

from ..log import get_logger
from ..store.codec import crc32c_update
from . import handshake
from .transport import Span, TransferError, Transport
from .wire_seal import SealError, WireSession

log = get_logger(__name__)

_CRC_PIECE = 256 << 10  # bytes summed at a time as they stream: small enough to be in cache still
_SOCK_BUF = 4 << 20  # bytes of kernel socket buffer each way (as LMCache's TCP channel)
_MAX_SPANS = 4096
_LINGER_S, _LINGER_BYTES = 2.0, 1 << 32  # a refused write's bytes are read and dropped this long, this much at most


def tune(sock: socket.socket) -> None:
    """Large kernel buffers and no Nagle delay on a data connection."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _left(deadline: float) -> Callable[[], float]:
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        return remaining

    return left


def _recv_into(sock: socket.socket, part: memoryview) -> None:
    got = 0
    while got < len(part):
        n = sock.recv_into(part[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-write")
        got += n
    part.release()


def _recv_checked(sock: socket.socket, part: memoryview, left: Callable[[], float]) -> int:
    """Receive ``part`` whole and return its CRC32C, summed piece by piece as the bytes land (each piece still in
    this core's cache: the check costs next to nothing, where a pass over the whole span afterwards cost ~20% of the
    stream's rate, ``benchmarks/results/peer_transfer_cpu.md``)."""
    got = checked = crc = 0
    while got < len(part):
        sock.settimeout(left())
        n = sock.recv_into(part[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-read")
        got += n
        if got - checked >= _CRC_PIECE or got == len(part):
            crc = crc32c_update(part[checked:got], crc)
            checked = got
    return crc


def _refuse_write(sock: socket.socket, error: str) -> None:
    """Refuse a write whose bytes are coming: send ``error``, then read and drop what the writer still sends until it
    closes (or is silent :data:`_LINGER_S`, or sent :data:`_LINGER_BYTES`), so that it reads the error before the
    connection ends. Closing with its bytes unread would reset the connection, and the writer would see only that."""
    try:
        handshake.send(sock, {"ok": False, "error": error})
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(_LINGER_S)
        buf, dropped = bytearray(1 << 20), 0
        while dropped < _LINGER_BYTES:
            n = sock.recv_into(buf)
            if n == 0:
                return
            dropped += n
    except OSError:
        pass


class TcpTransport(Transport):
    """Reads spans of peers' pools over TCP, and serves this node's pool to peers that read it.

    ``pool``: the local pool file's mapping (writable). ``dial(address)``: an admitted ``data`` connection to the
    node at ``address`` and its keys, a (socket, :class:`~.wire_seal.WireSession` or None) pair (None: plain
    transfers only, as :func:`kvx.node.handshake.dial` admits). ``bounds()``: the [start, end) of the pool
    file's bytes a peer may read (the slots' area). The reading side is called by the node's pull threads, one read
    per peer at a time (a lock per peer); the serving side (:meth:`serve`) runs on the connection's own thread.
    """

    name = "tcp"

    def __init__(
        self,
        pool,
        dial: Callable[[tuple[str, int]], tuple[socket.socket, WireSession | None]],
        bounds: Callable[[], tuple[int, int]],
        writable: Callable[[str, list[tuple[int, int]]], bool] | None = None,
        sealed: Callable[[list[tuple[int, int]]], bool] | None = None,
    ):
        """``writable(peer, spans)``: whether ``peer`` may write those (offset, nbytes) spans here (None: no one).
        ``sealed(spans)``: whether any of those spans lies in a slot of a sealed namespace (None: none does), which
        then crosses only sealed."""
        self.pool = pool
        self._dial = dial
        self._bounds = bounds
        self._writable = writable
        self._sealed = sealed
        self._lock = threading.Lock()  # guards the dicts below (pull threads)
        self._addr: dict[str, tuple[str, int]] = {}
        self._socks: dict[str, socket.socket] = {}
        self._sessions: dict[str, WireSession | None] = {}  # per peer: its connection's keys (None: a plain one)
        self._peer_locks: dict[str, threading.Lock] = {}
        self.bytes_served = 0  # the serving threads' count (read by stats: an int, written under _lock)

    def descriptor(self) -> bytes:
        return b""

    def connect(self, peer: str, address: tuple[str, int], descriptor: bytes) -> None:
        with self._lock:
            if self._addr.get(peer) != address:
                self._addr[peer] = address
                self._drop(peer)
            self._peer_locks.setdefault(peer, threading.Lock())

    def forget(self, peer: str) -> None:
        with self._lock:
            self._addr.pop(peer, None)
            self._drop(peer)

    def _drop(self, peer: str) -> None:
        self._sessions.pop(peer, None)
        sock = self._socks.pop(peer, None)
        if sock is not None:
            sock.close()

    def read(
        self,
        peer: str,
        spans: Sequence[Span],
        timeout: float,
        crcs: Sequence[int] | None = None,
        sealed: bool = False,
        landed: Callable[[int, bool], None] | None = None,
    ) -> list[bool]:
        """As :meth:`Transport.read`; checked here: this side computes each span's CRC32C as it receives it (piece by
        piece, while each is in cache: :func:`_recv_checked`) and compares it with ``crcs`` (the lease's,
        computed when each chunk was committed), or without them with the peer's, computed as it sends; each span's
        verdict is returned. ``sealed``: the bytes cross encrypted (module docstring; every GCM tag checked, a bad
        one fails the read), and without ``crcs`` a span that arrived is a good one (the tags authenticated it).
        ``landed(i, ok)``: with ``crcs``, called as each span is in and checked, in order (the caller serves a chunk
        before the rest of the read is in)."""
        if crcs is not None and len(crcs) != len(spans):
            raise ValueError(f"crcs: expected one per span ({len(spans)}), got {len(crcs)}")

        def _read(sock, session, sp, deadline):
            return self._read(sock, session if sealed else None, sealed, sp, deadline, crcs, landed)

        return self._transfer(peer, spans, timeout, _read)

    def write(self, peer: str, spans: Sequence[Span], timeout: float, sealed: bool = False) -> None:
        """As :meth:`Transport.write`; ``sealed``: the bytes cross encrypted (module docstring)."""

        def _write(sock, session, sp, deadline):
            return self._write(sock, session if sealed else None, sealed, sp, deadline)

        self._transfer(peer, spans, timeout, _write)

    def _transfer(self, peer: str, spans: Sequence[Span], timeout: float, how):
        with self._lock:
            address, lock = self._addr.get(peer), self._peer_locks.get(peer)
        if address is None or lock is None:
            raise TransferError(f"peer: expected a connected peer, got {peer!r}")
        deadline = time.monotonic() + timeout
        with lock:
            sock, session = self._socks.get(peer), self._sessions.get(peer)
            try:
                if sock is None:
                    sock, session = self._dial(address)
                    tune(sock)
                    with self._lock:
                        self._socks[peer], self._sessions[peer] = sock, session
                return how(sock, session, spans, deadline)
            except (OSError, ValueError) as e:
                with self._lock:
                    if self._socks.get(peer) is sock:
                        self._drop(peer)
                raise TransferError(
                    f"tcp {how.__name__[1:]} of node {peer} at {address[0]}:{address[1]}: {e}"
                ) from None

    def _read(
        self,
        sock: socket.socket,
        session: WireSession | None,
        sealed: bool,
        spans: Sequence[Span],
        deadline: float,
        expected: Sequence[int] | None,
        landed: Callable[[int, bool], None] | None = None,
    ) -> list[bool]:
        left = _left(deadline)
        if sealed and session is None:
            raise ValueError("seal: expected a data connection with keys for a sealed read, got a plain one")
        sock.settimeout(left())
        frame = {"op": "read", "spans": [[s.remote, s.nbytes] for s in spans]}
        if expected is not None or sealed:
            frame["crc"] = False  # the lease's CRC32Cs are here: the peer need not compute them as it sends
        if sealed:
            frame["seal"] = True
        handshake.send(sock, frame)
        reply = handshake.recv(sock)
        if not reply.get("ok"):
            raise ValueError(f"refused: {reply.get('error')}")
        if sealed and reply.get("seal") is not True:  # a node that ignored "seal" sends plaintext: take none of it
            raise ValueError("seal: expected the peer to acknowledge a sealed read, got a reply without (an older kvx)")
        for s in spans:
            if s.local < 0 or s.local + s.nbytes > len(self.pool):
                raise ValueError(f"span: expected a local range inside the pool, got {s}")
        mine = []
        with memoryview(self.pool) as view:
            for i, s in enumerate(spans):
                with view[s.local : s.local + s.nbytes] as part:
                    if session is not None:
                        mine.append(session.recv_span(sock, part, s.remote, left))
                    else:
                        mine.append(_recv_checked(sock, part, left))
                if landed is not None and expected is not None:
                    landed(i, mine[i] == expected[i])
        if sealed and expected is None:
            return [True] * len(spans)  # every piece's tag matched
        if expected is None:
            sock.settimeout(left())
            sent = handshake.recv(sock).get("crcs")
        else:
            sent = list(expected)
        if not isinstance(sent, list) or len(sent) != len(spans):
            raise ValueError(f"crcs: expected one per span after the bytes, got {str(sent)[:80]}")
        return [a == b for a, b in zip(mine, sent)]

    def _write(
        self, sock: socket.socket, session: WireSession | None, sealed: bool, spans: Sequence[Span], deadline: float
    ) -> None:
        left = _left(deadline)
        if sealed and session is None:
            raise ValueError("seal: expected a data connection with keys for a sealed write, got a plain one")
        for s in spans:
            if s.local < 0 or s.local + s.nbytes > len(self.pool):
                raise ValueError(f"span: expected a local range inside the pool, got {s}")
        sock.settimeout(left())
        frame = {"op": "write", "spans": [[s.remote, s.nbytes] for s in spans]}
        if sealed:
            frame["seal"] = True
        handshake.send(sock, frame)
        with memoryview(self.pool) as view:
            for s in spans:
                with view[s.local : s.local + s.nbytes] as part:
                    if session is not None:
                        session.send_span(sock, part, s.remote, left)
                        continue
                    sent = 0
                    while sent < s.nbytes:
                        sock.settimeout(left())
                        sent += sock.send(part[sent:])
        sock.settimeout(left())
        reply = handshake.recv(sock)
        if not reply.get("ok"):
            raise ValueError(f"refused: {reply.get('error')}")
        if sealed and reply.get("seal") is not True:
            raise ValueError(
                "seal: expected the peer to acknowledge a sealed write, got a reply without (an older kvx)"
            )

    # ---------------------------------------------------------------- serving
    def serve(
        self,
        sock: socket.socket,
        peer: str,
        on_bytes: Callable[[str, int, bool], None] | None = None,
        idle_s: float = 60.0,
        session: WireSession | None = None,
    ) -> None:
        """Answer ``peer``'s reads and writes on ``sock`` until it closes or is silent ``idle_s`` seconds (its
        connection thread); ``session``: the connection's keys (None: it moves nothing sealed). A read outside the
        pool's slots, or a plain read of a sealed namespace's slot, is refused (an error frame; the connection
        stays); a write anywhere but the slots reserved for ``peer``, a plain one into a sealed namespace's slot, or
        a sealed piece that fails its tag closes it. ``on_bytes(op, nbytes, sealed)`` after each transfer."""
        tune(sock)
        sock.settimeout(idle_s)
        while True:
            try:
                msg = handshake.recv(sock)
            except (ConnectionError, OSError):
                return
            spans, op, sealed = msg.get("spans"), msg.get("op"), msg.get("seal", False) is True
            error = self._check(op, spans)
            if op == "write" and not error and not (self._writable and self._writable(peer, [tuple(s) for s in spans])):
                error = "spans: expected slots this node reserved for the writer's push"
            if not error and sealed and session is None:
                error = "seal: expected a data connection with keys (admitted by the cluster handshake), got none"
            if not error and not sealed and self._sealed is not None and self._sealed([tuple(s) for s in spans]):
                error = (
                    f'seal: expected a sealed {op} ("seal": true) of spans in a sealed namespace\'s slots, got a '
                    "plain one: its chunks cross only encrypted"
                )
            if error:
                if op == "write":
                    return _refuse_write(sock, error)  # the bytes that follow cannot be told from frames: close
                handshake.send(sock, {"ok": False, "error": error})
                continue
            ack = {"ok": True, "seal": True} if sealed else {"ok": True}
            left = _left(time.monotonic() + idle_s)
            with memoryview(self.pool) as view:
                if op == "write" and sealed:
                    try:
                        for off, n in spans:
                            with view[off : off + n] as part:
                                session.recv_span(sock, part, off, left)
                    except SealError as e:
                        return _refuse_write(sock, str(e))  # the stream is out of step: close
                    handshake.send(sock, ack)
                elif op == "write":
                    for off, n in spans:
                        _recv_into(sock, view[off : off + n])
                    handshake.send(sock, ack)
                elif sealed:  # the reader checks against its lease's CRC32Cs, or trusts the tags
                    handshake.send(sock, ack)
                    for off, n in spans:
                        with view[off : off + n] as part:
                            session.send_span(sock, part, off, left)
                elif msg.get("crc", True) is False:  # the reader checks against its lease's CRC32Cs
                    handshake.send(sock, ack)
                    for off, n in spans:
                        sock.sendall(view[off : off + n])
                else:
                    handshake.send(sock, ack)
                    crcs = []
                    for off, n in spans:
                        crc = 0
                        for at in range(off, off + n, _CRC_PIECE):  # each piece summed while in cache, then sent
                            with view[at : min(at + _CRC_PIECE, off + n)] as piece:
                                crc = crc32c_update(piece, crc)
                                sock.sendall(piece)
                        crcs.append(crc)
                    handshake.send(sock, {"crcs": crcs})
            sock.settimeout(idle_s)  # a sealed transfer set a deadline per piece
            total = sum(n for _, n in spans)
            with self._lock:
                self.bytes_served += total
            if on_bytes is not None:
                on_bytes(op, total, sealed)

    def _check(self, op, spans) -> str | None:
        if op not in ("read", "write"):
            return f"op: expected 'read' or 'write', got {op!r}"
        lo, hi = self._bounds()
        if not isinstance(spans, list) or len(spans) > _MAX_SPANS:
            return f"spans: expected a list of at most {_MAX_SPANS} [offset, nbytes] pairs"
        for s in spans:
            ok = isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
            if not ok or s[1] <= 0 or s[0] < lo or s[0] + s[1] > hi:
                return f"spans: expected [offset, nbytes] inside the pool's slots [{lo}, {hi}), got {s!r}"
        return None

    def close(self) -> None:
        with self._lock:
            for peer in list(self._socks):
                self._drop(peer)
