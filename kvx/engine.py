"""Transfer engine: asynchronous copies beside the model's compute, and the one rule that orders them.

**Copy queues.** Loads (tier -> paged cache) and saves (paged cache -> tier) go on two queues, with one
API on every device; ``KVX_COPY_QUEUE`` picks the implementation on CPU:

- ``cuda`` (a CUDA cache; chosen automatically): two side streams. Loads on the highest-priority
  stream: the forward waits for them layer by layer, they are on its critical path. Saves on the
  lowest-priority stream: a burst of saves must not delay the next step's loads nor the model's kernels,
  and nothing waits for a save until its blocks are about to change. ``marker()`` records an event on
  the compute stream; ``submit(after=...)`` makes the queue's stream wait for markers and for jobs of the
  other queue; ``fence(job)`` makes the compute stream wait for a job. No host synchronisation.
- ``thread`` (CPU default, ``KVX_COPY_QUEUE=thread``): one worker thread per queue; the forward runs on
  the host, so a marker is already passed when it is taken and a fence waits on the host.
- ``deferred`` (CPU, ``KVX_COPY_QUEUE=deferred``): GPU semantics on the CPU, stricter than a GPU, so a
  missing fence shows up in CPU CI as wrong KV. Every job is a node of a happens-before graph: it follows
  the previous job of its queue and whatever it was submitted ``after``. Nothing runs when submitted:

  * a load runs as *early* as its edges allow (at once if they are all satisfied): a load that is not
    ordered after the compute stream overwrites blocks an earlier forward still reads;
  * a save runs as *late* as allowed: when a fence or a host wait needs it, or else only once the *next*
    step's forward has written the cache (see :meth:`forward_done`): a save that is not fenced before
    its blocks change reads the new owner's KV;
  * a load that is not fenced before the layer that reads it runs after that forward too: attention
    read stale blocks.

  The compute stream is the host (vLLM's CPU forward runs in ``execute_model``), so a fence runs the job
  and what it depends on at once. A simulated engine can instead put its forward on a virtual compute
  stream (:meth:`compute`): forwards then run lazily too, after every job fenced before them, which is
  how a test shows a load racing an earlier forward (a GPU's host running a step ahead).

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

``Job.done()`` polls without blocking (a CUDA event query); ``Job.wait()`` blocks (off the per-step path);
an exception raised by a job is kept and re-raised by ``wait()`` / returned by ``error()``.
"""

from __future__ import annotations

import os
import queue as queue_mod
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

QUEUES = ("load", "save")
MODES = ("cuda", "thread", "deferred")
ENV = "KVX_COPY_QUEUE"


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


