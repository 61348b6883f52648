"""A blocking client connection to ``kvx node`` (:mod:`.protocol`): one request, one reply, with a timeout.

Used by the engines' :class:`~.client.NodeIndex` and by the ``kvx node`` control subcommands. Not thread-safe:
one owner (the thread that calls it).
"""

from __future__ import annotations

import select
import socket

from .protocol import HEADER, ProtocolError, body_length, decode, encode


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
        self._buf.clear()
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
        :class:`NodeUnavailable` (the connection closed) if it could not be sent or answered."""
        self.connect()
        self._next += 1
        msg = {"op": op, "id": self._next, **args}
        try:
            self._sock.sendall(encode(msg))
            reply = decode(self._recv(body_length(self._recv(HEADER.size))))
        except (OSError, ProtocolError) as e:
            self.close()
            if isinstance(e, NodeUnavailable):
                raise
            raise NodeUnavailable(f"kvx node at {self.path}: {op}: {e}") from None
        if reply.get("id") != self._next:
            self.close()
            raise NodeUnavailable(f"kvx node at {self.path}: {op}: a reply to request {reply.get('id')}")
        if not reply.get("ok"):
            raise NodeError(f"kvx node: {op}: {reply.get('error', 'refused')}")
        return reply
