"""The worker's load pipeline: chunk bytes from the tiers into the paged KV cache.

The copies of chunks in the CPU tier are queued at once, one job per *layer group* running that group's layers
of one :class:`kvx.kernels.ops.CopyBatch` of every chunk at hand (checked once, not once per layer); chunks in the other
tiers (disk, Redis, ...: :class:`kvx.store.Tier`) are read and verified on I/O threads straight into a CPU slot
when the scheduler allotted one (promotion), and their copies are queued as soon as the read is in, at the latest
in :meth:`LoadPipeline.wait_for_layer` of the first layer, the only place that waits for a read. That fences the
layer's group (CUDA and the deferred CPU queue: one group per layer, so loading overlaps the forward; CPU threads:
one group, the copy already uses every core). A chunk that cannot be read or verified is not written; its blocks
are reported to vLLM (:meth:`LoadPipeline.take_errors`, or per request with several KV cache groups) and to the
scheduler with the step's results (:mod:`.validity`), and recorded in :attr:`LoadPipeline.outcomes`, the verdict
the save pipeline takes as an argument.

Owned by :class:`~.worker.KVXWorker`, which hands it the step's loads; worker thread only, except the reads on
the reader pool (they touch only the tensors handed to them and a load's ``failed`` / ``keep`` under its lock).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..engine import Job
from ..kernels import ops
from ..log import get_logger
from .keys import rank_key
from .metadata import FAILED, OK, ChunkLoad, LoadSpec
from .validity import LoadOutcomes

if TYPE_CHECKING:
    from .worker import KVXWorker

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


class Once:
    """A value built by the first :meth:`get` (on a copy queue, where a failure is the job's error); the
    build's error is raised again by every later call."""

    __slots__ = ("_build", "_value", "_error")

    def __init__(self, build):
        self._build, self._value, self._error = build, None, None

    def get(self):
        if self._build is not None:
            build, self._build = self._build, None
            try:
                self._value = build()
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class _Load:
    """One request's load in flight. Worker thread only, except ``failed`` / ``keep`` (I/O threads)."""

    spec: LoadSpec
    jobs: dict[int, list[Job]] = field(default_factory=dict)  # layer group -> its copy jobs
    pending: list[tuple[ChunkLoad, Future]] = field(default_factory=list)  # reads not done at submission
    failed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned sources the kernels may still read
    early: Job | None = None  # raw pages that must land before the forward (see ChunkLoad)
    started: float = 0.0
    reported: bool = False  # failures reported to vLLM and the scheduler

    def all_jobs(self) -> list[Job]:
        return ([self.early] if self.early is not None else []) + [j for js in self.jobs.values() for j in js]


class LoadPipeline:
    """The loads in flight on one worker, from ``start_load_kv`` until every copy ran (see the module docstring).

    ``w`` is the owning worker: the registered KV cache (layout, layer groups, :class:`kvx.engine.BlockOrder`),
    the CPU pool and the tiers are read from it, results go to its ``out`` / ``stats``."""

    def __init__(self, w: KVXWorker, reader: ThreadPoolExecutor | None, fence_at_start: bool):
        self.w = w
        self.reader = reader  # tier reads: on the critical path, normal priority
        self.fence_at_start = fence_at_start  # fence every load in start (no per-layer fences)
        self.outcomes = LoadOutcomes()  # the verdict handed to the save pipeline
        self._sync: list[_Load] = []
        self._async: dict[str, _Load] = {}
        self._retiring: list[_Load] = []  # reported to vLLM, copies maybe still running
        self._errors: set[int] = set()  # blocks that failed to load, for vLLM
        self._failed_reqs: set[str] = set()  # several groups: async loads that failed, for failed_recving

    def idle(self) -> bool:
        return not (self._sync or self._async or self._retiring)

    # ---------------------------------------------------------------- start
    def start(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            load = self._start_load(spec)
            if spec.is_async:
                self._async[spec.req_id] = load
                continue
            self._sync.append(load)
            if load.early is not None:
                self._fence_job(load, load.early)
            if self.fence_at_start:
                self._resolve(load)
                for jobs in load.jobs.values():
                    for job in jobs:
                        self._fence_job(load, job)

    def _start_load(self, spec: LoadSpec) -> _Load:
        """Queue the copies of every chunk whose bytes are at hand (CPU tier); start the other tiers' reads,
        whose copies are queued when the reads are done (at the latest where the first layer needs them)."""
        w = self.w
        load = _Load(spec, started=time.perf_counter())
        ready: list[tuple[ChunkLoad, torch.Tensor]] = []
        for ch in spec.chunks:
            self.outcomes.started(ch.block_ids)
            if ch.tier == "cpu":
                ready.append((ch, w.slot_view(ch.slot, ch.tokens, ch.state)))
                w.stats["cpu_read_bytes"] += ready[-1][1].nbytes
            else:
                load.pending.append((ch, self.reader.submit(self._read_chunk, ch, load)))
        early = [ch for ch, _ in ready + load.pending if ch.before_forward and w.fmt == "pages"]
        if early:
            # Raw pages cannot be written token by token: the block this step's first token goes to is loaded
            # whole, before the forward writes that token into it (the one I/O wait in start_load_kv, on the
            # CPU backend's opaque pages only).
            self._resolve(load, only={c.key for c in early})
            ready += self._take_ready(load)
            srcs = [(ch, src) for ch, src in ready if ch.before_forward]
            ready = [(ch, src) for ch, src in ready if not ch.before_forward]
            if srcs:
                batch = Once(lambda srcs=srcs: self.scatter_batch(srcs))
                load.early = w.order.load(
                    [b for ch, _ in srcs for b in ch.block_ids],
                    lambda: batch.get().run(),
                    name=f"load {spec.req_id} before forward",
                )
        self._queue_chunks(load, ready + self._take_ready(load))
        w.stats["loaded_chunks"] += len(spec.chunks)
        w.stats["loaded_blocks"] += sum(len(c.block_ids) for c in spec.chunks)
        return load

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
        """One copy job per layer group for ``chunks`` (group order: the forward reads group 0 first), each
        running that group's layers of one :class:`kvx.kernels.ops.CopyBatch` of them all."""
        if not chunks:
            return
        blocks = [b for ch, _ in chunks for b in ch.block_ids]
        batch = Once(lambda: self.scatter_batch(chunks))  # checked once, in the first job
        for g, (a, b, _) in enumerate(self.w.groups):
            job = self.w.order.load(
                blocks, lambda a=a, b=b: batch.get().run(a, b), name=f"load {load.spec.req_id} group {g}"
            )
            load.jobs.setdefault(g, []).append(job)

    def scatter_batch(self, chunks) -> ops.CopyBatch:
        """The scatters that write ``chunks`` (every layer) into their blocks."""
        batch = self.w.batch()
        for ch, src in chunks:
            self._add_scatters(batch, ch, src)
        return batch

    def _add_scatters(self, batch: ops.CopyBatch, ch: ChunkLoad, src: torch.Tensor) -> None:
        w = self.w
        if ch.positions is not None:  # several groups / null blocks skipped: contiguous runs
            if ch.before_forward and w.fmt == "pages":  # the scheduler never plans this
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
        view = w.blocks_view(src, ch.first_block, len(ch.block_ids))
        op = "scatter_pages" if w.fmt == "pages" else "scatter_blocks"
        bs = w.geom.block_size
        if ch.before_forward and w.fmt != "pages":
            # the last block is shared with this step's first computed token: copy only the tokens the
            # chunk provides, so the order against the forward's write of that token does not matter
            n = ch.shared_tokens
            full = ch.block_ids[:-1]
            if full:
                batch.add(op, w.kernel_ids(full), view.narrow(2, 0, len(full) * bs))
            slots = [ch.block_ids[-1] * bs + t for t in range(n)]
            batch.add("scatter_slots", slots, view.narrow(2, len(full) * bs, n))
        else:
            batch.add(op, w.kernel_ids(ch.block_ids), view)

    def _fail_chunk(self, load: _Load, ch: ChunkLoad, e: BaseException) -> None:
        with load.lock:
            if ch.key in load.failed:
                return
            load.failed.add(ch.key)
        # log the text, not the exception: a handler that keeps records (a QueueHandler, pytest's capture)
        # would keep its traceback, and the frames' chunk buffers with it
        self.w.throttle.warning(
            failure_cause("load", e),
            "kvx: request %s: chunk %s not loaded (%s); vLLM recomputes it",
            load.spec.req_id,
            ch.key,
            str(e),
        )

    def _read_chunk(self, ch: ChunkLoad, load: _Load) -> torch.Tensor:
        """Read and verify one chunk from its tier, into its CPU slot if it has one (promotion); return a
        copyable source. On a reader thread."""
        w = self.w
        key = rank_key(ch.key, w.shard, w.shards) if w.shards > 1 else ch.key
        shape = w.chunk_shape(ch.tokens, ch.state)
        dst = w.slot_view(ch.slot, ch.tokens, ch.state) if ch.slot is not None else None
        if dst is not None and dst.is_contiguous():
            out = dst
        else:  # a partial chunk's slot view is strided; the kernels read host memory only when pinned
            out = torch.empty(shape, dtype=w.chunk_dtype, pin_memory=w.layout.device.type == "cuda")
        t0 = time.perf_counter()
        w.tiers[ch.tier].get_into(key, out)
        w.note_read(ch.tier, out.nbytes, time.perf_counter() - t0)
        w.stats[f"{ch.tier}_reads"] += 1
        w.stats[f"{ch.tier}_read_bytes"] += out.nbytes
        if dst is not None and out is not dst:
            dst.copy_(out)
            out = dst
        elif dst is None and w.layout.device.type == "cuda":
            with load.lock:
                load.keep.append(out)  # alive until the copy jobs finished
        return out

    # ---------------------------------------------------------------- the forward
    def wait_for_layer(self, g: int) -> None:
        """Rule 4: before attention reads layer group ``g``, its loads are fenced. A read still in flight is
        waited for here, where the forward first needs it, and only here."""
        for load in self._sync:
            if load.pending:
                self._resolve(load)
            for job in load.jobs.get(g, ()):
                self._fence_job(load, job)

    def _fence_job(self, load: _Load, job: Job) -> None:
        try:
            self.w.engine.fence(job)
        except Exception as e:  # noqa: BLE001 - the copy itself failed: recompute every chunk
            self._fail_all(load, e)

    def _fail_all(self, load: _Load, e: BaseException) -> None:
        with load.lock:
            if len(load.failed) < len(load.spec.chunks):
                self.w.throttle.error(
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
        for load in self._sync:
            self._resolve(load)
            for jobs in load.jobs.values():
                for job in jobs:
                    self._fence_job(load, job)
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
        w = self.w
        for job in load.all_jobs():
            if job.done() and job.error() is not None:
                self._fail_all(load, job.error())
        for ch in load.spec.chunks:
            if ch.key in load.failed:
                if w.geom.num_groups > 1:  # block ids cannot name it to vLLM: the request fails (async)
                    self._failed_reqs.add(load.spec.req_id)
                else:
                    self._errors.update(ch.block_ids)
                self.outcomes.failed(ch.block_ids)
                w.out.failed_blocks.extend(ch.block_ids)
                w.stats["load_errors"] += 1
            if ch.slot_xfer is not None:  # the promotion into a CPU slot
                w.out.report(ch.slot_xfer, FAILED if ch.key in load.failed else OK)

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
                if deadline is not None:
                    futures_wait([f for _, f in load.pending], timeout=max(0.0, deadline - time.perf_counter()))
                self._queue_chunks(load, self._take_ready(load))
            if deadline is not None and not load.pending:
                for job in load.all_jobs():
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    try:
                        job.wait(left)
                    except Exception:  # noqa: BLE001 - a timeout or the copy's own error: judged below, as polled
                        break
            if not load.pending and all(j.done() for j in load.all_jobs()):
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
        w = self.w
        keep = []
        for load in self._retiring:
            if block:
                for job in load.all_jobs():
                    wait_quietly(job.wait)
            if all(job.done() for job in load.all_jobs()):
                load.keep.clear()
                w.out.report(load.spec.xfer, OK)
                w.stats["load_ms"] += (time.perf_counter() - load.started) * 1e3
                w.hist["load_seconds"].append(time.perf_counter() - load.started)
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
