"""Worker side of the connector: the hooks vLLM calls in each worker process (one per TP/PP rank), in their order.

What to move comes from the scheduler's :class:`KVXMetadata`; how is :mod:`kvx.kernels.plan` (a step's copies between
host memory and the cache, planned once into a compiled plan: staged through device buffers, by DMA, or by the copy
kernel), issued on the :class:`kvx.engine.TransferEngine` copy queues by compiled code, one call per layer; in what
order against the forwards is :class:`kvx.engine.BlockOrder` (every copy goes through it). The work is two pipelines,
one per direction: :class:`~.loads.LoadPipeline` (tiers -> paged KV cache) and :class:`~.saves.SavePipeline` (paged KV
cache -> tiers); this module describes the registered KV cache (:class:`~.cache.RegisteredKV`: layout, layer groups,
the CPU pool's slots, the copies' machinery) and hands it to both, owns the tiers and the transfer engine, hands each
step's metadata to the pipelines, and hands the step's load verdict to the save pipeline as an argument (a save
computed against a load that failed here is dropped: :mod:`.validity`). Results (one outcome per transfer id,
:class:`KVXWorkerMetadata`) are collected in a :class:`~.cache.WorkerResults` and returned by
:meth:`KVXWorker.build_worker_meta`.

Step order: ``handle_preemptions`` (fence the copies of every block this step's forward writes), ``bind``,
``start_load_kv``, per layer ``wait_for_layer_load`` / ``save_kv_layer``, then ``wait_for_save`` and the result
hooks (``get_finished``, ``get_block_ids_with_load_errors``, ``build_worker_meta``) in either order
(:data:`kvx.testing.RUNNER_ORDERS`): the step's sync loads are finished by whichever of them runs first.

Several KV cache groups (:mod:`.common`): vLLM aliases layer i of every group onto one tensor, so the layout
here is the physical layers; a chunk holds each group's blocks in turn (``ChunkLoad.positions`` places the
blocks of a load), saves are queued in ``wait_for_save`` (a physical layer is written by one model layer
per group: ``save_kv_layer`` of the first does not mean it is complete), and a failed (async) load is
reported per request (:meth:`take_failed_requests`), not by block ids.

Thread ownership: everything here runs on vLLM's worker thread, except the I/O pools (tier reads and
writes: they touch only the tensors handed to them, ``stats`` counters, and the pipelines' locked state) and the
copy queues' threads on CPU. The I/O threads run on every CPU the process may use (:func:`~.threads.io_thread`), not on
the core vLLM bound the worker's thread to.

Device memory (CUDA): besides vLLM's KV cache, kvx takes ``staging_bytes`` (default 64 MiB) for its staging rings
(:meth:`kvx.engine.TransferEngine.configure_staging`) when it registers the caches, i.e. after vLLM sized its KV
cache from ``gpu_memory_utilization``: it comes from the share vLLM leaves free (10% of the device at the default
0.9), and registration fails with a clear error naming ``staging_bytes`` if the device has less free.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine import TransferEngine, make_engine
from ..kernels import ops
from ..kernels.layout import KVLayout
from ..log import get_logger
from ..node.client import NodePool
from ..store import REMOVED, CPUPool, SlotPool, Tier, TierContext, tier_class
from .cache import RegisteredKV, WorkerResults
from .common import EngineGeometry, chunk_bytes, head_parts, num_cpu_slots, object_rows, write_backlog
from .config import ConfigError, KVXConfig
from .loads import LoadPipeline
from .metadata import KVXMetadata, KVXWorkerMetadata
from .parts import PartIO, Share
from .saves import SavePipeline, WriteBuffers
from .threads import io_thread

log = get_logger(__name__)

# An idle step (nothing computed) with async loads in flight waits up to this long for them in get_finished. vLLM
# steps idle steps back to back while requests wait for their loads: on CPU those steps' Python holds the GIL the copy
# thread needs between its kernels, so a load spread over hundreds of idle steps took many times its copy time; a
# wait releases the GIL, and costs nothing while nothing else is scheduled.
IDLE_STEP_WAIT_S = 0.005
# An idle step while a request waits for the chunks its P/D producer announced (KVXMetadata.pd_waiting) and no load is
# in flight pauses this long in get_finished. vLLM steps such steps back to back, each a lookup in the scheduler and,
# with TP > 1, a round trip through its worker processes, which spin between steps (its shared-memory queue polls
# with sched_yield for a second after each read). Where the host has few cores, those steps keep them busy: the
# producer's writes, and every other process on the host, can then wait runnable for the whole pd_wait_ms, after which
# the consumer computes the chunks it was waiting for. A pause lets the workers sleep; a chunk that lands is seen at
# most this much later.
PD_IDLE_PAUSE_S = 0.01
# As PD_IDLE_PAUSE_S, while a lookup waits for its node to have the slots of a pull from a peer (KVXMetadata.
# pull_waiting): that takes a lease round trip to the peer, a few ms; then the lookup is a hit, loaded as the chunks
# arrive. A shorter pause: the next lookup sees the slots sooner.
PULL_IDLE_PAUSE_S = 0.002


def node_pool(cache: RegisteredKV, page_heads: bool, pin: bool = False) -> NodePool:
    """This worker's view of a node's slots: a slot holds a chunk with every rank's KV heads, head-major (each
    head's bytes one run), and a rank of any TP size copies its heads' runs; a chunk that cannot be cut by head
    (MLA, where every rank holds the same bytes; a single worker) is the whole slot. ``page_heads``: raw pages
    whose heads are runs of a page (:attr:`kvx.kernels.layout.KVLayout.page_head_bytes`); ``pin``: a GPU engine's
    (:class:`~kvx.node.client.NodePool`)."""
    share = cache.parts.share
    logical = cache.slot_shape()
    storage = cache.host_storage_shape(logical)
    if share.heads == (0, share.total_heads):
        return NodePool(storage, cache.chunk_dtype, None, storage, pin)
    n = share.heads[1] - share.heads[0]
    # one head's raw pages are that head's run of a page of every head (chunks split by head: parts.py)
    if share.split and share.layers[0] == 0 and (cache.fmt == "canonical" or page_heads or n == 1):
        if cache.head_major:
            per_head = storage[1:]
        elif len(logical) == 5:  # one head, [L, P, T, 1, D]
            per_head = (*logical[:3], *logical[4:])
        else:  # one head's raw pages, [L, S, n, bytes]
            per_head = logical
        if n == 1 or cache.head_major:
            return NodePool((share.total_heads, *per_head), cache.chunk_dtype, share.heads, storage, pin)
    raise ValueError(
        f"tiers: the node tier stores a chunk once per host, cut by KV head, for engines of one pipeline stage; this "
        f"worker holds heads {share.heads} of {share.total_heads} and layers {share.layers} of chunks in format "
        f"{cache.fmt!r}, which it cannot cut by head (use the cpu tier)"
    )


def _whole_share(geom: EngineGeometry, split: bool, layers: int) -> Share:
    """The share of a worker holding every head and layer (one process, tests): layers numbered from 0."""
    if geom.total_kv_heads not in (0, geom.num_kv_heads) and not geom.use_mla:
        raise ValueError(
            f"share_of: expected a worker's share for a model of {geom.total_kv_heads} KV heads, {geom.num_kv_heads} "
            "of them here"
        )
    heads = 1 if geom.use_mla else geom.num_kv_heads
    return Share((0, heads), heads, (0, layers), split=split)


def _physical_names(views: dict[str, torch.Tensor], lay: KVLayout) -> list[str]:
    """Per physical layer of ``lay``, the name of a layer viewing it (the first: several KV cache groups alias it)."""
    first: dict[int, str] = {}
    for name, t in views.items():
        first.setdefault(t.data_ptr(), name)
    return [first[t.data_ptr()] for t in lay.layers]


class KVXWorker:
    """Worker-side half of :class:`kvx.connector.KVXConnector`."""

    def __init__(
        self,
        config: KVXConfig,
        geom: EngineGeometry,
        fmt: str,
        fingerprint: str,
        share_of: Callable[[list[str]], Share] | None = None,
        fence_loads_at_start: bool = False,
        background_writes: bool = True,
    ):
        """``share_of``: this worker's :class:`~.parts.Share` of every chunk from its KV layers' names, in the
        cache's physical order (default: the whole chunk, layers numbered from 0). ``fence_loads_at_start``: fence
        every load in ``start_load_kv`` (no per-layer fences: a connector not ``layerwise``).
        ``background_writes``: tier writes run only on idle cores (SCHED_IDLE); a P/D producer's writes are what its
        consumer waits for, so it passes False (normal priority)."""
        self.config = config
        self.geom = geom
        self.fmt = fmt
        self.share_of = share_of  # None: the whole chunk (set when the caches' layout is known)
        self.share: Share | None = None  # fixed at the first registration
        # the engine's only worker writes each chunk's record itself (else the scheduler does: :mod:`.parts`)
        self.write_records = True
        self.fingerprint = fingerprint
        self.background_writes = background_writes
        self.cache: RegisteredKV | None = None  # the registered KV cache (None before registration, during a sleep)
        self.group_of: dict[str, int] = {}
        self.layer_of: dict[str, int] = {}  # layer name -> layer index in the layout
        self.pool: SlotPool | None = None
        self.tiers: dict[str, Tier] = {}  # the tiers after the CPU pool, by name
        self.engine: TransferEngine | None = None
        self._meta: KVXMetadata | None = None
        self._loads_started = False
        self._idle_step = False
        self._pd_pause = 0.0  # how long this idle step pauses in get_finished (worker thread)
        self._save_layers = False  # this step queues its saves layer by layer (save_kv_layer)
        self._group_ends: dict[str, int] = {}  # name of the last layer of each layer group -> the group
        self.results = WorkerResults()  # outcomes, counters, samples: the pipelines report here
        self.loads = LoadPipeline(self.results, self.tiers, fence_loads_at_start, geom.num_groups)
        if config.node_tier is not None:  # a chunk a pull brings: the pull's wait, and the engine's grace past it
            self.loads.coming_wait_s = config.node_tier.pull_wait_ms / 1e3 + 1.0
        self.saves = SavePipeline(self.results, self.tiers)
        self._polled_for_stats = False  # take_stats polled the saves since build_worker_meta last ran
        self.totals = Counter()  # every counter since start (take_stats adds to it)
        self._removed: list[tuple[str, str]] = []  # (tier, chunk key) removed from a byte tier here (any thread)
        self._removed_lock = threading.Lock()
        # (views, geometry, layout name, vLLM block count) registered last: kept across a sleep, to check and
        # describe the restored caches (vLLM's tensor objects, which vLLM keeps too: no memory held here; the
        # geometry is plain values, so no pointer or device table outlives unregister_kv_caches)
        self._registered: tuple[dict[str, torch.Tensor], tuple, object, int] | None = None

    # the registered cache's facts, for callers that knew them as the worker's
    @property
    def layout(self) -> KVLayout | None:
        return self.cache.layout if self.cache is not None else None

    @property
    def groups(self) -> list[tuple[int, int, KVLayout]]:
        return self.cache.groups if self.cache is not None else []

    @property
    def order(self):
        return self.cache.order if self.cache is not None else None

    @property
    def stats(self) -> Counter:
        return self.results.stats

    @property
    def out(self) -> KVXWorkerMetadata:
        return self.results.out

    @property
    def hist(self) -> dict[str, list[float]]:
        return self.results.hist

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
        if self.config.node_tier is not None:
            self.pool = node_pool(self.cache, lay.page_head_bytes is not None, pin=pin)
            self.pool.attach_now(self.config.node_tier.socket, self.config.node_tier.timeout)
            self.cache.pool = self.pool
        elif n_slots:
            shape = self.cache.host_storage_shape(self.cache.slot_shape())
            self.pool = CPUPool(n_slots, shape, self.cache.chunk_dtype, pin=pin)
            self.cache.pool = self.pool
        ctx = TierContext(self.fingerprint, role="worker", writes=self.share.writer, io_threads=self.config.io_threads)
        self.tiers.update({t.type: tier_class(t.type).open(t, ctx) for t in self.config.byte_tiers})
        for tier in self.tiers.values():
            tier.subscribe(self._on_tier_event)
        if self.tiers:
            # Reads keep normal priority: the forward waits for them (a SCHED_IDLE reader runs only when a
            # core is idle). Writers: as many per tier, so a slow tier does not hold up the others.
            reader = ThreadPoolExecutor(
                self.config.io_threads, thread_name_prefix="kvx-read", initializer=io_thread, initargs=(False,)
            )
            writer = ThreadPoolExecutor(
                self.config.io_threads * len(self.tiers),
                thread_name_prefix="kvx-write",
                initializer=io_thread,
                initargs=(self.background_writes,),
            )
            cache, shape = self.cache, self.cache.slot_shape()

            # write buffers (saves to the byte tiers alone): a few now, up to as many as the scheduler's write
            # backlog lets be in flight (each counts a whole buffer against every tier it writes)
            def new_buffer():
                return cache.host_empty(shape, pin=pin)

            per_tier = write_backlog(self.config, self.geom) // chunk_bytes(self.config, self.geom)
            cap = len(self.tiers) * per_tier
            buffers = WriteBuffers([new_buffer() for _ in range(min(2 * self.config.io_threads, cap))], new_buffer, cap)
            self.loads.use_reader(reader)
            self.saves.use_writer(writer, buffers)
        log.info(
            "kvx: worker (heads %s of %d, layers %s) registered %s, format %s, %d CPU slots, tiers %s, copies %s%s",
            self.share.heads,
            self.share.total_heads,
            self.share.layers,
            lay,
            self.fmt,
            n_slots,
            list(self.tiers) or "none",
            self.cache.path,
            f" (staging {self.engine.staging_bytes >> 20} MiB)" if self.engine.staged else "",
        )

    def _describe(self, kv_caches: dict[str, torch.Tensor], layout_name, num_blocks: int) -> None:
        """Everything tied to the KV tensors' addresses: the layout (layer pointers, the kernels' device tables),
        the layer groups and the layer names' places in them; the copy queues the first time."""
        views = dict(kv_caches)
        first = next(iter(views.values()))
        rows = int(first.shape[0])
        if num_blocks <= 0 or rows % num_blocks:
            raise ValueError(f"kv_caches: expected views with a multiple of {num_blocks} blocks, got {rows}")
        ratio = rows // num_blocks
        lay = KVLayout.from_vllm(
            views, layout_name, use_mla=self.geom.use_mla, backend="CPU_ATTN" if self.geom.opaque else None
        )
        if lay.block_size * ratio != self.geom.block_size or lay.num_heads != self.geom.num_kv_heads:
            raise ValueError(
                f"kv_caches: expected blocks of {self.geom.block_size} tokens x "
                f"{self.geom.num_kv_heads} heads, got {lay}"
            )
        if self.geom.num_groups > 1 and lay.num_layers != self.geom.num_layers:
            raise ValueError(
                f"kv_caches: expected the {self.geom.num_groups} KV cache groups' layers to alias "
                f"{self.geom.num_layers} tensors, got {lay.num_layers}"
            )
        if self.fmt == "pages" and lay.page is None:
            raise ValueError(
                f"kv_caches: the {lay.name} views have no contiguous page per block; use format 'canonical'"
            )
        rows = object_rows(self.geom, self.config.chunk_size)
        if self.fmt == "pages":
            shape = lay.page_shape(rows * (self.geom.block_size // lay.block_size))
        else:
            shape = lay.canonical_shape(rows * self.geom.block_size)
        geometry = (lay.dtype, lay.num_layers, lay.device, shape)
        if self._registered is not None and geometry != self._registered[1]:
            # restored after a sleep: the chunks in the tiers and the CPU pool's slots must still fit
            raise ValueError(
                f"kv_caches: expected caches of the geometry registered before the sleep "
                f"(dtype, layers, device, chunk shape {self._registered[1]}), got {geometry}"
            )
        if self.engine is None:
            self.engine = make_engine(lay.device)
        if self.share is None:
            if self.share_of is None:
                self.share = _whole_share(self.geom, head_parts(self.geom, self.fmt, layout_name), lay.num_layers)
            else:
                self.share = self.share_of(_physical_names(views, lay))
        self.cache = RegisteredKV(
            self.config,
            self.geom,
            self.fmt,
            lay,
            ratio,
            self.engine,
            self.pool,
            PartIO(self.share, self.fmt, records=self.write_records),
        )
        self.loads.attach(self.cache)
        self.saves.attach(self.cache)
        if self.engine.staged:
            self._configure_staging(lay)
        if lay.device.type == "cuda":
            # the kernels' device tables of layer addresses, uploaded now: a first upload inside a step would
            # make the host wait for the copy stream
            for layout in [lay] + [sub for _, _, sub in self.cache.groups]:
                layout.layer_ptrs(lay.device)
            if not os.environ.get("KVX_H2D_DMA_MIN_BYTES"):
                # DMA straight into blocks or staged, per piece size, measured now, not in a step; per device, on
                # scratch buffers (not the KV tensors): a sleep does not change it
                ops.calibrate_h2d(lay.device)
        ptr_to_layer = {t.data_ptr(): i for i, t in enumerate(lay.layers)}
        self.layer_of, self.group_of, self._group_ends = {}, {}, {}
        for name, t in views.items():
            layer = ptr_to_layer.get(t.data_ptr())
            if layer is not None:
                self.layer_of[name] = layer
                g = self.group_of[name] = self.cache.group_of_layer(layer)
                if layer == self.cache.groups[g][1] - 1:
                    self._group_ends[name] = g  # the layer that completes its group: save_kv_layer queues it
        self._registered = (views, geometry, layout_name, num_blocks)

    def _configure_staging(self, lay: KVLayout) -> None:
        """The engine's staging rings (``staging_bytes``), once the caches exist: a buffer must hold one block of
        one layer (the smallest leg), and on CUDA the device must have the budget free (vLLM's KV cache took its
        share of the device already)."""
        budget = self.config.staging_bytes
        buffer = budget // 4
        if buffer < lay.page_bytes:
            raise ConfigError(
                f"staging_bytes: expected at least {4 * lay.page_bytes} bytes (four staging buffers, each at least "
                f"one block of one layer, {lay.page_bytes} bytes), got {budget}"
            )
        if lay.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(lay.device)
            if free < budget:
                raise ConfigError(
                    f"staging_bytes: expected at most the {free >> 20} MiB free on {lay.device} after vLLM sized its "
                    f"KV cache, got {budget >> 20} MiB; lower staging_bytes or vLLM's gpu_memory_utilization"
                )
        self.engine.configure_staging(budget)

    # ------------------------------------------------------------------ sleep mode (vLLM >= 0.33)
    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep frees or unmaps the KV cache: drain every copy touching it, then drop what is
        tied to its addresses (layout, layer pointers, the kernels' device pointer tables, the layer groups).
        Kept: the CPU tier and the byte tiers with everything stored in them (a sleep loses no chunk), the
        write buffers, the tier writes still in flight (they read kvx's own host buffers, not the KV
        cache) and their results, which later steps report; the H2D calibration (per device). Freed: the
        device staging rings (made again on wake-up). Idempotent."""
        if self.layout is None:
            return
        self.loads.drain()  # every read in: its copies are queued, then run by the flush
        self.engine.flush()  # every copy of the KV cache, loads and gathers, has run
        self.loads.after_drain()  # a step vLLM did not finish (it drains them first): reported
        self.engine.drop_staging()  # device memory a sleeping engine should not hold
        # no job refers to the old blocks any more: a new cache (and BlockOrder) is described on wake-up
        self.cache, self.layer_of, self.group_of, self._group_ends = None, {}, {}, {}
        self.loads.attach(None)
        self.saves.attach(None)
        self.saves.bind(None)
        log.info(
            "kvx: worker (heads %s, layers %s) unregistered its KV caches (sleep); %s chunks stay in the tiers",
            self.share.heads,
            self.share.layers,
            "CPU and byte tier" if self.pool is not None else "byte tier",
        )

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
        log.info(
            "kvx: worker (heads %s, layers %s) restored its KV caches: %s",
            self.share.heads,
            self.share.layers,
            self.layout,
        )

    # the stored objects' shapes (:class:`~.cache.RegisteredKV`), for callers that knew them as the worker's
    @property
    def chunk_dtype(self) -> torch.dtype:
        return self.cache.chunk_dtype

    def chunk_shape(self, tokens: int, state: bool = False) -> tuple[int, ...]:
        """The shape of a stored object (:func:`~.common.object_rows`)."""
        return self.cache.chunk_shape(tokens, state)

    def slot_shape(self) -> tuple[int, ...]:
        """A CPU slot's (and a write buffer's) shape: the largest object, a chunk or a state object."""
        return self.cache.slot_shape()

    def slot_view(self, slot: int, tokens: int, state: bool = False) -> torch.Tensor:
        """The part of CPU slot ``slot`` that holds a chunk of ``tokens`` tokens (``state``: its state object)."""
        return self.cache.slot_view(slot, tokens, state)

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
        # a step that computes nothing (no block written, nothing to save): vLLM steps such steps back to back while
        # requests wait for their async loads, so its result hooks may wait for those a little (poll_async)
        self._idle_step = isinstance(meta, KVXMetadata) and not (meta.forward_blocks or meta.saves or meta.loads)
        self._pd_pause = 0.0
        if self._idle_step:  # a lookup put off: for a P/D producer's chunks, or for a pull's slots
            self._pd_pause = PD_IDLE_PAUSE_S if meta.pd_waiting else PULL_IDLE_PAUSE_S if meta.pull_waiting else 0.0
        if self.pool is not None and isinstance(meta, KVXMetadata):
            self.pool.attach(meta.node)  # the node's pool of this step's plans (mapped anew after a node restart)
        self._loads_started = False
        self.saves.bind(meta)
        # this step's layer-wise saves (decided once, not per layer)
        self._save_layers = self.config.save_layerwise and self.saves.has_saves() and self.geom.num_groups == 1

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or self.layout is None or self._loads_started:
            return
        self._loads_started = True  # start each step's loads once, even if called again
        self.loads.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Rule 4: the layer's loads fenced (one compiled call per plan); a step loading nothing returns at once."""
        if not self.loads.loading:
            return
        g = self.group_of.get(layer_name)
        if g is not None:
            self.loads.wait_for_layer(g)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Layer-wise saves: once the forward wrote the last layer of a layer group, that group's gathers
        are issued (after a marker the compiled call takes), so they overlap the rest of the forward. A step saving
        nothing returns at once."""
        if not self._save_layers:
            return
        g = self._group_ends.get(layer_name)
        if g is not None:
            self.saves.submit_group(g, self.loads.verdict)

    def wait_for_save(self) -> None:
        """End of the step's forward: finish the sync loads (if no result hook did), queue the gathers
        save_kv_layer did not, start the tier writes. Nothing here waits for a copy (on CPU the thread queue
        does: the copies there use the cores the next forward needs)."""
        self.loads.finish_sync()
        if self.engine is not None:
            self.engine.forward_done()
        if self.layout is not None and self.saves.has_saves():
            self.saves.finish_step(self.loads.verdict)
        self.saves.bind(None)
        self.loads.retire()

    # ------------------------------------------------------------------ results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads: finished once their reads are in and their copies have run (polled). Like every result
        hook, it first finishes the step's sync loads (the runners call the result hooks before or after
        ``wait_for_save``: :data:`kvx.testing.RUNNER_ORDERS`)."""
        self.loads.finish_sync()
        if self._pd_pause and not self.loads.has_async():
            pause, self._pd_pause = self._pd_pause, 0.0  # once per step
            time.sleep(pause)
        done = self.loads.poll_async(wait_s=IDLE_STEP_WAIT_S if self._idle_step else 0.0)
        self.loads.retire()
        return None, (done or None)

    def take_failed_requests(self) -> set[str]:
        """Several KV cache groups: requests whose async load failed, since the last call (each also
        returned by :meth:`get_finished` then or before)."""
        return self.loads.take_failed_requests()

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.loads.finish_sync()
        return self.loads.take_errors()

    def build_worker_meta(self) -> KVXWorkerMetadata | None:
        # the saves were polled by take_stats when vLLM asked for the step's stats first (it does, just
        # before this): a write is then counted in the same step's stats as the metadata that reports it;
        # polled again here, a write finished in between would reach the stats a step late, never on an
        # engine that goes idle with it
        self.loads.finish_sync()
        if not self._polled_for_stats:
            self.saves.poll()
        self._polled_for_stats = False
        with self._removed_lock:
            removed, self._removed = self._removed, []
        if removed and self.saves.writer is not None:
            # a chunk whose part went is no longer whole: its record goes too (off this thread), so lookups miss it
            for tier, key in removed:
                self.saves.writer.submit(self.tiers[tier].delete, key)
        out = self.results.take_out()
        out.removed, out.reads = removed, self.results.take_reads()
        if out.is_empty():
            return None
        if self.share is not None:
            out.layers = [self.share.layers]
        return out

    def idle(self) -> bool:
        """No load or save in flight on this worker."""
        return self.loads.idle() and self.saves.idle()

    def _on_tier_event(self, tier: str, event: str, keys) -> None:
        """A tier listener (any thread): chunks removed from a byte tier here (evicted to make room for a
        write, a corrupt copy dropped), for the scheduler's KV events and eviction counts."""
        if event != REMOVED:
            return
        # a chunk's first part names it, if this process wrote it: other parts, records and other processes' chunks
        # are not counted (a chunk is one eviction, not one per part)
        keys = [k for k in map(self.saves.chunk_of, keys) if k is not None]
        with self._removed_lock:
            self._removed += [(tier, k) for k in keys]

    def take_stats(self) -> dict:
        """Counters since the last call (vLLM reports them per step), and the latency samples
        (``load_seconds``, ``save_seconds``: lists); ``totals`` keeps the counters' sum."""
        self.saves.poll()
        self._polled_for_stats = True
        r = self.results
        stats, r.stats = dict(r.stats), Counter()
        self.totals.update(stats)
        for name, samples in r.hist.items():
            if samples:
                stats[name], r.hist[name] = samples, []
        return stats

    def clear(self) -> None:
        self._meta = None

    def close(self) -> None:
        """Finish every copy and write (a shutdown must not leave half-written state)."""
        self.loads.close()
        if self.engine is not None:
            self.engine.flush()
        self.loads.retire(block=True)
        self.saves.close()
        if self.loads.reader is not None:
            self.loads.reader.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
        if self.pool is not None:
            self.pool.close()
        for tier in self.tiers.values():
            tier.close()
