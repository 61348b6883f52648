"""``kvx node`` across hosts: nodes that pull chunks they miss from their peers' pools.

A node started with ``--listen HOST:PORT --peers HOST:PORT,... --secret-file FILE`` is a member of a cluster. Only
members talk (:mod:`.handshake`: an HMAC challenge-response both ways before anything else). Engines do not: they
keep talking to their own node, which pulls for them.

**A pull** (:meth:`Cluster.pull`, on a pull thread): an engine's lookup missed chunks ``keys`` of its namespace and
asked its node to pull them (the ``pull`` op; the engine puts the request off until the answer).

1. ``have``: every peer that is up is asked, at once, how many leading ``keys`` it holds READY (a fan-out with the
   pull's deadline; a peer that does not answer in time is marked down and left alone for a while).
2. The peer with the longest run is chosen; its run is cut to what its measured rate moves within the pull's budget
   (a pull slower than the engine's budget is declined: the engine recomputes).
3. PENDING slots here for that run (:meth:`~.index.NodeState.pull_alloc`), then ``lease`` on the peer: it leases the
   chunks to this connection (no eviction under the read) and answers each one's offset, generation and CRC32C.
4. The transport reads the chunks' bytes into the slots (:mod:`.transport`: kvx's TCP channel or one NIXL READ).
5. Each slot's CRC32C is checked as it lands; the chunks that passed, in order, are committed READY here one by one
   as they do, and ``release`` on the peer ends the lease (the rest freed). An engine's lookup that finds the
   pull's slots PENDING reports them as a hit loaded asynchronously; its workers copy each chunk as it turns READY.

**A push** (:meth:`Cluster.push`, P/D): a producer engine names its consumer's node (``kvx_push_to``) and its
request's chunks; as each becomes READY here, ``reserve`` on the consumer's node allocates PENDING slots for the
ones it lacks (held by this connection: they go if it does), the transport writes the bytes into them, and
``commit_pushed`` has the consumer check each slot's CRC32C and commit the good ones. The consumer's request waits
for them as kvx's P/D waits (``pd_wait_ms``).

**Sealed namespaces** (an engine of it seals its byte tiers): over the tcp transport their chunks are pulled and
pushed as any others', but cross only encrypted (:mod:`.wire_seal`: AES-256-GCM under keys each end derives from the
cluster secret and the handshake's nonces; no key crosses): a pull reads sealed if its namespace is sealed here or
the lease says it is there, a push writes sealed if it is sealed here or the reservation says it is there, and a
node serves none of a sealed namespace's slots in the clear, nor takes a plain write into one. Over NIXL (one-sided:
it cannot encrypt) they stay on their host (:attr:`~.index.NodeState.seal_transit`).

Anything that fails (a peer killed, stopped, cut off, answering garbage; a slot evicted under the read; a CRC that
does not match) frees the slots and answers fewer chunks: the engine recomputes them, never serves them. A peer's
leases end with its control connection (the peer closed it, or it sat idle past ``lease_s``).

Threads: the loop thread owns the index (every call into it goes through ``call``); the accept thread takes peers'
connections; each admitted connection is served on its own thread; pulls run on ``kvx-node-pull`` threads and ask
peers on ``kvx-node-ask`` threads. A :class:`_Link` (this node's view of one peer) is guarded by its lock.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..log import Throttle, get_logger
from ..store.codec import crc32c_update
from . import handshake
from .answers import PeerAnswers
from .handshake import Denied
from .protocol import PoolGeometry
from .tcp import TcpTransport
from .transport import Span, TransferError, Transport
from .wire_seal import WireSession

log = get_logger(__name__)

_DOWN_S = (1.0, 30.0)  # a peer that failed is left alone this long, doubling up to the second figure
_RATE_WEIGHT = 0.3  # weight of a new read in a peer's rate estimate
_RELEASE_AFTER_FAILURE_S = 0.25  # a failed read's lease is released within this, or left to the connection's end
_READ_GROUPS = 4  # a pull's transfers where the transport does not check as it streams (checks overlap reads)


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ``ValueError`` naming ``what`` otherwise."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT (a port 1-65535), got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterConfig:
    """A node's membership: its id, where it listens, its peers, the cluster's secret, its transport."""

    node_id: str
    listen: tuple[str, int]
    peers: tuple[tuple[str, int], ...]
    secret: bytes
    transport: str = "tcp"
    timeout: float = 2.0  # seconds to dial a peer, or for a peer to answer a request
    lease_s: float = 30.0  # a peer's control connection idle this long is closed (its leases released)
    push_s: float = 60.0  # a push waits at most this long for its chunks to be written here
    membership: str | None = None  # a Redis url where members announce themselves (in place of peers)
    membership_cluster: bool = False  # that url names a Redis Cluster node
    membership_ttl_s: float = 10.0  # a member not heard from this long has left


class _Phases:
    """Where a pull's time went: milliseconds per phase, in order (``kvx node stats``: ``last_pull``)."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[f"{phase}_ms"] = round((now - self._t) * 1e3, 3)
        self._t = now


