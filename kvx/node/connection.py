"""A blocking client connection to ``kvx node`` (:mod:`.protocol`): one request, one reply, with a timeout; or
requests posted without waiting, whose replies are read after (the daemon answers a connection's frames in order).

Used by the engines' :class:`~.client.NodeIndex` and by the ``kvx node`` control subcommands. Not thread-safe:
one owner (the thread that calls it).
"""

from __future__ import annotations

import select
import socket
from collections import deque
from collections.abc import Callable

from ..log import get_logger
from .protocol import HEADER, ProtocolError, body_length, decode, encode

log = get_logger(__name__)


class NodeError(RuntimeError):
    """The node answered a request with an error (``ok`` false): the request was wrong, the node is well."""


class NodeUnavailable(ConnectionError):
    """The node could not be reached, or the connection broke or timed out."""


class Connection:
    """One connection to the node at ``path``. ``timeout``: seconds per request (connect, send, reply)."""

    def __init__(self, path: str, timeout: float = 2.0):
        self.path = str(path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes read past the last frame
        self._next = 0
        # posted requests whose replies are not read yet, in order: (id, op, on_reply)
        self._posted: deque[tuple[int, str, Callable[[dict | NodeError], None] | None]] = deque()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        if self._sock is not None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise NodeUnavailable(f"kvx node at {self.path}: {e}") from None
        self._sock = s

    def alive(self) -> bool:
        """Whether the connection is open and the node has not closed its end (one non-blocking peek: the node's
        death is seen at once, not at the next request)."""
        if self._sock is None:
            return False
        try:
            self.poll()  # the replies of posted requests first: what follows them is the node's EOF or nothing
        except NodeUnavailable:
            return False
        try:
            if not select.select([self._sock], [], [], 0)[0]:
                return True  # nothing to read: open
            # readable: the node closed it (EOF), or bytes it sent unasked (kept for the next call to judge)
            if self._sock.recv(1, socket.MSG_PEEK) != b"":
                return True
        except OSError:
            pass
        self.close()
        return False

    def close(self) -> None:
        """Close the connection; the replies of posted requests are dropped unread (the node undoes a closed
        connection's leases and allocations itself)."""
        self._buf.clear()
        self._posted.clear()
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _recv(self, n: int) -> bytes:
        """``n`` bytes of the reply: from what the last read brought beyond the previous frame, then the socket
        (reads of up to 64 KiB: a reply's header and body mostly in one system call)."""
        while len(self._buf) < n:
            part = self._sock.recv(max(65536, n - len(self._buf)))
            if not part:
                raise NodeUnavailable(f"kvx node at {self.path}: connection closed")
            self._buf += part
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def call(self, op: str, **args) -> dict:
        """Send request ``op`` and return its reply; :class:`NodeError` if the node refused it,
        :class:`NodeUnavailable` (the connection closed) if it could not be sent or answered. The replies of the
        requests posted before it are read first, and handed to their ``on_reply``."""
        rid = self._send(op, args)
        self.drain()
        try:
            reply = self._reply(op, rid)
        except NodeUnavailable:
            self.close()
            raise
        out = _refusal_or(op, reply)
        if isinstance(out, NodeError):
            raise out
        return out

    def post(self, op: str, on_reply: Callable[[dict | NodeError], None] | None = None, **args) -> None:
        """Send request ``op`` without waiting for its reply: a later :meth:`call` or :meth:`poll` reads it and
        hands it to ``on_reply`` (the reply, or the :class:`NodeError` of a refusal; without ``on_reply``, a
        refusal is logged). :class:`NodeUnavailable` if it could not be sent."""
        self.poll()  # replies already here: read, so that they never pile up
        rid = self._send(op, args)
        self._posted.append((rid, op, on_reply))

    def poll(self) -> None:
        """Read the replies of posted requests that have arrived, without waiting for the others."""
        try:
            while self._posted and (self._buf or select.select([self._sock], [], [], 0)[0]):
                self._take_posted()
        except (OSError, ValueError) as e:  # ValueError: select on a closed socket
            self.close()
            if isinstance(e, NodeUnavailable):
                raise
            raise NodeUnavailable(f"kvx node at {self.path}: {e}") from None

    def wait(self, timeout: float) -> None:
        """Block until a reply (or the node's EOF) is here to :meth:`poll`, or ``timeout`` seconds passed: for a caller
        with nothing else to do while a posted request is answered (none: at once)."""
        if self._sock is not None and self._posted and not self._buf:
            try:
                select.select([self._sock], [], [], max(0.0, timeout))
            except (OSError, ValueError):  # closed meanwhile: the next poll says so
                pass

    def drain(self) -> None:
        """Read the replies of every posted request, waiting for those not here yet."""
        try:
            while self._posted:
                self._take_posted()
        except NodeUnavailable:
            self.close()
            raise

    def _send(self, op: str, args: dict) -> int:
        self.connect()
        self._next += 1
        try:
            self._sock.sendall(encode({"op": op, "id": self._next, **args}))
        except (OSError, ProtocolError) as e:
            self.close()
            raise NodeUnavailable(f"kvx node at {self.path}: {op}: {e}") from None
        return self._next

    def _reply(self, op: str, rid: int) -> dict:
        """The next reply on the connection, which must answer request ``rid``."""
        try:
            reply = decode(self._recv(body_length(self._recv(HEADER.size))))
        except NodeUnavailable:
            raise
        except (OSError, ProtocolError) as e:
            raise NodeUnavailable(f"kvx node at {self.path}: {op}: {e}") from None
        if reply.get("id") != rid:
            raise NodeUnavailable(f"kvx node at {self.path}: {op}: a reply to request {reply.get('id')}")
        return reply

    def _take_posted(self) -> None:
        rid, op, on_reply = self._posted.popleft()
        out = _refusal_or(op, self._reply(op, rid))
        if on_reply is not None:
            on_reply(out)
        elif isinstance(out, NodeError):
            log.warning("%s", out)


def _refusal_or(op: str, reply: dict) -> dict | NodeError:
    """``reply``, or the :class:`NodeError` of a refusal (``ok`` false)."""
    return reply if reply.get("ok") else NodeError(f"kvx node: {op}: {reply.get('error', 'refused')}")
