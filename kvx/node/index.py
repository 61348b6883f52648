"""``kvx node``'s index (:class:`NodeState`): which chunk is in which slot of the pool, per namespace, with
its leases, admin pins and quotas; and the pool file's slot table and directory, which it alone writes. The
life cycle and its rules: :mod:`kvx.node.daemon`. Loop thread only (:class:`kvx.node.server.NodeServer`'s).

A sealed namespace (an engine of it seals its byte tiers) moves between nodes only where the node's transport
encrypts it on the wire (:attr:`NodeState.seal_transit`: kvx's tcp channel, :mod:`kvx.node.wire_seal`); elsewhere
(NIXL, or no cluster) its chunks stay on this host: no pull, push, peer ``have`` or lease for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from ..log import get_logger
from ..store.alloc import Allocator
from .args import BadRequest, Refused, counts
from .directory import DirectoryWriter
from .protocol import (
    FREE,
    MAX_PULLS,
    PENDING,
    READY,
    PoolGeometry,
    dir_seed,
    write_entry,
)
from .records import Client, Entry, Namespace

log = get_logger(__name__)

_ZERO_KEY = bytes(16)


# ------------------------------------------------------------------------------------------------ the state
class NodeState:
    """The pool's index: slots, namespaces, recency, leases, admin pins, quotas, counters; and the slot table in
    ``table`` (the pool file's first ``geom.data_offset`` bytes, mapped) that engines read. No sockets: a
    connection is an id given to :meth:`open`; :class:`kvx.node.requests.Requests` turns its decoded requests into
    calls of the typed methods here. Loop thread only.

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

    :attr:`seal_transit` (set by the node at start, before any engine: True when its cluster's transport is tcp):
    sealed namespaces' chunks may cross to and from peers, encrypted on the wire; False: they stay on this host.
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
        # the slots, their runs, recency, pins and generations (kvx.store.alloc); its chunks are this index's Entries
        self.slots = Allocator(0, self._evicted, self._freed, quarantine_s)
        self._carve = carve
        if geom is not None:
            self._use_pool(geom, table, epoch)
        self.pool_path = pool_path
        self._namespaces: dict[str, Namespace] = {}
        self._clients: dict[int, Client] = {}
        self._next_internal = 0  # ids of the daemon's own clients (a pull's slots): negative, never a connection's
        self.seal_transit = False  # sealed namespaces move between nodes (encrypted on the wire: tcp only)
        # pull(cid, rid, namespace, keys, chunk_bytes, budget_s) -> whether it took the pull (its reply comes later,
        # through the server): the cluster's, where the node has peers (kvx.node.peers.Cluster.pull)
        self.on_pull: Callable[[int, int, str, list[str], int, float], bool] | None = None
        # push(namespace, keys, chunk_bytes, to) -> whether it took them: the cluster's (Cluster.push)
        self.on_push: Callable[[str, list[str], int, str], bool] | None = None
        self.cluster_stats: Callable[[], dict] | None = None
        # committed(offset, generation, nbytes): a chunk is READY (Cluster.committed: its CRC32C made ahead)
        # committed(offset, generation, nbytes, crc): crc the chunk's CRC32C where it is known (a pull checked it)
        self.on_commit: Callable[[int, int, int, int | None], None] | None = None
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
            self._namespaces[name] = Namespace(name, quota=quota)

    def _use_pool(self, geom: PoolGeometry, table, epoch: bytes) -> None:
        if geom.num_slots < 1:
            raise ValueError(f"geom: expected at least one slot, got {geom}")
        self.geom, self.table, self.epoch = geom, table, epoch
        self._dir = DirectoryWriter(table, geom, dir_seed(epoch))
        # a chunk: a run of slots (kvx.store.runs), chunks of any size in one pool
        self.slots = Allocator(geom.num_slots, self._evicted, self._freed, self.slots.quarantine_s)

    @property
    def slot_bytes(self) -> int:
        """Bytes of a slot (the pool's allocation unit); 0 while the pool is not carved (no chunk yet)."""
        return self.geom.slot_bytes if self.geom is not None else 0

    def _units(self, nbytes: int) -> int:
        """Slots in the run of a chunk of ``nbytes``."""
        return max(1, -(-nbytes // self.geom.slot_bytes))

    def run_bytes(self, ns: Namespace) -> int:
        """Bytes of the pool one chunk of ``ns`` takes (its run of slots)."""
        return self._units(ns.chunk_bytes) * self.geom.slot_bytes if self.geom is not None else 0

    # -------------------------------------------------------------------------------------- connections
    def open(self, cid: int, pid: int = 0) -> None:
        """A new connection ``cid`` (from process ``pid``): it must say ``hello`` first."""
        self._clients[cid] = Client(cid, pid)

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
        if c.ns is not None and c.role == "engine":
            c.ns.clients -= 1

    def client(self, cid: int) -> Client:
        """Connection ``cid``'s record (it must be open)."""
        return self._clients[cid]

    def generation(self, slot: int) -> int:
        """How many times ``slot`` changed hands (a reader or writer compares it to see its chunk unchanged)."""
        return self.slots.generation[slot]

    def namespace(self, name: object) -> Namespace | None:
        """The namespace ``name``, if known."""
        return self._namespaces.get(name) if isinstance(name, str) else None

    def namespace_names(self) -> list[str]:
        return list(self._namespaces)

    def pool_info(self) -> dict:
        """What ``hello`` tells a connection about the pool (no pool yet: its fields None)."""
        if self.geom is None:  # a control connection before any engine: no pool file yet
            return {"pool": None, "epoch": None, "num_slots": 0, "slot_bytes": None}
        return {
            "cluster": self.on_pull is not None,
            "seal_transit": self.on_pull is not None and self.seal_transit,
            "pool": self.pool_path,
            "epoch": self.epoch.hex(),
            "num_slots": self.geom.num_slots,
            "slot_bytes": self.geom.slot_bytes,
            "data_offset": self.geom.data_offset,
            "table_offset": self.geom.table_offset,
        }

    def join(
        self, c: Client, name: str, model: str, chunk_size: int, need: int, count: bool = True, sealed: bool = False
    ) -> None:
        """``c`` (an engine, or a puller: ``count`` False) serves namespace ``name`` (``model``, ``chunk_size``
        tokens a chunk, chunks of ``need`` bytes): the pool is carved now if it is not yet; the namespace is made
        if new. ``sealed``: the engine seals its byte tiers, so from now on the namespace's chunks cross between
        nodes only encrypted (:attr:`seal_transit`), or else stay on this host (see :meth:`pull`). Raises
        :class:`BadRequest` for chunks larger than the largest run."""
        if self.geom is None:
            self._use_pool(*self._carve(need))
        if self._units(need) > self.slots.max_units:
            raise BadRequest(
                f"slot_bytes: expected chunks that a run of at most {self.slots.max_units} slots of "
                f"{self.geom.slot_bytes} bytes holds ({self.slots.max_units * self.geom.slot_bytes} bytes), got {need} "
                "(start kvx node with a larger --size)"
            )
        ns = self._namespaces.get(name)
        if ns is None:
            ns = self._namespaces[name] = Namespace(name)
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
        ns.chunk_bytes = max(ns.chunk_bytes, need)
        ns.clients += count
        if sealed:
            self.seal(name, f"engine pid {c.pid}")

    def seal(self, name: str, why: str) -> None:
        """Namespace ``name`` is sealed from now on (for good: its chunks are still the tenant's), for ``why``."""
        ns = self._namespaces.get(name)
        if ns is None or ns.sealed:
            return
        ns.sealed = True
        where = "cross between nodes only encrypted" if self.seal_transit else "stay on this host"
        log.info("kvx node: namespace %s is sealed (%s): its chunks %s", name, why, where)

    def is_sealed(self, name: str) -> bool:
        """Whether namespace ``name`` is known and sealed."""
        ns = self._namespaces.get(name)
        return ns is not None and ns.sealed

    def _stays(self, ns: Namespace | None) -> bool:
        """Whether ``ns``'s chunks stay on this host: sealed, where the transport does not encrypt them."""
        return ns is not None and ns.sealed and not self.seal_transit

    def sealed_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Whether any (offset, nbytes) span of the pool file touches a run of slots held by a chunk (PENDING, READY
        or doomed) of a sealed namespace: such bytes cross between nodes only encrypted."""
        if self.geom is None or not any(ns.sealed for ns in self._namespaces.values()):
            return False
        sb, base, at = self.geom.slot_bytes, self.geom.data_offset, self.slots.at
        for off, n in spans:
            first, end = max(0, (off - base) // sb), min(self.geom.num_slots, -(-(off + n - base) // sb))
            s = first
            for k in range(self.geom.num_slots.bit_length() + 1):  # a run from before the span, into it
                start = first & ~((1 << k) - 1)
                if (h := at.get(start)) is not None and start + h.units > first:
                    if h.ns.sealed:
                        return True
                    s = start + h.units
                    break
            while s < end:
                h = at.get(s)
                if h is not None and h.ns.sealed:
                    return True
                s += h.units if h is not None else 1
        return False

    # -------------------------------------------------------------------------------------- engine ops
    def lookup(self, c: Client, keys: Sequence[str]) -> list[int]:
        """States of ``keys`` in ``c``'s namespace (FREE for absent); counts hits (leading READY keys) and one
        miss if the prefix stops. Touches no recency."""
        ns = c.ns
        states = [e.state if (e := ns.entries.get(k)) else FREE for k in keys]
        hits = next((i for i, s in enumerate(states) if s != READY), len(states))
        ns.hits += hits
        ns.misses += hits < len(states)
        return states

    def tally(self, ns: Namespace, hits: int, misses: int) -> None:
        """An engine's lookups it answered from the directory since its last tally: ``hits`` (leading READY keys)
        and ``misses`` (lookups whose prefix stopped), added to its namespace's figures."""
        ns.hits += hits
        ns.misses += misses

    def allocate(self, c: Client, key: str) -> dict:
        """A PENDING slot for ``key`` leased to ``c`` until it commits or aborts: ``{slot, generation, reason}``
        (reason None, or why there is no slot: "present", "quota", "full")."""
        ns = c.ns
        if key in ns.entries:
            return {"slot": None, "generation": None, "reason": "present"}
        if not self._within_quota(ns):
            return {"slot": None, "generation": None, "reason": "quota"}
        e = Entry(key, ns=ns, state=PENDING, owner=c.cid)
        if not self.slots.reserve(e, self._units(ns.chunk_bytes)):  # evicts the pool's LRU chunks if it must
            return {"slot": None, "generation": None, "reason": "full"}
        ns.entries[key] = c.pending[key] = e
        ns.pending += 1
        gen = self.slots.generation[e.slot]
        write_entry(self.table, self.geom, e.slot, bytes.fromhex(key), gen, PENDING)
        return {"slot": e.slot, "generation": gen, "reason": None}

    def _within_quota(self, ns: Namespace) -> bool:
        """Evict the LRU chunks of ``ns`` one more chunk of it needs to stay within its quota; False if too few
        are evictable (nothing is evicted then)."""
        sb = self.run_bytes(ns)
        need = -(-((ns.chunks + ns.pending + 1) * sb - ns.quota) // sb) if ns.quota is not None else 0
        victims = list(islice(self.slots.evictable(ns.lru), need)) if need > 0 else []
        if len(victims) < need:
            return False
        for e in victims:
            self.slots.evict(e)
        return True

    def commit(self, c: Client, key: str, crc: int | None = None) -> None:
        """``c`` wrote every byte of ``key``'s slot: serve it from now on (most recently used). ``crc``: its CRC32C,
        where the writer checked it (a pull, a push): not computed again for the peers' leases."""
        e = c.pending.get(key)
        if e is None:
            got = self._describe(c.ns, key)
            raise Refused(f"commit: expected a PENDING key this connection allocated, got {key} ({got})")
        del c.pending[key]
        e.state, e.owner = READY, None
        e.ns.pending -= 1
        e.ns.chunks += 1
        self.slots.ready(e)
        e.ns.lru[e] = None
        gen = self.slots.generation[e.slot]
        write_entry(self.table, self.geom, e.slot, bytes.fromhex(key), gen, READY)
        self._dir.insert(bytes.fromhex(key), e.slot)
        if self.on_commit is not None:
            self.on_commit(self.geom.slot_offset(e.slot), gen, e.ns.chunk_bytes, crc)

    @staticmethod
    def _describe(ns: Namespace, key: str) -> str:
        e = ns.entries.get(key)
        return "absent" if e is None else "READY" if e.state == READY else "PENDING, allocated by another connection"

    def abort(self, c: Client, key: str) -> None:
        """``c``'s write of ``key`` failed or was dropped: free the slot. A no-op for a key ``c`` does not have
        PENDING (as :meth:`kvx.store.cpu.CPUIndex.abort`)."""
        e = c.pending.pop(key, None)
        if e is not None:
            self._drop(e)

    def pin(self, c: Client, keys: Sequence[str]) -> list[Entry]:
        """Lease chunks to ``c`` for a load (most recently used now): READY ones, or PENDING ones a pull is bringing
        from a peer (the engine's workers wait for them to turn READY; one the pull does not bring turns FREE in the
        slot table at once, failing their loads). All or nothing."""
        entries = []
        for k in keys:
            e = c.ns.entries.get(k)
            if e is None or not (e.state == READY or self._pulled_here(e)):
                got = self._describe(c.ns, k)
                raise Refused(f"pin: expected READY keys, got {k} ({got}); nothing pinned")
            entries.append(e)
        for e in entries:
            self._lease(c, e)
            self._touch(e)
        return entries

    def _pulled_here(self, e: Entry) -> bool:
        """``e`` is PENDING in a slot a pull from a peer is reading into."""
        owner = self._clients.get(e.owner) if e.state == PENDING and e.owner is not None else None
        return owner is not None and owner.role == "pull"

    def hold(self, c: Client, key: str) -> Entry:
        """Lease a PENDING or READY chunk to ``c`` while its bytes are read for another tier's write."""
        e = c.ns.entries.get(key)
        if e is None:
            raise Refused(f"hold: expected a PENDING or READY key, got {key} (absent)")
        self._lease(c, e)
        return e

    def unpin(self, c: Client, keys: Sequence[str]) -> None:
        """Release ``c``'s leases, one per occurrence of a key. All or nothing."""
        for k, n in counts(keys).items():
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

    def _lease(self, c: Client, e: Entry) -> None:
        self.slots.pin(e)
        c.leases.setdefault(e.key, []).append(e)

    def _unlease(self, e: Entry) -> None:
        self.slots.unpin(e)  # frees a doomed chunk's run at its last lease

    def _touch(self, e: Entry) -> None:
        if e in e.ns.lru:  # not admin-pinned
            self.slots.touch(e)
            e.ns.lru.move_to_end(e)

    # -------------------------------------------------------------------------------------- control ops
    def ready_prefix(self, ns: Namespace, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are READY in ``ns`` (no counters, no recency)."""
        return next((i for i, k in enumerate(keys) if not self._ready(ns, k)), len(keys))

    @staticmethod
    def _ready(ns: Namespace, key: str) -> Entry | None:
        e = ns.entries.get(key)
        return e if e is not None and e.state == READY else None

    def pin_prefix(self, ns: Namespace, keys: Sequence[str]) -> int:
        """Admin-pin the leading READY ``keys`` of ``ns`` while its pinned bytes stay within its quota; returns how
        many. An admin pin outlives the connection; pins of overlapping prefixes count."""
        sb = self.run_bytes(ns)
        for n, k in enumerate(keys):
            e = self._ready(ns, k)
            if e is None or (not e.admin and ns.quota is not None and (ns.admin_pinned + 1) * sb > ns.quota):
                return n
            if not e.admin:
                ns.admin_pinned += 1
                self.slots.exempt(e)
                del ns.lru[e]
            e.admin += 1
        return len(keys)

    def unpin_prefix(self, ns: Namespace, keys: Sequence[str]) -> int:
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
                self.slots.exempt(e, False)
                ns.lru[e] = None
        return n

    def evict(self, ns: Namespace, keys: Sequence[str] | None = None) -> int:
        """Remove READY chunks of ``ns`` (``keys``, or all), admin pins and all; leased ones are doomed. PENDING
        chunks stay. Returns how many left the index."""
        if keys is None:
            keys = list(ns.entries)
        gone = [e for k in dict.fromkeys(keys) if (e := self._ready(ns, k)) is not None]
        for e in gone:
            self._drop(e)
        return len(gone)

    def set_quota(self, ns: Namespace, quota: int | None) -> None:
        """Set (or clear, None) ``ns``'s quota; if it is now over, evict its LRU unpinned chunks until within or
        none is left."""
        ns.quota = quota
        while quota is not None and (ns.chunks + ns.pending) * self.run_bytes(ns) > quota:
            victim = next(self.slots.evictable(ns.lru), None)
            if victim is None:
                return
            self.slots.evict(victim)

    # -------------------------------------------------------------------------------------- pulls and peers
    def pull(self, c: Client, rid: int, keys: Sequence[str], budget_s: float) -> int | None:
        """Engine ``c`` missed ``keys`` (its lookup's first miss on): pull what peers hold of them. None if the
        pull was taken (its answer, the leading keys now READY here, comes later on ``c`` for request ``rid``);
        else 0 at once: nothing to ask (no peers, the first key present or being written here). At most
        :data:`~.protocol.MAX_PULLS` in flight per connection (several requests' lookups missing at once). A sealed
        namespace pulls only where the transport encrypts it on the wire (:attr:`seal_transit`); elsewhere nothing:
        its chunks cross no host boundary, either way (the pool holds them in the clear, NIXL would carry them so)."""
        if c.pulling >= MAX_PULLS:
            raise BadRequest(f"pull: expected at most {MAX_PULLS} pulls in flight per connection, got one more")
        n = next((i for i, k in enumerate(keys) if k in c.ns.entries), len(keys))
        if n == 0 or self.on_pull is None or self.geom is None or self._stays(c.ns):
            return 0
        if not self.on_pull(c.cid, rid, c.ns.name, list(keys[:n]), c.ns.chunk_bytes, budget_s):
            return 0
        c.pulling += 1
        return None

    def push(self, c: Client, keys: Sequence[str], to: str) -> bool:
        """A P/D producer's chunks ``keys``: send each to the node at ``to`` once it is READY here."""
        if self.on_push is None:
            raise Refused("push: expected a node in a cluster (kvx node --listen), got one without")
        if self._stays(c.ns):  # stays on this host: the consumer waits for a shared byte tier, or recomputes
            return False
        return self.on_push(c.ns.name, list(keys), c.ns.chunk_bytes, to)

    def push_lease(self, owner: int, namespace: str, keys: Sequence[str]) -> tuple[list[tuple[str, int, int]], str]:
        """Lease the leading READY ``keys`` to the daemon's client ``owner`` (a push reads them): (key, offset,
        generation) each, and what stopped the run: "end", "pending" (being written: wait) or "absent" (a sealed
        namespace's too where it stays on this host: it became sealed after the push began)."""
        ns = self._namespaces.get(namespace)
        if ns is None or self.geom is None or self._stays(ns):
            return [], "absent"
        c = self._clients[owner]
        out = []
        for k in keys:
            e = ns.entries.get(k)
            if e is None or e.state != READY:
                return out, "absent" if e is None else "pending"
            self._lease(c, e)
            out.append((k, self.geom.slot_offset(e.slot), self.slots.generation[e.slot]))
        return out, "end"

    def unlease_all(self, owner: int) -> None:
        """Release every lease of the daemon's client ``owner``."""
        c = self._clients[owner]
        for held in c.leases.values():
            for e in held:
                self._unlease(e)
        c.leases.clear()

    def push_reserve(
        self, cid: int, peer: str, namespace: str, keys: Sequence[str], nbytes: int, sealed: bool = False
    ) -> list:
        """A peer pushes ``keys`` of ``namespace`` (``nbytes`` each) here: per key, the byte offset of a PENDING slot
        it may write (held by its connection ``cid``), or None (present here already, or no room). The namespace is
        made if no engine of it has come yet (its engines find the chunks when they do). ``sealed``: the pusher's
        namespace is sealed, so it is here too from now on. A sealed namespace takes pushes only where the transport
        encrypts them (:attr:`seal_transit`: then its slots take only sealed writes, :meth:`sealed_spans`); elsewhere
        none (its chunks cross no host boundary)."""
        if self.geom is None or self._stays(self._namespaces.get(namespace)) or (sealed and not self.seal_transit):
            return [None] * len(keys)
        if self._units(nbytes) > self.slots.max_units:
            raise BadRequest(f"nbytes: expected at most this pool's largest run, {self._max_bytes()}, got {nbytes}")
        ns = self._namespaces.get(namespace)
        if ns is None:
            ns = self._namespaces[namespace] = Namespace(namespace, chunk_bytes=nbytes)
        ns.chunk_bytes = max(ns.chunk_bytes, nbytes)  # its runs hold what the peer writes
        if sealed:
            self.seal(namespace, f"pushed sealed by node {peer}")
        c = self._clients[cid]
        c.ns, c.peer = ns, peer
        out = []
        for k in keys:
            got = self.allocate(c, k)
            out.append(None if got["slot"] is None else self.geom.slot_offset(got["slot"]))
        return out

    def pending_offsets(self, cid: int, keys: Sequence[str]) -> list[int | None]:
        """The byte offsets of connection ``cid``'s PENDING slots of ``keys`` (None: not one of them)."""
        c = self._clients[cid]
        return [self.geom.slot_offset(c.pending[k].slot) if k in c.pending else None for k in keys]

    def writable(self, peer: str, spans: Sequence[tuple[int, int]]) -> bool:
        """Whether every (offset, nbytes) is inside a slot PENDING for a push of node ``peer``."""
        if self.geom is None:
            return False
        mine = {
            self.geom.slot_offset(e.slot): e.units * self.geom.slot_bytes
            for c in self._clients.values()
            if c.peer == peer
            for e in c.pending.values()
        }
        return all(off in mine and n <= mine[off] for off, n in spans)

    def push_commit(
        self, cid: int, keys: Sequence[str], good: Sequence[bool], crcs: Sequence[int | None] | None = None
    ) -> int:
        """The pushed ``keys`` arrived (``good``: whole, their CRC32C checked, ``crcs``): commit those, free the
        others."""
        c = self._clients[cid]
        n = 0
        for i, (k, ok) in enumerate(zip(keys, good)):
            if k not in c.pending:
                continue
            if ok:
                self.commit(c, k, crcs[i] if crcs is not None else None)
                c.ns.pushed += 1
                n += 1
            else:
                self.abort(c, k)
        return n

    def pull_done(self, cid: int) -> bool:
        """A pull of connection ``cid`` is over: whether the connection is still there to be answered."""
        c = self._clients.get(cid)
        if c is None:
            return False
        c.pulling = max(0, c.pulling - 1)
        return True

    def open_internal(self, role: str = "peer") -> int:
        """A client of the daemon's own (a peer's connection, a pull's slots): its id, for :meth:`close`."""
        self._next_internal -= 1
        self.open(self._next_internal)
        self._clients[self._next_internal].role = role
        return self._next_internal

    def peer_have(self, namespace: str, keys: Sequence[str]) -> int:
        """How many leading ``keys`` this pool holds READY in ``namespace`` (0 for a namespace it does not know, or a
        sealed one that stays on this host: it serves no peer)."""
        ns = self._namespaces.get(namespace)
        return 0 if ns is None or self._stays(ns) else self.ready_prefix(ns, keys)

    def peer_lease(self, cid: int, namespace: str, keys: Sequence[str], nbytes: int) -> list[tuple[str, int, int]]:
        """Lease the leading READY ``keys`` of ``namespace`` to peer connection ``cid`` for a read of ``nbytes``
        each: (key, byte offset in the pool file, generation) per chunk leased (none of a sealed namespace that stays
        on this host; a sealed one's otherwise, which the peer then reads sealed: :meth:`sealed_spans`)."""
        ns = self._namespaces.get(namespace)
        if ns is None or self.geom is None or self._stays(ns):
            return []
        if self._units(nbytes) > self.slots.max_units:
            raise BadRequest(f"nbytes: expected at most this pool's largest run, {self._max_bytes()}, got {nbytes}")
        c = self._clients[cid]
        out = []
        for k in keys:
            e = self._ready(ns, k)
            if e is None or nbytes > e.units * self.geom.slot_bytes:
                break
            self._lease(c, e)
            self._touch(e)
            out.append((k, self.geom.slot_offset(e.slot), self.slots.generation[e.slot]))
        ns.served += len(out)
        return out

    def peer_release(self, cid: int, keys: Sequence[str], generations: Sequence[int]) -> list[bool]:
        """Release peer ``cid``'s leases of ``keys``: per key, whether its slot kept the generation it was leased
        with (it does while leased; False also for a key the peer did not lease)."""
        c = self._clients[cid]
        out = []
        for k, gen in zip(keys, generations):
            held = c.leases.get(k)
            if not held:
                out.append(False)
                continue
            e = held.pop(0)
            if not held:
                del c.leases[k]
            out.append(self.slots.generation[e.slot] == gen and not e.doomed)
            self._unlease(e)
        return out

    def pull_alloc(self, owner: int, namespace: str, keys: Sequence[str]) -> list[tuple[str, int]]:
        """PENDING slots for the leading ``keys`` there is room for, held by the daemon's client ``owner`` (a
        pull): (key, byte offset in the pool file) each, in order, stopping at the first without a slot."""
        ns = self._namespaces.get(namespace)
        c = self._clients.get(owner)
        if ns is None or c is None:
            return []
        c.ns = ns
        out = []
        for k in keys:
            got = self.allocate(c, k)
            if got["slot"] is None:
                break
            out.append((k, self.geom.slot_offset(got["slot"])))
        return out

    def pull_commit(self, owner: int, key: str, crc: int | None = None) -> None:
        """One chunk of a pull arrived and passed its check against ``crc`` (they arrive in order): READY from now on,
        before the pull's other chunks are in (an engine's load waiting for it starts)."""
        c = self._clients.get(owner)
        if c is not None and key in c.pending:
            self.commit(c, key, crc)
            c.committed += 1

    def pull_end(self, owner: int, good: Sequence[str], crcs: Sequence[int | None] | None = None) -> int:
        """A pull is over: commit its ``good`` keys (checked against ``crcs``, in order; :meth:`pull_commit` made the
        first ones READY already), free its other slots (quarantined: a transfer that timed out may still land in
        them) and its client. Returns how many were committed."""
        c = self._clients[owner]
        n = c.committed
        for i in range(n, len(good)):
            if good[i] not in c.pending:
                break
            self.commit(c, good[i], crcs[i] if crcs is not None else None)
            n += 1
        if c.ns is not None:
            c.ns.pulled += n
        for e in list(c.pending.values()):
            self._drop(e, quarantine=True)
        c.ns = None  # not an engine: close() counts no client of the namespace
        self._clients.pop(owner)
        return n

    # -------------------------------------------------------------------------------------- slots
    def _evicted(self, e: Entry) -> None:
        """The allocator evicts ``e`` to make room (LRU, or over its namespace's quota)."""
        e.ns.evictions += 1
        self._unindex(e)

    def _drop(self, e: Entry, quarantine: bool = False) -> None:
        """Take ``e`` out of the index; free its slot now, or at its last unpin if it is leased (``quarantine``: a
        PENDING slot of a closed connection, reused after the allocator's ``quarantine_s``). A pull's leased PENDING
        slot (an engine's load waits for it) reads FREE in the slot table at once: that load fails now."""
        pulled = self._pulled_here(e)
        self._unindex(e)
        self.slots.drop(e, quarantine)
        if pulled and e.doomed:
            write_entry(self.table, self.geom, e.slot, _ZERO_KEY, self.slots.generation[e.slot], FREE)

    def _unindex(self, e: Entry) -> None:
        """Take ``e`` out of its namespace, the directory, its writer's pending and the counters."""
        ns = e.ns
        del ns.entries[e.key]
        if e.state == READY:
            self._dir.remove(bytes.fromhex(e.key))  # no engine finds it from now on
            ns.chunks -= 1
            if e.admin:
                ns.admin_pinned -= 1
                e.admin = 0
            else:
                del ns.lru[e]
        else:
            ns.pending -= 1
            if e.owner in self._clients:
                self._clients[e.owner].pending.pop(e.key, None)

    def _freed(self, e: Entry) -> None:
        """``e``'s run is free (its generation bumped): engines reading the table see the slot FREE."""
        write_entry(self.table, self.geom, e.slot, _ZERO_KEY, self.slots.generation[e.slot], FREE)

    def _max_bytes(self) -> int:
        return self.slots.max_units * self.geom.slot_bytes

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
                "used": num_slots - self.slots.free_units,
                "free": self.slots.free_units,
                "largest_free": self.slots.largest(),  # slots: the largest run free now
                "quarantined": len(self.slots.quarantine),
                "pending": sum(ns.pending for ns in self._namespaces.values()),
            },
            **({"cluster": self.cluster_stats()} if self.cluster_stats is not None else {}),
            "clients": sum(c.cid > 0 for c in self._clients.values()),
            "leases": sum(len(held) for c in self._clients.values() for held in c.leases.values()),  # pins now
            **self.counters,
            "namespaces": {
                name: {
                    "model": ns.model,
                    "chunk_size": ns.chunk_size,
                    "chunks": ns.chunks,
                    "pending": ns.pending,
                    "bytes": (ns.chunks + ns.pending) * self.run_bytes(ns),
                    "hits": ns.hits,
                    "pulled": ns.pulled,
                    "pushed": ns.pushed,
                    "served": ns.served,
                    "misses": ns.misses,
                    "evictions": ns.evictions,
                    "pinned": ns.admin_pinned,
                    "quota": ns.quota,
                    "sealed": ns.sealed,
                    "clients": ns.clients,
                }
                for name, ns in self._namespaces.items()
            },
        }
