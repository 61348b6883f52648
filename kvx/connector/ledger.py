"""Every chunk transfer in flight, from the scheduler's plan to the workers' results: the one owner of the save
and load paths' bookkeeping on the scheduler side. Scheduler thread only (no locking).

A transfer is one :class:`InFlight` record, keyed by an id that rides in the step's metadata
(:class:`~.metadata.ChunkSave`, :class:`~.metadata.ChunkLoad`, :class:`~.metadata.LoadSpec`) and comes back in
each worker's results (:attr:`~.metadata.KVXWorkerMetadata.results`: one outcome per worker and transfer). It
ends when every worker reported it (:meth:`ChunkLedger.settle`). Three kinds:

- ``slot``: a CPU slot being written: a save gathering a chunk into it, or a promotion reading a slower tier's
  copy into it. Committed (a hit from then on) when every worker wrote it and no failed load poisoned it
  (:meth:`ChunkLedger.poison`); else aborted, and the requests that counted the chunk as saved because this write
  was in flight are handed back to the scheduler to plan it again. Once committed, a chunk planned with
  ``through`` tiers is written through to them (:meth:`ChunkLedger.plan_write_through`).
- ``tier``: a chunk written to a byte tier, from the paged cache (gathered), or from its CPU slot, which the
  transfer holds until every worker reported. At most one per (tier, chunk) at a time. Once every worker
  reported its parts stored (:data:`~.metadata.OK` or :data:`~.metadata.HELD`), the chunk's record is written
  (``commit``: :mod:`.parts`); the transfer ends when it is, and only then is the chunk stored (a hit, an event).
- ``load``: a request's load; the CPU slots it reads stay pinned until every worker finished it.

A bounded write backlog (``max_write_backlog``): each tier write counts the bytes it queues on a worker (the
object's bytes; a whole CPU slot's when it is gathered into a worker's write buffer, which it occupies) until it
ends; a tier write that would take a tier's bytes in flight past the bound is not planned (the chunk is not
written to that tier; counted in :attr:`ChunkLedger.dropped`). A stalled tier therefore holds at most the bound,
and a worker never has more buffered saves in flight than its write-buffer pool can hold (see
:class:`~.saves.SavePipeline`).

The request-level decisions are the scheduler's parts, which open transfers here: the save planner
(:class:`~.save_plan.SavePlanner`: which chunks a step saves, to which tiers, advancing the tracker's
:class:`~.tracker.SaveCursor`) calls :meth:`ChunkLedger.plan_save`; the load planner
(:class:`~.load_plan.LoadPlanner`) calls :meth:`ChunkLedger.plan_load`; the hit filters and P/D waits are
:mod:`.lookup`'s. :class:`~.scheduler.KVXScheduler` owns the ledger and drives the rest: it settles the workers'
results, poisons the chunks of failed loads (:mod:`.validity` tells which), rewinds the save cursors of what was
aborted, and plans the write-throughs each step. The slot tier's index (:class:`kvx.store.SlotIndex`) is the
slots' allocator, and :class:`kvx.store.stack.TierStack` answers queries only. Life of one saved chunk::

    SavePlanner ──> plan_save ──> ChunkSave(slot_xfer, to_tiers={tier: xfer}) ──> workers
        ──> results {xfer: [outcome per worker]} ──> KVXScheduler: settle: slot committed (or aborted: the
        request's cursor rewound), tier write ended (record committed: end_commits; events, CPU hold released)
        ──> plan_write_through (committed chunks planned with ``through`` tiers) ──> ...
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..log import get_logger
from ..store import SlotIndex, SlotState
from ..store.stack import TierStack
from .events import KVEvents
from .metadata import FAILED, HELD, OK, ChunkSave

log = get_logger(__name__)


class Kind(enum.Enum):
    SLOT = "slot"  # a CPU slot written (save or promotion)
    TIER = "tier"  # a chunk written to a byte tier
    LOAD = "load"  # a request's load


@dataclass(frozen=True)
class LoadChunk:
    """One chunk of a request's load, as the scheduler plans it (:meth:`ChunkLedger.plan_load`)."""

    key: str
    tier: str  # where it is read from ("cpu": the first level, the CPU tier or the node)
    tokens: int
    promote: bool = False  # from another tier: also read into a first-level slot, if one is free
    state: bool = False  # a hybrid model's state object


@dataclass(frozen=True)
class WriteThrough:
    """A chunk to write to ``tiers`` from its first-level slot once that slot is committed."""

    tokens: int
    tiers: list[str]
    state: bool = False


