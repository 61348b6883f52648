"""The engine's parts every engine shares: jobs, the staging ring, the interface, and the bridge that lets the
compiled issue path (``csrc/plan/queues.h``) put jobs on an engine written in Python. See :mod:`kvx.engine`.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable

import torch

from .._ext import C as _C
from .._ext import require as _require

QUEUES = ("load", "save", "h2d", "d2h")  # in the compiled path's numbering (queues.h Queue); 4 is the compute stream
COMPUTE = 4
MODES = ("cuda", "thread", "deferred")
ENV = "KVX_COPY_QUEUE"
STAGING_BUFFERS = 2  # per direction: the DMA of one leg overlaps the reshape of the previous one
_FAKE_RINGS = itertools.count()


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
        self._event = event  # a kvx._C.Event (CUDA, null engines), or None
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
    a staged copy crosses PCIe through (:mod:`kvx.kernels.plan`). Rule 5 of :class:`kvx.engine.BlockOrder`: the
    compiled ring (:attr:`c`, ``kvx._C.StagingRing``) hands a buffer out with the job its previous user was (a load's
    reshape, a save's DMA), which the buffer's next writer follows. Allocated once (never on the per-step path);
    ``allocate=False`` (a null engine's) names addresses and holds no memory. Owned by its engine, used from the
    worker thread."""

    def __init__(self, device: torch.device, count: int, capacity: int, allocate: bool = True):
        if count < 1 or capacity < 1:
            raise ValueError(f"count, capacity: expected >= 1, got {count}, {capacity}")
        self.capacity = capacity
        if allocate:
            self.buffers = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
            addresses = [b.data_ptr() for b in self.buffers]
        else:  # addresses no memory is behind (distinct, aligned): a null engine's, never read or written
            self.buffers = []
            step = (capacity + 4095) // 4096 * 4096
            addresses = [(1 << 40) + (next(_FAKE_RINGS) * count + i) * step for i in range(count)]
        self.by_address = {b.data_ptr(): b for b in self.buffers}
        self.c = _require().StagingRing(addresses, capacity)

    @property
    def count(self) -> int:
        return self.c.count


