"""``kvx node``'s daemon: one KV-chunk pool per host in shared memory, its index, and the control socket.

Every vLLM engine on the host connects to the unix socket (:mod:`.protocol`'s frames), asks for slots
(``allocate`` / ``commit`` / ``pin`` ...) and copies chunk bytes into or out of the mapped pool file itself:
no chunk byte crosses the socket. The daemon writes only the pool's header and slot table. The pool file is made
at start with ``--slot-size SIZE``, or, by default (``auto``), at the first engine's hello, its slots as large as
that engine's chunks: one model's engines fit, whatever the model.

Slot life cycle (as :class:`kvx.store.cpu.CPUIndex`, per namespace, leases held by connections)::

    FREE --allocate(key)--> PENDING --commit(key)--> READY --evict (LRU, no pins)--> FREE
                               \\--abort(key) or the allocating connection closes--> FREE

- Only READY slots are hits. A PENDING slot is never evicted nor served.
- A *lease* (``pin``, ``hold``) is held by one connection and released by ``unpin`` or when that connection
  closes (an engine killed with SIGKILL included: the kernel closes its socket). An *admin pin*
  (``pin_prefix``) is held by the daemon until ``unpin_prefix`` or ``evict``. A slot with either is never
  evicted to make room.
- ``evict`` (the operator's explicit request) of a leased chunk *dooms* it: it leaves the index at once (lookups
  miss it) and its slot is freed when the last lease goes, so a reader never sees its bytes change under it.
- A namespace (an engine's model, KV dtype and chunk format: :func:`kvx.keys.namespace_digest`) may
  have a quota in bytes (every chunk takes one whole slot): an allocation that would exceed it evicts the
  namespace's own least recently used chunks, and only those; ``pin_prefix`` never pins past it.

**The daemon starts empty.** On start an existing pool file is unlinked and a fresh one created: the index (which
key is in which slot, namespaces, recency, pins, quotas) lives only in the daemon's memory, and a slot's bytes
may be half-written by an engine killed in the middle of a save, so rebuilding the index from the file would need
per-chunk checksums that kvx does not keep in the pool. Starting empty is always correct; engines that mapped the
old file keep their mapping until they reconnect, see a new epoch and map the new file.

Threads: :class:`NodeState` is owned by the event-loop thread (no locks). :class:`NodeServer` runs that loop;
the only other thread is the optional Prometheus endpoint, which reads a snapshot of :meth:`NodeState.stats`
that the loop publishes under a lock.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..log import Throttle, get_logger
from .protocol import (
    DIR_ENTRY,
    FREE,
    HEADER,
    KEY_RE,
    KEYS_RE,
    NAMESPACE_RE,
    PENDING,
    READY,
    VERSION,
    PoolGeometry,
    ProtocolError,
    body_length,
    decode,
    dir_home,
    dir_seed,
    encode,
    pack_header,
    write_entry,
)

log = get_logger(__name__)

_ZERO_KEY = bytes(16)
_RECV_BYTES = 1 << 18
_MAX_PENDING_REPLIES = 64 << 20  # bytes of unsent replies after which a client that does not read is dropped


def default_pool_path(socket_path: str) -> str:
    """``/dev/shm/kvx-node-<sha256(abs socket path)[:12]>.pool``: one pool per socket, found again on restart."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return f"/dev/shm/kvx-node-{digest}.pool"


# ------------------------------------------------------------------------------------------------ the state
class BadRequest(ValueError):
    """A request with an unknown op or wrong arguments (counted as ``bad_requests``)."""


class Refused(ValueError):
    """A well-formed request the index cannot honour now (commit of a slot that is not PENDING, pin of a chunk that
    is not READY, ...): an error reply, not counted as a bad request (another engine may have evicted the chunk)."""


