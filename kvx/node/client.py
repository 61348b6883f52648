"""An engine's side of ``kvx node``: the scheduler's index (:class:`NodeIndex`) and the workers' mapping of the
pool (:class:`NodePool`).

The node takes the CPU tier's place: :class:`NodeIndex` answers the calls the connector makes of
:class:`kvx.store.CPUIndex` (``allocate``, ``commit``, ``pin``, ...) by asking the daemon, and every worker copies
into and out of the slots of the pool file it maps. The scheduler's connection holds the engine's leases: its
PENDING slots and its pins end with it, so an engine killed mid-save or mid-load leaves nothing held.

A node that is down (or answers late) degrades to recompute, never to an error or a hang: lookups find nothing,
saves find no slot (the byte tiers alone get them), and a pin that fails hands the workers slot -1, which fails
that chunk's load (vLLM recomputes it). The index tries the node again at most every ``retry_s``; each new
connection tells the workers the pool file and its epoch (:attr:`NodeIndex.pool`), so a restarted node's new
pool is mapped at the next step.

Workers check a slot's table entry (:func:`kvx.node.protocol.slot_entry`) before they copy from it and again once
the copy is done, and before and after they write it: a slot that is not the chunk's (another key, another
generation, not READY / PENDING) fails the copy.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..log import get_logger
from ..store.slots import SlotIndex, SlotPool, SlotState
from ..store.tier import STORED, Listener
from .connection import Connection, NodeError, NodeUnavailable
from .directory import Directory
from .protocol import MAX_PULLS, PENDING, READY, VERSION, PoolGeometry, ProtocolError, slot_entry, unpack_header

log = get_logger(__name__)

_STATES = {0: None, 1: SlotState.PENDING, 2: SlotState.READY}
_PULL_KEYS = 256  # keys one pull asks for at most
_PULL_GRACE_S = 1.0  # past pull_wait_ms, how long an engine waits for its node's answer before it gives up
_TRIED_S = 10.0  # a key a pull did not bring is not pulled again this long (the peers did not have it)


@dataclass(eq=False)
class _Pull:
    """A pull in flight: the keys asked for, and when the engine stops waiting for the answer."""

    keys: list[str]
    deadline: float

    def __post_init__(self):
        self.asked = frozenset(self.keys)


class NodeIndex(SlotIndex):
    """The node's index as the connector's first level (a :class:`kvx.store.SlotIndex`, shared). Scheduler thread
    only: it owns the connection, and with it the engine's leases.

    ``namespace``: the engine's key namespace (its digest: :func:`kvx.connector.common.namespace`); ``model``: a
    name for ``kvx node stats``; ``slot_bytes``: the bytes one of its chunks takes in a slot (every rank's heads);
    ``sealed``: the engine seals its byte tiers (their ``encryption``): its chunks lie in the node's pool in the
    clear, so they cross to other nodes only where the node says they cross encrypted (its hello's ``seal_transit``:
    kvx's tcp channel, :mod:`kvx.node.wire_seal`); with a node that does not say so (NIXL, or a kvx before sealed
    transfers) this engine asks for no pull or push, and its chunks stay on this host.
    """

    shared = True  # several engines store into it: a chunk present is written to the byte tiers by its writer only

    def __init__(
        self,
        socket_path: str,
        namespace: bytes,
        model: str,
        chunk_size: int,
        slot_bytes: int,
        timeout: float = 2.0,
        retry_s: float = 1.0,
        pull_wait_ms: int = 500,
        sealed: bool = False,
    ):
        self.conn = Connection(socket_path, timeout)
        self.puller = Connection(socket_path, timeout)  # pulls from peers: answered when done, so apart
        self.pull_wait_s = pull_wait_ms / 1e3
        self.sealed = sealed
        self._cluster = False  # the node said it has peers
        self._seal_transit = False  # the node said sealed chunks cross between nodes encrypted
        self._pulls: list[_Pull] = []  # the pulls in flight (at most MAX_PULLS), oldest first
        self._tried: dict[str, float] = {}  # key -> until when a pull that did not bring it is not asked again
        self.hello = {
            "version": VERSION,
            "role": "engine",
            "namespace": namespace.hex(),
            "model": model,
            "chunk_size": chunk_size,
            "slot_bytes": slot_bytes,
            "pid": os.getpid(),
            **({"sealed": True} if sealed else {}),  # a node of a kvx before sealed namespaces takes the hello
        }
        self.retry_s = retry_s
        self.pool: tuple[str, str] | None = None  # (pool file, epoch) of the live connection
        self._next_try = 0.0
        self._listeners: list[Listener] = []
        self._dir: Directory | None = None  # the pool's directory and slot table, mapped read-only
        self._tally = [0, 0]  # hits, misses since the last tally
        self._held: Counter[str] = Counter()  # lease pins the connection holds, per key
        self._next_tally = 0.0
        self.stats = {"unavailable": 0, "refused": 0, "reconnects": 0}
        self._refusal: str | None = None  # the node's last refusal of this engine's hello, logged once

    # ---------------------------------------------------------------- connection
    def _call(self, op: str, **args) -> dict | None:
        """The reply to ``op``; None if the node is down (tried again after ``retry_s``)."""
        if not self.conn.connected:
            if time.monotonic() < self._next_try:
                return None
            self._next_try = time.monotonic() + self.retry_s
            try:
                reply = self.conn.call("hello", **self.hello)
            except NodeUnavailable:
                return None
            except NodeError as e:  # asked again every retry_s (the node may be restarted otherwise); said once
                if str(e) != self._refusal:
                    log.error("kvx: the node at %s refused this engine: %s", self.conn.path, e)
                self._refusal = str(e)
                self.conn.close()
                self.stats["refused"] += 1
                return None
            self._refusal = None
            self.pool = (reply["pool"], reply["epoch"])
            self._dir = _map_directory(reply)
            self._cluster = bool(reply.get("cluster"))
            self._seal_transit = reply.get("seal_transit") is True
            self.stats["reconnects"] += 1
            log.info("kvx: connected to the node at %s (pool %s)", self.conn.path, reply["pool"])
        try:
            reply = self.conn.call(op, **args)
        except NodeUnavailable as e:
            self._lost(e)
            return None
        self._send_tally(op)
        return reply

    def _post(self, op: str, on_reply=None, **args) -> bool:
        """Send ``op`` without waiting for its reply (:meth:`Connection.post`); False if the node is down."""
        if not self.conn.connected:
            return False
        try:
            self.conn.post(op, on_reply, **args)
        except NodeUnavailable as e:
            self._lost(e)
            return False
        self._send_tally(op)
        return True

    def _send_tally(self, after: str) -> None:
        """The lookups' figures ride with the engine's next request (posted: nothing waits for them)."""
        if after != "tally" and self._tally != [0, 0]:
            hits, misses = self._tally
            self._tally = [0, 0]
            self._post("tally", hits=hits, misses=misses)

    def _lost(self, why) -> None:
        log.warning("kvx: the node is unavailable (%s); its chunks are misses until it is back", why)
        self.pool = self._dir = None
        self._held.clear()  # the node released the connection's leases
        self.stats["unavailable"] += 1

    def close(self) -> None:
        self.conn.close()
        self.puller.close()
        self.pool = self._dir = None

    def _may_move(self) -> bool:
        """Whether this engine's chunks may cross to other nodes: unsealed, or the node encrypts them on the wire (a
        sealed namespace's chunks otherwise stay on this host)."""
        return not self.sealed or self._seal_transit

    def push(self, keys: Sequence[str], to: str) -> bool:
        """A P/D producer's chunks: the node sends each to the node at ``to`` once it is READY here (posted)."""
        if not self._cluster or not keys or not self._may_move():
            return False
        return self._post("push", None, keys="".join(keys), to=to)

    # ---------------------------------------------------------------- pulls from peers
    def pulling(self, missing: Sequence[str]) -> bool:
        """A node in a cluster: True while the node pulls ``missing`` (a lookup's keys from its first miss on) from a
        peer, for at most ``pull_wait_ms`` (and a second's grace for the node's answer). The first lookup to miss a
        key starts a pull of it and the keys after it, up to :data:`~.protocol.MAX_PULLS` pulls in flight (other
        requests' lookups); a key a pull did not bring is not pulled again for :data:`_TRIED_S`. Once the node has
        the pull's slots, :meth:`coming` counts them and the lookup is a hit (asked first)."""
        if not self._cluster or self.pull_wait_s <= 0 or self._dir is None or not missing or not self._may_move():
            return False
        now = time.monotonic()
        if self._pulls:
            self._poll_pulls(now)
        if any(missing[0] in p.asked for p in self._pulls):
            return True  # being pulled: wait (the node makes its chunks READY one by one, a lookup may see some)
        if len(self._pulls) >= MAX_PULLS or self._tried.get(missing[0], 0.0) > now:
            return False
        p = _Pull(list(missing[:_PULL_KEYS]), now + self.pull_wait_s + _PULL_GRACE_S)
        budget = max(1, int(self.pull_wait_s * 1e3))
        try:
            if not self.puller.connected:
                self.puller.call("hello", **{**self.hello, "role": "puller"})
            self.puller.post("pull", lambda reply: self._pulled(p, reply), keys="".join(p.keys), budget_ms=budget)
        except (NodeUnavailable, NodeError) as e:
            log.info("kvx: cannot ask the node to pull (%s)", e)
            self.puller.close()
            self._end_pulls("the connection closed")
            self._note_tried(p.keys, now)
            return False
        self._pulls.append(p)
        return True

    def coming(self, missing: Sequence[str]) -> int:
        """How many leading keys of ``missing`` a pull this engine asked for is bringing into the node's slots now
        (PENDING in the slot table, or READY already): a hit loaded asynchronously, each chunk copied once it is
        READY (the node makes a pull's chunks READY one by one, in order, as each arrives and passes its check). 0
        while no pull of ``missing[0]`` is in flight, or before the node has the pull's slots."""
        if not self._pulls or self._dir is None or not missing:
            return 0
        self._poll_pulls(time.monotonic())
        asked = next((p.asked for p in self._pulls if missing[0] in p.asked), None)
        if asked is None:
            return 0
        keys = list(missing[:_PULL_KEYS])
        ready, pending = self._dir.slots("".join(keys)), self._dir.pending("".join(keys))
        return next(
            (i for i, (k, r, p) in enumerate(zip(keys, ready, pending)) if k not in asked or (r < 0 and p < 0)),
            len(keys),
        )

    def _poll_pulls(self, now: float) -> None:
        try:
            self.puller.poll()
        except NodeUnavailable:
            pass
        if not self.puller.connected:
            self._end_pulls("the node closed the connection")
        elif any(now > p.deadline for p in self._pulls):  # the node did not answer in time: drop the connection
            self.puller.close()  # and with it every pull of it (the node ends them)
            self._end_pulls("no answer within pull_wait_ms")

    def _end_pulls(self, why: str) -> None:
        for p in list(self._pulls):
            self._pulled(p, NodeError(why))

    def _pulled(self, p: _Pull, reply) -> None:
        """Pull ``p`` is over (its reply, or a :class:`NodeError`): the keys it did not bring are tried."""
        if p not in self._pulls:
            return
        self._pulls.remove(p)
        n = reply.get("pulled", 0) if isinstance(reply, dict) else 0
        self.stats["pulled"] = self.stats.get("pulled", 0) + n
        self._note_tried(p.keys[n:], time.monotonic())

    def _note_tried(self, keys: Sequence[str], now: float) -> None:
        if len(self._tried) > 4 * _PULL_KEYS:
            self._tried = {k: t for k, t in self._tried.items() if t > now}
        for k in keys:
            self._tried[k] = now + _TRIED_S

    def subscribe(self, listener: Listener) -> None:
        """``listener("cpu", STORED | REMOVED, keys)`` for the chunks this engine commits or evicts itself."""
        self._listeners.append(listener)

    def _emit(self, event: str, keys: list[str]) -> None:
        for fn in self._listeners:
            fn("cpu", event, keys)

    # ---------------------------------------------------------------- queries
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is READY: read from the pool's directory (:class:`kvx.node.protocol.Directory`), with
        no round trip. The hits (the leading READY keys) and misses are told to the daemon (``tally``), for its
        per-namespace figures, after the engine's next request (a hit's pin, a miss's allocations), or a second
        later at the latest while it looks up."""
        if not keys:
            return []
        if not self.conn.alive():
            if self.pool is not None:
                self._lost("its connection closed")
            if self._call("tally", hits=0, misses=0) is None:  # a new connection, at most every retry_s
                return [False] * len(keys)
        if self._dir is None:
            return [False] * len(keys)
        found = self._dir.ready("".join(keys))
        hits = next((i for i, f in enumerate(found) if not f), len(found))
        self._tally[0] += hits
        self._tally[1] += hits < len(found)
        if time.monotonic() >= self._next_tally:
            self._next_tally = time.monotonic() + 1.0
            self._send_tally("lookup")
        return found

    def __contains__(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def state(self, key: str) -> SlotState | None:
        """READY or PENDING as the pool's directory and slot table say now, else None (also while the node is
        down): no round trip, as ``contains_many``. The save planning asks this of every chunk of a request (16
        on a 4096-token prompt; asking the daemon costs a round trip per chunk not found READY, slower while
        vLLM's threads hold the cores). A stale answer costs at most a save: READY or PENDING skips
        it (another engine has it), None tries ``allocate``, which the daemon answers."""
        return None if self._dir is None else _STATES[self._dir.state(key)]

    # ---------------------------------------------------------------- slots
    def allocate(self, key: str) -> int | None:
        reply = self._call("allocate", key=key)
        return reply["slot"] if reply else None

    def commit(self, key: str) -> None:
        try:
            reply = self._call("commit", key=key)
        except NodeError as e:  # the connection was lost meanwhile: its slot was freed
            log.warning("kvx: chunk %s not committed to the node (%s)", key, e)
            return
        if reply is not None:
            self._emit(STORED, [key])

    def abort(self, key: str) -> None:
        try:
            self._call("abort", key=key)
        except NodeError:
            pass

    def pin(self, keys: Sequence[str]) -> list[int]:
        """Lease pins on READY chunks for a load: their slots as the directory gives them now, -1 for a chunk it
        does not hold READY or if the node is down (the workers then fail those chunks' loads: recomputed). A chunk a
        pull of this engine is still bringing (:meth:`coming`) gets its PENDING slot (the workers wait for it).

        The pin is posted, not waited for: its round trip, slow while vLLM's threads hold the cores, delayed a
        request's first step for every hit. The lease is a guard, not what makes a read safe: the workers
        check each slot's key, generation and state before and after their copies, so a chunk evicted before the
        daemon saw the pin fails its load and is recomputed, never served torn."""
        keys = list(keys)
        if self._dir is None or not self.conn.alive():
            return [-1] * len(keys)
        slots = self._dir.slots("".join(keys))
        ready = [k for k, s in zip(keys, slots) if s >= 0]
        # chunks a pull of this engine is still bringing (coming): their PENDING slots, pinned apart (all or nothing
        # each: a pull that fails meanwhile costs those chunks' pins, not the READY ones')
        wanted = [i for i, s in enumerate(slots) if s < 0 and any(keys[i] in p.asked for p in self._pulls)]
        coming = []
        if wanted:
            for i, s in zip(wanted, self._dir.pending("".join(keys[i] for i in wanted))):
                if s >= 0:
                    slots[i] = s
                    coming.append(keys[i])

        def pinned(held: list[str]):
            def on_reply(reply) -> None:
                if isinstance(reply, NodeError):  # all or nothing: one of them was evicted since the lookup
                    log.info("kvx: %s", reply)
                else:
                    self._held.update(held)

            return on_reply

        for group in (ready, coming):
            if group and not self._post("pin", pinned(group), keys="".join(group)):
                return [-1] * len(keys)
        return slots

    def hold(self, key: str) -> int | None:
        """A lease pin while the chunk's slot is read for a byte tier's write; None if the node refused or is down
        (that write is not made)."""
        try:
            reply = self._call("hold", key=key)
        except NodeError:
            return None
        if not reply:
            return None
        self._held[key] += 1
        return reply["slot"]

    def unpin(self, keys: Iterable[str]) -> None:
        """Release the lease pins this connection holds among ``keys`` (a pin that failed, or that a lost connection
        released, is not asked for). Posted: nothing waits for a release."""
        if self.conn.connected:
            try:
                self.conn.drain()  # the replies of posted pins: which of them hold
            except NodeUnavailable as e:
                self._lost(e)
        mine = []
        for k in keys:
            if self._held[k] > 0:
                self._held[k] -= 1
                mine.append(k)
        self._held += Counter()  # drop the zeros
        if mine:
            self._post("unpin", keys="".join(mine))


_POPULATE_STEP = 4 << 20  # bytes per call in the background: the copy pool waits at most one call
_POPULATE_ALL = 1 << 62  # one call, on every core of the copy pool (at registration)


def _populate(data: torch.Tensor, current, step: int = _POPULATE_STEP) -> None:
    """Map every page of a node pool into this process ahead of its copies, ``step`` bytes a call, while
    ``current()`` (the pool is still the one mapped). Each page's first touch is otherwise a fault on the
    critical path: a fresh engine's first load is slower than from a CPU tier, whose pool is committed at start-up
    (:class:`kvx.store.CPUPool`), and slower still while a background commit runs (``benchmarks/bench_node.py``,
    ``results/node_cpu.md``)."""
    try:
        from .._ext import load

        _C = load()
    except ImportError:  # the pure-Python fallback: pages fault in on first touch
        return
    ptr, n = data.data_ptr(), data.numel()
    for off in range(0, n, step):
        if not current():
            return
        if _C.cpu_populate_write(ptr + off, min(step, n - off), 1 if step == _POPULATE_STEP else 0):
            return  # EINVAL: a kernel before 5.14


def _map_directory(hello: dict) -> Directory | None:
    """The directory and slot table of the pool a ``hello`` reply names, mapped read-only; None if it cannot be
    (logged: lookups then miss)."""
    try:
        with open(hello["pool"], "rb") as f:
            m = mmap.mmap(f.fileno(), hello["data_offset"], mmap.MAP_SHARED, mmap.PROT_READ)
        geom, epoch = unpack_header(m)
        if epoch.hex() != hello["epoch"]:
            raise ProtocolError(f"expected epoch {hello['epoch']}, got {epoch.hex()}")
        return Directory(m, geom, epoch)
    except (OSError, ValueError) as e:
        log.error("kvx: cannot map the node's pool %s (%s); its chunks are misses", hello["pool"], e)
        return None


class NodePool(SlotPool):
    """A worker's mapping of the node's pool file (a :class:`kvx.store.SlotPool`, shared).

    ``storage_shape``: a whole slot's tensor (every rank's KV heads: head-major ``[H, ...]`` when ``heads`` cuts
    it); ``heads``: this worker's [first, end) of dim 0, or None (the worker's share is the whole slot);
    ``view_shape``: the shape :meth:`slot` returns (this worker's storage shape). Worker thread only; the mapping
    of a replaced pool stays alive as long as a tensor of it does.
    """

    def __init__(
        self,
        storage_shape: Sequence[int],
        dtype: torch.dtype,
        heads: tuple[int, int] | None,
        view_shape: Sequence[int],
        pin: bool = False,
    ):
        """``pin``: register each mapping with CUDA (page-locked, mapped into the device's address space), as the
        CPU tier's pool is on a GPU engine, so the copy paths DMA to and from it."""
        self.pin, self.pinned = pin, False
        self.storage_shape, self.dtype = tuple(storage_shape), dtype
        self.heads, self.view_shape = heads, tuple(view_shape)
        self.slot_bytes = torch.Size(self.storage_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.epoch: str | None = None
        self.geom: PoolGeometry | None = None
        self._map: mmap.mmap | None = None
        self.data: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.geom.num_slots if self.geom is not None else 0

    def attach_now(self, socket_path: str, timeout: float) -> None:
        """At registration: ask the node at ``socket_path`` for its pool, map it and commit its pages now, on every
        core, as the CPU tier's pool is committed at start-up (a node that is down: mapped when a step names it)."""
        conn = Connection(socket_path, timeout)
        try:
            hello = conn.call("hello", version=VERSION, role="control", pid=os.getpid())
        except (NodeUnavailable, NodeError) as e:
            log.info("kvx: the node is not up yet (%s); its pool is mapped once it is", e)
            return
        finally:
            conn.close()
        if hello["pool"] is None:  # --slot-size auto: this engine's scheduler is the first, and makes it
            log.info("kvx: the node has no pool yet; it is mapped when a step names it")
            return
        self.attach((hello["pool"], hello["epoch"]), background=False)

    def attach(self, pool: tuple[str, str] | None, background: bool = True) -> None:
        """Map ``pool`` ((path, epoch), from the step's metadata) unless it is the one mapped, and commit its pages
        (``background``: on a thread, as the engine serves; else now, on every core)."""
        if pool is None or pool[1] == self.epoch:
            return
        path, epoch = pool
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            geom, file_epoch = unpack_header(m)
            if file_epoch.hex() != epoch:
                raise ProtocolError(f"pool file {path}: expected epoch {epoch}, got {file_epoch.hex()}")
            if geom.file_bytes > size:
                raise ProtocolError(f"pool file {path}: expected at least {geom.file_bytes} bytes, got {size}")
        except (OSError, ValueError) as e:
            log.error("kvx: cannot map the node's pool (%s); its chunks are recomputed on this worker until it can", e)
            self.epoch = self.geom = self._map = self.data = None
            return
        data = torch.frombuffer(m, dtype=torch.uint8, offset=geom.data_offset, count=geom.num_slots * geom.slot_bytes)
        if self.pin:
            # portable | mapped, as CPUPool. A replaced pool's registration stays: copies in flight may read it
            err = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 3))
            if err != 0:
                log.error("kvx: cannot page-lock the node's pool (cudaHostRegister error %d); not using it", err)
                self.epoch = self.geom = self._map = self.data = None
                return
            self.pinned = True
        self.data = data  # a chunk's slot: the first of its run (kvx.store.runs), its bytes from there on
        self._map, self.geom, self.epoch = m, geom, epoch
        if not background:
            _populate(data, lambda: True, _POPULATE_ALL)
            return
        self._populating = threading.Thread(
            target=_populate, args=(data, lambda e=epoch: self.epoch == e), name="kvx-node-populate", daemon=True
        )
        self._populating.start()
        log.info("kvx: mapped the node's pool %s (%d slots of %d bytes)", path, geom.num_slots, geom.slot_bytes)

    def slot(self, i: int) -> torch.Tensor:
        """This worker's part of slot ``i`` (:attr:`view_shape`)."""
        start = i * self.geom.slot_bytes if self.data is not None else 0
        if self.data is None or not 0 <= i or start + self.slot_bytes > self.data.numel():
            raise ValueError(f"slot: expected a slot of the mapped node pool ({self.num_slots} slots), got {i}")
        whole = self.data[start : start + self.slot_bytes].view(self.dtype).view(self.storage_shape)
        if self.heads is not None:
            whole = whole.narrow(0, self.heads[0], self.heads[1] - self.heads[0])
        return whole.view(self.view_shape) if whole.is_contiguous() else whole

    def entry(self, slot: int) -> tuple[str, int, int] | None:
        """(key, generation, state) of ``slot`` in the pool's table; None if no pool is mapped or no such slot."""
        if self._map is None or not 0 <= slot < self.geom.num_slots:
            return None
        key, gen, state = slot_entry(self._map, self.geom, slot)
        return key.hex(), gen, state

    def check(self, slot: int, key: str, reading: bool, generation: int | None = None) -> int:
        """The generation of ``slot`` if it holds chunk ``key`` (READY when ``reading``, else PENDING) and, given
        ``generation``, still that one; :class:`kvx.store.ChunkError` otherwise."""
        from ..store import ChunkError

        e = self.entry(slot)
        want = READY if reading else PENDING
        if e is None or e[0] != key or e[2] != want or (generation is not None and e[1] != generation):
            raise ChunkError(
                f"node slot {slot}: expected chunk {key} ({'ready' if reading else 'being written'}"
                f"{'' if generation is None else f', generation {generation}'}), got {e}"
            )
        return e[1]

    def wait_ready(self, slot: int, key: str, deadline: float) -> int:
        """As :meth:`kvx.store.SlotPool.wait_ready`: the table entry read every 0.2 ms, then less often (up to every
        1 ms) while it stays PENDING. The generation returned is the READY one's, which the copy's checks then hold
        (:meth:`check`). An entry that reads as neither (another key, FREE) is read again before it fails the chunk:
        the daemon may be writing it (a read that a pause splits may mix its fields)."""
        from ..store import ChunkError

        pause, odd = 0.0002, 0
        while True:
            e = self.entry(slot)
            if e is not None and e[0] == key and e[2] == READY:
                return e[1]
            if e is None or e[0] != key or e[2] != PENDING:
                odd += 1
                if odd > 1:
                    raise ChunkError(f"node slot {slot}: expected chunk {key} coming (pending, then ready), got {e}")
            else:
                odd = 0
            if time.monotonic() >= deadline:
                raise ChunkError(f"node slot {slot}: chunk {key} still pending at the pull's deadline")
            time.sleep(pause)
            pause = min(2 * pause, 0.001)

    def close(self) -> None:
        self.data = self._map = self.epoch = None  # unmapped when the last tensor of it goes
