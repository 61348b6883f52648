"""Transfer engine: asynchronous copies beside the model's compute, and the one rule that orders them.

**Copy queues.** Four queues, with one API on every device (:class:`TransferEngine`, made by :func:`make_engine`):

- ``load``: copies that write blocks (a load's reshape from its staging buffer, a DMA straight into blocks, a
  kernel copy into blocks): the forward waits for them layer by layer.
- ``save``: copies that read blocks (a save's gather into its staging buffer, ...): nothing waits for a save until
  its blocks are about to change.
- ``h2d``: a load's DMA from pinned host memory into its staging buffer (the copy engines; no SM);
- ``d2h``: a save's DMA from its staging buffer to pinned host memory.

A staged load is two jobs, ``h2d`` then ``load``; a staged save two, ``save`` then ``d2h`` (:mod:`kvx.kernels.staged`):
with two streams per direction the DMA of one part overlaps the reshape of the previous one.

A job is ``fn(stream)``: ``stream`` is its queue's CUDA stream handle (an int, ``cudaStream_t``) on CUDA, None
elsewhere; the CUDA engine does not change torch's current stream (use :func:`on_stream` for torch ops in a job).
``marker()`` records an event on the compute stream; ``submit(after=...)`` makes the queue wait for markers and for
jobs of other queues; ``fence(job)`` makes the compute stream wait for a job; no host synchronisation on CUDA.

Three engines (``KVX_COPY_QUEUE`` picks on CPU, :func:`copy_queue_mode`); callers ask their properties
(:attr:`TransferEngine.layerwise`, :attr:`~TransferEngine.staged`, :attr:`~TransferEngine.host_copies`), not a mode:

- :class:`CudaEngine` (a CUDA cache): the four queues are four side streams.
- :class:`ThreadEngine` (CPU default, ``KVX_COPY_QUEUE=thread``): one worker thread per queue; the forward runs
  on the host, so a marker is already passed when it is taken and a fence waits on the host. Host copies use the
  copy kernel (no staging: host memory is the cache's memory).
- :class:`DeferredEngine` (CPU, ``KVX_COPY_QUEUE=deferred``): GPU semantics on the CPU, stricter than a GPU, so a
  missing fence or edge shows up in CPU CI as wrong KV. It runs the CUDA code path (staging included, CPU memory
  standing in for the device's). Every job is a node of a happens-before graph: it follows the previous job of
  its queue and whatever it was submitted ``after``. Nothing runs when submitted:

  * a load-side job (``h2d``, ``load``) runs as *early* as its edges allow, at the engine's next observation
    point (a fence, a step's begin or forward end, :meth:`~TransferEngine.poll`), DMAs before reshapes: a load
    that is not ordered after the compute stream overwrites blocks an earlier forward still reads, and a DMA
    into a staging buffer that is not ordered after the reshape still reading it overwrites the bytes first;
  * a save-side job (``save``, ``d2h``) runs as *late* as allowed: when a fence or a host wait needs it, or else
    only once the *next* step's forward has written the cache (see :meth:`DeferredEngine.forward_done`), gathers
    before DMAs: a save that is not fenced before its blocks change reads the new owner's KV, and a gather into a
    staging buffer not ordered after the DMA still reading it overwrites the bytes first;
  * a load that is not fenced before the layer that reads it runs after that forward too: attention read stale
    blocks.

  The compute stream is the host (vLLM's CPU forward runs in ``execute_model``), so a fence runs the job and what
  it depends on at once. A simulated engine can instead put its forward on a virtual compute stream
  (:meth:`DeferredEngine.compute`): forwards then run lazily too, after every job fenced before them, which is how
  a test shows a load racing an earlier forward (a GPU's host running a step ahead).

**The rule** (:class:`BlockOrder`, used for every copy the connector makes):

1. A copy that writes blocks (a load) runs after every earlier use of them on the compute stream (a
   marker taken when it is submitted) and after every queued copy that reads them (the save of the
   request that held them before).
2. A copy that reads blocks (a save) runs after the forward that wrote them (a marker) and after every
   queued load into them.
3. Before a forward writes blocks, every queued copy that reads or writes them is fenced. The scheduler
   names those blocks in each step's metadata: the blocks the step computes and the blocks freed since
   the last step (``KVXMetadata.forward_blocks``), learned in the step that may reuse them, not later.
4. Before a forward reads loaded blocks, their load is fenced: per layer, in ``wait_for_layer_load``.
5. A staging buffer is reused only after every copy that read or wrote it completed: a copy that writes it (a
   load's DMA in, a save's gather) runs after its previous users, which :meth:`StagingRing.acquire` returns when
   the buffer is handed out (:meth:`BlockOrder.load_parts`, :meth:`BlockOrder.save_parts`). The ring is a fixed
   set of buffers taken in turn: a step larger than the budget waits on the device for a buffer, never on the host,
   and allocates nothing.

``Job.done()`` polls without blocking (a CUDA event query); ``Job.wait()`` blocks (off the per-step path);
an exception raised by a job is kept and re-raised by ``wait()`` / returned by ``error()``.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

QUEUES = ("load", "save", "h2d", "d2h")
MODES = ("cuda", "thread", "deferred")
ENV = "KVX_COPY_QUEUE"
STAGING_BUFFERS = 2  # per direction: the DMA of one part overlaps the reshape of the previous one
_EAGER = ("h2d", "load")  # the deferred engine's load side, in the order it prefers ready jobs (DMAs first)
_LAZY = ("save", "d2h")  # its save side, in the order it forces them (gathers first)


def copy_queue_mode(device: torch.device | str) -> str:
    """The copy queue for ``device``: ``cuda`` on CUDA; on CPU ``KVX_COPY_QUEUE`` (``thread`` default,
    ``deferred``). Raises ValueError naming the variable for any other value."""
    device = torch.device(device)
    value = os.environ.get(ENV, "").strip()
    if value and value not in ("auto", "thread", "deferred"):
        raise ValueError(f"{ENV}: expected one of 'auto', 'thread', 'deferred', got {value!r}")
    if device.type == "cuda":
        return "cuda"
    return "deferred" if value == "deferred" else "thread"


def make_engine(device: torch.device | str = "cpu", name: str = "kvx-copy", mode: str | None = None) -> TransferEngine:
    """The engine for ``device``: ``mode`` (one of :data:`MODES`), or :func:`copy_queue_mode`'s."""
    device = torch.device(device)
    mode = mode or copy_queue_mode(device)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if (mode == "cuda") != (device.type == "cuda"):
        raise ValueError(f"mode: {mode!r} does not run on a {device.type} device")
    return {"cuda": CudaEngine, "thread": ThreadEngine, "deferred": DeferredEngine}[mode](device, name)


