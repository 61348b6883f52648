"""``kvx node``'s server (:class:`NodeServer`): the pool file, the control socket and the event loop that serves
:class:`~.index.NodeState`, and the Prometheus endpoint. Threads: :mod:`kvx.node.daemon`.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import selectors
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..log import Throttle, get_logger
from .index import NodeState, Refused
from .peers import Cluster, ClusterConfig
from .protocol import (
    HEADER,
    PoolGeometry,
    ProtocolError,
    body_length,
    decode,
    encode,
    pack_header,
)
from .requests import Requests

log = get_logger(__name__)

_RECV_BYTES = 1 << 18
_MAX_PENDING_REPLIES = 64 << 20  # bytes of unsent replies after which a client that does not read is dropped


def _populate(pool: mmap.mmap, geom: PoolGeometry) -> None:
    """Commit the pool's slot pages in this process (a thread of its own): a page's first touch under a pull
    would otherwise cost a fault and its zeroing (64 MiB of fresh slots: tens of ms) inside the pull."""
    try:
        import numpy as np

        from .._ext import load

        view = np.frombuffer(pool, dtype=np.uint8, count=geom.num_slots * geom.slot_bytes, offset=geom.data_offset)
        try:
            err = load().cpu_populate_write(view.ctypes.data, view.size, 1)
        finally:
            del view  # the mapping may be closed once this goes
        if err:
            log.info("kvx node: the pool's pages are made at first touch (MADV_POPULATE_WRITE: errno %d)", err)
    except (ImportError, ValueError, BufferError) as e:
        log.info("kvx node: the pool's pages are made at first touch (%s)", e)


def default_pool_path(socket_path: str) -> str:
    """``/dev/shm/kvx-node-<sha256(abs socket path)[:12]>.pool``: one pool per socket, found again on restart."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return f"/dev/shm/kvx-node-{digest}.pool"


# ------------------------------------------------------------------------------------------------ the server
class StartError(RuntimeError):
    """The daemon cannot start (another one listens on the socket, the pool file cannot be made, ...)."""


@dataclass(eq=False)
class _Conn:
    """One client socket and its unparsed input and unsent output. Loop thread only."""

    sock: socket.socket
    cid: int
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    closing: bool = False  # close once wbuf is sent