@dataclass(eq=False)
class _Link:
    """One configured peer as this node dials it: its control connection, state and figures. Under ``lock``."""

    address: tuple[str, int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    node: str | None = None  # its id, once it said it
    state: str = "unknown"  # "up", "down" (unreachable, or failed a request), "refused" (no member)
    error: str | None = None
    next_try: float = 0.0
    down_s: float = _DOWN_S[0]
    rate: float | None = None  # bytes/s of its reads, smoothed
    epoch: str | None = None  # of the peer's pool the transport was told of
    used: float = 0.0  # when its connection last carried a request
    bytes_in: int = 0
    bytes_out_pushed: int = 0
    bytes_sealed_in: int = 0  # bytes pulled from it sealed
    bytes_sealed_out_pushed: int = 0  # of bytes_out_pushed, those that crossed sealed
    chunks_in: int = 0
    pulls: int = 0
    failures: int = 0

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


class Cluster:
    """This node's part of a cluster (module docstring).

    ``call(fn, wait=True)``: runs ``fn(state)`` on the loop thread (:class:`~.index.NodeState`) and returns its result
    (``wait=False``: queued, not waited for; the loop runs calls in order).
    ``reply_later(cid, rid, reply)``: answers request ``rid`` of connection ``cid`` (an engine's pull).
    """

    def __init__(
        self,
        config: ClusterConfig,
        call: Callable[..., Any],
        reply_later: Callable[[int, int, dict], None],
    ):
        if config.transport not in ("tcp", "nixl"):
            raise ValueError(f"--transport: expected 'tcp' or 'nixl', got {config.transport!r}")
        self.config = config
        self._call = call
        self._reply_later = reply_later
        self._links = [_Link(a) for a in config.peers]
        self._push_links: dict[tuple[str, int], _Link] = {}  # consumers' nodes named by pushes (under _lock)
        self._lock = threading.Lock()  # guards the figures below and the transport's creation
        self.transport: Transport | None = None
        self._pool = None
        self._geom: PoolGeometry | None = None
        self._epoch = ""
        self.counters = dict.fromkeys(
            ("pulls", "pulled", "misses", "declined_slow", "failed", "bad_chunks", "refused_peers", "served")
            + ("pushes", "pushed", "push_failed", "received"),
            0,
        )
        self._out: dict[str, int] = {}  # bytes served per peer id (reads, and writes taken)
        self._sealed_out: dict[str, int] = {}  # of those, bytes peers read sealed, per peer id
        self._sealed_in: dict[str, int] = {}  # bytes peers wrote here sealed (pushes), per peer id
        self.last_pull: dict = {}  # the last pull's phases (under _lock)
        self._answers = PeerAnswers(call, self._count)
        self._checks = ThreadPoolExecutor(2, thread_name_prefix="kvx-node-check")
        self._listener: socket.socket | None = None
        self._members = None  # RedisMembership with --membership
        self._stopping = threading.Event()
        self._pulls = ThreadPoolExecutor(4, thread_name_prefix="kvx-node-pull")
        self._ask = ThreadPoolExecutor(max(8, len(self._links)), thread_name_prefix="kvx-node-ask")
        self._throttle = Throttle(log)

    # ---------------------------------------------------------------- start and stop
    def start(self) -> None:
        """Listen on ``config.listen`` (``OSError`` if it cannot) and accept members on a thread."""
        host, port = self.config.listen
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        threading.Thread(target=self._accept, name="kvx-node-accept", daemon=True).start()
        if self.config.membership is not None:
            from .membership import RedisMembership, redis_client

            client = redis_client(self.config.membership, self.config.membership_cluster, self.config.timeout)
            self._members = RedisMembership(
                client,
                self.config.secret,
                self.config.node_id,
                f"{host}:{port}",
                self.set_peers,
                ttl_s=self.config.membership_ttl_s,
            )
            self._members.start()
        log.info(
            "kvx node: cluster member %s, listening on %s:%d, %d peer(s), transport %s",
            self.config.node_id,
            host,
            port,
            len(self._links),
            self.config.transport,
        )

    def use_pool(self, pool, geom: PoolGeometry, epoch: bytes) -> None:
        """The pool is made (at start, or at the first engine's hello): ``pool`` maps the whole file."""
        with self._lock:
            self._pool, self._geom, self._epoch = pool, geom, epoch.hex()
            if self.config.transport == "nixl":
                from .nixl import NixlTransport

                self.transport = NixlTransport(pool, f"{self.config.node_id}/{self._epoch[:8]}")
            else:
                self.transport = TcpTransport(
                    pool,
                    self._dial_data,
                    lambda: (geom.data_offset, geom.file_bytes),
                    lambda peer, spans: self._call(lambda s: s.writable(peer, spans)),
                    lambda spans: self._call(lambda s: s.sealed_spans(spans)),
                )
            self._answers.use_pool(pool, self._epoch, self.transport)

    def set_peers(self, addresses: Sequence[str]) -> None:
        """The members now (``HOST:PORT`` each; the membership's thread): new ones become peers, gone ones are
        dropped (their connection closed: the leases they held here are released by their own side)."""
        want = set()
        for a in addresses:
            try:
                want.add(parse_address(a, "member"))
            except ValueError as e:
                self._throttle.warning(f"member {a}", "kvx node: %s", e)
        want.discard(self.config.listen)
        with self._lock:
            have = {lk.address: lk for lk in self._links}
            gone = [lk for a, lk in have.items() if a not in want]
            self._links = [lk for lk in self._links if lk.address in want] + [
                _Link(a) for a in sorted(want) if a not in have
            ]
        for lk in gone:
            with lk.lock:
                self._close_link(lk)
        if gone or len(want) != len(have):
            log.info("kvx node: members now %s", ", ".join(f"{h}:{p}" for h, p in sorted(want)) or "none")

    def stop(self) -> None:
        self._stopping.set()
        if self._members is not None:
            self._members.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self._pulls.shutdown(wait=False, cancel_futures=True)  # a pull in flight waits on the loop
        self._ask.shutdown(wait=False, cancel_futures=True)
        self._answers.close()
        self._checks.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            links = self._links + list(self._push_links.values())
        for link in links:
            with link.lock:
                self._close_link(link)
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- serving peers
    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, addr), name="kvx-node-peer", daemon=True).start()

    def _welcome(self) -> dict:
        return {"transport": self.config.transport, "epoch": self._epoch}

    def _serve(self, sock: socket.socket, addr) -> None:
        """One admitted peer connection, until it closes (its thread)."""
        try:
            sock.settimeout(self.config.timeout)
            peer, role, keying = handshake.admit_keyed(sock, self.config.secret, self.config.node_id, self._welcome())
        except Denied as e:
            with self._lock:
                self.counters["refused_peers"] += 1
            self._throttle.warning(f"denied {addr[0]}", "kvx node: refused a connection from %s: %s", addr[0], e)
            sock.close()
            return
        except (OSError, ValueError):
            sock.close()
            return
        try:
            if role == "data":
                if isinstance(self.transport, TcpTransport):
                    session = WireSession(self.config.secret, keying)
                    self.transport.serve(
                        sock, peer, lambda op, n, sealed: self._served(peer, op, n, sealed), session=session
                    )
                return
            self._serve_control(sock, peer)
        except (OSError, ValueError):
            pass
        finally:
            sock.close()

    def _served(self, peer: str, op: str, n: int, sealed: bool) -> None:
        with self._lock:
            self._out[peer] = self._out.get(peer, 0) + n
            if sealed:
                figures = self._sealed_out if op == "read" else self._sealed_in
                figures[peer] = figures.get(peer, 0) + n

    def _serve_control(self, sock: socket.socket, peer: str) -> None:
        cid = self._call(lambda s: s.open_internal("peer"))
        try:
            sock.settimeout(self.config.lease_s)
            while True:
                try:
                    msg = handshake.recv(sock)
                except (ConnectionError, TimeoutError, OSError):
                    return
                try:
                    reply = {"ok": True, **self._answers.answer(cid, peer, msg)}
                except ValueError as e:
                    reply = {"ok": False, "error": str(e)}
                handshake.send(sock, reply)
        finally:
            self._call(lambda s: s.close(cid))

    def committed(self, offset: int, generation: int, nbytes: int, crc: int | None = None) -> None:
        """A chunk became READY here (loop thread: the index's hook): :meth:`.answers.PeerAnswers.committed`."""
        if not self._stopping.is_set():
            self._answers.committed(offset, generation, nbytes, crc)

    # ---------------------------------------------------------------- dialing peers
    def _dial(self, address: tuple[str, int], role: str) -> tuple[socket.socket, dict]:
        return handshake.dial(address, self.config.secret, self.config.node_id, role, self.config.timeout)

    def _dial_data(self, address: tuple[str, int]) -> tuple[socket.socket, WireSession]:
        """A data connection to the node at ``address``, and its keys (:mod:`.wire_seal`)."""
        sock, _, keying = handshake.dial_keyed(
            address, self.config.secret, self.config.node_id, "data", self.config.timeout
        )
        return sock, WireSession(self.config.secret, keying)

    def _request(self, link: _Link, msg: dict, timeout: float) -> dict:
        """``msg``'s reply from ``link`` (dialing it first if needed), within ``timeout`` seconds; ``OSError`` /
        ``ValueError`` (the link is then marked down) or :class:`Denied`."""
        with link.lock:
            try:
                if link.sock is not None and time.monotonic() - link.used > 0.8 * self.config.lease_s:
                    self._close_link(link)  # the peer is about to close it as idle (lease_s): a fresh one
                reused = link.sock is not None
                try:
                    return self._exchange(link, msg, timeout)
                except ConnectionError:
                    if not reused:
                        raise
                    self._close_link(link)  # closed by the peer while idle: once more, on a new connection
                    return self._exchange(link, msg, timeout)
            except Denied as e:
                self._down(link, "refused", str(e))
                raise
            except (OSError, ValueError) as e:
                if link.sock is not None or time.monotonic() >= link.next_try:  # not a link left alone meanwhile
                    self._down(link, "down", f"{type(e).__name__}: {e}")
                raise

    def _exchange(self, link: _Link, msg: dict, timeout: float) -> dict:
        """One request on ``link``'s connection (dialed first if there is none); link.lock held."""
        if link.sock is None:
            if time.monotonic() < link.next_try:
                raise OSError(f"down ({link.error})")
            link.sock, welcome = self._dial(link.address, "control")
            link.node = str(welcome.get("node"))
            if welcome.get("transport") != self.config.transport:
                raise ValueError(
                    f"transport: expected a peer on {self.config.transport!r}, got {welcome.get('transport')!r}"
                )
            self._connect_transport(link, welcome.get("epoch", ""))
            link.state, link.error, link.down_s = "up", None, _DOWN_S[0]
        link.sock.settimeout(max(timeout, 0.001))
        handshake.send(link.sock, msg)
        reply = handshake.recv(link.sock)
        if not reply.get("ok"):
            raise ValueError(f"refused {msg.get('op')}: {reply.get('error')}")
        if reply.get("epoch") not in (None, link.epoch):
            self._connect_transport(link, reply["epoch"])
        link.used = time.monotonic()
        return reply

    def _connect_transport(self, link: _Link, epoch: str) -> None:
        """Tell the transport how to read ``link``'s pool (link.lock held)."""
        descriptor = b""
        if self.config.transport != "tcp" and epoch:
            handshake.send(link.sock, {"op": "describe"})
            reply = handshake.recv(link.sock)
            descriptor, epoch = bytes.fromhex(reply.get("descriptor", "")), reply.get("epoch", epoch)
        link.epoch = epoch
        if self.transport is not None and (descriptor or self.config.transport == "tcp"):
            self.transport.connect(link.node, link.address, descriptor)

    def _down(self, link: _Link, state: str, error: str) -> None:
        """``link`` failed (link.lock held): close it and leave it alone for a while."""
        if link.state == "up":
            log.warning("kvx node: peer %s (%s) is %s: %s", link.name, link.node, state, error)
        self._close_link(link)
        link.state, link.error = state, error
        link.next_try = time.monotonic() + link.down_s
        link.down_s = min(link.down_s * 2, _DOWN_S[1])

    def _close_link(self, link: _Link) -> None:
        if link.sock is not None:
            link.sock.close()
            link.sock = None
        if link.node is not None and self.transport is not None:
            self.transport.forget(link.node)

    # ---------------------------------------------------------------- pulling
    def pull(self, cid: int, rid: int, namespace: str, keys: list[str], nbytes: int, budget_s: float) -> bool:
        """Start a pull of ``keys`` (loop thread: the ``pull`` op's hook); its answer goes to request ``rid`` of
        connection ``cid``. False if this node has no peer or no pool to pull into yet."""
        if not (self._links or self._members) or self.transport is None or nbytes <= 0 or self._stopping.is_set():
            return False
        self._pulls.submit(self._pull, cid, rid, namespace, keys, nbytes, budget_s)
        return True

    def _pull(self, cid: int, rid: int, namespace: str, keys: list[str], nbytes: int, budget_s: float) -> None:
        result: dict = {"pulled": 0}
        try:
            result = self._pull_chunks(namespace, keys, nbytes, time.monotonic() + budget_s)
        except Exception:  # noqa: BLE001 - a pull that fails is a miss, never the node's end
            log.exception("kvx node: a pull of %d chunk(s) failed", len(keys))
            self._count("failed")
        self._reply_later(cid, rid, result)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _live(self) -> list[_Link]:
        """The peers worth asking now: connected, or past the time a failure left them alone."""
        with self._lock:
            links = list(self._links)
        now = time.monotonic()
        return [lk for lk in links if lk.sock is not None or now >= lk.next_try]

    def _ask_all(self, namespace: str, keys: list[str], deadline: float, live: list[_Link]) -> tuple[_Link | None, int]:
        """The peer of ``live`` holding the longest run of ``keys``, and its length (``have`` to each at once)."""
        msg = {"op": "have", "namespace": namespace, "keys": "".join(keys)}

        def ask(link: _Link) -> int:
            try:
                return int(self._request(link, msg, deadline - time.monotonic())["ready"])
            except (OSError, ValueError, TypeError, KeyError):
                return 0

        futures = {self._ask.submit(ask, lk): lk for lk in live}
        done, _ = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        best, n = None, 0
        for f in done:
            got = min(f.result(), len(keys))
            lk = futures[f]
            if got > n or (got == n and got and (lk.rate or 0) > ((best.rate or 0) if best else 0)):
                best, n = lk, got
        return best, n

    def _fit(self, link: _Link, n: int, nbytes: int, deadline: float) -> int:
        """How many of ``n`` chunks ``link`` can bring before ``deadline`` at its measured rate (all: no rate yet)."""
        if not link.rate:
            return n
        return min(n, int(max(0.0, deadline - time.monotonic()) * link.rate / nbytes))

    def _lease(self, link: _Link, namespace: str, keys: list[str], nbytes: int, deadline: float) -> tuple[list, bool]:
        """Lease the leading READY ``keys`` on ``link``: [key, offset, generation, CRC32C] per chunk (a prefix), and
        whether the namespace is sealed there (the peer serves its chunks only to a sealed read)."""
        msg = {"op": "lease", "namespace": namespace, "keys": "".join(keys), "nbytes": nbytes}
        reply = self._request(link, msg, deadline - time.monotonic())
        leased = reply["chunks"]
        if [c[0] for c in leased] != keys[: len(leased)]:
            raise ValueError(f"lease: expected a prefix of the keys asked for, got {[c[0] for c in leased][:4]}...")
        return leased, reply.get("sealed") is True

    def _pull_chunks(self, namespace: str, keys: list[str], nbytes: int, deadline: float) -> dict:
        """Pull the leading ``keys`` some peer holds. One peer to ask, fast enough for them all: its lease is its
        answer (a round trip fewer); else ``have`` to every peer, then the lease on the one holding the most (beside
        this node's slots for them)."""
        self._count("pulls")
        phases = _Phases()
        live = self._live()
        link, leased, sealed_there = None, None, False
        if len(live) == 1 and self._fit(live[0], len(keys), nbytes, deadline) == len(keys):
            link = live[0]
            try:
                leased, sealed_there = self._lease(link, namespace, keys, nbytes, deadline)
            except (OSError, ValueError, TypeError, KeyError):
                leased = []
            n = len(leased)
        elif live:
            link, n = self._ask_all(namespace, keys, deadline, live)
        phases.mark("ask")
        if link is None or n == 0:
            self._count("misses")
            return {"pulled": 0, "reason": "miss"}
        fit = n if leased is not None else self._fit(link, n, nbytes, deadline)  # a lease was asked for: all fit
        if fit < n:
            self._count("declined_slow")
            if fit == 0:
                return {"pulled": 0, "reason": "slow", "from": link.node}
            n = fit
        owner = self._call(lambda s: s.open_internal("pull"))
        good: list[str] = []
        slots: list = []
        lease = None
        try:
            if leased is None:  # the lease on the chosen peer, beside this node's slots
                lease = self._ask.submit(self._lease, link, namespace, keys[:n], nbytes, deadline)
            slots, sealed = self._call(lambda s: (s.pull_alloc(owner, namespace, keys[:n]), s.is_sealed(namespace)))
            phases.mark("slots")
            if lease is not None:
                (leased, sealed_there), lease = lease.result(), None
                phases.mark("lease")
            if sealed_there and not sealed and leased:  # sealed there: read sealed, and sealed here from now on
                sealed = True
                self._call(lambda s: s.seal(namespace, f"pulled sealed from node {link.node}"))
            if slots:
                good = self._read(link, slots, leased, nbytes, deadline, phases, sealed, owner)
            elif leased:
                self._release(link, leased, deadline)  # no room here: the peer's chunks are free again
        except (OSError, ValueError, TypeError, KeyError, TransferError) as e:
            with link.lock:
                link.failures += 1
            self._count("failed")
            self._throttle.warning(f"pull {link.name}", "kvx node: a pull from %s failed: %s", link.name, e)
            if isinstance(e, TransferError) and leased:  # the bytes failed, the control link may not have
                self._release_quietly(link, leased, min(deadline, time.monotonic() + _RELEASE_AFTER_FAILURE_S))
        finally:
            if lease is not None:  # this node's slots failed while the lease was asked: end it
                lease.cancel() or self._release_quietly(link, lease, min(deadline, time.monotonic() + 1.0))
            crc_of = {c[0]: c[3] for c in leased or ()}
            pulled = self._call(lambda s: s.pull_end(owner, good, [crc_of.get(k) for k in good]))
            phases.mark("commit")
        self._count("pulled", pulled)
        with self._lock:
            self.last_pull = {"chunks": pulled, **phases.ms}
        if not slots:
            return {"pulled": 0, "reason": "full"}
        return {"pulled": pulled, "from": link.node}

    def _read_checked(
        self, link: _Link, spans: list[Span], crcs: list, deadline: float, sealed: bool, landed
    ) -> list[bool]:
        """Read ``spans`` in a few transfers, each one's chunks checked against ``crcs`` (the lease's) on a thread
        while the next one moves: the checks cost little time of their own. ``landed(i, ok)`` per span, in order, as
        its check is done."""
        size = max(1, -(-len(spans) // _READ_GROUPS))
        checks = []
        told = 0

        def check(s: Span, crc) -> bool:
            with memoryview(self._pool) as view:
                return crc is not None and crc32c_update(view[s.local : s.local + s.nbytes]) == crc

        try:
            for i in range(0, len(spans), size):
                left = max(0.001, deadline - time.monotonic())
                self.transport.read(link.node, spans[i : i + size], left, sealed=sealed)
                checks += [self._checks.submit(check, s, c) for s, c in zip(spans[i : i + size], crcs[i : i + size])]
                while told < len(checks) and checks[told].done():
                    landed(told, checks[told].result())
                    told += 1
            for f in checks[told:]:
                landed(told, f.result())
                told += 1
            return [f.result() for f in checks]
        finally:
            for f in checks:  # none still reading a slot the caller frees
                f.cancel() or f.exception()

    def _read(
        self,
        link: _Link,
        slots: Sequence[tuple[str, int]],
        leased: list,
        nbytes: int,
        deadline: float,
        phases: _Phases,
        sealed: bool,
        owner: int,
    ) -> list[str]:
        """Read ``leased`` chunks of ``link`` into ``slots`` (as many as both have), check them, release the lease:
        the keys that arrived whole, in order. ``sealed``: the read is sealed (its namespace is sealed here).

        Each chunk is READY here as soon as it and every one before it passed its check (``owner``'s
        :meth:`~.index.NodeState.pull_commit`, queued to the loop thread, not waited for): an engine whose load waits
        for the pull copies the first chunks while the rest cross. A CRC32C that matches the lease's is what makes a
        chunk good (the lease kept it from eviction on the peer); the release after the read stops the commits of
        the chunks not yet made READY where the peer says its slot changed hands under the read."""
        keys = [k for k, _ in slots]
        spans = [Span(int(c[1]), off, nbytes) for c, (_, off) in zip(leased, slots)]
        arrived: list[str] = []

        def landed(i: int, ok: bool) -> None:
            if ok and i == len(arrived):  # in order, every one before it good
                arrived.append(keys[i])
                self._call(lambda s, k=keys[i], crc=leased[i][3]: s.pull_commit(owner, k, crc), wait=False)

        t0 = time.monotonic()
        if isinstance(self.transport, TcpTransport):  # it checks each chunk against the lease's as it streams
            crcs = [c[3] for c in leased[: len(spans)]]
            ok = self.transport.read(link.node, spans, max(0.001, deadline - t0), crcs, sealed, landed)
        else:
            ok = self._read_checked(link, spans, [c[3] for c in leased], deadline, sealed, landed)
        seconds = time.monotonic() - t0
        phases.mark("read")
        good = next((i for i, v in enumerate(ok) if not v), len(ok))
        phases.mark("check")
        if good < len(ok):
            self._count("bad_chunks", len(ok) - good)
            log.warning("kvx node: chunk %s from %s failed its CRC32C check; not served", keys[good], link.name)
        intact = self._release(link, leased, deadline)
        phases.mark("release")
        good = max(len(arrived), next((i for i in range(good) if not intact[i]), good))
        with link.lock:
            link.pulls += 1
            link.chunks_in += len(spans)
            link.bytes_in += len(spans) * nbytes
            link.bytes_sealed_in += len(spans) * nbytes if sealed else 0
            rate = len(spans) * nbytes / max(seconds, 1e-6)
            link.rate = rate if link.rate is None else (1 - _RATE_WEIGHT) * link.rate + _RATE_WEIGHT * rate
        return keys[:good]

    def _release_quietly(self, link: _Link, leased, deadline: float) -> None:
        """End a lease after a failed pull (``leased``: the chunks, or the future of the lease), if the peer answers
        before ``deadline``; else its leases end with its control connection."""
        try:
            chunks = leased.result(max(0.0, deadline - time.monotonic()))[0] if hasattr(leased, "result") else leased
            if chunks:
                self._release(link, chunks, deadline)
        except Exception:  # noqa: BLE001 - the pull failed already; the link is marked down where it failed
            pass

    def _release(self, link: _Link, leased: list, deadline: float) -> list[bool]:
        """End the lease of ``leased`` on ``link``: per chunk, whether it stayed intact (not evicted) under it."""
        release = {"op": "release", "keys": [c[0] for c in leased], "generations": [int(c[2]) for c in leased]}
        return self._request(link, release, max(0.001, deadline - time.monotonic()))["intact"]

    # ---------------------------------------------------------------- pushing (P/D)
    def push(self, namespace: str, keys: list[str], nbytes: int, to: str) -> bool:
        """Send ``keys`` of ``namespace`` to the node at ``to`` as each is READY here (loop thread: the ``push``
        op's hook). False if ``to`` is no address or there is no pool yet."""
        try:
            address = parse_address(to, "to")
        except ValueError as e:
            self._throttle.warning("push to", "kvx node: a push not sent: %s", e)
            return False
        if self.transport is None or nbytes <= 0 or self._stopping.is_set():
            return False
        with self._lock:
            link = next((lk for lk in self._links if lk.address == address), None)
            if link is None:
                link = self._push_links.setdefault(address, _Link(address))
        self._pulls.submit(self._push, link, namespace, keys, nbytes)
        return True

    def _push(self, link: _Link, namespace: str, keys: list[str], nbytes: int) -> None:
        self._count("pushes")
        deadline = time.monotonic() + self.config.push_s
        owner = self._call(lambda s: s.open_internal("push"))
        pause = 0.001
        try:
            while keys and time.monotonic() < deadline:
                ready, stop, sealed = self._call(
                    lambda s: (*s.push_lease(owner, namespace, keys), s.is_sealed(namespace))
                )
                if ready:
                    self._push_chunks(link, namespace, ready, nbytes, deadline, sealed)
                    self._call(lambda s: s.unlease_all(owner))
                    keys = keys[len(ready) :]
                    pause = 0.001
                elif stop == "absent":
                    break  # a chunk not saved here (dropped, evicted): the consumer computes from there
                else:
                    time.sleep(pause)  # the producer's workers are writing it: wait for its commit
                    pause = min(pause * 2, 0.05)
        except (OSError, ValueError, TypeError, KeyError, TransferError) as e:
            failed = e
        else:
            failed = None
        finally:
            self._call(lambda s: s.close(owner))  # its leases first: a failure counted is a failure cleaned up
        if failed is not None:
            self._count("push_failed")
            with link.lock:
                link.failures += 1
            self._throttle.warning(f"push {link.name}", "kvx node: a push to %s failed: %s", link.name, failed)

    def _push_chunks(self, link: _Link, namespace: str, ready, nbytes: int, deadline: float, sealed: bool) -> None:
        """Reserve slots on ``link`` for ``ready`` (key, offset, generation), write the ones it lacks, commit them.
        ``sealed``: the namespace is sealed here; the write is sealed then, or if the reservation says it is there."""
        keys = [k for k, _, _ in ready]
        msg = {"op": "reserve", "namespace": namespace, "keys": "".join(keys), "nbytes": nbytes}
        if sealed:
            msg["seal"] = True
        reply = self._request(link, msg, deadline - time.monotonic())
        offsets, sealed = reply["offsets"], sealed or reply.get("sealed") is True
        todo = [(r, o) for r, o in zip(ready, offsets) if o is not None]
        if not todo:
            return
        spans = [Span(int(o), off, nbytes) for (_, off, _), o in todo]
        self.transport.write(link.node, spans, max(0.001, deadline - time.monotonic()), sealed)
        with memoryview(self._pool) as view:
            crcs = [crc32c_update(view[s.local : s.local + nbytes]) for s in spans]
        sent = [k for (k, _, _), _ in todo]
        done = {"op": "commit_pushed", "namespace": namespace, "keys": "".join(sent), "crcs": crcs, "nbytes": nbytes}
        n = int(self._request(link, done, max(0.001, deadline - time.monotonic()))["committed"])
        self._count("pushed", n)
        with link.lock:
            link.bytes_out_pushed += len(sent) * nbytes
            link.bytes_sealed_out_pushed += len(sent) * nbytes if sealed else 0

    # ---------------------------------------------------------------- figures
    def stats(self) -> dict:
        """What ``kvx node stats`` shows of the cluster (any thread)."""
        peers = []
        with self._lock:
            links = self._links + list(self._push_links.values())
        for lk in links:
            with lk.lock:
                peers.append(
                    {
                        "address": lk.name,
                        "node": lk.node,
                        "state": lk.state,
                        "error": lk.error,
                        "bytes_in": lk.bytes_in,
                        "chunks_in": lk.chunks_in,
                        "bytes_out": (self._out.get(lk.node, 0) if lk.node else 0) + lk.bytes_out_pushed,
                        # sealed: of those, what crossed encrypted (pulled here or pushed here by it; read from
                        # here or pushed to it)
                        "bytes_sealed_in": lk.bytes_sealed_in + (self._sealed_in.get(lk.node, 0) if lk.node else 0),
                        "bytes_sealed_out": (self._sealed_out.get(lk.node, 0) if lk.node else 0)
                        + lk.bytes_sealed_out_pushed,
                        "pulls": lk.pulls,
                        "failures": lk.failures,
                        "rate_gbps": round(lk.rate / 1e9, 3) if lk.rate else None,
                    }
                )
        with self._lock:
            return {
                "node": self.config.node_id,
                "listen": f"{self.config.listen[0]}:{self.config.listen[1]}",
                "transport": self.config.transport,
                "peers": peers,
                "bytes_out": sum(self._out.values()),
                "bytes_sealed_out": sum(self._sealed_out.values()),  # read from here by peers, sealed
                "bytes_sealed_in": sum(self._sealed_in.values()),  # pushed here by peers, sealed
                "last_pull": dict(self.last_pull),
                **self.counters,
            }
