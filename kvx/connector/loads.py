"""The worker's load pipeline: chunk bytes from the tiers into the paged KV cache.

The copies of chunks in the CPU tier are queued at once: one compiled :class:`kvx.kernels.plan.Plan` of every chunk
at hand (checked and planned once, not once per layer), cut into legs by *layer group* and issued in compiled code
(staged: a DMA job and a reshape job per leg, :meth:`~.cache.RegisteredKV.queue_loads`); chunks in the other
tiers (disk, Redis, ...: :class:`kvx.store.Tier`) are read and verified on I/O threads straight into a CPU slot
when the scheduler allotted one (promotion), and their copies are queued as soon as the read is in, at the latest
in :meth:`LoadPipeline.wait_for_layer` of the first layer, the only place that waits for a read. That fences the
layer's group (CUDA and the deferred CPU queue: one group per layer, so loading overlaps the forward; CPU threads:
one group, the copy already uses every core). A chunk that cannot be read or verified is not written; its blocks
are reported to vLLM (:meth:`LoadPipeline.take_errors`, or per request with several KV cache groups) and to the
scheduler with the step's results (:mod:`.validity`), and recorded in :attr:`LoadPipeline.outcomes`, the verdict
the save pipeline takes as an argument.

Owned by :class:`~.worker.KVXWorker`, which hands it the registered cache (:class:`~.cache.RegisteredKV`, ``cache``)
and the step's loads; it reports into a :class:`~.cache.WorkerResults`. Worker thread only, except the reads on the
reader pool (they touch only the tensors handed to them, a load's ``failed`` / ``keep`` under its lock, and the
results' counters).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch

from ..kernels.plan import Copies, Plan
from ..log import get_logger
from ..store import ChunkError, Tier
from .cache import RegisteredKV, WorkerResults, plan_done, plan_error, wait_plan
from .metadata import FAILED, OK, ChunkLoad, LoadSpec
from .validity import LoadOutcomes

log = get_logger(__name__)


def failure_cause(what: str, e: BaseException) -> str:
    """What a failure is, without the chunk key or path: the unit :class:`kvx.log.Throttle` counts."""
    text = re.sub(r"[0-9a-f]{16,}|/\S*|\(.*?\)", "", str(e))
    return f"{what}: {type(e).__name__}: {' '.join(text.split())[:80]}"


def wait_quietly(wait: Callable[[], object]) -> None:
    """Block until a job/future is finished; its error, if any, is read and reported later."""
    try:
        wait()
    except Exception:  # noqa: BLE001
        pass


@dataclass
class _Load:
    """One request's load in flight. Worker thread only, except ``failed`` / ``keep`` (I/O threads)."""

    spec: LoadSpec
    plans: list[Plan] = field(default_factory=list)  # its issued copies (each fenced layer group by layer group)
    pending: list[tuple[ChunkLoad, Future]] = field(default_factory=list)  # reads not done at submission
    failed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned sources the copies may still read
    early: list[Plan] = field(default_factory=list)  # raw pages that must land before the forward (see ChunkLoad)
    started: float = 0.0
    reported: bool = False  # failures reported to vLLM and the scheduler
    checks: list[tuple[ChunkLoad, int]] = field(default_factory=list)  # node slots read: (chunk, generation)

    def all_plans(self) -> list[Plan]:
        return self.early + self.plans