@dataclass
class InFlight:
    """One transfer in flight (a load, a slot write or a tier write). Owned by :class:`ChunkLedger` (scheduler
    thread)."""

    id: int
    kind: Kind
    key: str  # the chunk's key; LOAD: the request id
    tier: str = "cpu"  # TIER: the tier written
    nbytes: int = 0  # TIER: the bytes it queues on a worker (counted against the tier's backlog until it ends)
    holds: bool = False  # TIER: reads the chunk's CPU slot, held until the write ends
    pins: list[str] = field(default_factory=list)  # LOAD: CPU chunks pinned for it
    through: WriteThrough | None = None  # SLOT: the writes to make from the slot once committed
    # SLOT: requests that counted the chunk as saved because this write was in flight: {request: its chunk index
    # (None: its trailing partial chunk)}; planned again if the write is aborted
    awaiting: dict[str, int | None] = field(default_factory=dict)
    poisoned: bool = False  # SLOT: written with KV of a failed load: aborted, never committed
    outcomes: list[str] = field(default_factory=list)  # one per worker that reported


@dataclass
class Settled:
    """What the transfers that ended in one :meth:`ChunkLedger.settle` mean for the requests."""

    loads_done: list[str] = field(default_factory=list)  # requests whose load every worker finished
    # (request, its chunk to plan again; None: its partial chunk), per aborted write it counted on
    rewind: list[tuple[str, int | None]] = field(default_factory=list)
    aborted: int = 0  # CPU slot writes aborted


def _first_chunk(a: int | None, b: int | None) -> int | None:
    """The earlier of two chunk indices of a request (None: its partial chunk, after every full one)."""
    return b if a is None else a if b is None else min(a, b)