class TransferEngine:
    """Ordered copy queues on ``device`` (see :mod:`kvx.engine`): the interface of the engines.

    Properties callers branch on instead of a mode: :attr:`layerwise` (copies overlap the forward: one layer
    group per layer), :attr:`staged` (host <-> cache copies cross through device staging buffers and DMA),
    :attr:`host_copies` (copies run on the host's cores, which the next forward needs: the step waits for them).
    :attr:`queues` is the engine as the compiled issue path sees it (``kvx._C.Queues``); :attr:`sm_count`, when
    set, is the SM count its plans' CUDA launches are decided for (a null engine's, on a CPU cache).
    """

    mode = ""
    layerwise = True
    staged = True
    host_copies = False
    sm_count = 0

    def __init__(self, device: torch.device, name: str = "kvx-copy"):
        self.device = torch.device(device)
        self.name = name
        self._closed = False
        self._rings: dict[str, StagingRing] = {}
        self.queues = None  # set by each engine

    # ------------------------------------------------------------------ staging
    def configure_staging(self, budget: int, count: int = STAGING_BUFFERS) -> None:
        """Allocate the staging rings: ``budget`` bytes in all, a ring of ``count`` buffers for each direction
        (``"load"``, ``"save"``). Called once the KV cache exists (its memory is vLLM's; this comes from what vLLM
        leaves free). Again with another budget: the rings are replaced (after :meth:`flush`)."""
        self.drop_staging()
        per = budget // (2 * count) // 256 * 256
        if per < 256:
            raise ValueError(f"budget: expected at least {2 * count * 256} bytes for the staging rings, got {budget}")
        self._rings = {q: self._make_ring(count, per) for q in ("load", "save")}

    def _make_ring(self, count: int, capacity: int) -> StagingRing:
        return StagingRing(self.device, count, capacity)

    def drop_staging(self) -> None:
        """Free the staging rings (their copies must have run: :meth:`flush` first)."""
        self._rings = {}

    def ring(self, direction: str) -> StagingRing:
        """The staging ring of ``"load"`` or ``"save"`` (:meth:`configure_staging`)."""
        ring = self._rings.get(direction)
        if ring is None:
            raise RuntimeError(f"no staging ring for {direction!r}: configure_staging() was not called")
        return ring

    def staging_buffer(self, address: int) -> torch.Tensor | None:
        """The ring buffer at ``address`` (None: 0, or not a ring's)."""
        for ring in self._rings.values():
            buf = ring.by_address.get(address)
            if buf is not None:
                return buf
        return None

    @property
    def staging_bytes(self) -> int:
        return sum(r.count * r.capacity for r in self._rings.values())

    # ------------------------------------------------------------------ jobs as the compiled path's events
    def event_of(self, point):
        """``point`` (a :class:`Job`, a marker, a ``kvx._C.Event`` or None) as a ``kvx._C.Event``."""
        if point is None:
            return _C.Event()
        if isinstance(point, Job):
            return point._event if point._event is not None else _C.Event.of(point)
        return point if isinstance(point, _C.Event) else _C.Event.of(point)

    def job_of(self, event, name: str = "", queue: str = "load") -> Job | None:
        """A ``kvx._C.Event`` of the compiled path as a :class:`Job` (None for None): a Python engine's job itself, or
        a job of the event."""
        if event is None:
            return None
        payload = event.payload
        return payload if payload is not None else Job(name, queue, event)

    # ------------------------------------------------------------------ API
    def stream_of(self, queue: str):
        """The torch CUDA stream of ``queue`` (None off CUDA)."""
        return None

    def marker(self):
        """A point on the compute stream that later copies may be submitted ``after`` (CUDA: an event;
        deferred: a node after the virtual compute stream's last op; thread: None, already passed)."""
        return None

    def sync_compute(self) -> None:
        """Take the current stream as the compute stream the compiled path records markers on (CUDA; else nothing)."""

    def tail(self, queue: str):
        """The last job submitted on ``queue`` (None: none): a point after everything on it."""
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


class EngineQueues(_C.Queues if _C is not None else object):
    """A Python engine's queues as the compiled issue path sees them (``kvx._C.Queues``, ``csrc/plan/queues.h``):
    each operation the compiled code issues becomes a job of the engine (a DMA or reshape of a plan's leg), a
    recorded point the queue's last job, a wait an edge of the queue's next job (the compute stream's: a fence). So the
    deferred copy queue runs the compiled path's own order, and the thread queue its copies. Owned by its engine
    (the worker thread)."""

    def __init__(self, engine: TransferEngine):
        super().__init__()
        self.engine = engine
        self._after: list[list] = [[] for _ in QUEUES]  # edges of each queue's next job

    def record(self, queue: int):
        eng = self.engine
        return eng.event_of(eng.marker() if queue == COMPUTE else eng.tail(QUEUES[queue]))

    def wait(self, queue: int, event) -> None:
        job = event.payload
        if job is None:
            return
        if queue == COMPUTE:
            self.engine.fence(job)
        else:
            self._after[queue].append(job)

    def dma(self, queue: int, plan, leg: int, staging: int) -> None:
        buf = self.engine.staging_buffer(staging)
        self._submit(queue, lambda s: plan.dma(leg, buf, s), f"{getattr(plan, 'name', 'plan')} leg {leg} dma")

    def reshape(self, queue: int, plan, leg: int, staging: int) -> None:
        buf = self.engine.staging_buffer(staging)
        self._submit(queue, lambda s: plan.reshape(leg, buf, s), f"{getattr(plan, 'name', 'plan')} leg {leg}")

    def _submit(self, queue: int, fn: Callable, name: str) -> None:
        after, self._after[queue] = self._after[queue], []
        self.engine.submit(fn, queue=QUEUES[queue], after=after, name=name)