class LoadPipeline:
    """The loads in flight on one worker, from ``start_load_kv`` until every copy ran (see the module docstring).

    ``cache``: the registered KV cache (set by the worker; None while none is); ``results``: where outcomes and
    counters go; ``tiers``: the byte tiers by name; ``groups``: the engine's KV cache groups. A chunk is read from a
    byte tier as this worker's parts of it (:class:`~.parts.PartIO`, the cache's)."""

    def __init__(
        self,
        results: WorkerResults,
        tiers: dict[str, Tier],
        fence_at_start: bool,
        groups: int = 1,
    ):
        self.cache: RegisteredKV | None = None  # the registered KV cache (:meth:`attach`)
        self.several_groups = groups > 1  # KV cache groups: a failed load is reported per request
        self.results, self.tiers = results, tiers
        self.reader: ThreadPoolExecutor | None = None  # tier reads (:meth:`use_reader`)
        self.fence_at_start = fence_at_start  # fence every load in start (no per-layer fences)
        self.outcomes = LoadOutcomes()  # the verdict handed to the save pipeline
        self._sync: list[_Load] = []
        self._async: dict[str, _Load] = {}
        self._retiring: list[_Load] = []  # reported to vLLM, copies maybe still running
        self._errors: set[int] = set()  # blocks that failed to load, for vLLM
        self._fenced: set[int] = set()  # layer groups wait_for_layer fenced this step
        self._failed_reqs: set[str] = set()  # several groups: async loads that failed, for failed_recving
        self.coming_wait_s = 1.5  # how long a chunk still coming into a node's slot (a pull) may take (the worker's)
        self._waiter: ThreadPoolExecutor | None = None  # waits for coming chunks, in order (one thread)

    def attach(self, cache: RegisteredKV | None) -> None:
        """The registered KV cache the copies go to (None: unregistered, during a sleep)."""
        self.cache = cache

    def use_reader(self, reader: ThreadPoolExecutor) -> None:
        """The threads that read the byte tiers (registration, once there are tiers): on the critical path,
        normal priority."""
        self.reader = reader

    def idle(self) -> bool:
        return not (self._sync or self._async or self._retiring)

    @property
    def loading(self) -> bool:
        """This step has sync loads for its layers to fence (``wait_for_layer_load`` returns at once otherwise)."""
        return bool(self._sync)

    def has_async(self) -> bool:
        """Async loads not yet reported finished."""
        return bool(self._async)

    # ---------------------------------------------------------------- start
    def start(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            load = self._start_load(spec)
            if spec.is_async:
                self._async[spec.req_id] = load
                continue
            self._sync.append(load)
            for plan in load.early:
                self._fence_plan(load, plan)
            if self.fence_at_start:
                self._resolve(load)
                for plan in load.plans:
                    self._fence_plan(load, plan)

    def _start_load(self, spec: LoadSpec) -> _Load:
        """Queue the copies of every chunk whose bytes are at hand (CPU tier); start the other tiers' reads,
        whose copies are queued when the reads are done (at the latest where the first layer needs them)."""
        c, stats = self.cache, self.results.stats
        load = _Load(spec, started=time.perf_counter())
        ready: list[tuple[ChunkLoad, torch.Tensor]] = []
        for ch in spec.chunks:
            self.outcomes.started(ch.block_ids)
            if ch.tier == "cpu":
                try:  # a node's slot: this chunk's, READY (checked again once copied)
                    generation = c.check_slot(ch.slot, ch.key, reading=True)
                except ChunkError as e:
                    if ch.coming and ch.slot is not None and ch.slot >= 0:  # a pull is filling it: wait for it
                        load.pending.append((ch, self._await(ch, load)))
                    else:
                        self._fail_chunk(load, ch, e)
                    continue
                if generation is not None:
                    load.checks.append((ch, generation))
                ready.append((ch, c.slot_view(ch.slot, ch.tokens, ch.state)))
                stats["cpu_read_bytes"] += ready[-1][1].nbytes
            else:
                load.pending.append((ch, self.reader.submit(self._read_chunk, ch, load)))
        early = [ch for ch, _ in ready + load.pending if ch.before_forward and c.fmt == "pages"]
        if early:
            # Raw pages cannot be written token by token: the block this step's first token goes to is loaded
            # whole, before the forward writes that token into it (the one I/O wait in start_load_kv, on the
            # CPU backend's opaque pages only).
            self._resolve(load, only={c.key for c in early})
            ready += self._take_ready(load)
            srcs = [(ch, src) for ch, src in ready if ch.before_forward]
            ready = [(ch, src) for ch, src in ready if not ch.before_forward]
            plan = self._submit(load, srcs, "before forward")
            load.early = [plan] if plan is not None else []
        self._queue_chunks(load, ready + self._take_ready(load))
        stats["loaded_chunks"] += len(spec.chunks)
        stats["loaded_blocks"] += sum(len(c.block_ids) for c in spec.chunks)
        return load

    def _await(self, ch: ChunkLoad, load: _Load) -> Future:
        """The future of chunk ``ch``'s slot turning READY (a pull from a peer is filling it), then its view: the
        copies are queued as each chunk comes (:meth:`poll_async`), while the rest still cross. On the waiter
        thread, in the order asked (a pull's chunks turn READY in order)."""
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="kvx-await")
        deadline = time.monotonic() + self.coming_wait_s
        self.results.stats["coming_chunks"] += 1

        def wait() -> torch.Tensor:
            c = self.cache
            generation = c.pool.wait_ready(ch.slot, ch.key, deadline)
            with load.lock:
                load.checks.append((ch, generation))  # checked again once copied, as any node slot
            view = c.slot_view(ch.slot, ch.tokens, ch.state)
            self.results.stats["cpu_read_bytes"] += view.nbytes
            return view

        return self._waiter.submit(wait)

    def _take_ready(self, load: _Load) -> list[tuple[ChunkLoad, torch.Tensor]]:
        """Pop the chunks whose reads are done (failed ones are recorded, not returned)."""
        out, still = [], []
        for ch, fut in load.pending:
            if not fut.done():
                still.append((ch, fut))
                continue
            try:
                out.append((ch, fut.result()))
            except Exception as e:  # noqa: BLE001 - any read failure means "recompute"
                self._fail_chunk(load, ch, e)
        load.pending = still
        return out

    def _resolve(self, load: _Load, only: set[str] | None = None) -> None:
        """Wait for the reads of ``load`` (all, or the chunks in ``only``) and queue their copies."""
        for ch, fut in load.pending:
            if only is None or ch.key in only:
                wait_quietly(fut.result)
        if only is None:
            self._queue_chunks(load, self._take_ready(load))

    def _queue_chunks(self, load: _Load, chunks: list[tuple[ChunkLoad, torch.Tensor]]) -> None:
        """Queue the copies of ``chunks``: one plan of them all, its legs by layer group (group order: the forward
        reads group 0 first)."""
        plan = self._submit(load, chunks)
        if plan is not None:
            load.plans.append(plan)

    def _submit(self, load: _Load, chunks: list[tuple[ChunkLoad, torch.Tensor]], what: str = "") -> Plan | None:
        """One compiled plan of ``chunks`` (checked and planned once), issued whole (:meth:`~.cache.RegisteredKV.
        queue_loads`). A plan that cannot be built (a check failing) or issued fails its chunks: recomputed. One that
        failed while being issued is returned still: the legs it issued are fenced like any (they write blocks)."""
        if not chunks:
            return None
        try:
            plan = self.cache.plan(self.scatter_copies(chunks), f"load {load.spec.req_id}{' ' + what if what else ''}")
        except Exception as e:  # noqa: BLE001 - any failure to copy means "recompute"
            for ch, _ in chunks:
                self._fail_chunk(load, ch, e)
            return None
        try:
            self.cache.queue_loads(plan, [b for ch, _ in chunks for b in ch.block_ids])
        except Exception as e:  # noqa: BLE001
            for ch, _ in chunks:
                self._fail_chunk(load, ch, e)
        return plan

    def scatter_copies(self, chunks) -> Copies:
        """The scatters that write ``chunks`` (every layer) into their blocks."""
        copies = self.cache.copies()
        for ch, src in chunks:
            self._add_scatters(copies, ch, src)
        return copies

    def _add_scatters(self, batch: Copies, ch: ChunkLoad, src: torch.Tensor) -> None:
        c = self.cache
        if ch.positions is not None:  # several groups / null blocks skipped: contiguous runs
            if ch.before_forward and c.fmt == "pages":  # the scheduler never plans this
                raise RuntimeError(f"load {ch.key}: raw pages before the forward must come in one run")
            i = 0
            while i < len(ch.block_ids):
                j = i + 1
                while j < len(ch.block_ids) and ch.positions[j] == ch.positions[i] + j - i:
                    j += 1
                run = ChunkLoad(
                    ch.key,
                    ch.tier,
                    ch.slot,
                    ch.block_ids[i:j],
                    ch.positions[i],
                    ch.tokens,
                    before_forward=ch.before_forward and j == len(ch.block_ids),
                    shared_tokens=ch.shared_tokens,
                )
                self._add_scatters(batch, run, src)
                i = j
            return
        view = c.blocks_view(src, ch.first_block, len(ch.block_ids))
        op = "scatter_pages" if c.fmt == "pages" else "scatter_blocks"
        bs = c.geom.block_size
        if ch.before_forward and c.fmt != "pages":
            # the last block is shared with this step's first computed token: copy only the tokens the
            # chunk provides, so the order against the forward's write of that token does not matter
            n = ch.shared_tokens
            full = ch.block_ids[:-1]
            if full:
                batch.add(op, c.kernel_ids(full), view.narrow(2, 0, len(full) * bs))
            slots = [ch.block_ids[-1] * bs + t for t in range(n)]
            batch.add("scatter_slots", slots, view.narrow(2, len(full) * bs, n))
        else:
            batch.add(op, c.kernel_ids(ch.block_ids), view)

    def _fail_chunk(self, load: _Load, ch: ChunkLoad, e: BaseException) -> None:
        with load.lock:
            if ch.key in load.failed:
                return
            load.failed.add(ch.key)
        # log the text, not the exception: a handler that keeps records (a QueueHandler, pytest's capture)
        # would keep its traceback, and the frames' chunk buffers with it
        self.results.throttle.warning(
            failure_cause("load", e),
            "kvx: request %s: chunk %s not loaded (%s); vLLM recomputes it",
            load.spec.req_id,
            ch.key,
            str(e),
        )

    def _read_chunk(self, ch: ChunkLoad, load: _Load) -> torch.Tensor:
        """Read and verify one chunk from its tier, into its CPU slot if it has one (promotion); return a
        copyable source. On a reader thread."""
        c, results = self.cache, self.results
        shape = c.chunk_shape(ch.tokens, ch.state)
        dst = c.slot_view(ch.slot, ch.tokens, ch.state) if ch.slot is not None else None
        if dst is not None and c.dense(dst):
            out = dst
        else:  # a partial chunk's slot view is strided; DMA reads host memory asynchronously only when pinned
            out = c.host_empty(shape, pin=c.layout.device.type == "cuda")
        t0 = time.perf_counter()
        c.parts.read(self.tiers[ch.tier], ch.key, out)
        results.note_read(ch.tier, out.nbytes, time.perf_counter() - t0)
        results.stats[f"{ch.tier}_reads"] += 1
        results.stats[f"{ch.tier}_read_bytes"] += out.nbytes
        if dst is not None and out is not dst:
            dst.copy_(out)
            out = dst
        elif dst is None and c.layout.device.type == "cuda":
            with load.lock:
                load.keep.append(out)  # alive until the copy jobs finished
        return out

    # ---------------------------------------------------------------- the forward
    def wait_for_layer(self, g: int) -> None:
        """Rule 4: before attention reads layer group ``g``, its loads are fenced. A read still in flight is
        waited for here, where the forward first needs it, and only here."""
        self._fenced.add(g)
        for load in self._sync:
            if load.pending:
                self._resolve(load)
            for plan in load.plans:
                try:
                    self.cache.fence(plan, g)
                except Exception as e:  # noqa: BLE001 - the copy itself failed: recompute every chunk
                    self._fail_all(load, e)

    def _fence_plan(self, load: _Load, plan: Plan, skip: set[int] = frozenset()) -> None:
        """Fence every layer group of ``plan`` but those in ``skip`` (fenced already)."""
        try:
            for g in range(plan.num_ranges):
                if g not in skip:
                    self.cache.fence(plan, g)
        except Exception as e:  # noqa: BLE001 - the copy itself failed: recompute every chunk
            self._fail_all(load, e)

    def _fail_all(self, load: _Load, e: BaseException) -> None:
        with load.lock:
            if len(load.failed) < len(load.spec.chunks):
                self.results.throttle.error(
                    failure_cause("copy", e),
                    "kvx: request %s: load failed (%s); vLLM recomputes it",
                    load.spec.req_id,
                    str(e),
                )
                load.failed.update(ch.key for ch in load.spec.chunks)

    def verdict(self) -> LoadOutcomes:
        """Every read of the step's sync loads in and their failures reported: the blocks whose load failed on
        this worker, for the step's saves (a save computed against one is dropped)."""
        for load in self._sync:
            self._resolve(load)
            self._report_failures(load)
        return self.outcomes

    def finish_sync(self) -> None:
        """The step's sync loads are over once its forward ran: wait for the reads still out, fence the groups
        no layer fenced (a step without those layers) and report the chunks that failed, so that vLLM hears
        of them with this step's results and recomputes them before it samples from them. Idempotent."""
        fenced, self._fenced = self._fenced, set()
        for load in self._sync:
            self._resolve(load)
            for plan in load.plans:
                if len(fenced) < plan.num_ranges:  # a step without some of the layers: fence the rest now
                    self._fence_plan(load, plan, fenced)
            self._report_failures(load)
            self._retiring.append(load)
        self._sync = []

    def _report_failures(self, load: _Load) -> None:
        """Tell vLLM and the scheduler which chunks of ``load`` did not load (once, when its reads are all
        in and its jobs fenced or done): vLLM recomputes their blocks, the scheduler and the saves of this
        worker treat them as unverified (:mod:`.validity`)."""
        if load.reported:
            return
        load.reported = True
        r = self.results
        for plan in load.all_plans():
            err = plan_error(plan)
            if err is not None:
                self._fail_all(load, err)
        for ch, generation in load.checks:  # the slot was not handed on while it was read
            try:
                self.cache.check_slot(ch.slot, ch.key, True, generation)
            except ChunkError as e:
                self._fail_chunk(load, ch, e)
        for ch in load.spec.chunks:
            if ch.key in load.failed:
                if self.several_groups:  # block ids cannot name it to vLLM: the request fails (async)
                    self._failed_reqs.add(load.spec.req_id)
                else:
                    self._errors.update(ch.block_ids)
                self.outcomes.failed(ch.block_ids)
                r.out.failed_blocks.extend(ch.block_ids)
                r.stats["load_errors"] += 1
            if ch.slot_xfer is not None:  # the promotion into a CPU slot
                r.out.report(ch.slot_xfer, FAILED if ch.key in load.failed else OK)

    # ---------------------------------------------------------------- results
    def poll_async(self, wait_s: float = 0.0) -> set[str]:
        """Async loads finished since the last call: their reads in and their copies run (polled). ``wait_s``: an
        idle step's caller first waits up to that long for the first load's reads and copies (a wait releases the
        GIL that the reader and copy threads need)."""
        done = set()
        for rid, load in list(self._async.items()):
            deadline = time.perf_counter() + wait_s if wait_s > 0 else None
            wait_s = 0.0  # one wait per step
            if load.pending:
                self._queue_chunks(load, self._take_ready(load))
                # copies queued as each read comes (a pull's chunks arrive one by one), while the wait lasts
                while load.pending and deadline is not None and (left := deadline - time.perf_counter()) > 0:
                    futures_wait([f for _, f in load.pending], timeout=left, return_when=FIRST_COMPLETED)
                    self._queue_chunks(load, self._take_ready(load))
            if deadline is not None and not load.pending:
                for plan in load.all_plans():
                    left = deadline - time.perf_counter()
                    if left <= 0 or not plan.num_legs:
                        break
                    job = plan.done(plan.num_legs - 1).payload  # a Python engine's: a host wait with a timeout
                    try:
                        if job is not None:
                            job.wait(left)
                    except Exception:  # noqa: BLE001 - a timeout or the copy's own error: judged below, as polled
                        break
            if not load.pending and all(plan_done(p) for p in load.all_plans()):
                self._report_failures(load)
                self._retiring.append(load)
                del self._async[rid]
                done.add(rid)
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def retire(self, block: bool = False) -> None:
        """A load is done for the scheduler (its CPU slots may be unpinned and reused) once every copy job
        has finished; polled, never waited for on the per-step path."""
        r = self.results
        keep = []
        for load in self._retiring:
            if block:
                for plan in load.all_plans():
                    wait_quietly(lambda plan=plan: wait_plan(plan))
            if all(plan_done(p) for p in load.all_plans()):
                load.keep.clear()
                r.out.report(load.spec.xfer, OK)
                r.stats["load_ms"] += (time.perf_counter() - load.started) * 1e3
                r.hist["load_seconds"].append(time.perf_counter() - load.started)
            else:
                keep.append(load)
        self._retiring = keep

    # ---------------------------------------------------------------- sleep and shutdown
    def drain(self) -> None:
        """Before the KV cache goes away (sleep): every read in and its copies queued, then run by the caller's
        flush; the step's sync loads reported (vLLM drains a step before it sleeps)."""
        for load in self._sync + list(self._async.values()):
            self._resolve(load)

    def after_drain(self) -> None:
        for load in self._sync:
            self._report_failures(load)
            self._retiring.append(load)
        self._sync = []
        self.retire()

    def close(self) -> None:
        """Finish every load (its copies run by the caller's flush before :meth:`retire` ``(block=True)``)."""
        for load in list(self._async.values()) + self._sync:
            self._resolve(load)
            self._retiring.append(load)
        self._async, self._sync = {}, []
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