_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class NodeServer:
    """The daemon: the pool file, the socket and the event loop that serves :class:`NodeState`.

    :meth:`start` binds the socket and makes the pool file (with ``geom`` None: at the first engine's hello);
    :meth:`serve` runs the loop in the calling thread until :meth:`stop` (safe from a signal handler or another
    thread), then closes every connection and removes the socket and the pool file. Everything but the metrics
    snapshot is owned by the loop thread.

    Args:
        socket_path: the unix socket engines connect to.
        pool_path: the pool file (``/dev/shm`` or a hugetlbfs mount).
        geom: the pool's geometry (:meth:`PoolGeometry.fit`); None: the pool is made at the first engine's hello,
            ``size`` bytes of slots as large as that engine's chunks (``--slot-size auto``).
        socket_mode: permissions of the socket and of the pool file (peers need both).
        allow_uids, allow_gids: peers admitted besides the daemon's own uid and root (a gid: the peer's primary
            group). With ``allow_gids`` the socket and pool file are given to the first group.
        quotas: namespaces registered up front with a quota in bytes.
        metrics_port: Prometheus endpoint's port (0: none).
        quarantine_s: :class:`NodeState`'s (a slot abandoned PENDING is reused this many seconds later).
    """

    def __init__(
        self,
        socket_path: str,
        pool_path: str,
        geom: PoolGeometry,
        *,
        socket_mode: int = 0o660,
        allow_uids: Sequence[int] = (),
        allow_gids: Sequence[int] = (),
        quotas: dict[str, int] | None = None,
        metrics_port: int = 0,
        quarantine_s: float = 5.0,
        size: int | None = None,
        cluster: ClusterConfig | None = None,
    ):
        if geom is None and size is None:
            raise ValueError("size: expected the pool's bytes when geom is None (slots sized by the first engine)")
        self.socket_path = os.path.abspath(socket_path)
        self.pool_path = os.path.abspath(pool_path)
        self.geom = geom
        self.size = size if geom is None else geom.file_bytes
        self.socket_mode = socket_mode
        self.allow_uids = {os.getuid(), 0, *allow_uids}
        self.allow_gids = set(allow_gids)
        self._group = allow_gids[0] if allow_gids else None
        self._quotas = dict(quotas or {})
        self.metrics_port = metrics_port
        self.quarantine_s = quarantine_s
        self.state: NodeState | None = None
        self.requests: Requests | None = None  # the state's requests, as frames bring them
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stopping = False
        self._conns: dict[int, _Conn] = {}
        self._next_cid = 0
        self._made: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) of the files this daemon made
        self._map: mmap.mmap | None = None
        self._httpd = None
        self._snapshot_lock = threading.Lock()
        self._snapshot: dict = {}  # stats() as the loop last published it; under _snapshot_lock
        self._throttle = Throttle(log)
        self.cluster_config = cluster
        self.cluster: Cluster | None = None
        self._calls: queue.SimpleQueue[tuple[Callable[[NodeState], Any], Future]] = queue.SimpleQueue()
        self._loop_thread: int | None = None

    # -------------------------------------------------------------------------------------- start and stop
    def start(self) -> None:
        """Bind the socket, make a fresh pool file (unless its slots wait for the first engine) and start the
        metrics endpoint; :class:`StartError` if one of them fails (nothing is left behind then)."""
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            self._bind()
            if self.geom is not None:
                table, epoch = self._make_pool()
                self.state = NodeState(self.geom, table, self.pool_path, epoch, self._quotas, self.quarantine_s)
                self.requests = Requests(self.state)
                self._start_cluster()
                if self.cluster is not None:
                    self.cluster.use_pool(self._map, self.geom, epoch)
            else:
                self._check_room(os.statvfs(os.path.dirname(self.pool_path)), self.size)
                self.state = NodeState(
                    None, None, self.pool_path, None, self._quotas, self.quarantine_s, carve=self._carve
                )
                self.requests = Requests(self.state)
                self._start_cluster()
            if self.metrics_port:
                self._start_metrics()
        except BaseException:
            self._cleanup()
            raise
        self._publish()
        metrics = f", metrics on port {self.metrics_port}" if self.metrics_port else ""
        if self.geom is None:
            log.info(
                "kvx node: socket %s, pool %s: %.2f GiB, its slots as large as the first engine's chunks%s",
                self.socket_path,
                self.pool_path,
                self.size / 2**30,
                metrics,
            )
        else:
            self._log_pool("")
            log.info("kvx node: socket %s%s", self.socket_path, metrics)

    def _log_pool(self, why: str) -> None:
        g = self.geom
        log.info(
            "kvx node: pool %s: %d slots x %g MiB (%.2f GiB)%s",
            self.pool_path,
            g.num_slots,
            g.slot_bytes / 2**20,
            g.num_slots * g.slot_bytes / 2**30,
            why,
        )

    def _carve(self, slot_bytes: int) -> tuple[PoolGeometry, Any, bytes]:
        """The pool, made at the first engine's hello with slots of its ``slot_bytes`` (:class:`NodeState`)."""
        geom = PoolGeometry.fit(self.size, slot_bytes)
        if geom.num_slots < 1:
            raise Refused(
                f"slot_bytes: expected chunks that a pool of --size {self.size} bytes holds one of, got {slot_bytes}"
            )
        self.geom = geom
        try:
            table, epoch = self._make_pool()
        except StartError as e:
            self.geom = None
            raise Refused(f"cannot make the pool: {e}") from None
        self._log_pool(" (slots sized by the first engine's chunks)")
        if self.cluster is not None:
            self.cluster.use_pool(self._map, geom, epoch)
        return geom, table, epoch

    def _bind(self) -> None:
        path = self.socket_path
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise StartError(f"--socket: expected a socket path, got {path!r}, which exists and is no socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(2.0)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # a stale socket: its daemon is gone
            except OSError as e:  # a timeout: a daemon too busy to accept is still a daemon
                raise StartError(f"--socket: {path} exists and does not answer as a stale socket would: {e}") from None
            else:
                raise StartError(f"--socket: another kvx node is listening on {path}; stop it first")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            raise StartError(f"--socket: cannot listen on {path}: {e}") from None
        self._listener = sock
        self._remember(path)
        self._own(path)
        sock.listen(128)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, "accept")

    def _make_pool(self) -> tuple[mmap.mmap, bytes]:
        """A fresh pool file of ``geom``: its mapped header and table, and its epoch."""
        path = self.pool_path
        try:
            if os.path.lexists(path):
                os.unlink(path)  # the daemon starts empty (module docstring)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, self.socket_mode)
        except OSError as e:
            raise StartError(f"--pool: cannot make {path}: {e.strerror}") from None
        try:
            self._remember(path)
            self._own(path)
            self._check_room(os.fstatvfs(fd), self.geom.file_bytes)
            block = max(os.fstat(fd).st_blksize, 4096)  # a hugetlbfs file is sized and mapped in huge pages
            os.ftruncate(fd, -(-self.geom.file_bytes // block) * block)
            # the whole file: the header and table the daemon writes, the slots a peer's pull lands in
            self._map = mmap.mmap(fd, -(-self.geom.file_bytes // block) * block)
        except OSError as e:
            raise StartError(f"--pool: cannot size or map {path} ({self.geom.file_bytes} bytes): {e}") from None
        finally:
            os.close(fd)
        epoch = os.urandom(16)
        header = pack_header(self.geom, epoch)
        self._map[: len(header)] = header
        if self.cluster_config is not None:  # pulls land in the slots: their pages made now, not under a pull
            threading.Thread(
                target=_populate, args=(self._map, self.geom), name="kvx-node-populate", daemon=True
            ).start()
        return self._map, epoch

    def _check_room(self, vfs: os.statvfs_result, nbytes: int) -> None:
        """A pool larger than its file system's free space would be sized (sparse) and mapped, and an engine
        writing past the free space would die of SIGBUS: refuse it now."""
        free = vfs.f_bavail * vfs.f_frsize
        if nbytes > free:
            raise StartError(
                f"--size: expected at most the {free} bytes free on the file system of {self.pool_path}, got a "
                f"pool of {nbytes} bytes"
            )

    def _remember(self, path: str) -> None:
        st = os.lstat(path)
        self._made[path] = (st.st_dev, st.st_ino)

    def _own(self, path: str) -> None:
        """The socket's mode (umask aside), and the first ``allow_gids`` group, on ``path``."""
        os.chmod(path, self.socket_mode)
        if self._group is not None:
            try:
                os.chown(path, -1, self._group)
            except OSError as e:
                log.warning("kvx node: cannot give %s to group %d (%s): members must reach it", path, self._group, e)

    def stop(self) -> None:
        """Make :meth:`serve` return. Safe from a signal handler and from any thread."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # the wake-up byte of an earlier stop is still unread: the loop wakes anyway

    def _cleanup(self) -> None:
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._listener is not None:
            self._listener.close()
        for path, ident in self._made.items():  # only the files this daemon made (not a successor's)
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == ident:
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self._made.clear()
        if self.cluster is not None:
            self.cluster.stop()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a transport still holds a view of it: unmapped when that goes
                pass
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -------------------------------------------------------------------------------------- the loop
    def serve(self) -> None:
        """Run the event loop until :meth:`stop`, then close everything and remove the socket and pool file."""
        self._loop_thread = threading.get_ident()
        try:
            while not self._stopping:
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._serve_one(key.data, key.events)
                self._run_calls()
                self._publish()
        finally:
            log.info("kvx node: stopping; closing %d connection(s)", len(self._conns))
            self._cleanup()

    # -------------------------------------------------------------------------------------- other threads
    def _start_cluster(self) -> None:
        if self.cluster_config is None:
            return
        self.cluster = Cluster(self.cluster_config, self.call, self.reply_later)
        try:
            self.cluster.start()
        except OSError as e:
            host, port = self.cluster_config.listen
            raise StartError(f"--listen: cannot listen on {host}:{port}: {e.strerror}") from None
        except ValueError as e:  # --membership's Redis Cluster unreachable
            raise StartError(str(e)) from None
        # a sealed namespace's chunks cross only encrypted: over kvx's tcp channel; over NIXL they stay here
        self.state.seal_transit = self.cluster_config.transport == "tcp"
        self.state.on_pull = self.cluster.pull
        self.state.on_push = self.cluster.push
        self.state.on_commit = self.cluster.committed
        self.state.cluster_stats = self.cluster.stats

    def call(self, fn: Callable[[NodeState], Any], timeout: float = 30.0, wait: bool = True) -> Any:
        """``fn(state)`` run on the loop thread, its result (or exception) returned to the calling thread (the
        cluster's threads: the index has one owner). ``TimeoutError`` if the loop does not get to it in time.
        ``wait=False``: queued and not waited for (None returned); the loop runs calls in the order they came."""
        if threading.get_ident() == self._loop_thread:
            return fn(self.state)
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._wake()
        return fut.result(timeout) if wait else None

    def reply_later(self, cid: int, rid: int, reply: dict) -> None:
        """Answer request ``rid`` of connection ``cid`` (a deferred reply: a pull's), from any thread."""

        def send(state: NodeState) -> None:
            conn = self._conns.get(cid)
            if state.pull_done(cid) and conn is not None:
                conn.wbuf += encode({"id": rid, "ok": True, **reply})
                self._flush(conn)

        self._calls.put((send, Future()))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # a wake-up byte is already unread: the loop wakes anyway

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.state))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE and the like: the client waits in the backlog
                self._throttle.warning("accept", "kvx node: accept failed: %s", e)
                return
            pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if uid not in self.allow_uids and gid not in self.allow_gids:
                self.state.counters["refused_clients"] += 1
                self._throttle.warning(
                    f"refused {uid}", "kvx node: refused pid %d (uid %d, gid %d): not allowed", pid, uid, gid
                )
                sock.close()
                continue
            sock.setblocking(False)
            self._next_cid += 1
            conn = self._conns[self._next_cid] = _Conn(sock, self._next_cid)
            self.state.open(conn.cid, pid)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            log.debug("kvx node: connection %d from pid %d (uid %d)", conn.cid, pid, uid)

    def _serve_one(self, conn: _Conn, events: int) -> None:
        """Serve one connection's event; a failure of the daemon's own drops that connection, never the loop."""
        try:
            self._on_event(conn, events)
        except Exception:  # noqa: BLE001 - nothing a client sends may stop the daemon
            self.state.counters["internal_errors"] += 1
            log.exception("kvx node: connection %d failed; closing it", conn.cid)
            if conn.cid in self._conns:
                self._close(conn)

    def _on_event(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_READ:
            try:
                data = conn.sock.recv(_RECV_BYTES)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._close(conn)
                return
            if data:
                conn.rbuf += data
                self._answer(conn)
        self._flush(conn)

    def _answer(self, conn: _Conn) -> None:
        """Answer every whole frame in ``conn.rbuf``."""
        while not conn.closing and len(conn.rbuf) >= HEADER.size:
            try:
                n = body_length(bytes(conn.rbuf[: HEADER.size]))
                if len(conn.rbuf) < HEADER.size + n:
                    return
                msg = decode(bytes(conn.rbuf[HEADER.size : HEADER.size + n]))
            except ProtocolError as e:
                self._bad_frame(conn, str(e))
                return
            del conn.rbuf[: HEADER.size + n]
            reply, keep = self.requests.request(conn.cid, msg)
            if reply is None:  # answered later (reply_later)
                continue
            try:
                conn.wbuf += encode(reply)
            except ProtocolError as e:  # a reply too large for one frame
                conn.wbuf += encode({"id": reply["id"], "ok": False, "error": str(e)})
            conn.closing = not keep

    def _bad_frame(self, conn: _Conn, error: str) -> None:
        self.state.counters["bad_frames"] += 1
        self._throttle.warning("bad frame", "kvx node: connection %d: %s; closing it", conn.cid, error)
        conn.wbuf += encode({"id": None, "ok": False, "error": error})
        conn.closing = True
        conn.rbuf.clear()

    def _flush(self, conn: _Conn) -> None:
        if conn.wbuf:
            try:
                del conn.wbuf[: conn.sock.send(conn.wbuf)]
            except BlockingIOError:
                pass
            except OSError:
                self._close(conn)
                return
        if (conn.closing and not conn.wbuf) or len(conn.wbuf) > _MAX_PENDING_REPLIES:
            self._close(conn)
            return
        events = selectors.EVENT_WRITE if conn.wbuf else selectors.EVENT_READ  # read more once the replies are out
        if events != conn.events:
            self._sel.modify(conn.sock, events, conn)
            conn.events = events

    def _close(self, conn: _Conn) -> None:
        del self._conns[conn.cid]  # first: a connection is closed once, whatever fails below
        self._sel.unregister(conn.sock)
        conn.sock.close()
        self.state.close(conn.cid)
        log.debug("kvx node: connection %d closed", conn.cid)

    # -------------------------------------------------------------------------------------- metrics
    def _publish(self) -> None:
        if self._httpd is not None:
            snapshot = self.state.stats()
            with self._snapshot_lock:
                self._snapshot = snapshot

    def snapshot(self) -> dict:
        """The stats the loop last published (any thread)."""
        with self._snapshot_lock:
            return self._snapshot

    def _start_metrics(self) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise StartError("--metrics-port: expected prometheus_client installed, got no such module") from None
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_Collector(self.snapshot))
        try:
            self._httpd, _ = start_http_server(self.metrics_port, registry=registry)
        except OSError as e:
            raise StartError(f"--metrics-port: cannot listen on port {self.metrics_port}: {e.strerror}") from None


class _Collector:
    """Prometheus collector of a :meth:`NodeState.stats` snapshot. Runs in the metrics thread; reads only the
    snapshot it is given."""

    _NS = (  # stats field, metric, kind, help
        ("chunks", "kvx_node_chunks", "gauge", "READY chunks in the pool"),
        ("bytes", "kvx_node_bytes", "gauge", "bytes of the namespace's slots (READY and PENDING)"),
        ("hits", "kvx_node_hits", "counter", "leading READY keys of engine lookups"),
        ("misses", "kvx_node_misses", "counter", "engine lookups whose prefix stopped at a key not READY"),
        ("evictions", "kvx_node_evictions", "counter", "chunks evicted to make room (LRU or quota)"),
        ("pinned", "kvx_node_pinned_chunks", "gauge", "chunks with an admin pin"),
        ("quota", "kvx_node_quota_bytes", "gauge", "the namespace's quota (absent: none)"),
    )

    def __init__(self, snapshot):
        self._snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._snapshot()
        if not s:
            return
        pool = s["pool"]
        yield GaugeMetricFamily("kvx_node_pool_bytes", "bytes of the pool's slots", value=pool["bytes"])
        yield GaugeMetricFamily("kvx_node_slots", "slots in the pool", value=pool["num_slots"])
        yield GaugeMetricFamily("kvx_node_slots_used", "slots in use (READY, PENDING, doomed)", value=pool["used"])
        yield GaugeMetricFamily("kvx_node_clients", "connected clients", value=s["clients"])
        yield CounterMetricFamily("kvx_node_refused_clients", "connections refused", value=s["refused_clients"])
        yield CounterMetricFamily("kvx_node_bad_frames", "frames kvx did not write", value=s["bad_frames"])
        for field_name, name, kind, text in self._NS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, text, labels=["namespace", "model"]
            )
            for ns, v in s["namespaces"].items():
                if v[field_name] is not None:
                    family.add_metric([ns, v["model"]], v[field_name])
            yield family