@dataclass(eq=False)
class _Namespace:
    """One engine namespace: its chunks, recency, counters and quota. Loop thread only."""

    name: str
    model: str = ""
    chunk_size: int | None = None
    quota: int | None = None  # bytes, or None: no quota
    entries: dict[str, _Entry] = field(default_factory=dict)  # in the index: PENDING and READY
    lru: OrderedDict[_Entry, None] = field(default_factory=OrderedDict)  # READY, no admin pin; LRU first
    chunks: int = 0  # READY in the index
    pending: int = 0  # PENDING in the index
    admin_pinned: int = 0  # READY with an admin pin
    clients: int = 0  # engine connections
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # chunks evicted to make room (LRU or quota); an operator's ``evict`` is not counted


@dataclass(eq=False)
class _Entry:
    """One slot in use. ``doomed``: out of the index (evicted or its writer gone) but leased: freed at the last
    unpin. Loop thread only."""

    key: str
    ns: _Namespace
    slot: int
    state: int  # PENDING or READY
    owner: int | None  # the connection that allocated it, while PENDING
    leases: int = 0
    admin: int = 0
    doomed: bool = False


@dataclass(eq=False)
class _Client:
    """One connection's part of the index: what it allocated and has not committed, and the leases it holds.
    Loop thread only."""

    cid: int
    pid: int
    role: str | None = None  # None until hello
    ns: _Namespace | None = None  # engines only
    pending: dict[str, _Entry] = field(default_factory=dict)
    leases: dict[str, list[_Entry]] = field(default_factory=dict)  # one element per lease, oldest first


_MISSING = object()


