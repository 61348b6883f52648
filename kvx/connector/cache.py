"""What a worker's copy pipelines use: the registered KV cache and how copies reach it, and where results go.

:class:`RegisteredKV` is the KV cache a worker registered, as the load and save pipelines see it: the layout and
its layer groups, the chunk format and the shapes of stored objects, the CPU tier's slots, and the copies'
machinery (the :class:`kvx.engine.TransferEngine`, its :class:`kvx.engine.BlockOrder`, the host path and its
staging rings). :meth:`RegisteredKV.queue_loads` / :meth:`RegisteredKV.queue_saves` issue a compiled
:class:`kvx.kernels.plan.Plan` on the engine's queues (one or two jobs per leg: a staged leg is a DMA and a reshape,
ordered by rule 5), and :meth:`RegisteredKV.fence` fences a layer group's legs: each one compiled call.
:class:`WorkerResults` collects what the pipelines report to vLLM and the scheduler.

Owned by :class:`~.worker.KVXWorker`, which builds a new :class:`RegisteredKV` whenever it describes the caches
(registration, a wake-up after sleep: the tensors' addresses change) and hands it to both pipelines; worker
thread only. :class:`WorkerResults`: the worker thread, except ``stats`` counters (I/O threads add to them) and
:meth:`WorkerResults.note_read` (reader threads, under its lock).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import torch

from .._ext import C as _C
from ..engine import BlockOrder, Job, TransferEngine
from ..kernels.layout import KVLayout
from ..kernels.plan import Copies, Plan
from ..log import Throttle, get_logger
from ..store import SlotPool
from .common import EngineGeometry, object_rows
from .config import KVXConfig
from .metadata import KVXWorkerMetadata
from .parts import PartIO

log = get_logger(__name__)

_MAX_READS = 256  # read records per step report (the latest: enough for a moving estimate)


class RegisteredKV:
    """The registered KV cache and the copies' machinery (see the module docstring)."""

    def __init__(
        self,
        config: KVXConfig,
        geom: EngineGeometry,
        fmt: str,
        layout: KVLayout,
        ratio: int,
        engine: TransferEngine,
        pool: SlotPool | None,
        parts: PartIO,
    ):
        self.config, self.geom, self.fmt = config, geom, fmt
        self.layout, self.ratio, self.engine, self.pool = layout, ratio, engine, pool
        self.parts = parts  # how this worker's share of a chunk is read from and written to a byte tier
        self.order = BlockOrder(engine)
        # Layer groups: the unit wait_for_layer_load fences and save_kv_layer queues. One per layer where copies
        # overlap the forward (CUDA, and the deferred CPU queue that runs its code path); one for all layers on CPU
        # threads (the CPU copy already uses every core).
        n = layout.num_layers
        self.ranges = [(i, i + 1) for i in range(n)] if engine.layerwise else [(0, n)]
        self.groups = [(a, b, layout.layer_range(a, b)) for a, b in self.ranges]
        # how chunks cross between host memory and the cache: the copy kernel where the cache is host memory
        self.path = config.copy_path if engine.staged else "kernel"

    # ------------------------------------------------------------------ shapes
    @property
    def chunk_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fmt == "pages" else self.layout.dtype

    def rows(self, tokens: int, state: bool = False) -> int:
        """vLLM blocks per layer of a stored object (:func:`~.common.object_rows`)."""
        return object_rows(self.geom, tokens, state)

    def shape(self, rows: int) -> tuple[int, ...]:
        """A stored object's logical shape: canonical ``[L, P, T, H, D]``, raw pages ``[L, S, n, segment_bytes]``, or
        raw pages split by head ``[L, S, n, H, segment_bytes / H]`` when :attr:`head_major`."""
        if self.fmt == "pages":
            n = rows * (self.geom.block_size // self.layout.block_size)
            return self.layout.page_heads_shape(n) if self.head_major else self.layout.page_shape(n)
        return self.layout.canonical_shape(rows * self.geom.block_size)

    def chunk_shape(self, tokens: int, state: bool = False) -> tuple[int, ...]:
        """The shape of a stored object (:func:`~.common.object_rows`)."""
        return self.shape(self.rows(tokens, state))

    def slot_shape(self) -> tuple[int, ...]:
        """A CPU slot's (and a write buffer's) shape: the largest object, a chunk or a state object."""
        chunk = self.config.chunk_size
        return self.shape(max(self.rows(chunk), self.rows(chunk, state=True)))

    # ------------------------------------------------------------------ host buffers
    @property
    def head_major(self) -> bool:
        """Whether host buffers (CPU slots, write buffers, read buffers) hold each KV head's bytes as one run:
        ``[H, L, P, T, D]`` in memory, seen as the canonical ``[L, P, T, H, D]`` (raw pages: ``[H, L, S, n, run]``
        seen as ``[L, S, n, H, run]``, :meth:`kvx.kernels.layout.KVLayout.page_heads_shape`). Then each head's part
        of a chunk is written and read in place, with no copy on the way (:class:`~.parts.PartIO`): so when chunks
        are cut by head and this worker holds several heads (raw pages: where each head's bytes are one run of a
        page, :attr:`kvx.kernels.layout.KVLayout.page_head_bytes`, as in the CPU backend's pages and ``HND``
        layouts). The host path stages them head-major too (:mod:`kvx.kernels.plan`), so that a head's tokens
        cross PCIe as one DMA run."""
        share = self.parts.share
        if not (share.split and share.heads[1] - share.heads[0] > 1):
            return False
        return self.fmt == "canonical" or self.layout.page_head_bytes is not None

    def host_storage_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape in memory of a host buffer of (logical) ``shape``: heads first when :attr:`head_major`."""
        shape = tuple(shape)
        return (shape[3], *shape[:3], *shape[4:]) if self.head_major else shape

    def host_view(self, storage: torch.Tensor) -> torch.Tensor:
        """A host buffer in memory (:meth:`host_storage_shape`) as its logical shape."""
        return storage.movedim(0, 3) if self.head_major else storage

    def host_empty(self, shape: Sequence[int], pin: bool = False) -> torch.Tensor:
        """A new host buffer of (logical) ``shape``, laid out as :attr:`head_major` says."""
        storage = torch.empty(self.host_storage_shape(shape), dtype=self.chunk_dtype, pin_memory=pin)
        return self.host_view(storage)

    def dense(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is a whole host buffer in this cache's layout (not a strided part of one)."""
        if self.head_major:
            return buf.movedim(3, 0).is_contiguous()
        return buf.is_contiguous()

    def blocks_view(self, chunk: torch.Tensor, first_block: int, n_blocks: int) -> torch.Tensor:
        """The part of a chunk tensor that holds vLLM blocks [first_block, first_block + n_blocks)."""
        unit = self.ratio if self.fmt == "pages" else self.geom.block_size
        return chunk.narrow(2, first_block * unit, n_blocks * unit)

    def kernel_ids(self, block_ids: list[int]) -> list[int]:
        if self.ratio == 1:
            return block_ids
        return [b * self.ratio + r for b in block_ids for r in range(self.ratio)]

    def slot_view(self, slot: int, tokens: int, state: bool = False) -> torch.Tensor:
        """The part of CPU slot ``slot`` that holds a chunk of ``tokens`` tokens (``state``: its state object)."""
        return self.blocks_view(self.slot(slot), 0, self.rows(tokens, state))

    def slot(self, slot: int) -> torch.Tensor:
        """CPU slot ``slot``, whole, in the logical shape of :meth:`slot_shape`."""
        return self.host_view(self.pool.slot(slot))

    def check_slot(self, slot: int, key: str, reading: bool, generation: int | None = None) -> int | None:
        """A node pool's slot ``slot``: its generation if it holds chunk ``key`` (READY when ``reading``, else being
        written) and, given ``generation``, still that one; :class:`kvx.store.ChunkError` if not
        (:meth:`kvx.store.SlotPool.check`). A CPU pool's slots are this engine's alone: None."""
        return self.pool.check(slot, key, reading, generation)

    def group_of_layer(self, layer: int) -> int:
        return next(g for g, (a, b, _) in enumerate(self.groups) if a <= layer < b)

    # ------------------------------------------------------------------ copies
    def copies(self) -> Copies:
        """An empty set of copies between the cache and host buffers, by this worker's path (a step's loads, or its
        saves: :mod:`kvx.kernels.plan`)."""
        return Copies(self.layout, path=self.path, max_ctas=self.config.max_ctas, sm_count=self.engine.sm_count)

    def plan(self, copies: Copies, name: str = "") -> Plan:
        """``copies`` planned by layer group (staged: each leg fits one buffer of the engine's ring)."""
        ring = None
        if self.engine.staged:
            ring = self.engine.ring("save" if copies.gather else "load")
        plan = copies.plan(self.ranges, ring.capacity if ring is not None else None)
        plan.name = name
        return plan

    def queue_loads(self, plan: Plan, blocks: Sequence[int]) -> Job | None:
        """Issue every leg of a load plan in compiled code (rules 1 and 5: :meth:`kvx.engine.BlockOrder.load_plan`);
        the job recorded against the blocks (None: nothing to copy)."""
        return self.order.load_plan(blocks, plan)

    def fence(self, plan: Plan, group: int) -> None:
        """Rule 4: the compute stream waits for ``plan``'s legs of layer group ``group`` (one compiled call)."""
        _C.fence_range(self.engine.queues, plan, group)

    def queue_saves(self, plan: Plan, group: int, blocks: Sequence[int], first: bool, last: bool) -> None:
        """Issue ``plan``'s legs of layer group ``group`` in compiled code, right after the forward wrote them (rules
        2 and 5: :meth:`kvx.engine.BlockOrder.save_plan`). ``first`` / ``last``: the plan's first / last call."""
        self.order.save_plan(blocks, plan, group, first, last)


def plan_done(plan: Plan) -> bool:
    """Every issued leg of a plan ran: the last issued leg's last job did (a plan's legs end in order on one
    queue). Call once it is issued (a leg never issued, after an error, is not waited for)."""
    for k in range(plan.num_legs - 1, -1, -1):
        ev = plan.done(k)
        if ev is not None:
            return ev.query()
    return True


def plan_error(plan: Plan) -> BaseException | None:
    """The first error a Python engine's job of ``plan`` kept (a CUDA engine's errors raise when issued)."""
    n = plan.num_legs
    last = plan.done(n - 1) if n else None
    if last is None or last.payload is None:  # not issued, or not a Python engine's jobs: nothing kept
        return None
    for k in range(n):
        for ev in (plan.touched(k), plan.done(k)):
            job = ev.payload if ev is not None else None
            if job is not None and job.done() and job.error() is not None:
                return job.error()
    return None


def wait_plan(plan: Plan) -> None:
    """Block until every issued leg of ``plan`` ran (off the per-step path, or on CPU threads)."""
    for k in range(plan.num_legs):
        ev = plan.done(k)
        if ev is not None:
            ev.synchronize()


class WorkerResults:
    """What a worker's pipelines report: one outcome per transfer id (``out``, returned by
    ``build_worker_meta``), counters (``stats``), latency samples (``hist``), the reads' records (``note_read``),
    and a throttled log. The worker thread swaps ``out`` per step; see the module docstring for threads."""

    def __init__(self) -> None:
        self.out = KVXWorkerMetadata()
        self.stats: Counter = Counter()
        self.hist: dict[str, list[float]] = {"load_seconds": [], "save_seconds": []}
        self.throttle = Throttle(log)
        self._reads: list[tuple[str, int, float]] = []  # (tier, bytes, seconds) per chunk read (reader threads)
        self._reads_lock = threading.Lock()

    def note_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A chunk read from a byte tier (a reader thread): reported with the step's results."""
        with self._reads_lock:
            self._reads.append((tier, nbytes, seconds))

    def take_reads(self) -> list[tuple[str, int, float]]:
        with self._reads_lock:
            reads, self._reads = self._reads[-_MAX_READS:], []
        return reads

    def take_out(self) -> KVXWorkerMetadata:
        out, self.out = self.out, KVXWorkerMetadata()
        return out