class ChunkLedger:
    """The transfers in flight (see the module docstring). Scheduler thread only."""

    def __init__(
        self,
        cpu: SlotIndex | None,
        stack: TierStack,
        num_workers: int,
        events: KVEvents,
        writes: bool,
        backlog: int | None = None,
        object_bytes: Callable[[int, bool], int] = lambda tokens, state: 0,
        slot_bytes: int = 0,
        commit: Callable[[str, str], Future | None] | None = None,
    ):
        self.cpu = cpu
        self.writes = writes  # a producer: promoted chunks are written through to the faster tiers
        self.stack = stack
        self.num_workers = num_workers
        self.events = events
        self._next_id = 0
        self._open: dict[int, InFlight] = {}
        self._slot_writes: dict[str, int] = {}  # chunk key -> its SLOT transfer
        self._tier_writes: dict[tuple[str, str], int] = {}  # (tier, chunk key) -> its TIER transfer
        self._through: list[tuple[str, WriteThrough]] = []  # committed slots' writes: (chunk key, its writes)
        self.backlog = backlog  # bytes per tier that its writes in flight may queue (None: no bound)
        self.object_bytes = object_bytes  # (tokens, state) -> a stored object's bytes on one worker
        self.slot_bytes = slot_bytes  # a write buffer's bytes (a CPU slot's): what a buffered save occupies
        self._pending: Counter[str] = Counter()  # tier -> bytes its writes in flight queue (per worker)
        self.dropped: Counter[str] = Counter()  # tier -> writes not planned: its backlog was full
        # saves planned to the byte tiers alone because every CPU slot was being written or read: one per planned save
        # (a chunk with nowhere to go is no save and is not counted)
        self.slots_busy = 0
        # writes a chunk's record once every worker stored its parts (None from it, or no commit: nothing to write)
        self.commit = commit
        self._commits: list[tuple[InFlight, Future]] = []
        self.commit_errors = 0

    # ---------------------------------------------------------------- queries
    def idle(self) -> bool:
        """Nothing in flight (records included) and nothing waiting to be written through."""
        return not self._open and not self._through and not self._commits

    def writes_in_flight(self) -> int:
        """CPU slot writes and tier writes in flight (the ``pending_writes`` gauge)."""
        return len(self._slot_writes) + len(self._tier_writes)

    def pending_bytes(self, tier: str) -> int:
        """Bytes the writes to ``tier`` in flight queue on a worker (at most ``backlog``)."""
        return self._pending[tier]

    def open_transfers(self) -> list[InFlight]:
        return list(self._open.values())

    def lacking(self, key: str, among: Sequence[str] | None = None) -> list[str]:
        """The tiers (of ``among``; default all) to write chunk ``key`` to: not known to hold it
        (:meth:`TierStack.lacking`) and not being written already."""
        idle = [n for n in (self.stack.names() if among is None else among) if (n, key) not in self._tier_writes]
        return self.stack.lacking(key, idle) if idle else []  # a local tier is asked only if not being written

    # ---------------------------------------------------------------- plans
    def _open_transfer(self, kind: Kind, key: str, **kw) -> InFlight:
        tr = InFlight(self._next_id, kind, key, **kw)
        self._next_id += 1
        self._open[tr.id] = tr
        if kind is Kind.SLOT:
            self._slot_writes[key] = tr.id
        elif kind is Kind.TIER:
            self._tier_writes[(tr.tier, key)] = tr.id
        return tr

    def _write_tiers(
        self, key: str, tiers: Sequence[str], holds: bool, nbytes: int
    ) -> tuple[dict[str, int], int | None]:
        """Open a tier write of ``key`` (``nbytes`` queued on a worker) to each of ``tiers`` whose backlog has room
        for it (the others are counted in :attr:`dropped`); with ``holds``, each holds the chunk's CPU slot
        (returned) until it ends."""
        out, slot = {}, None
        for name in tiers:
            if self.backlog is not None and self._pending[name] + nbytes > self.backlog:
                self.dropped[name] += 1  # the tier is not keeping up: the chunk is not written there
                continue
            if holds:
                held = self.cpu.hold(key)
                if held is None:  # a node that lost the chunk, or is down: nothing to read it from
                    break
                slot = held
            self._pending[name] += nbytes
            out[name] = self._open_transfer(Kind.TIER, key, tier=name, holds=holds, nbytes=nbytes).id
        return out, slot

    def plan_save(
        self,
        req_id: str,
        chunk: int | None,
        key: str,
        block_ids: list[int],
        tokens: int,
        deps: Sequence[int],
        skip_tier: str | None,
        gather_first: bool,
        state: bool = False,
    ) -> ChunkSave | None:
        """Plan saving ``block_ids`` as chunk ``key`` (request ``req_id``'s ``chunk``-th; None: its partial chunk):
        into a free CPU slot if the CPU tier lacks it, and to every byte tier lacking it but ``skip_tier`` (the
        one the request loaded it from). ``gather_first``: gather into the CPU tier only, and write the chunk
        through to those tiers once committed (a save depending on loads, with several workers: only the
        scheduler hears every worker's failures). ``state``: ``key`` names a state object. None: nothing to do."""
        in_cpu = self.cpu.state(key) if self.cpu is not None else None
        slot = self.cpu.allocate(key) if self.cpu is not None and in_cpu is None else None
        if in_cpu is SlotState.PENDING and key in self._slot_writes:
            # another save is writing the chunk into the CPU tier (or this request's own earlier one, which a
            # failed load poisoned): counted as saved only if that write commits
            awaiting = self._open[self._slot_writes[key]].awaiting
            awaiting[req_id] = _first_chunk(awaiting.get(req_id, chunk), chunk)
        slot_tr = self._open_transfer(Kind.SLOT, key) if slot is not None else None
        shared = self.cpu is not None and self.cpu.shared  # a node: other engines store into it too
        # a chunk the node holds (or is being written by an engine) is written to the byte tiers by its writer, once
        # it commits: once per host
        to_tiers = [n for n in self.lacking(key) if n != skip_tier] if not (shared and in_cpu is not None) else []
        if to_tiers and (gather_first or (shared and slot is not None)):
            if slot_tr is not None:
                slot_tr.through = WriteThrough(tokens, to_tiers, state)
            to_tiers = []
        # the tier writes read the CPU slot: the READY copy (no gather needed), or the one being gathered into
        holds = bool(to_tiers) and (in_cpu is SlotState.READY or slot is not None)
        # no CPU copy to read: a worker gathers the chunk into a write buffer, which the writes occupy whole
        nbytes = self.object_bytes(tokens, state) if holds else self.slot_bytes
        writes, held = self._write_tiers(key, to_tiers, holds, nbytes)
        if slot is None and not writes:
            return None
        if slot is None and self.cpu is not None and in_cpu is None:
            self.slots_busy += 1  # a save planned without the CPU tier: it found every slot being written or read
        return ChunkSave(
            req_id,
            key,
            list(block_ids),
            tokens,
            slot,
            writes,
            held if in_cpu is SlotState.READY else None,
            deps=sorted(deps),
            slot_xfer=slot_tr.id if slot_tr is not None else None,
            state=state,
        )

    def plan_load(self, req_id: str, chunks: Sequence[LoadChunk]) -> tuple[int, list[tuple[int | None, int | None]]]:
        """Plan request ``req_id``'s load of ``chunks``: pin the CPU hits, and for a hit from another tier with
        ``promote``, allocate a CPU slot to read it into (written through, once committed, to the tiers faster than
        its own that lack it, by a producer). Returns the load's transfer id and, per chunk, (slot, the slot write's
        transfer id)."""
        pins = [c.key for c in chunks if c.tier == "cpu"]
        pinned = dict(zip(pins, self.cpu.pin(pins))) if pins else {}  # before allocating: that may evict
        out = []
        for c in chunks:
            if c.tier == "cpu":
                out.append((pinned[c.key], None))
                continue
            slot = self.cpu.allocate(c.key) if c.promote else None
            if slot is None:
                out.append((None, None))
                continue
            tr = self._open_transfer(Kind.SLOT, c.key)
            faster = self.lacking(c.key, self.stack.faster(c.tier)) if self.writes else []
            if faster:
                tr.through = WriteThrough(c.tokens, faster, c.state)
            out.append((slot, tr.id))
        return self._open_transfer(Kind.LOAD, req_id, pins=pins).id, out

    def plan_write_through(self) -> list[ChunkSave]:
        """The writes of chunks committed since the last call to the tiers they were planned ``through``."""
        todo, self._through = self._through, []
        saves = []
        for key, w in todo:
            tiers = self.lacking(key, w.tiers)
            if self.cpu.state(key) is not SlotState.READY or not tiers:
                continue
            writes, held = self._write_tiers(key, tiers, True, self.object_bytes(w.tokens, w.state))
            if not writes:
                continue
            saves.append(ChunkSave("", key, [], w.tokens, None, writes, held, state=w.state))
        return saves

    def poison(self, keys: Sequence[str]) -> None:
        """The CPU slots being written with these chunks hold KV computed against a failed load: abort them."""
        for key in keys:
            xid = self._slot_writes.get(key)
            if xid is not None:
                self._open[xid].poisoned = True

    # ---------------------------------------------------------------- results
    def settle(self, results: Mapping[int, Sequence[str]]) -> Settled:
        """Record the workers' outcomes; end the transfers every worker has reported."""
        out = Settled()
        self.end_commits()
        for xid, outcomes in results.items():
            tr = self._open.get(xid)
            if tr is None:
                log.warning("kvx: a worker reported transfer %s, which is not in flight; ignored", xid)
                continue
            tr.outcomes += outcomes
            if len(tr.outcomes) < self.num_workers:
                continue
            del self._open[xid]
            if tr.kind is Kind.SLOT:
                self._end_slot(tr, out)
            elif tr.kind is Kind.TIER:
                self._pending[tr.tier] -= tr.nbytes  # the workers' buffers are free
                if tr.holds:
                    self.cpu.unpin([tr.key])
                fut = (
                    self.commit(tr.tier, tr.key) if self.commit and all(o in (OK, HELD) for o in tr.outcomes) else None
                )
                if fut is not None:
                    self._commits.append((tr, fut))  # every part stored: the record is being written
                else:  # no record to write here (one worker wrote it with its parts), or not every part stored
                    self._end_tier(tr, OK in tr.outcomes and FAILED not in tr.outcomes)
            else:
                if tr.pins:
                    self.cpu.unpin(tr.pins)
                out.loads_done.append(tr.key)
        return out

    def _end_tier(self, tr: InFlight, stored: bool) -> None:
        del self._tier_writes[(tr.tier, tr.key)]
        if stored:
            self.events.stored(tr.tier, tr.key)  # new bytes, every part in

    def end_commits(self) -> None:
        """End the tier writes whose records were written (or failed to be: the chunk stays a miss). Every step."""
        keep = []
        for tr, fut in self._commits:
            if not fut.done():
                keep.append((tr, fut))
                continue
            err = fut.exception()
            if err is not None:
                self.commit_errors += 1
                log.warning(
                    "kvx: the record of chunk %s was not written to %s (%s); it stays a miss", tr.key, tr.tier, err
                )
            # stored: the tier announces the record it wrote (its STORED event), once, when new
            self._end_tier(tr, False)
        self._commits = keep

    def _end_slot(self, tr: InFlight, out: Settled) -> None:
        del self._slot_writes[tr.key]
        if self.cpu.state(tr.key) is not SlotState.PENDING:  # cleared meanwhile (reset_cache)
            return
        if all(o == OK for o in tr.outcomes) and not tr.poisoned:
            self.cpu.commit(tr.key)
            if tr.through is not None:
                self._through.append((tr.key, tr.through))
            return
        self.cpu.abort(tr.key)
        out.aborted += 1
        out.rewind += tr.awaiting.items()
