"""The worker's save pipeline: chunk bytes from the paged KV cache into the CPU tier and the byte tiers.

:meth:`SavePipeline.submit_group` issues a layer group's gathers (that group's legs of one compiled
:class:`kvx.kernels.plan.Plan` of the step's saves, planned when the first group is: staged across PCIe, a gather
into a staging buffer and a DMA to host memory per leg, :meth:`~.cache.RegisteredKV.queue_saves`, one compiled call
that also takes the marker) as soon as the forward wrote its last layer, so the copies overlap the
rest of the forward (``save_layerwise``; otherwise, and for groups no layer reported, :meth:`SavePipeline.finish_step`
queues them). A save whose KV depends on a block whose load failed on this worker (the load pipeline's verdict,
an argument) is dropped before anything is gathered. :meth:`SavePipeline.finish_step` starts the tier writes on I/O
threads (one per tier and chunk, so a slow tier does not hold up the others), which wait for their gathers. A save
to the byte tiers alone gathers into a pinned write buffer of this pipeline's pool, which grows on demand up to its
cap: the scheduler's write backlog (``max_write_backlog``, :class:`~.ledger.ChunkLedger`) counts each such save
as a whole buffer against every tier it writes until every worker reported it, so at most ``tiers x backlog / slot``
are in flight, the cap; a save finding none (which the bound rules out) is dropped, never waited for: a stalled
tier never blocks the forward. Nothing waits for a gather on the
per-step path (CPU threads excepted: there the copies use the cores the next forward needs, so they finish in
``finish_step``); the worker's ``handle_preemptions`` fences the ones whose blocks the next forward writes. Each
save's transfers (its CPU slot, each tier write) are reported once, by id, when they end (:meth:`SavePipeline.poll`).

Owned by :class:`~.worker.KVXWorker`, which hands it the registered cache (:class:`~.cache.RegisteredKV`, ``cache``)
and each step's metadata; it reports into a :class:`~.cache.WorkerResults`. Worker thread only, except the writer
pool's threads (a tier write touches the tensor handed to it, the write-buffer pool under its condition, the
rank-key map under its lock, and the results' counters).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..kernels.plan import Plan
from ..log import get_logger
from ..store import ChunkError, StoreFullError, Tier
from .cache import RegisteredKV, WorkerResults, plan_done, plan_error, wait_plan
from .loads import failure_cause, wait_quietly
from .metadata import FAILED, HELD, NOOP, OK, ChunkSave, KVXMetadata
from .parts import PartIO
from .validity import LoadOutcomes

log = get_logger(__name__)

_MAX_PART_KEYS = 1 << 18  # parts' keys remembered to name evicted chunks (bounded memory)


@dataclass
class _Save:
    save: ChunkSave
    plan: Plan | None = None  # the gathers it waits for (none: from a CPU slot)
    dest: torch.Tensor | None = None
    writes: dict[str, Future] = field(default_factory=dict)  # tier name -> its write in flight
    buffer: int | None = None  # its write buffer (a save to the byte tiers alone)
    error: BaseException | None = None  # its copies could not be queued
    slot_reported: bool = False
    generation: int | None = None  # a node slot's generation when the save began (checked again when written)
    started: float = field(default_factory=time.perf_counter)

    def copies_done(self) -> bool:
        return self.plan is None or plan_done(self.plan)

    def copy_error(self) -> BaseException | None:
        return self.error or (plan_error(self.plan) if self.plan is not None else None)

    def wait_copies(self) -> None:
        """Block until its gathers ran (re-raise a job's error)."""
        if self.plan is not None:
            wait_plan(self.plan)


class WriteBuffers:
    """Pinned (on CUDA) chunk buffers for saves to the byte tiers alone: ``buffers`` at first, more made on demand
    (``new()``) up to ``cap``. Taken on the worker thread, released by the thread that polls a write's end;
    guarded by a condition."""

    def __init__(self, buffers: list[torch.Tensor], new: Callable[[], torch.Tensor] | None = None, cap: int = 0):
        self.buffers = buffers
        self._new = new
        self.cap = max(cap, len(buffers))
        self._free = list(range(len(buffers)))
        self._cv = threading.Condition()

    def take(self) -> int | None:
        """A free buffer, made if none is free and fewer than ``cap`` exist; None: ``cap`` buffers are taken."""
        with self._cv:
            if self._free:
                return self._free.pop()
            if self._new is None or len(self.buffers) >= self.cap:
                return None
            self.buffers.append(self._new())
            return len(self.buffers) - 1

    def release(self, idx: int) -> None:
        with self._cv:
            self._free.append(idx)
            self._cv.notify_all()


class SavePipeline:
    """The saves in flight on one worker (see the module docstring). ``cache``: the registered KV cache (set by the
    worker); ``results``: where outcomes and counters go; ``tiers``: the byte tiers by name; ``buffers``: the
    write buffers. A chunk is written to a byte tier as this worker's parts of it (:class:`~.parts.PartIO`, the
    cache's; a replica of another rank's heads writes none)."""

    def __init__(
        self,
        results: WorkerResults,
        tiers: dict[str, Tier],
    ):
        self.cache: RegisteredKV | None = None  # the registered KV cache (:meth:`attach`)
        self.results, self.tiers = results, tiers
        self.writer: ThreadPoolExecutor | None = None  # tier writes (:meth:`use_writer`)
        self.buffers = WriteBuffers([])
        self._saves: list[_Save] = []  # handed to the writers, not all reported yet
        self._meta: KVXMetadata | None = None
        self._step: list[_Save] | None = None  # this step's saves, once begun
        # this step's gathers, fixed when the first group is queued: (the plan, its saves, their blocks); plan None
        # when it could not be built
        self._gathers: tuple[Plan | None, list[_Save], list[int]] | None = None
        self._submitted: set[int] = set()  # layer groups whose gathers are queued this step
        # the first part's key -> its chunk's key, of the parts written here (an eviction of it names the chunk)
        self._part_keys: OrderedDict[str, str] = OrderedDict()
        self.part_keys_lock = threading.Lock()

    def idle(self) -> bool:
        return not self._saves and self._step is None

    def chunk_of(self, part_key: str) -> str | None:
        """The chunk key of the first part of a chunk this process wrote (None: not such a part)."""
        with self.part_keys_lock:
            return self._part_keys.pop(part_key, None)

    # ---------------------------------------------------------------- one step
    def attach(self, cache: RegisteredKV | None) -> None:
        """The registered KV cache the copies come from (None: unregistered, during a sleep)."""
        self.cache = cache

    def use_writer(self, writer: ThreadPoolExecutor, buffers: WriteBuffers) -> None:
        """The threads that write the byte tiers and the host buffers they write from (registration, once there
        are tiers): background priority unless a P/D producer's."""
        self.writer, self.buffers = writer, buffers

    def bind(self, meta: KVXMetadata | None) -> None:
        self._meta = meta
        self._step = None
        self._gathers = None
        self._submitted = set()

    def has_saves(self) -> bool:
        return self._meta is not None and bool(self._meta.saves)

    def _begin(self, verdict: Callable[[], LoadOutcomes]) -> list[_Save]:
        """This step's saves, once: the ones computed against a load that failed here (``verdict()``, asked once a
        step, when the first saves begin) are dropped;
        the rest get their destination (CPU slot or write buffer)."""
        if self._step is not None:
            return self._step
        c, r = self.cache, self.results
        self._step = []
        failed = verdict()
        for s in self._meta.saves:
            if s.deps and failed.taints(s.deps):
                # computed against KV that never arrived: vLLM recomputes it, and the scheduler plans the
                # chunk again once it has
                if s.slot_xfer is not None:
                    r.out.report(s.slot_xfer, FAILED)
                for xfer in s.to_tiers.values():
                    r.out.report(xfer, NOOP)
                r.stats["saves_dropped"] += 1
                continue
            rec = _Save(s)
            slot = s.from_slot if s.from_slot is not None else s.slot
            if slot is not None:
                try:  # a node's slot: still this chunk's (a lost connection may have handed it on)
                    rec.generation = c.check_slot(slot, s.key, reading=s.from_slot is not None)
                except ChunkError as e:
                    r.throttle.warning("slot", "kvx: chunk %s not saved: %s", s.key, str(e))
                    for xfer in ([s.slot_xfer] if s.slot_xfer is not None else []) + list(s.to_tiers.values()):
                        r.out.report(xfer, FAILED)
                    r.stats["saves_dropped"] += 1
                    continue
                rec.dest = c.slot_view(slot, s.tokens, s.state)
            else:  # other tiers only: a write buffer if one is free now, else one in finish_step
                self._take_buffer(rec, self.buffers.take())
            self._step.append(rec)
        return self._step

    def _take_buffer(self, rec: _Save, idx: int | None) -> None:
        if idx is not None:
            rec.buffer = idx
            rows = self.cache.rows(rec.save.tokens, rec.save.state)
            rec.dest = self.cache.blocks_view(self.buffers.buffers[idx], 0, rows)

    def submit_group(self, g: int, verdict: Callable[[], LoadOutcomes]) -> None:
        """Issue the gathers of layer group ``g`` of this step's saves, right after the forward wrote it: its legs of
        one compiled plan of every save (built once, at the first group), in one compiled call."""
        if g in self._submitted:
            return
        self._submitted.add(g)
        if self._gathers is None:
            recs = [rec for rec in self._begin(verdict) if rec.save.from_slot is None and rec.dest is not None]
            self._gathers = (self._gather_plan(recs), recs, [blk for r in recs for blk in r.save.block_ids])
        plan, recs, blocks = self._gathers
        if plan is None:
            return
        # the plan's edges to queued loads go with its first group issued, its record against the blocks with its
        # last (the save queue runs the groups in order): per layer, only the layer's own marker
        first = len(self._submitted) == 1
        last = len(self._submitted) == len(self.cache.groups)
        try:
            self.cache.queue_saves(plan, g, blocks, first, last)
        except Exception as e:  # noqa: BLE001 - a copy that cannot be issued: its saves fail, nothing is stored
            for rec in recs:
                rec.error = rec.error or e

    def _gather_plan(self, recs: list[_Save]) -> Plan | None:
        """The gathers of ``recs`` as one compiled plan by layer group; None when it cannot be built (its saves then
        fail: nothing is stored)."""
        if not recs:
            return None
        c = self.cache
        op = "gather_pages" if c.fmt == "pages" else "gather_blocks"
        try:
            copies = c.copies()
            for rec in recs:
                copies.add(op, c.kernel_ids(rec.save.block_ids), rec.dest)
            plan = c.plan(copies, f"save {len(recs)} chunks")
        except Exception as e:  # noqa: BLE001 - reported as the saves' copy error
            for rec in recs:
                rec.error = e
            return None
        for rec in recs:
            rec.plan = plan
        return plan

    def finish_step(self, verdict: Callable[[], LoadOutcomes]) -> None:
        """End of the step's forward: queue the gathers ``submit_group`` did not, start the tier writes."""
        c, r = self.cache, self.results
        t0 = time.perf_counter()
        if len(self._submitted) < len(c.groups):  # the groups save_kv_layer did not queue
            for g in range(len(c.groups)):
                self.submit_group(g, verdict)
        for rec in self._begin(verdict):
            s = rec.save
            if rec.dest is None and s.from_slot is None:
                # every write buffer was taken when the step began: one an earlier write freed since, gathering
                # all layers at once; none (the scheduler's backlog bound rules it out): dropped, never waited for
                self.poll()
                self._take_buffer(rec, self.buffers.take())
                if rec.dest is None:
                    for xfer in s.to_tiers.values():
                        r.out.report(xfer, NOOP)
                    r.stats["saves_dropped_backpressure"] += 1
                    continue
                plan = self._gather_plan([rec])
                try:
                    for g in range(plan.num_ranges if plan is not None else 0):
                        c.queue_saves(plan, g, s.block_ids, g == 0, g == plan.num_ranges - 1)
                except Exception as e:  # noqa: BLE001 - reported as the save's copy error
                    rec.error = e
            for name in s.to_tiers:
                args = (name, s, rec, c.fmt, c.parts)  # the parts: a sleep may drop the cache
                rec.writes[name] = self.writer.submit(self._write_chunk, *args)
            self._saves.append(rec)
            r.stats["saved_chunks"] += 1
        if c.engine.host_copies:
            for plan in {id(rec.plan): rec.plan for rec in self._step if rec.plan is not None}.values():
                wait_quietly(lambda plan=plan: wait_plan(plan))
            r.stats["save_ms"] += (time.perf_counter() - t0) * 1e3
        self._step = None
        self._gathers = None

    def _write_chunk(self, name: str, s: ChunkSave, rec: _Save, fmt: str, parts: PartIO) -> bool:
        """One tier write, on a writer thread, once the chunk's copies ran (it may end after a sleep dropped the
        registered cache: it reads only kvx's own buffer)."""
        rec.wait_copies()
        if rec.error is not None:
            raise rec.error
        t0 = time.perf_counter()
        written, keys = parts.write(self.tiers[name], s.key, rec.dest, {"tokens": str(s.tokens), "format": fmt})
        self.results.stats[f"{name}_write_ms"] += (time.perf_counter() - t0) * 1e3
        if keys:
            with self.part_keys_lock:
                self._part_keys[keys[0]] = s.key
                while len(self._part_keys) > _MAX_PART_KEYS:
                    self._part_keys.popitem(last=False)
        return written

    # ---------------------------------------------------------------- results
    def poll(self, block: bool = False) -> None:
        """Report the saves' transfers that ended (``block``: wait for every one)."""
        r = self.results
        keep = []
        for rec in self._saves:
            self._poll_copies(rec, block)
            self._poll_writes(rec, block)
            if not rec.slot_reported:
                # a write ends after the chunk's gathers ran: a save whose writes all ended in this poll reports its
                # copies in it too, and releases its write buffer in the poll that reports its writes (the
                # scheduler's backlog counts the buffer until then)
                self._poll_copies(rec, False)
            if not rec.slot_reported or rec.writes:
                keep.append(rec)
                continue
            r.hist["save_seconds"].append(time.perf_counter() - rec.started)
            if rec.buffer is not None:
                self.buffers.release(rec.buffer)
        self._saves = keep

    def _poll_copies(self, rec: _Save, block: bool) -> None:
        """Report the CPU slot write of ``rec`` if its gathers ran (``block``: wait for them)."""
        r, s = self.results, rec.save
        if rec.slot_reported:
            return
        if block:
            wait_quietly(rec.wait_copies)
        if rec.copies_done():
            rec.slot_reported = True
            err = rec.copy_error()
            if err is None and rec.generation is not None and s.slot is not None:
                try:
                    self.cache.check_slot(s.slot, s.key, False, rec.generation)
                except ChunkError as e:
                    err = e
            if err is not None:
                r.throttle.error(failure_cause("save", err), "kvx: saving chunk %s failed: %s", s.key, str(err))
                r.stats["save_errors"] += 1
            if s.slot_xfer is not None:
                r.out.report(s.slot_xfer, FAILED if err is not None else OK)
                if err is None and rec.dest is not None:
                    r.stats["cpu_write_bytes"] += rec.dest.nbytes

    def _poll_writes(self, rec: _Save, block: bool) -> None:
        """Report the tier writes of ``rec`` that ended (``block``: wait for them)."""
        r, s = self.results, rec.save
        for name, fut in list(rec.writes.items()):
            if block:
                wait_quietly(fut.result)
            if not fut.done():
                continue
            err = fut.exception()
            if isinstance(err, StoreFullError):  # expected under pressure: the chunk stays uncached
                r.throttle.warning(
                    failure_cause(f"{name} full", err), "kvx: chunk %s not written to %s: %s", s.key, name, str(err)
                )
                r.stats[f"{name}_full"] += 1
            elif err is not None:
                r.throttle.error(
                    failure_cause(f"{name} write", err),
                    "kvx: writing chunk %s to %s failed: %s",
                    s.key,
                    name,
                    str(err),
                )
                r.stats[f"{name}_write_errors"] += 1
            elif fut.result():
                r.stats[f"{name}_writes"] += 1
                r.stats[f"{name}_write_bytes"] += rec.dest.nbytes
            # every part of this worker's in the tier: written now (OK) or there already (HELD)
            r.out.report(s.to_tiers[name], FAILED if err is not None else OK if fut.result() else HELD)
            del rec.writes[name]

    def close(self) -> None:
        """Every save reported (the caller flushed the copy queue first), the writers stopped."""
        self.poll(block=True)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
