"""A small RESP2 client for the Redis tier's data path: one socket, zero-copy values, hard deadlines.

Why not redis-py for the bytes: a GET through redis-py + hiredis builds a ``bytes`` object (a copy)
that the tier then copies again into the CPU-pool slot, and a SET joins the value into one buffer.
Here a GET's bulk reply is received with ``recv_into`` straight into the caller's memory (the codec
header into a small buffer first, so it is checked before the payload lands), and a SET sends the
header and the tensor's memory with ``sendall`` of memoryviews: a value's bytes are copied once, by the
kernel. The two clients side by side: ``benchmarks/bench_redis.py``, results in
``benchmarks/results/redis_cpu.md``.

Every operation runs against a deadline (``time.monotonic()`` seconds): each send and receive waits at
most the time left (within ``_REARM_S``), so a server that stops answering (SIGSTOP, a dead host) fails
the operation on time instead of hanging it. Plain sockets block with the kernel's SO_RCVTIMEO /
SO_SNDTIMEO, set again only when off by more than ``_REARM_S``: a receive is one syscall, where a
Python socket timeout costs a poll before every receive and an ioctl per change (a 4 MiB GET over TCP
made nearly three times the syscalls that way, by strace -c). A connection that failed in the middle of a
reply (timeout, reset, a protocol error, or the caller's sink refusing the value) is closed: it is never
reused with unread bytes in flight. Error replies become typed exceptions (:func:`reply_error`).
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from .errors import StoreError, StoreFullError, StoreUnavailableError

_CRLF = b"\r\n"
_BUF = 1 << 16  # read buffer for reply lines and small values
_DIRECT = _BUF // 2  # a read at least this big goes straight into the caller's memory
_REARM_S = 0.005  # a socket call may end this much before or after its deadline (see _arm)
_MAX_LINE = 1 << 16  # a reply line (status, error, length) longer than this is not RESP
_BULK_REFUSED = "ERR Protocol error: invalid bulk length"  # a value over proto-max-bulk-len
_LAST_WORDS_S = 0.05  # how long a failed SET waits for the server's reason (_set_failed)


def _timeval(seconds: float) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO / SO_SNDTIMEO (0 would mean no timeout: at least 1 us)."""
    us = max(1, int(seconds * 1e6))
    return struct.pack("@ll", us // 1_000_000, us % 1_000_000)


# ------------------------------------------------------------------------------------------ errors
class RespError(StoreError):
    """An error reply from the server (``-ERR ...``) that has no more specific type."""


class NoScriptError(RespError):
    """``-NOSCRIPT``: the script is not in the server's cache (restarted, flushed): load it again."""


class RedirectError(StoreError):
    """``-MOVED slot host:port`` (``ask`` False: the slot lives there now) or ``-ASK slot host:port``
    (``ask`` True: this one key is being migrated; send ``ASKING`` before the command there)."""

    def __init__(self, message: str, slot: int, host: str, port: int, ask: bool):
        super().__init__(message)
        self.slot, self.host, self.port, self.ask = slot, host, port, ask


class ValueTooLarge(StoreError):
    """``-ERR Protocol error: invalid bulk length``: the server refuses a value longer than its
    ``proto-max-bulk-len`` (and closes the connection). ``size``: the refused value's bytes, when known."""

    def __init__(self, message: str, size: int | None = None):
        super().__init__(message)
        self.size = size


class AuthError(StoreUnavailableError):
    """``-NOAUTH`` / ``-WRONGPASS``: the server refuses us (a missing or wrong password in the url)."""


class ConnectionLost(StoreUnavailableError):
    """The connection failed (refused, reset, closed, or no answer before the deadline: ``timeout``)."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


class ProtocolError(ConnectionLost):
    """The server sent bytes that are not RESP (the connection is out of step: closed)."""


def reply_error(message: str) -> StoreError:
    """The exception for an error reply ``message`` (without the leading ``-``)."""
    code = message.split(" ", 1)[0]
    if code == "OOM":
        return StoreFullError(f"redis: out of memory ({message})")
    if code in ("MOVED", "ASK"):
        try:
            _, slot, addr = message.split(" ")
            host, _, port = addr.rpartition(":")
            return RedirectError(message, int(slot), host, int(port), code == "ASK")
        except ValueError:
            return ProtocolError(f"redis: malformed redirection {message!r}")
    if code in ("NOAUTH", "WRONGPASS", "NOPERM"):
        return AuthError(f"redis: authentication refused ({message})")
    if code == "NOSCRIPT":
        return NoScriptError(message)
    if message.startswith(_BULK_REFUSED):
        return ValueTooLarge(f"redis: value refused: longer than the server's proto-max-bulk-len ({message})")
    if code in ("LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"):
        return StoreUnavailableError(f"redis: not serving now ({message})")
    return RespError(f"redis: {message}")


# ------------------------------------------------------------------------------------------ encoding
def _arg(a) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, bool):
        raise TypeError(f"redis argument: expected str, bytes or a number, got {a!r}")
    if isinstance(a, (int, float)):
        return repr(a).encode()
    if isinstance(a, (bytearray, memoryview)):
        return bytes(a)
    raise TypeError(f"redis argument: expected str, bytes or a number, got {type(a).__name__}")


def encode_command(*args) -> bytes:
    """A RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = _arg(a)
        parts.append(b"$%d\r\n" % len(b))
        parts.append(b)
        parts.append(_CRLF)
    return b"".join(parts)


class Sink(Protocol):
    """Where a bulk reply's bytes go (:meth:`RespConnection.get_into`)."""

    def begin(self, index: int, length: int | None) -> None:
        """Reply ``index`` is a value of ``length`` bytes (None: the key does not exist). May raise."""

    def buffer(self) -> memoryview:
        """Where the next bytes go (writable, non-empty while bytes are expected). May raise."""

    def advance(self, n: int) -> None:
        """``n`` bytes were written at the start of the last :meth:`buffer`."""


# ------------------------------------------------------------------------------------------ connection
class RespConnection:
    """One connection to a Redis server (not thread-safe: one operation at a time).

    Args:
        host, port: TCP address; or ``unix_path``: a unix socket.
        ssl_context: TLS (``rediss://``); ``server_hostname`` is checked against the certificate when the
            context checks host names.
        username, password: ``AUTH`` on connect; db: ``SELECT`` on connect when not 0.
        deadline: ``time.monotonic()`` by which connecting (and AUTH/SELECT) must be done.
        send_buffer: SO_SNDBUF in bytes (the kernel doubles it, capped by ``net.core.wmem_max``); None: the
            kernel's default (TCP: autotuned).
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        unix_path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        deadline: float,
        send_buffer: int | None = None,
    ):
        self.address = unix_path or f"{host}:{port}"
        self._rbuf = bytearray(_BUF)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        self.sock: socket.socket | None = None
        try:
            if unix_path:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.settimeout(self._left(deadline))
                    s.connect(unix_path)
                except BaseException:
                    s.close()
                    raise
            else:
                s = socket.create_connection((host, port), timeout=self._left(deadline))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if ssl_context is not None:
                    try:
                        s.settimeout(self._left(deadline))
                        s = ssl_context.wrap_socket(s, server_hostname=server_hostname or host)
                    except BaseException:
                        s.close()
                        raise
        except TimeoutError as e:
            raise ConnectionLost(f"redis {self.address}: connect timed out ({e})", timeout=True) from None
        except ssl.SSLError as e:
            raise ConnectionLost(f"redis {self.address}: TLS handshake failed ({e})") from None
        except OSError as e:
            raise ConnectionLost(f"redis {self.address}: cannot connect ({e.strerror or e})") from None
        self.sock = s
        self._tls = isinstance(s, ssl.SSLSocket)
        self._armed = -1.0  # seconds the socket's timeout was last set to (-1: not yet)
        try:
            if not self._tls:
                s.settimeout(None)  # blocking; the kernel's SO_RCVTIMEO / SO_SNDTIMEO bound each call
            if send_buffer is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        except OSError as e:
            s.close()
            self.sock = None
            raise ConnectionLost(f"redis {self.address}: cannot set up the socket ({e.strerror or e})") from None
        try:
            setup = []
            if password is not None:
                setup.append(("AUTH", username, password) if username else ("AUTH", password))
            if db:
                setup.append(("SELECT", db))
            if setup:
                for r in self.pipeline(setup, deadline, raise_errors=False):
                    if isinstance(r, Exception):
                        raise r
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- state
    @property
    def closed(self) -> bool:
        return self.sock is None

    def close(self) -> None:
        s, self.sock = self.sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def stale(self) -> bool:
        """True if an idle connection is unusable: closed by the server (EOF readable) or holding unread
        bytes (a restarted or killed server leaves such connections in a pool)."""
        if self.sock is None or self._rpos != self._rend:
            return True
        if isinstance(self.sock, ssl.SSLSocket):
            return False  # TLS 1.3 servers send session tickets after the handshake: readable, not stale
        try:  # poll, not select: an engine process may hold more than select's 1024 descriptors
            p = select.poll()
            p.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def _arm(self, deadline: float) -> None:
        """Bound the next socket call by ``deadline`` (within _REARM_S). The timeout is set again only when
        it is more than _REARM_S off the time left: operations with the same ``timeout_ms`` set it about
        once each 5 ms, not once per call. Plain sockets block, with the kernel's SO_RCVTIMEO and
        SO_SNDTIMEO: a receive is one syscall (a Python socket timeout adds a poll before each and an
        ioctl per change). TLS sockets keep Python's timeout (the ssl module polls by it)."""
        left = self._left(deadline)
        if abs(left - self._armed) <= _REARM_S:
            return
        s = self.sock
        if self._tls:
            s.settimeout(left)
        else:
            tv = _timeval(left)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._armed = left

    def _failed(self, e: BaseException, what: str) -> BaseException:
        """Close the connection; the exception to raise for ``e``: I/O errors become
        :class:`ConnectionLost`, anything else (the sink's errors, an interrupt) stays as it is."""
        if isinstance(e, (OSError, ConnectionLost)):
            return self._fail(e, what)
        self.close()
        return e

    def _set_failed(self, e: BaseException, sizes: Sequence[int]) -> BaseException:
        """The error to raise for a SET that failed with ``e`` (the connection is closed): the server's
        refusal of a value over its ``proto-max-bulk-len`` when that is why (it answers the length line
        with an error and closes the connection, so sending the rest fails with EPIPE / ECONNRESET), else
        :meth:`_failed`'s error."""
        if isinstance(e, (BrokenPipeError, ConnectionResetError)) and self.sock is not None:
            words = _CRLF + self._last_words()  # the replies of earlier commands may come first
            i = words.find(_CRLF + b"-" + _BULK_REFUSED.encode())
            if i >= 0:
                line = words[i + 3 : words.find(_CRLF, i + 3)]
                return self._refused(reply_error(line.decode(errors="replace")), sizes)
        return self._failed(e, "SET")

    def _refused(self, r: Exception, sizes: Sequence[int]) -> Exception:
        """An error reply to a SET; a refused value closes the connection (the server closed its end) and
        names the largest value sent."""
        if not isinstance(r, ValueTooLarge):
            return r
        self.close()
        size = max(sizes, default=None)
        return ValueTooLarge(
            f"redis {self.address}: value of {size} bytes refused: longer than the server's proto-max-bulk-len", size
        )

    def _last_words(self) -> bytes:
        """What the server sent before it dropped the connection: the unread bytes, and what arrives within
        _LAST_WORDS_S (TLS: the unread bytes only)."""
        got = bytes(self._rbuf[self._rpos : self._rend])
        if self._tls:
            return got
        try:
            p = select.poll()
            p.register(self.sock, select.POLLIN)
            if p.poll(int(_LAST_WORDS_S * 1000)):
                got += self.sock.recv(_BUF, socket.MSG_DONTWAIT)
        except (OSError, ValueError):
            pass
        return got

    def _fail(self, e: BaseException, what: str) -> ConnectionLost:
        """Close the connection; the error to raise for ``e``."""
        addr = self.address
        self.close()
        if isinstance(e, ConnectionLost):
            return e
        if isinstance(e, (socket.timeout, TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO
            err = ConnectionLost(f"redis {addr}: no answer in time ({what})", timeout=True)
        elif isinstance(e, ssl.SSLError):
            err = ConnectionLost(f"redis {addr}: TLS error ({what}: {e})")
        elif isinstance(e, OSError):
            err = ConnectionLost(f"redis {addr}: connection lost ({what}: {e.strerror or e})")
        else:
            err = ConnectionLost(f"redis {addr}: {what}: {e}")
        err.__suppress_context__ = True
        return err

    # ---------------------------------------------------------------- low-level I/O
    def _send(self, bufs: Sequence, deadline: float) -> None:
        s = self.sock
        if s is None:
            raise ConnectionLost(f"redis {self.address}: connection is closed")
        for b in bufs:
            if self._tls:
                self._arm(deadline)  # Python's timeout bounds the whole sendall
                s.sendall(b)
                continue
            mv = memoryview(b).cast("B")
            off, end = 0, len(mv)
            while off < end:  # a blocking send queues it all (one syscall) or times out partway
                self._arm(deadline)
                off += s.send(mv[off:])

    def _fill(self, deadline: float) -> None:
        """Read more bytes into the read buffer (which the caller has consumed or compacted)."""
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        elif self._rend == _BUF:
            n = self._rend - self._rpos
            self._rbuf[:n] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, n
        self._arm(deadline)
        n = self.sock.recv_into(self._rview[self._rend :])
        if n == 0:
            raise ConnectionLost(f"redis {self.address}: connection closed by the server")
        self._rend += n

    def _readline(self, deadline: float) -> bytes:
        while True:
            i = self._rbuf.find(_CRLF, self._rpos, self._rend)
            if i >= 0:
                line = bytes(self._rbuf[self._rpos : i])
                self._rpos = i + 2
                return line
            if self._rend - self._rpos >= _MAX_LINE - 2:
                raise ProtocolError(f"redis {self.address}: reply line longer than {_MAX_LINE} bytes")
            self._fill(deadline)

    def _readinto(self, mv: memoryview, deadline: float) -> None:
        """Fill ``mv`` exactly: buffered bytes first, then large reads straight into ``mv``."""
        off = 0
        while off < len(mv):
            off += self._read_some(mv[off:], deadline)

    def _read_some(self, mv: memoryview, deadline: float) -> int:
        """Put the next bytes into ``mv`` (non-empty): buffered ones, else what one receive brings (large
        reads straight into ``mv``); how many."""
        have = self._rend - self._rpos
        if not have and len(mv) >= _DIRECT:
            self._arm(deadline)
            k = self.sock.recv_into(mv)
            if k == 0:
                raise ConnectionLost(f"redis {self.address}: connection closed by the server")
            return k
        if not have:
            self._fill(deadline)
            have = self._rend - self._rpos
        k = min(have, len(mv))
        mv[:k] = self._rview[self._rpos : self._rpos + k]
        self._rpos += k
        return k

    def _expect_crlf(self, deadline: float) -> None:
        while self._rend - self._rpos < 2:
            self._fill(deadline)
        if self._rbuf[self._rpos : self._rpos + 2] != _CRLF:
            raise ProtocolError(f"redis {self.address}: bulk reply not followed by CRLF")
        self._rpos += 2

    def _read_reply(self, deadline: float):
        """One reply: str (status), int, bytes, None, list, or an exception object (error reply)."""
        line = self._readline(deadline)
        if not line:
            raise ProtocolError(f"redis {self.address}: empty reply line")
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest.decode()
            if kind == b"-":
                return reply_error(rest.decode(errors="replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                if n < 0:
                    return None
                out = bytearray(n)
                self._readinto(memoryview(out), deadline)
                self._expect_crlf(deadline)
                return bytes(out)
            if kind == b"*":
                n = int(rest)
                return None if n < 0 else [self._read_reply(deadline) for _ in range(n)]
        except ValueError:
            pass
        raise ProtocolError(f"redis {self.address}: unexpected reply {line[:64]!r}")

    # ---------------------------------------------------------------- commands
    def pipeline(self, commands: Sequence[Sequence], deadline: float, raise_errors: bool = True) -> list:
        """Send ``commands`` in one write and read their replies. An error reply is raised (the first one,
        after every reply was read) or, with ``raise_errors=False``, returned in its place."""
        self.send(commands, deadline)
        return self.replies(commands, deadline, raise_errors)

    def send(self, commands: Sequence[Sequence], deadline: float) -> None:
        """The first half of :meth:`pipeline`: send ``commands`` in one write, so that the caller works while
        the server answers. :meth:`replies` must follow (or :meth:`close`: unread replies foul the stream)."""
        try:
            self._send([b"".join(encode_command(*c) for c in commands)], deadline)
        except BaseException as e:  # noqa: BLE001 - close on anything, interrupts included
            raise self._failed(e, f"{commands[0][0] if commands else 'pipeline'}")

    def replies(self, commands: Sequence[Sequence], deadline: float, raise_errors: bool = True) -> list:
        """The second half of :meth:`pipeline`: the replies of the ``commands`` :meth:`send` sent."""
        try:
            replies = [self._read_reply(deadline) for _ in commands]
        except BaseException as e:  # noqa: BLE001 - close on anything, interrupts included
            raise self._failed(e, f"{commands[0][0] if commands else 'pipeline'}")
        if raise_errors:
            for r in replies:
                if isinstance(r, Exception):
                    raise r
        return replies

    def command(self, *args, deadline: float):
        """One command; its reply (an error reply is raised)."""
        return self.pipeline([args], deadline)[0]

    def exists_each(self, keys: Sequence[str], deadline: float, suffixes: Sequence[str] = ("",)) -> list:
        """Pipelined ``EXISTS key`` per key, in one write: 0 / 1 per key, or the error reply (e.g. a MOVED
        :class:`RedirectError`) in its place. With several ``suffixes``, one ``EXISTS key+s1 key+s2 ...`` per key
        (names of one cluster slot), answered with how many of them exist. The lookup's hot path: the commands
        are formatted in one pass and the replies parsed a buffer at a time (a 256-key lookup spent most of its
        time in the general encoder and reply reader)."""
        try:
            ks = [_arg(k) for k in keys]
            sfx = [_arg(s) for s in suffixes]
            if len(sfx) == 1:
                s = sfx[0]
                wire = b"".join(b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s%s\r\n" % (len(k) + len(s), k, s) for k in ks)
            else:
                head = b"*%d\r\n$6\r\nEXISTS\r\n" % (len(sfx) + 1)
                wire = b"".join(head + b"".join(b"$%d\r\n%s%s\r\n" % (len(k) + len(s), k, s) for s in sfx) for k in ks)
            self._send([wire], deadline)
            out: list = []
            n = len(keys)
            while len(out) < n:
                end = self._rbuf.rfind(_CRLF, self._rpos, self._rend)
                if end < 0:
                    if self._rend - self._rpos >= _MAX_LINE - 2:
                        raise ProtocolError(f"redis {self.address}: reply line longer than {_MAX_LINE} bytes")
                    self._fill(deadline)
                    continue
                lines = bytes(self._rbuf[self._rpos : end]).split(_CRLF)[: n - len(out)]
                for line in lines:
                    kind = line[:1]
                    if kind == b":":
                        out.append(int(line[1:]))
                    elif kind == b"-":
                        out.append(reply_error(line[1:].decode(errors="replace")))
                    else:
                        raise ProtocolError(f"redis {self.address}: EXISTS answered {line[:64]!r}")
                    self._rpos += len(line) + 2
            return out
        except ValueError as e:
            raise self._failed(
                ProtocolError(f"redis {self.address}: EXISTS answered a bad integer ({e})"), "EXISTS"
            ) from None
        except BaseException as e:  # noqa: BLE001 - close on anything, interrupts included
            raise self._failed(e, "EXISTS")

    def set_value(self, key: str, bufs: Sequence, options: Sequence, deadline: float, prefix: Sequence[Sequence] = ()):
        """``SET key <value> *options`` where the value is the concatenation of ``bufs`` (bytes-like,
        sent as they are: no copy). ``prefix``: small commands sent before it in the same write (e.g.
        ``ASKING``). Returns the SET's reply ("OK", or None when NX/XX refused); raises error replies."""
        views = [memoryview(b).cast("B") for b in bufs]
        total = sum(len(v) for v in views)
        k = _arg(key)
        head = b"".join(encode_command(*c) for c in prefix)
        head += b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(options), len(k), k, total)
        tail = _CRLF + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in map(_arg, options))
        try:
            # the first buffer (a codec header: a few hundred bytes) rides with the command head
            if views and len(views[0]) <= _BUF:
                self._send([head + views[0], *views[1:], tail], deadline)
            else:
                self._send([head, *views, tail], deadline)
            replies = [self._read_reply(deadline) for _ in range(len(prefix) + 1)]
        except BaseException as e:  # noqa: BLE001 - close on anything, interrupts included
            raise self._set_failed(e, [total])
        for r in replies:
            if isinstance(r, Exception):
                raise self._refused(r, [total])
        return replies[-1]

    def set_many(self, items: Sequence[tuple[str, Sequence]], options: Sequence, deadline: float) -> list:
        """Pipelined ``SET key <value> *options`` for each ``(key, bufs)``; the replies (error replies
        returned in their place, after every reply was read), except a value refused as too large
        (:class:`ValueTooLarge`), raised: the server closes the connection after it."""
        opts = b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in map(_arg, options))
        sizes: list[int] = []
        replies: list = []
        try:
            for key, bufs in items:
                views = [memoryview(b).cast("B") for b in bufs]
                sizes.append(sum(len(v) for v in views))
                k = _arg(key)
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(options), len(k), k, sizes[-1])
                self._send([head, *views, _CRLF + opts], deadline)
            for _ in items:
                replies.append(self._read_reply(deadline))
                if isinstance(replies[-1], ValueTooLarge):
                    break
        except BaseException as e:  # noqa: BLE001 - close on anything, interrupts included
            raise self._set_failed(e, sizes)
        if replies and isinstance(replies[-1], ValueTooLarge):
            raise self._refused(replies[-1], sizes)
        return replies

    def get_into(
        self,
        keys: Sequence[str],
        sink: Sink,
        deadline: float,
        prefix: Sequence[Sequence] = (),
        ready: Callable[[], None] | None = None,
    ) -> None:
        """``GET`` of ``keys``, one ahead: the GET of key i+1 goes out as soon as reply i's length line is in,
        so the server prepares value i+1 while value i is on the wire. (All at once, redis-server 7.0 builds
        every reply before it writes the first byte, so the wire idles while it does; one ahead, a chunk of
        several parts arrives in about half the time.) Each value's bytes are received into the memory ``sink``
        hands out (no intermediate copy for large reads). ``prefix``: small commands sent first
        (``ASKING``), whose replies must be OK. ``ready``: called once the first GET is out, before its reply
        is read, so that the caller's own preparation of the sink overlaps the server's of the value. Error
        replies are raised; any exception (the sink's and ``ready``'s included) with replies still unread
        closes the connection."""
        if not keys:
            return
        pending = True  # replies left unread: the connection cannot be reused
        sent = 0  # GETs sent

        def send_next() -> None:
            nonlocal sent
            if sent < len(keys):
                self._send([encode_command("GET", keys[sent])], deadline)
                sent += 1

        try:
            self._send([b"".join(encode_command(*c) for c in prefix) + encode_command("GET", keys[0])], deadline)
            sent = 1
            if ready is not None:
                ready()
            for _ in prefix:
                r = self._read_reply(deadline)
                if isinstance(r, Exception):
                    raise r
            for i in range(len(keys)):
                line = self._readline(deadline)
                kind = line[:1]
                if kind == b"-":
                    pending = sent > i + 1
                    raise reply_error(line[1:].decode(errors="replace"))
                if kind != b"$":
                    raise ProtocolError(f"redis {self.address}: GET answered {line[:64]!r}")
                try:
                    n = int(line[1:])
                except ValueError:
                    raise ProtocolError(f"redis {self.address}: GET answered {line[:64]!r}") from None
                if n < 0:
                    pending = sent > i + 1
                    sink.begin(i, None)
                    pending = True
                    send_next()
                    continue
                sink.begin(i, n)
                send_next()
                while n:  # the sink sees each receive's bytes at once (checksummed while in cache)
                    mv = sink.buffer()
                    k = self._read_some(mv[: min(len(mv), n)], deadline)
                    sink.advance(k)
                    n -= k
                self._expect_crlf(deadline)
            pending = False
        except BaseException as e:
            if isinstance(e, (OSError, ConnectionLost)) or pending:
                raise self._failed(e, "GET")
            raise