class TransferEngine:
    """Two ordered copy queues (``load``, ``save``) on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", name: str = "kvx-copy", mode: str | None = None):
        self.device = torch.device(device)
        self.mode = mode or copy_queue_mode(self.device)
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if (self.mode == "cuda") != (self.device.type == "cuda"):
            raise ValueError(f"mode: {self.mode!r} does not run on a {self.device.type} device")
        self._closed = False
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._queues: dict[str, queue_mod.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        if self.mode == "cuda":
            low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): high is the smaller number
            self._streams = {
                "load": torch.cuda.Stream(device=self.device, priority=high),
                "save": torch.cuda.Stream(device=self.device, priority=low),
            }
        elif self.mode == "thread":
            for q in QUEUES:
                self._queues[q] = queue_mod.SimpleQueue()
                t = threading.Thread(target=self._loop, args=(self._queues[q],), name=f"{name}-{q}", daemon=True)
                t.start()
                self._threads.append(t)
        else:
            self._lock = threading.RLock()
            self._owner_thread = threading.get_ident()
            self._tails: dict[str, Job | None] = {"load": None, "save": None, "compute": None}
            self._pending: list[Job] = []  # submitted, not run (submission order)
            self._compute_waits: list[Job] = []  # jobs fenced since the last compute op
            self._virtual = False  # a simulated forward uses compute()
            self._hold_loads = False  # while forward_done runs virtual compute ops
            self._epoch = 0  # steps begun

    @property
    def stream(self):
        """The CUDA save stream (None off CUDA)."""
        return self._streams.get("save")

    def stream_of(self, queue: str):
        return self._streams.get(queue)

    # ---------------------------------------------------------------- API
    def marker(self):
        """A point on the compute stream that later copies may be submitted ``after`` (CUDA: an event;
        deferred: a node after the virtual compute stream's last op; thread: None, already passed)."""
        if self.mode == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        if self.mode == "thread":
            return None
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

    def submit(self, fn: Callable[[], None], *, queue: str = "load", after: Iterable = (), name: str = "") -> Job:
        """Queue ``fn`` on ``queue`` after the markers and jobs in ``after`` (None entries are ignored)."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if queue not in QUEUES:
            raise ValueError(f"queue: expected one of {QUEUES}, got {queue!r}")
        after = [a for a in after if a is not None]
        if self.mode == "cuda":
            stream = self._streams[queue]
            for a in after:
                ev = a._event if isinstance(a, Job) else a
                if ev is not None:
                    stream.wait_event(ev)
            error = None
            with torch.cuda.stream(stream):
                try:
                    fn()
                except BaseException as e:  # surfaced through the job, like on CPU
                    error = e
                ev = torch.cuda.Event()
                ev.record(stream)
            job = Job(name, queue, ev)
            job._error = error
            return job
        job = Job(name, queue)
        if self.mode == "thread":
            job._deps = [a for a in after if isinstance(a, Job)]
            self._queues[queue].put((fn, job))
            return job
        with self._lock:
            job._fn, job._owner, job._epoch = fn, self, self._epoch
            tail = self._tails[queue]
            job._deps = ([tail] if tail is not None else []) + [a for a in after if isinstance(a, Job)]
            self._tails[queue] = job
            self._pending.append(job)
            if queue == "load":
                self._loads_asap()  # a load runs as early as its edges allow
            return job

    def fence(self, job: Job) -> None:
        """Order the compute stream after ``job`` (CUDA: a stream wait, no host sync; thread: a host wait;
        deferred: the job runs now, or before the next virtual compute op)."""
        if job is None:
            return
        if self.mode == "cuda":
            if job._event is not None:
                torch.cuda.current_stream(self.device).wait_event(job._event)
            if job._error is not None:
                raise job._error
            return
        if self.mode == "thread":
            job.wait()
            return
        with self._lock:
            if self._virtual:
                self._compute_waits.append(job)
            else:
                self._force(job)
        if job.done() and job._error is not None:
            raise job._error

    def compute(self, fn: Callable[[], None], name: str = "forward") -> Job:
        """Deferred mode only: put ``fn`` (a simulated forward) on a virtual compute stream. It runs lazily,
        after every job fenced before it."""
        if self.mode != "deferred":
            raise RuntimeError(
                f"compute(): only the deferred copy queue has a virtual compute stream (mode is {self.mode!r})"
            )
        with self._lock:
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
        """The host begins a step (``handle_preemptions``, before any hook of the step). Deferred: counts
        steps, for :meth:`forward_done`."""
        if self.mode == "deferred":
            with self._lock:
                self._epoch += 1

    def forward_done(self) -> None:
        """The host reached the end of a step's forward (``wait_for_save``). Deferred: what nothing forced
        runs now, as late as a GPU could run it: the virtual compute ops of the previous step (a GPU's host
        runs a step ahead), then the copies of the step before that, which therefore run after the next
        forward wrote the cache."""
        if self.mode != "deferred":
            return
        with self._lock:
            self._run_compute(lambda j: j._epoch < self._epoch)
            for job in [j for j in self._pending if j._epoch < self._epoch - 1]:
                self._force(job)

    def flush(self) -> None:
        """Run everything queued (deferred); wait for everything queued (thread, CUDA)."""
        if self.mode == "cuda":
            for s in self._streams.values():
                s.synchronize()
        elif self.mode == "thread":
            if not self._closed:
                for q in QUEUES:
                    self.submit(lambda: None, queue=q).wait()
        else:
            with self._lock:
                self._run_compute(lambda j: True)
                for job in list(self._pending):
                    self._force(job)

    def close(self) -> None:
        """Finish queued jobs and stop the worker threads."""
        if self._closed:
            return
        if self.mode == "deferred":
            self.flush()
        self._closed = True
        if self.mode == "thread":
            for q in self._queues.values():
                q.put(None)
            for t in self._threads:
                t.join()
        elif self.mode == "cuda":
            for s in self._streams.values():
                s.synchronize()

    # ---------------------------------------------------------------- thread mode
    @staticmethod
    def _loop(q: queue_mod.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, job = item
            try:
                for d in job._deps:  # a job of the other queue it must follow
                    d._done.wait()
                fn()
            except BaseException as e:
                job._finish(e)
            else:
                job._finish()
            del item, fn, job  # the closure holds a load's buffers: not until the next job arrives

    # ---------------------------------------------------------------- deferred mode
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
        """Run every load whose edges are all satisfied (loads run as early as allowed)."""
        while not self._hold_loads:
            ready = next((j for j in self._pending if j.queue == "load" and all(d.done() for d in j._deps)), None)
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

    def load(self, blocks: Sequence[int], fn: Callable[[], None], name: str = "", after: Iterable = ()) -> Job:
        """Submit a copy that writes ``blocks`` (rule 1)."""
        deps = [self.engine.marker(), *after, *self._live(self._readers, blocks)]
        job = self.engine.submit(fn, queue="load", after=deps, name=name)
        self._note(self._writers, blocks, job)
        return job

    def save(self, blocks: Sequence[int], fn: Callable[[], None], name: str = "", marker=None) -> Job:
        """Submit a copy that reads ``blocks`` (rule 2). ``marker``: one taken right after the forward wrote
        them (taken now if None)."""
        deps = [marker if marker is not None else self.engine.marker(), *self._live(self._writers, blocks)]
        job = self.engine.submit(fn, queue="save", after=deps, name=name)
        self._note(self._readers, blocks, job)
        return job

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
