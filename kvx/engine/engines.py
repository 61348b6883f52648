"""The engines (see :mod:`kvx.engine`): CUDA streams, a null engine that runs nothing (the host-only benchmark),
worker threads (CPU), and the deferred queue that gives the CPU a GPU's semantics.
"""

from __future__ import annotations

import queue as queue_mod
import threading
from collections.abc import Callable, Iterable

import torch

from .._ext import require as _require
from .base import MODES, QUEUES, EngineQueues, Job, StagingRing, TransferEngine, copy_queue_mode

_EAGER = ("h2d", "load")  # the deferred engine's load side, in the order it prefers ready jobs (DMAs first)
_LAZY = ("save", "d2h")  # its save side, in the order it forces them (gathers first)


def make_engine(device: torch.device | str = "cpu", name: str = "kvx-copy", mode: str | None = None) -> TransferEngine:
    """The engine for ``device``: ``mode`` (one of :data:`MODES`), or :func:`copy_queue_mode`'s."""
    device = torch.device(device)
    mode = mode or copy_queue_mode(device)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if (mode == "cuda") != (device.type == "cuda"):
        raise ValueError(f"mode: {mode!r} does not run on a {device.type} device")
    return {"cuda": CudaEngine, "thread": ThreadEngine, "deferred": DeferredEngine}[mode](device, name)