def _show(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(args: dict, name: str, ok, expected: str) -> Any:
    value = args.get(name, _MISSING)
    if value is _MISSING or not ok(value):
        raise BadRequest(f"{name}: expected {expected}, got {_show(value)}")
    return value


def _key(args: dict, name: str = "key") -> str:
    return _get(args, name, lambda v: isinstance(v, str) and KEY_RE.fullmatch(v), "32 lowercase hex digits")


def _keys(args: dict, name: str = "keys") -> list[str]:
    """A request's keys: a list, or one string of keys end to end (:data:`~.protocol.KEYS_RE`: what engines send,
    a quarter of the list's cost to encode and decode), each checked."""
    keys = _get(args, name, lambda v: isinstance(v, (list, str)), "a list of keys (32 lowercase hex digits each)")
    if isinstance(keys, str):
        if not KEYS_RE.fullmatch(keys):
            raise BadRequest(f"{name}: expected keys of 32 lowercase hex digits end to end, got {_show(keys)}")
        return [keys[i : i + 32] for i in range(0, len(keys), 32)]
    if all(isinstance(k, str) for k in keys) and KEYS_RE.fullmatch("".join(keys)) and all(len(k) == 32 for k in keys):
        return keys  # one match for the whole list
    for i, k in enumerate(keys):
        if not (isinstance(k, str) and KEY_RE.fullmatch(k)):
            raise BadRequest(f"{name}[{i}]: expected 32 lowercase hex digits, got {_show(k)}")
    return keys


def _count(keys: Sequence[str]) -> dict[str, int]:
    count: dict[str, int] = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    return count


class NodeState:
    """The pool's index: slots, namespaces, recency, leases, admin pins, quotas, counters; and the slot table in
    ``table`` (the pool file's first ``geom.data_offset`` bytes, mapped) that engines read. No sockets: a
    connection is an id given to :meth:`open`, and :meth:`request` answers one decoded request. Loop thread only.

    Args:
        geom: the pool's geometry; None: none yet, ``carve(slot_bytes)`` makes the pool at the first engine's hello
            and returns its ``(geom, table, epoch)`` (its slots as large as that engine's chunks), or raises
            :class:`Refused`.
        table: a writable buffer of at least ``geom.data_offset`` bytes (its slot table starts all FREE).
        pool_path, epoch: what ``hello`` tells engines (the file to map, and its 16 random bytes).
        quotas: namespaces registered up front, with their quota in bytes.
        quarantine_s: a slot left PENDING by a connection that closed is reused only this many seconds later: its
            engine's workers (other processes, such as a TP engine's, which outlive its scheduler's connection for
            a moment) may still be writing it, and must not write into another engine's chunk.
    """

    def __init__(
        self,
        geom: PoolGeometry | None,
        table,
        pool_path: str,
        epoch: bytes | None,
        quotas: dict[str, int] | None = None,
        quarantine_s: float = 0.0,
        carve: Callable[[int], tuple[PoolGeometry, Any, bytes]] | None = None,
    ):
        if geom is None and carve is None:
            raise ValueError("geom: expected a pool geometry, or carve to make one, got neither")
        self.geom: PoolGeometry | None = None
        self.table = self.epoch = None
        self._free: list[int] = []
        self._generation: list[int] = []
        self._carve = carve
        if geom is not None:
            self._use_pool(geom, table, epoch)
        self.pool_path = pool_path
        self.quarantine_s = quarantine_s
        self._quarantine: deque[tuple[float, int]] = deque()  # (when it may be reused, slot), oldest first
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # READY, no admin pin, every namespace; LRU first
        self._namespaces: dict[str, _Namespace] = {}
        self._clients: dict[int, _Client] = {}
        self.counters = dict.fromkeys(
            (
                "refused_clients",
                "bad_frames",
                "bad_requests",
                "internal_errors",
                "leases_released",
                "aborted_on_disconnect",
            ),
            0,
        )
        for name, quota in (quotas or {}).items():
            self._namespaces[name] = _Namespace(name, quota=quota)
        self._ops = {
            "hello": (self._op_hello, None),
            "lookup": (self._op_lookup, None),
            "allocate": (self._op_allocate, "engine"),
            "commit": (self._op_commit, "engine"),
            "abort": (self._op_abort, "engine"),
            "pin": (self._op_pin, "engine"),
            "hold": (self._op_hold, "engine"),
            "unpin": (self._op_unpin, "engine"),
            "tally": (self._op_tally, "engine"),
            "stats": (lambda c, a: self.stats(), None),
            "pin_prefix": (self._op_pin_prefix, None),
            "unpin_prefix": (self._op_unpin_prefix, None),
            "evict": (self._op_evict, None),
            "quota": (self._op_quota, None),
        }

    def _use_pool(self, geom: PoolGeometry, table, epoch: bytes) -> None:
        if geom.num_slots < 1:
            raise ValueError(f"geom: expected at least one slot, got {geom}")
        self.geom, self.table, self.epoch = geom, table, epoch
        self._seed = dir_seed(epoch)
        self._free = list(range(geom.num_slots - 1, -1, -1))  # a stack: slot 0 first
        self._generation = [0] * geom.num_slots

    @property
    def slot_bytes(self) -> int:
        """Bytes of a slot; 0 while the pool is not carved (no chunk yet)."""
        return self.geom.slot_bytes if self.geom is not None else 0

    # -------------------------------------------------------------------------------------- connections
    def open(self, cid: int, pid: int = 0) -> None:
        """A new connection ``cid`` (from process ``pid``): it must say ``hello`` first."""
        self._clients[cid] = _Client(cid, pid)

    def close(self, cid: int) -> None:
        """Connection ``cid`` is gone (EOF, error, its process killed): free every slot it allocated and did not
        commit, release every lease it held."""
        c = self._clients.pop(cid)
        for e in list(c.pending.values()):
            self.counters["aborted_on_disconnect"] += 1
            self._drop(e, quarantine=True)
        for held in c.leases.values():
            for e in held:
                self.counters["leases_released"] += 1
                self._unlease(e)
        if c.ns is not None:
            c.ns.clients -= 1

    # -------------------------------------------------------------------------------------- requests
    def request(self, cid: int, msg: dict) -> tuple[dict, bool]:
        """Answer ``msg`` (a decoded frame body) from connection ``cid``: (the reply, whether the connection stays
        open). Never raises: a bad request, a refusal and a bug in the daemon are all error replies."""
        rid = msg.get("id")
        rid = rid if _is_int(rid) else None
        c = self._clients[cid]
        op = msg.get("op")
        try:
            if rid is None:
                raise BadRequest(f"id: expected an int, got {_show(msg.get('id', _MISSING))}")
            if c.role is None and op != "hello":
                self.counters["bad_requests"] += 1
                return {"id": rid, "ok": False, "error": f"op: expected 'hello' first, got {_show(op)}"}, False
            if not isinstance(op, str) or op not in self._ops:
                raise BadRequest(f"op: expected one of {', '.join(self._ops)}, got {_show(op)}")
            fn, role = self._ops[op]
            if role is not None and c.role != role:
                raise BadRequest(f"op {op}: expected a connection with role {role!r}, got role {c.role!r}")
            return {"id": rid, "ok": True, **fn(c, msg)}, True
        except BadRequest as e:
            self.counters["bad_requests"] += 1
            return {"id": rid, "ok": False, "error": str(e)}, True
        except Refused as e:
            return {"id": rid, "ok": False, "error": str(e)}, True
        except Exception as e:  # noqa: BLE001 - nothing a client sends may stop the daemon
            self.counters["internal_errors"] += 1
            log.exception("kvx node: op %r of connection %d (pid %d) failed", op, cid, c.pid)
            return {"id": rid, "ok": False, "error": f"internal error in op {op!r}: {type(e).__name__}: {e}"}, True

    def _op_hello(self, c: _Client, args: dict) -> dict:
        if c.role is not None:
            raise BadRequest(f"hello: expected once per connection, got a second one (role {c.role!r})")
        _get(args, "version", lambda v: _is_int(v) and v == VERSION, f"protocol version {VERSION}")
        role = _get(args, "role", lambda v: v in ("engine", "control"), "'engine' or 'control'")
        pid = args.get("pid", c.pid)
        if not _is_int(pid):
            raise BadRequest(f"pid: expected an int, got {_show(pid)}")
        if role == "engine":
            self._hello_engine(c, args)
        c.role, c.pid = role, pid
        if self.geom is None:  # a control connection before any engine: no pool file yet
            return {"pool": None, "epoch": None, "num_slots": 0, "slot_bytes": None}
        return {
            "pool": self.pool_path,
            "epoch": self.epoch.hex(),
            "num_slots": self.geom.num_slots,
            "slot_bytes": self.geom.slot_bytes,
            "data_offset": self.geom.data_offset,
            "table_offset": self.geom.table_offset,
        }

    def _hello_engine(self, c: _Client, args: dict) -> None:
        name = _get(args, "namespace", lambda v: isinstance(v, str) and NAMESPACE_RE.fullmatch(v), "8-128 hex digits")
        model = _get(args, "model", lambda v: isinstance(v, str), "a model name (str)")
        chunk_size = _get(args, "chunk_size", lambda v: _is_int(v) and v > 0, "a positive int (tokens)")
        need = _get(args, "slot_bytes", lambda v: _is_int(v) and v > 0, "a positive int (bytes of one chunk)")
        if self.geom is None:
            self._use_pool(*self._carve(need))
        if need > self.geom.slot_bytes:
            raise BadRequest(
                f"slot_bytes: expected at most the pool's slot size, {self.geom.slot_bytes} bytes, got {need} "
                "(start kvx node with a --slot-size as large as the largest model's chunks)"
            )
        ns = self._namespaces.get(name)
        if ns is None:
            ns = self._namespaces[name] = _Namespace(name)
        if ns.chunk_size is None:  # new, or registered by --quota: the first engine's model and chunk size win
            ns.model, ns.chunk_size = model, chunk_size
        elif (ns.model, ns.chunk_size) != (model, chunk_size):
            log.warning(
                "kvx node: namespace %s: engine pid %d says model %r, chunk_size %d; keeping %r, %d",
                name,
                c.pid,
                model,
                chunk_size,
                ns.model,
                ns.chunk_size,
            )
        c.ns = ns
        ns.clients += 1

    def _namespace(self, args: dict) -> _Namespace:
        name = args.get("namespace", _MISSING)
        ns = self._namespaces.get(name) if isinstance(name, str) else None
        if ns is None:
            known = ", ".join(self._namespaces) or "none yet"
            raise BadRequest(f"namespace: expected a known namespace ({known}), got {_show(name)}")
        return ns

    # -------------------------------------------------------------------------------------- engine ops
    def _op_lookup(self, c: _Client, args: dict) -> dict:
        if "namespace" in args:
            return {"ready": self.ready_prefix(self._namespace(args), _keys(args))}
        if c.role != "engine":
            raise BadRequest("namespace: expected a namespace (a lookup without one is an engine's), got nothing")
        return {"states": self.lookup(c, _keys(args))}

    def lookup(self, c: _Client, keys: Sequence[str]) -> list[int]:
        """States of ``keys`` in ``c``'s namespace (FREE for absent); counts hits (leading READY keys) and one
        miss if the prefix stops. Touches no recency."""
        ns = c.ns
        states = [e.state if (e := ns.entries.get(k)) else FREE for k in keys]
        hits = next((i for i, s in enumerate(states) if s != READY), len(states))
        ns.hits += hits
        ns.misses += hits < len(states)
        return states

    def _op_tally(self, c: _Client, args: dict) -> dict:
        """An engine's lookups it answered from the directory since its last tally: ``hits`` (leading READY keys)
        and ``misses`` (lookups whose prefix stopped), added to its namespace's figures."""
        for name in ("hits", "misses"):
            n = _get(args, name, lambda v: _is_int(v) and v >= 0, "a count (an int >= 0)")
            setattr(c.ns, name, getattr(c.ns, name) + n)
        return {}

    def _op_allocate(self, c: _Client, args: dict) -> dict:
        return self.allocate(c, _key(args))

    def allocate(self, c: _Client, key: str) -> dict:
        """A PENDING slot for ``key`` leased to ``c`` until it commits or aborts: ``{slot, generation, reason}``
        (reason None, or why there is no slot: "present", "quota", "full")."""
        ns = c.ns
        if key in ns.entries:
            return {"slot": None, "generation": None, "reason": "present"}
        reason = self._make_room(ns)
        if reason:
            return {"slot": None, "generation": None, "reason": reason}
        slot = self._free.pop()
        self._generation[slot] += 1
        e = ns.entries[key] = _Entry(key, ns, slot, PENDING, c.cid)
        ns.pending += 1
        c.pending[key] = e
        write_entry(self.table, self.geom, slot, bytes.fromhex(key), self._generation[slot], PENDING)
        return {"slot": slot, "generation": self._generation[slot], "reason": None}

    def _make_room(self, ns: _Namespace) -> str | None:
        """Evict what one more chunk of ``ns`` needs: its own LRU chunks if it would exceed its quota, then the
        pool's LRU chunk if no slot is free. None if there is room now, else why not."""
        sb = self.geom.slot_bytes
        if ns.quota is not None:
            need = -(-((ns.chunks + ns.pending + 1) * sb - ns.quota) // sb)
            if need > 0:
                victims = list(islice(self._evictable(ns.lru), need))
                if len(victims) < need:
                    return "quota"
                for e in victims:
                    self._evict(e)
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self._free.append(self._quarantine.popleft()[1])
        if not self._free:
            victim = next(self._evictable(self._lru), None)
            if victim is None:
                return "full"
            self._evict(victim)
        return None

    @staticmethod
    def _evictable(lru: OrderedDict[_Entry, None]) -> Iterator[_Entry]:
        """READY chunks with no pin, least recently used first (admin-pinned ones are not in an LRU)."""
        return (e for e in lru if not e.leases)

    def _op_commit(self, c: _Client, args: dict) -> dict:
        self.commit(c, _key(args))
        return {}

    def commit(self, c: _Client, key: str) -> None:
        """``c`` wrote every byte of ``key``'s slot: serve it from now on (most recently used)."""
        e = c.pending.get(key)
        if e is None:
            got = self._describe(c.ns, key)
            raise Refused(f"commit: expected a PENDING key this connection allocated, got {key} ({got})")
        del c.pending[key]
        e.state, e.owner = READY, None
        e.ns.pending -= 1
        e.ns.chunks += 1
        self._lru[e] = None
        e.ns.lru[e] = None
        write_entry(self.table, self.geom, e.slot, bytes.fromhex(key), self._generation[e.slot], READY)
        self._dir_insert(bytes.fromhex(key), e.slot)

    @staticmethod
    def _describe(ns: _Namespace, key: str) -> str:
        e = ns.entries.get(key)
        return "absent" if e is None else "READY" if e.state == READY else "PENDING, allocated by another connection"

    def _op_abort(self, c: _Client, args: dict) -> dict:
        self.abort(c, _key(args))
        return {}

    def abort(self, c: _Client, key: str) -> None:
        """``c``'s write of ``key`` failed or was dropped: free the slot. A no-op for a key ``c`` does not have
        PENDING (as :meth:`kvx.store.cpu.CPUIndex.abort`)."""
        e = c.pending.pop(key, None)
        if e is not None:
            self._drop(e)

    def _op_pin(self, c: _Client, args: dict) -> dict:
        entries = self.pin(c, _keys(args))
        return {"slots": [e.slot for e in entries], "generations": [self._generation[e.slot] for e in entries]}

    def pin(self, c: _Client, keys: Sequence[str]) -> list[_Entry]:
        """Lease READY chunks to ``c`` for a load (most recently used now). All or nothing."""
        entries = []
        for k in keys:
            e = c.ns.entries.get(k)
            if e is None or e.state != READY:
                raise Refused(f"pin: expected READY keys, got {k} ({self._describe(c.ns, k)}); nothing pinned")
            entries.append(e)
        for e in entries:
            self._lease(c, e)
            self._touch(e)
        return entries

    def _op_hold(self, c: _Client, args: dict) -> dict:
        e = self.hold(c, _key(args))
        return {"slot": e.slot, "generation": self._generation[e.slot]}

    def hold(self, c: _Client, key: str) -> _Entry:
        """Lease a PENDING or READY chunk to ``c`` while its bytes are read for another tier's write."""
        e = c.ns.entries.get(key)
        if e is None:
            raise Refused(f"hold: expected a PENDING or READY key, got {key} (absent)")
        self._lease(c, e)
        return e

    def _op_unpin(self, c: _Client, args: dict) -> dict:
        self.unpin(c, _keys(args))
        return {}

    def unpin(self, c: _Client, keys: Sequence[str]) -> None:
        """Release ``c``'s leases, one per occurrence of a key. All or nothing."""
        for k, n in _count(keys).items():
            if len(c.leases.get(k, ())) < n:
                raise Refused(
                    f"unpin: expected keys this connection leased, got {k} {n} time(s), "
                    f"leased {len(c.leases.get(k, ()))}; nothing unpinned"
                )
        for k in keys:
            held = c.leases[k]
            e = held.pop(0)  # the oldest: a doomed chunk's lease before that of the key allocated again
            if not held:
                del c.leases[k]
            self._unlease(e)

    def _lease(self, c: _Client, e: _Entry) -> None:
        e.leases += 1
        c.leases.setdefault(e.key, []).append(e)

    def _unlease(self, e: _Entry) -> None:
        e.leases -= 1
        if e.doomed and not e.leases:
            self._release(e)

    def _touch(self, e: _Entry) -> None:
        if e in self._lru:  # not admin-pinned
            self._lru.move_to_end(e)
            e.ns.lru.move_to_end(e)

    # -------------------------------------------------------------------------------------- control ops
    def ready_prefix(self, ns: _Namespace, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are READY in ``ns`` (no counters, no recency)."""
        return next((i for i, k in enumerate(keys) if not self._ready(ns, k)), len(keys))

    @staticmethod
    def _ready(ns: _Namespace, key: str) -> _Entry | None:
        e = ns.entries.get(key)
        return e if e is not None and e.state == READY else None

    def _op_pin_prefix(self, c: _Client, args: dict) -> dict:
        return {"pinned": self.pin_prefix(self._namespace(args), _keys(args))}

    def pin_prefix(self, ns: _Namespace, keys: Sequence[str]) -> int:
        """Admin-pin the leading READY ``keys`` of ``ns`` while its pinned bytes stay within its quota; returns how
        many. An admin pin outlives the connection; pins of overlapping prefixes count."""
        sb = self.slot_bytes
        for n, k in enumerate(keys):
            e = self._ready(ns, k)
            if e is None or (not e.admin and ns.quota is not None and (ns.admin_pinned + 1) * sb > ns.quota):
                return n
            if not e.admin:
                ns.admin_pinned += 1
                del self._lru[e], ns.lru[e]
            e.admin += 1
        return len(keys)

    def _op_unpin_prefix(self, c: _Client, args: dict) -> dict:
        return {"unpinned": self.unpin_prefix(self._namespace(args), _keys(args))}

    def unpin_prefix(self, ns: _Namespace, keys: Sequence[str]) -> int:
        """Drop one admin pin of each of ``keys`` that has one; returns how many. A chunk left with no admin pin
        becomes the most recently used."""
        n = 0
        for k in keys:
            e = self._ready(ns, k)
            if e is None or not e.admin:
                continue
            n += 1
            e.admin -= 1
            if not e.admin:
                ns.admin_pinned -= 1
                self._lru[e] = None
                ns.lru[e] = None
        return n

    def _op_evict(self, c: _Client, args: dict) -> dict:
        ns = self._namespace(args)
        keys = _keys(args) if args.get("keys") is not None else None
        return {"evicted": self.evict(ns, keys)}

    def evict(self, ns: _Namespace, keys: Sequence[str] | None = None) -> int:
        """Remove READY chunks of ``ns`` (``keys``, or all), admin pins and all; leased ones are doomed. PENDING
        chunks stay. Returns how many left the index."""
        if keys is None:
            keys = list(ns.entries)
        gone = [e for k in dict.fromkeys(keys) if (e := self._ready(ns, k)) is not None]
        for e in gone:
            self._drop(e)
        return len(gone)

    def _op_quota(self, c: _Client, args: dict) -> dict:
        ns = self._namespace(args)
        quota = _get(args, "bytes", lambda v: v is None or (_is_int(v) and v >= 0), "a byte count >= 0 or null")
        self.set_quota(ns, quota)
        return {}

    def set_quota(self, ns: _Namespace, quota: int | None) -> None:
        """Set (or clear, None) ``ns``'s quota; if it is now over, evict its LRU unpinned chunks until within or
        none is left."""
        ns.quota = quota
        while quota is not None and (ns.chunks + ns.pending) * self.slot_bytes > quota:
            victim = next(self._evictable(ns.lru), None)
            if victim is None:
                return
            self._evict(victim)

    # -------------------------------------------------------------------------------------- slots
    def _evict(self, e: _Entry) -> None:
        e.ns.evictions += 1
        self._drop(e)

    def _drop(self, e: _Entry, quarantine: bool = False) -> None:
        """Take ``e`` out of the index; free its slot now, or at its last unpin if it is leased (``quarantine``: a
        PENDING slot of a closed connection, reused after :attr:`quarantine_s`)."""
        ns = e.ns
        del ns.entries[e.key]
        if e.state == READY:
            self._dir_remove(bytes.fromhex(e.key))  # no engine finds it from now on
            ns.chunks -= 1
            if e.admin:
                ns.admin_pinned -= 1
                e.admin = 0
            else:
                del self._lru[e], ns.lru[e]
        else:
            ns.pending -= 1
            if e.owner in self._clients:
                self._clients[e.owner].pending.pop(e.key, None)
        if e.leases:
            e.doomed = True
        else:
            self._release(e, quarantine)

    # -------------------------------------------------------------------------------------- the directory
    def _dir_at(self, i: int) -> tuple[bytes, int]:
        return DIR_ENTRY.unpack_from(self.table, self.geom.dir_offset + DIR_ENTRY.size * i)

    def _dir_put(self, i: int, key: bytes, slot1: int) -> None:
        """Entry ``i`` := (``key``, ``slot1``): the key first, the slot last, so a reader that sees the slot sees
        the key (or, where a slot is being cleared, 0 first)."""
        off = self.geom.dir_offset + DIR_ENTRY.size * i
        if slot1 == 0:
            struct.pack_into("<I", self.table, off + 16, 0)
            self.table[off : off + 16] = key
        else:
            self.table[off : off + 16] = key
            struct.pack_into("<I", self.table, off + 16, slot1)

    def _dir_insert(self, key: bytes, slot: int) -> None:
        """Publish a READY chunk in the directory (linear probing: :mod:`.protocol`)."""
        mask = self.geom.dir_entries - 1
        i = dir_home(key, self.geom.dir_entries, self._seed)
        while self._dir_at(i)[1]:
            i = (i + 1) & mask
        self._dir_put(i, key, slot + 1)

    def _dir_remove(self, key: bytes) -> None:
        """Take a chunk out of the directory, shifting the entries after it back (no tombstones: a probe stops at
        the first empty entry)."""
        mask = self.geom.dir_entries - 1
        i = dir_home(key, self.geom.dir_entries, self._seed)
        while True:
            k, slot1 = self._dir_at(i)
            if not slot1:
                return
            if k == key:
                break
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            k, slot1 = self._dir_at(j)
            if not slot1:
                break
            home = dir_home(k, self.geom.dir_entries, self._seed)
            if (home - i - 1) & mask < (j - i) & mask:  # its home lies in (i, j]: it stays
                continue
            self._dir_put(i, k, slot1)
            i = j
        self._dir_put(i, _ZERO_KEY, 0)

    def _release(self, e: _Entry, quarantine: bool = False) -> None:
        self._generation[e.slot] += 1  # a reader or writer of the old chunk sees it changed
        write_entry(self.table, self.geom, e.slot, _ZERO_KEY, self._generation[e.slot], FREE)
        if quarantine and self.quarantine_s > 0:
            self._quarantine.append((time.monotonic() + self.quarantine_s, e.slot))
        else:
            self._free.append(e.slot)

    # -------------------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Everything ``stats`` answers (see the module docstring of :mod:`kvx.node.cli` for the fields)."""
        sb = self.slot_bytes
        num_slots = self.geom.num_slots if self.geom is not None else 0
        return {
            "pool": {
                "path": self.pool_path if self.geom is not None else None,
                "bytes": num_slots * sb,
                "num_slots": num_slots,
                "slot_bytes": sb or None,
                "used": num_slots - len(self._free),
                "free": len(self._free),
                "quarantined": len(self._quarantine),
                "pending": sum(ns.pending for ns in self._namespaces.values()),
            },
            "clients": len(self._clients),
            "leases": sum(len(held) for c in self._clients.values() for held in c.leases.values()),  # pins now
            **self.counters,
            "namespaces": {
                name: {
                    "model": ns.model,
                    "chunk_size": ns.chunk_size,
                    "chunks": ns.chunks,
                    "pending": ns.pending,
                    "bytes": (ns.chunks + ns.pending) * sb,
                    "hits": ns.hits,
                    "misses": ns.misses,
                    "evictions": ns.evictions,
                    "pinned": ns.admin_pinned,
                    "quota": ns.quota,
                    "clients": ns.clients,
                }
                for name, ns in self._namespaces.items()
            },
        }


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
            else:
                self._check_room(os.statvfs(os.path.dirname(self.pool_path)), self.size)
                self.state = NodeState(
                    None, None, self.pool_path, None, self._quotas, self.quarantine_s, carve=self._carve
                )
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
            self._map = mmap.mmap(fd, -(-self.geom.data_offset // block) * block)  # header and table only
        except OSError as e:
            raise StartError(f"--pool: cannot size or map {path} ({self.geom.file_bytes} bytes): {e}") from None
        finally:
            os.close(fd)
        epoch = os.urandom(16)
        header = pack_header(self.geom, epoch)
        self._map[: len(header)] = header
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
        if self._map is not None:
            self._map.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -------------------------------------------------------------------------------------- the loop
    def serve(self) -> None:
        """Run the event loop until :meth:`stop`, then close everything and remove the socket and pool file."""
        try:
            while not self._stopping:
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._serve_one(key.data, key.events)
                self._publish()
        finally:
            log.info("kvx node: stopping; closing %d connection(s)", len(self._conns))
            self._cleanup()

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
            reply, keep = self.state.request(conn.cid, msg)
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