def torch_stream(handle: int | None, device: torch.device | str | None = None):
    """The torch stream of CUDA stream handle ``handle`` (None: the current stream). Handle 0 is the legacy default
    stream: ``torch.cuda.ExternalStream(0)`` is not it but a new stream from torch's pool, which does not wait for
    the default stream's work nor it for its own (copies issued there raced the kernels issued on handle 0)."""
    current = torch.cuda.current_stream(device)
    if handle is None or handle == current.cuda_stream:
        return current
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


@contextlib.contextmanager
def on_stream(stream: int | None, device: torch.device | str | None = None):
    """Make the CUDA stream of handle ``stream`` torch's current stream (a job's torch ops); nothing off CUDA."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(torch_stream(stream, device)):
        yield


class Job:
    """One submitted copy: poll with :meth:`done`, block with :meth:`wait`."""

    __slots__ = ("name", "queue", "_event", "_done", "_error", "_fn", "_deps", "_epoch", "_owner")

    def __init__(self, name: str = "", queue: str = "load", event=None):
        self.name = name
        self.queue = queue
        self._event = event  # CUDA event, or None
        self._done = threading.Event() if event is None else None
        self._error: BaseException | None = None
        self._fn: Callable[[], None] | None = None  # deferred: what is still to run
        self._deps: list[Job] = []  # deferred / thread: jobs and markers it follows
        self._epoch = 0
        self._owner = None  # deferred: the engine that may run it

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._fn = None
        self._deps = []
        if self._done is not None:
            self._done.set()

    def done(self) -> bool:
        return self._event.query() if self._event is not None else self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job finished; re-raise its error. (Deferred: the engine's own thread runs it and
        what it depends on; another thread waits for that.)"""
        if self._event is not None:
            self._event.synchronize()
        else:
            if self._owner is not None and not self._done.is_set():
                self._owner._force_from(self)
            if not self._done.wait(timeout):
                raise TimeoutError(f"copy job {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error

    def error(self) -> BaseException | None:
        return self._error


class StagingRing:
    """``count`` staging buffers of ``capacity`` bytes on ``device`` (uint8), handed out in turn: the device memory
    a staged copy crosses PCIe through (:mod:`kvx.kernels.staged`). Rule 5 of :class:`BlockOrder`: :meth:`acquire`
    returns a buffer with the jobs that read or wrote it since it was last handed out; the copy that writes it runs
    after them. Allocated once (never on the per-step path); owned by its engine, used from the worker thread."""

    def __init__(self, device: torch.device, count: int, capacity: int):
        if count < 1 or capacity < 1:
            raise ValueError(f"count, capacity: expected >= 1, got {count}, {capacity}")
        self.capacity = capacity
        self.buffers = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
        self._users: list[list[Job]] = [[] for _ in range(count)]
        self._next = 0

    def acquire(self) -> tuple[int, torch.Tensor, list[Job]]:
        """The next buffer: ``(index, buffer, jobs its new writer must follow)`` (rule 5)."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        users = [j for j in self._users[i] if not j.done()]
        self._users[i] = []
        return i, self.buffers[i], users

    def note(self, index: int, *jobs: Job) -> None:
        """Jobs that read or write buffer ``index``: the next writer of it follows them."""
        self._users[index].extend(j for j in jobs if j is not None)


class TransferEngine:
    """Ordered copy queues on ``device`` (see the module docstring): the interface of the three engines.

    Properties callers branch on instead of a mode: :attr:`layerwise` (copies overlap the forward: one layer
    group per layer), :attr:`staged` (host <-> cache copies cross through device staging buffers and DMA),
    :attr:`host_copies` (copies run on the host's cores, which the next forward needs: the step waits for them).
    """

    mode = ""
    layerwise = True
    staged = True
    host_copies = False

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        self.device = torch.device(device)
        self.name = name
        self._closed = False
        self._rings: dict[str, StagingRing] = {}

    # ------------------------------------------------------------------ staging
    def configure_staging(self, budget: int, count: int = STAGING_BUFFERS) -> None:
        """Allocate the staging rings: ``budget`` bytes in all, a ring of ``count`` buffers for each direction
        (``"load"``, ``"save"``). Called once the KV cache exists (its memory is vLLM's; this comes from what vLLM
        leaves free). Again with another budget: the rings are replaced (after :meth:`flush`)."""
        self.drop_staging()
        per = budget // (2 * count) // 256 * 256
        if per < 256:
            raise ValueError(f"budget: expected at least {2 * count * 256} bytes for the staging rings, got {budget}")
        self._rings = {q: StagingRing(self.device, count, per) for q in ("load", "save")}

    def drop_staging(self) -> None:
        """Free the staging rings (their copies must have run: :meth:`flush` first)."""
        self._rings = {}

    def ring(self, direction: str) -> StagingRing:
        """The staging ring of ``"load"`` or ``"save"`` (:meth:`configure_staging`)."""
        ring = self._rings.get(direction)
        if ring is None:
            raise RuntimeError(f"no staging ring for {direction!r}: configure_staging() was not called")
        return ring

    @property
    def staging_bytes(self) -> int:
        return sum(len(r.buffers) * r.capacity for r in self._rings.values())

    # ------------------------------------------------------------------ API
    def stream_of(self, queue: str):
        """The torch CUDA stream of ``queue`` (None off CUDA)."""
        return None

    def marker(self):
        """A point on the compute stream that later copies may be submitted ``after`` (CUDA: an event;
        deferred: a node after the virtual compute stream's last op; thread: None, already passed)."""
        return None

    def submit(
        self, fn: Callable[[int | None], None], *, queue: str = "load", after: Iterable = (), name: str = ""
    ) -> Job:
        """Queue ``fn(stream)`` on ``queue`` after the markers and jobs in ``after`` (None entries are ignored)."""
        raise NotImplementedError

    def fence(self, job: Job) -> None:
        """Order the compute stream after ``job`` (CUDA: a stream wait, no host sync; thread: a host wait;
        deferred: the job runs now, or before the next virtual compute op)."""
        raise NotImplementedError

    def poll(self) -> None:
        """Let the queues run what is ready (deferred: an observation point; elsewhere nothing to do)."""

    def step_begin(self) -> None:
        """The host begins a step (``handle_preemptions``, before any hook of the step)."""

    def forward_done(self) -> None:
        """The host reached the end of a step's forward (``wait_for_save``)."""

    def flush(self) -> None:
        """Run everything queued (deferred); wait for everything queued (thread, CUDA)."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish queued jobs and stop the worker threads."""
        if not self._closed:
            self.flush()
            self._closed = True

    def _check_submit(self, queue: str) -> None:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if queue not in QUEUES:
            raise ValueError(f"queue: expected one of {QUEUES}, got {queue!r}")


class CudaEngine(TransferEngine):
    """Four side streams on a CUDA device. The SM work of a copy is a reshape inside HBM (~5 us per MiB, measured
    on an H200), so ``load`` and ``save`` run at the highest priority: a load's reshape lands before the layer that
    reads it, a save's gather right after the layer that wrote it, and each takes SMs for microseconds, not the
    milliseconds a PCIe copy on SMs took. ``h2d`` and ``d2h`` carry the DMAs (the copy engines, which no stream
    priority affects); they run beside the forward. Events order them; the host never waits."""

    mode = "cuda"

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        super().__init__(device, name)
        low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): high is the smaller number
        prio = {"load": high, "save": high, "h2d": low, "d2h": low}
        self._streams = {q: torch.cuda.Stream(device=self.device, priority=prio[q]) for q in QUEUES}
        self._handles = {q: s.cuda_stream for q, s in self._streams.items()}

    def stream_of(self, queue: str):
        return self._streams.get(queue)

    def marker(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def submit(self, fn, *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        self._check_submit(queue)
        stream = self._streams[queue]
        for a in after:
            ev = a._event if isinstance(a, Job) else a
            if ev is not None:
                stream.wait_event(ev)
        error = None
        try:
            fn(self._handles[queue])
        except BaseException as e:  # surfaced through the job, like on CPU
            error = e
        ev = torch.cuda.Event()
        ev.record(stream)
        job = Job(name, queue, ev)
        job._error = error
        return job

    def fence(self, job: Job) -> None:
        if job is None:
            return
        if job._event is not None:
            torch.cuda.current_stream(self.device).wait_event(job._event)
        if job._error is not None:
            raise job._error

    def flush(self) -> None:
        for s in self._streams.values():
            s.synchronize()


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
        self._queues[queue].put((fn, job))
        return job

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


class BlockOrder:
    """The ordering rule between copies and forwards, per block (see the module docstring). Owned by one
    worker and used from its thread only."""

    def __init__(self, engine: TransferEngine):
        self.engine = engine
        self._readers: dict[int, list[Job]] = {}  # block -> queued saves reading it
        self._writers: dict[int, list[Job]] = {}  # block -> queued loads writing it
        self._since_prune = 0

    def load_edges(self, blocks: Sequence[int], marker=None) -> list:
        """Rule 1: what a copy writing ``blocks`` runs after: the compute stream's last use of them (``marker``,
        taken now if None) and every queued copy reading them."""
        return [marker if marker is not None else self.engine.marker(), *self._live(self._readers, blocks)]

    def save_edges(self, blocks: Sequence[int], marker=None, loads: bool = True) -> list:
        """Rule 2: what a copy reading ``blocks`` runs after: the forward that wrote them (``marker``, taken right
        after it; now if None) and (``loads``) every queued load into them."""
        edges = [marker if marker is not None else self.engine.marker()]
        return edges + self._live(self._writers, blocks) if loads else edges

    def load(self, blocks: Sequence[int], fn: Callable, name: str = "", marker=None) -> Job:
        """One copy ``fn(stream)`` that writes ``blocks`` (:meth:`load_parts` of one part)."""
        return self.load_parts(blocks, [(None, fn)], None, name, marker)[0]

    def save(self, blocks: Sequence[int], fn: Callable, name: str = "", marker=None) -> Job:
        """One copy ``fn(stream)`` that reads ``blocks`` (:meth:`save_parts` of one part)."""
        return self.save_parts(blocks, [(fn, None)], None, name, marker)[0]

    def load_parts(
        self,
        blocks: Sequence[int],
        parts: Sequence[tuple[Callable | None, Callable]],
        ring: StagingRing | None = None,
        name: str = "",
        marker=None,
    ) -> list[Job]:
        """Submit the parts of one batch of copies that write ``blocks``, in order (rule 1 once for them all: one
        marker, the queued saves reading any of the blocks; the load queue runs the parts in order). A part
        ``(dma, reshape)`` is staged: ``dma(buffer, stream)`` fills a buffer of ``ring`` on the ``h2d`` queue after
        the buffer's previous users (rule 5), then ``reshape(buffer, stream)`` writes the blocks from it on the
        ``load`` queue; a part ``(None, copy)`` is one ``copy(stream)`` on the ``load`` queue. Returns each part's
        block-writing job (its end implies the part's). Only the last is recorded against the blocks: fencing it
        (rule 3) fences them all."""
        edges = self.load_edges(blocks, marker)
        jobs = []
        for k, (dma, copy) in enumerate(parts):
            what = f"{name} part {k}" if len(parts) > 1 else name
            if dma is None:
                job = self.engine.submit(copy, queue="load", after=edges, name=what)
            else:
                index, buf, users = ring.acquire()
                fill = self.engine.submit(
                    lambda s, dma=dma, buf=buf: dma(buf, s), queue="h2d", after=users, name=f"{what} dma"
                )
                job = self.engine.submit(
                    lambda s, copy=copy, buf=buf: copy(buf, s), queue="load", after=[*edges, fill], name=what
                )
                ring.note(index, fill, job)
            edges = []  # the parts after the first follow it on the load queue
            jobs.append(job)
        if jobs:
            self._note(self._writers, blocks, jobs[-1])
        return jobs

    def save_parts(
        self,
        blocks: Sequence[int],
        parts: Sequence[tuple[Callable, Callable | None]],
        ring: StagingRing | None = None,
        name: str = "",
        marker=None,
        first: bool = True,
        last: bool = True,
    ) -> list[Job]:
        """Submit the parts of one batch of copies that read ``blocks``, in order (rule 2 once for them all: after
        ``marker``, taken right after the forward wrote them (now if None), and the queued loads into any of the
        blocks). A part ``(gather, dma)`` is staged: ``gather(buffer, stream)`` fills a buffer of ``ring`` from the
        blocks on the ``save`` queue after the buffer's previous users (rule 5), then ``dma(buffer, stream)`` empties
        it to host memory on the ``d2h`` queue; a part ``(copy, None)`` is one ``copy(stream)`` on the ``save``
        queue. Returns each part's last job (its end is the part's). The last block-reading job is recorded against
        the blocks (rule 3 fences it, and the save queue runs the parts in order).

        A batch submitted in several calls (a step's saves, layer group by layer group, each after its own marker):
        ``first`` False skips the edges to queued loads (the first call's jobs, ahead on the save queue, have them),
        ``last`` False leaves the recording to the last call."""
        edges = self.save_edges(blocks, marker, loads=first)
        jobs, reader = [], None
        for k, (copy, dma) in enumerate(parts):
            what = f"{name} part {k}" if len(parts) > 1 else name
            if dma is None:
                reader = job = self.engine.submit(copy, queue="save", after=edges, name=what)
            else:
                index, buf, users = ring.acquire()
                reader = self.engine.submit(
                    lambda s, copy=copy, buf=buf: copy(buf, s), queue="save", after=[*edges, *users], name=what
                )
                job = self.engine.submit(
                    lambda s, dma=dma, buf=buf: dma(buf, s), queue="d2h", after=[reader], name=f"{what} dma"
                )
                ring.note(index, reader, job)
            edges = []  # the parts after the first follow it on the save queue
            jobs.append(job)
        if reader is not None and last:
            self._note(self._readers, blocks, reader)
        return jobs

    def load_staged(self, blocks, ring, dma, reshape, name: str = "", marker=None) -> Job:
        """One staged part that writes ``blocks`` (:meth:`load_parts`)."""
        return self.load_parts(blocks, [(dma, reshape)], ring, name, marker)[0]

    def save_staged(self, blocks, ring, gather, dma, name: str = "", marker=None) -> Job:
        """One staged part that reads ``blocks`` (:meth:`save_parts`); returns its DMA's job."""
        return self.save_parts(blocks, [(gather, dma)], ring, name, marker)[0]

    def before_forward(self, blocks: Iterable[int]) -> list[BaseException]:
        """Rule 3: fence every queued copy that reads or writes ``blocks``. Returns the errors of fenced jobs
        (the caller reports them where it reports the job)."""
        errors, seen = [], set()
        for table in (self._readers, self._writers):
            for b in blocks:
                for job in table.pop(b, ()):
                    if id(job) in seen or job.done():
                        continue
                    seen.add(id(job))
                    try:
                        self.engine.fence(job)
                    except Exception as e:  # noqa: BLE001 - kept by the job too
                        errors.append(e)
        self._prune()
        return errors

    def pending(self) -> int:
        return sum(len(v) for v in self._readers.values()) + sum(len(v) for v in self._writers.values())

    @staticmethod
    def _live(table: dict[int, list[Job]], blocks: Sequence[int]) -> list[Job]:
        out, seen = [], set()
        for b in blocks:
            for job in table.get(b, ()):
                if id(job) not in seen and not job.done():
                    seen.add(id(job))
                    out.append(job)
        return out

    def _note(self, table: dict[int, list[Job]], blocks: Sequence[int], job: Job) -> None:
        for b in blocks:
            table.setdefault(b, []).append(job)
        self._since_prune += 1
        if self._since_prune >= 256:
            self._prune()

    def _prune(self) -> None:
        """Forget finished jobs (bounded memory: blocks that are saved and never written again)."""
        self._since_prune = 0
        for table in (self._readers, self._writers):
            for b in [b for b, jobs in table.items() if all(j.done() for j in jobs)]:
                del table[b]