class CudaEngine(TransferEngine):
    """Four side streams on a CUDA device, driven by the compiled queues (``kvx._C.CudaQueues``): a plan's legs are
    issued in compiled code, one call per layer, each operation one CUDA API call. The SM work of a copy is only a
    reshape inside HBM, microseconds per layer, so ``load`` and ``save`` run at the highest priority: a load's reshape
    lands before the layer that reads it, a save's gather right after the layer that wrote it, and neither holds SMs
    for the time a PCIe copy on SMs would (the measurements: benchmarks/results/h100-2026-11-27/README.md). ``h2d``
    and ``d2h`` carry the DMAs (the copy engines, which no stream priority affects); they run beside the forward.
    Events order them; the host never waits. The compute stream is the current stream when a step begins
    (:meth:`step_begin`), a marker is taken or a job fenced."""

    mode = "cuda"

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        super().__init__(device, name)
        low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): high is the smaller number
        prio = {"load": high, "save": high, "h2d": low, "d2h": low}
        self._streams = {q: torch.cuda.Stream(device=self.device, priority=prio[q]) for q in QUEUES}
        self._handles = {q: s.cuda_stream for q, s in self._streams.items()}
        self.queues = _require().CudaQueues(*(self._handles[q] for q in QUEUES))
        self._index = {q: i for i, q in enumerate(QUEUES)}
        self._compute()

    def _compute(self) -> None:
        self.queues.compute = torch.cuda.current_stream(self.device).cuda_stream

    def sync_compute(self) -> None:
        self._compute()

    def stream_of(self, queue: str):
        return self._streams.get(queue)

    def step_begin(self) -> None:
        self._compute()

    def marker(self):
        self._compute()
        return self.queues.record(4)

    def submit(self, fn, *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        self._check_submit(queue)
        q = self._index[queue]
        for a in after:
            if a is not None:
                self.queues.wait(q, self.event_of(a))
        error = None
        try:
            fn(self._handles[queue])
        except BaseException as e:  # surfaced through the job, like on CPU
            error = e
        job = Job(name, queue, self.queues.record(q))
        job._error = error
        return job

    def fence(self, job: Job) -> None:
        if job is None:
            return
        self._compute()
        self.queues.wait(4, self.event_of(job))
        if isinstance(job, Job) and job._error is not None:
            raise job._error

    def flush(self) -> None:
        for s in self._streams.values():
            s.synchronize()


class NullEngine(TransferEngine):
    """An engine that plans and submits every job and runs none: everything a CUDA engine does on the host but the
    CUDA API calls themselves, which ``kvx._C.NullQueues`` counts instead (:attr:`queues`: ``records``, ``waits``,
    ``dma_calls``, ``launches``, ``uploads``). Its staging rings name addresses and hold no memory; its plans decide
    their CUDA launches for a device of :attr:`sm_count` SMs. For measuring the host time of the hooks on a machine
    without a GPU (``benchmarks/bench_pipeline.py --host-only``): nothing is copied, so never serve from it."""

    mode = "null"
    sm_count = 132  # an H100 SXM's

    def __init__(self, device: torch.device, name: str = "kvx-null"):
        super().__init__(device, name)
        self.queues = _require().NullQueues()

    def _make_ring(self, count: int, capacity: int) -> StagingRing:
        return StagingRing(self.device, count, capacity, allocate=False)

    def marker(self):
        return self.queues.record(4)

    def submit(self, fn, *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        self._check_submit(queue)
        q = QUEUES.index(queue)
        for a in after:
            if a is not None:
                self.queues.wait(q, self.event_of(a))
        return Job(name, queue, self.queues.record(q))  # fn is not run

    def fence(self, job: Job) -> None:
        if job is not None:
            self.queues.wait(4, self.event_of(job))

    def flush(self) -> None:
        pass


class ThreadEngine(TransferEngine):
    """One worker thread per queue on a CPU cache: the forward runs on the host, so a marker is already passed
    when it is taken and a fence waits on the host. Copies use the host's cores (:attr:`host_copies`) and no
    staging (the cache is host memory)."""

    mode = "thread"
    layerwise = False
    staged = False
    host_copies = True

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        super().__init__(device, name)
        self.queues = EngineQueues(self)
        self._tails: dict[str, Job | None] = {q: None for q in QUEUES}
        self._queues: dict[str, queue_mod.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        for q in QUEUES:
            self._queues[q] = queue_mod.SimpleQueue()
            t = threading.Thread(target=self._loop, args=(self._queues[q],), name=f"{name}-{q}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, fn, *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        self._check_submit(queue)
        job = Job(name, queue)
        job._deps = [a for a in after if isinstance(a, Job)]
        self._tails[queue] = job
        self._queues[queue].put((fn, job))
        return job

    def tail(self, queue: str):
        return self._tails.get(queue)

    def fence(self, job: Job) -> None:
        if job is not None:
            job.wait()

    def flush(self) -> None:
        if not self._closed:
            for q in QUEUES:
                self.submit(lambda s: None, queue=q).wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()

    @staticmethod
    def _loop(q: queue_mod.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, job = item
            try:
                for d in job._deps:  # a job of another queue it must follow
                    d._done.wait()
                fn(None)
            except BaseException as e:
                job._finish(e)
            else:
                job._finish()
            del item, fn, job  # the closure holds a load's buffers: not until the next job arrives


class DeferredEngine(TransferEngine):
    """GPU semantics on the CPU (see the module docstring): jobs run at the latest or earliest points their edges
    allow, as a GPU could schedule them, so a missing edge shows as wrong bytes. Owned by the thread that made it
    (the worker's); another thread's host wait leaves the job to it."""

    mode = "deferred"

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        super().__init__(device, name)
        self.queues = EngineQueues(self)
        self._lock = threading.RLock()
        self._owner_thread = threading.get_ident()
        self._tails: dict[str, Job | None] = {q: None for q in (*QUEUES, "compute")}
        self._pending: list[Job] = []  # submitted, not run (submission order)
        self._compute_waits: list[Job] = []  # jobs fenced since the last compute op
        self._virtual = False  # a simulated forward uses compute()
        self._hold_loads = False  # while forward_done runs virtual compute ops
        self._epoch = 0  # steps begun

    def marker(self):
        with self._lock:  # after every op on the virtual compute stream so far (None: nothing to wait for)
            if self._compute_waits:
                # fences since the last compute op are part of the stream, as a CUDA stream wait is: a node
                # after them, and the stream's new tail
                tail = self._tails["compute"]
                m = Job("fences", "compute")
                m._owner, m._epoch = self, self._epoch
                m._deps = ([tail] if tail is not None else []) + self._compute_waits
                self._compute_waits = []
                self._tails["compute"] = m
                self._pending.append(m)
                return m
            tail = self._tails["compute"]
            return tail if tail is not None and not tail.done() else None

    def tail(self, queue: str):
        return self._tails.get(queue)

    def submit(self, fn, *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        self._check_submit(queue)
        job = Job(name, queue)
        with self._lock:
            job._fn, job._owner, job._epoch = (lambda: fn(None)), self, self._epoch
            tail = self._tails[queue]
            job._deps = ([tail] if tail is not None else []) + [a for a in after if isinstance(a, Job)]
            self._tails[queue] = job
            self._pending.append(job)
            return job  # runs at the next observation point at the earliest (a load) or as late as allowed (a save)

    def fence(self, job: Job) -> None:
        if job is None:
            return
        with self._lock:
            self._loads_asap()
            if self._virtual:
                self._compute_waits.append(job)
            else:
                self._force(job)
        if job.done() and job._error is not None:
            raise job._error

    def poll(self) -> None:
        with self._lock:
            self._loads_asap()

    def compute(self, fn: Callable[[], None], name: str = "forward") -> Job:
        """Put ``fn`` (a simulated forward) on a virtual compute stream. It runs lazily, after every job fenced
        before it."""
        with self._lock:
            self._loads_asap()
            self._virtual = True
            op = Job(name, "compute")
            op._fn, op._owner, op._epoch = fn, self, self._epoch
            tail = self._tails["compute"]
            op._deps = ([tail] if tail is not None else []) + self._compute_waits
            self._compute_waits = []
            self._tails["compute"] = op
            self._pending.append(op)
            return op

    def step_begin(self) -> None:
        """Counts steps, for :meth:`forward_done`; an observation point."""
        with self._lock:
            self._loads_asap()
            self._epoch += 1

    def forward_done(self) -> None:
        """What nothing forced runs now, as late as a GPU could run it: the virtual compute ops of the previous
        step (a GPU's host runs a step ahead), then the copies of the step before that, which therefore run after
        the next forward wrote the cache; of those, the save side's gathers before its DMAs."""
        with self._lock:
            self._loads_asap()
            self._run_compute(lambda j: j._epoch < self._epoch)
            old = [j for j in self._pending if j._epoch < self._epoch - 1]
            rank = {q: i for i, q in enumerate(_LAZY)}
            for job in sorted(old, key=lambda j: rank.get(j.queue, len(_LAZY))):
                self._force(job)

    def flush(self) -> None:
        with self._lock:
            self._run_compute(lambda j: True)
            for job in list(self._pending):
                self._force(job)

    def _force_from(self, job: Job) -> None:
        """A host wait: on the engine's thread run the job now; elsewhere (an I/O thread) leave it to the
        engine's thread, as a GPU leaves a stream's work to the stream."""
        if threading.get_ident() == self._owner_thread:
            with self._lock:
                self._force(job)

    def _force(self, job: Job) -> None:
        """Run ``job`` after everything it depends on (iteratively: the graphs are long chains)."""
        stack = [job]
        while stack:
            j = stack[-1]
            if j.done():
                stack.pop()
                continue
            todo = [d for d in j._deps if not d.done()]
            if todo:
                stack.extend(reversed(todo))
                continue
            stack.pop()
            self._run(j)
        self._loads_asap()

    def _run_compute(self, which: Callable[[Job], bool]) -> None:
        """Run the pending virtual compute ops ``which`` selects, in order. A load they make ready (its marker
        ran) waits until they all ran: on a GPU such a load runs beside the next forward, which therefore
        sees its KV only if it is fenced after it (rule 4)."""
        self._hold_loads = True
        try:
            for job in [j for j in self._pending if j.queue == "compute" and which(j)]:
                self._force(job)
        finally:
            self._hold_loads = False
        self._loads_asap()

    def _run(self, job: Job) -> None:
        fn = job._fn
        try:
            if fn is not None:
                fn()
        except BaseException as e:
            job._finish(e)
        else:
            job._finish()
        try:
            self._pending.remove(job)
        except ValueError:
            pass

    def _loads_asap(self) -> None:
        """Run every load-side job whose edges are all satisfied, a ready DMA before a ready reshape (both are
        legal on a GPU; this one overwrites a staging buffer first where rule 5 is missing)."""
        while not self._hold_loads:
            ready = None
            for q in _EAGER:
                ready = next((j for j in self._pending if j.queue == q and all(d.done() for d in j._deps)), None)
                if ready is not None:
                    break
            if ready is None:
                return
            self._run(ready)
