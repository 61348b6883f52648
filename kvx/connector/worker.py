"""Worker side of the connector: moves chunk bytes between the paged KV cache and the tiers.

Runs in each vLLM worker process (one per TP/PP rank). What to move comes from the scheduler's
:class:`KVXMetadata`; how is :mod:`kvx.ops` on the :class:`kvx.engine.TransferEngine` copy queue.

Loads (``start_load_kv``): each chunk's source is resolved (CPU pool slot, or the chunk file read and
verified on an I/O thread, promoted into a CPU slot when the scheduler allotted one); then one copy job
per *layer group* scatters every chunk into its blocks. ``wait_for_layer_load`` fences the group of
that layer (CUDA: one group per layer, so loading overlaps the forward; CPU: one group, the copy already
uses every core). A chunk that cannot be read or verified is not written; its blocks are reported by
``get_block_ids_with_load_errors`` so vLLM recomputes them.

Saves (``wait_for_save``): after the forward wrote the KV (a marker on the compute stream), one gather
per chunk into its CPU slot (or a staging buffer), then the file write on an I/O thread. A save whose
KV depends on a block whose load failed on this worker is dropped before anything is gathered
(:mod:`.validity`); the failed blocks go back to the scheduler with the step's results. On CPU the
gathers finish before ``wait_for_save`` returns; on CUDA they run on the side stream and the compute
stream is fenced on them (``handle_preemptions``) before blocks of finished or preempted requests can
be reused.

Thread ownership: everything here runs on vLLM's worker thread, except the I/O pool (disk reads and
writes: touches only the tensors handed to it) and the engine's copy thread on CPU.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import ops
from ..engine import Job, TransferEngine
from ..layout import KVLayout
from ..log import Throttle, get_logger
from ..store import CPUPool, DiskStore, StoreFullError
from .common import EngineGeometry, num_cpu_slots
from .config import KVXConfig
from .keys import rank_key
from .metadata import ChunkLoad, ChunkSave, KVXMetadata, KVXWorkerMetadata, LoadSpec
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


@dataclass
class _Load:
    spec: LoadSpec
    jobs: list[Job]
    blocks: dict[str, list[int]]              # chunk key -> its destination blocks
    failed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: list[torch.Tensor] = field(default_factory=list)   # pinned sources the kernels may still read
    early: Job | None = None                  # chunks that must land before the forward (see ChunkLoad)


@dataclass
class _Save:
    save: ChunkSave
    job: Job | None
    disk: Future | None = None
    staging: int | None = None
    reported_cpu: bool = False


class KVXWorker:
    """Worker-side half of :class:`kvx.connector.KVXConnector`."""

    def __init__(self, config: KVXConfig, geom: EngineGeometry, fmt: str, fingerprint: str,
                 shard: int, shards: int, writes: bool):
        self.config = config
        self.geom = geom
        self.fmt = fmt
        self.shard, self.shards, self.writes = shard, shards, writes
        self.fingerprint = fingerprint
        self.layout: KVLayout | None = None
        self.groups: list[tuple[int, int, KVLayout]] = []   # (first layer, end layer, sub-layout)
        self.group_of: dict[str, int] = {}
        self.pool: CPUPool | None = None
        self.disk: DiskStore | None = None
        self.engine: TransferEngine | None = None
        self.reader: ThreadPoolExecutor | None = None   # disk reads for loads: on the critical path
        self.writer: ThreadPoolExecutor | None = None   # disk writes: background (SCHED_IDLE)
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[int] = []
        self._staging_cv = threading.Condition()
        self._meta: KVXMetadata | None = None
        self._sync_loads: list[_Load] = []
        self._async_loads: dict[str, _Load] = {}
        self._saves: list[_Save] = []
        self._fence_reqs: set[str] = set()
        self._errors: set[int] = set()
        self.outcomes = LoadOutcomes()
        self.throttle = Throttle(log)
        self._out = KVXWorkerMetadata()
        self._stats = Counter()
        self.totals = Counter()               # every counter since start (take_stats adds to it)
        self.fence_loads_at_start = False     # fence every load in start_load_kv (no per-layer fences)
        self._loads_started = False

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout_name, num_blocks: int) -> None:
        """Describe vLLM's per-layer views and allocate the tiers' worker-side resources.

        ``num_blocks`` is vLLM's block count: views whose dim 0 is a multiple of it hold kernel blocks
        (each vLLM block split in ``ratio`` pieces); block ids are then expanded on the fly.
        """
        views = dict(kv_caches)
        first = next(iter(views.values()))
        rows = int(first.shape[0])
        if num_blocks <= 0 or rows % num_blocks:
            raise ValueError(f"kv_caches: expected views with a multiple of {num_blocks} blocks, got {rows}")
        self.ratio = rows // num_blocks
        self.layout = KVLayout.from_vllm(views, layout_name, use_mla=self.geom.use_mla,
                                         backend="CPU_ATTN" if self.geom.opaque else None)
        lay = self.layout
        if lay.block_size * self.ratio != self.geom.block_size or lay.num_heads != self.geom.num_kv_heads:
            raise ValueError(f"kv_caches: expected blocks of {self.geom.block_size} tokens x "
                             f"{self.geom.num_kv_heads} heads, got {lay}")
        if self.fmt == "pages" and lay.page is None:
            raise ValueError(f"kv_caches: the {lay.name} views have no contiguous page per block; use "
                             "format 'canonical'")
        # Layer groups: the unit wait_for_layer_load fences. One per layer on CUDA (loads overlap the
        # forward); one for all layers on CPU (the CPU copy already uses every core).
        per_layer = lay.device.type == "cuda"
        bounds = [(i, i + 1) for i in range(lay.num_layers)] if per_layer else [(0, lay.num_layers)]
        for a, b in bounds:
            sub = KVLayout.from_tensors(list(lay.layers[a:b]), lay.name, lay.layer_names[a:b])
            self.groups.append((a, b, sub))
        ptr_to_layer = {t.data_ptr(): i for i, t in enumerate(lay.layers)}
        for name, t in views.items():
            layer = ptr_to_layer.get(t.data_ptr())
            if layer is not None:
                self.group_of[name] = next(g for g, (a, b, _) in enumerate(self.groups) if a <= layer < b)
        pin = lay.device.type == "cuda"
        n_slots = num_cpu_slots(self.config, self.geom)
        if n_slots:
            self.pool = CPUPool(n_slots, self.chunk_shape(self.config.chunk_size), self.chunk_dtype, pin=pin)
        disk = self.config.disk_tier
        if disk is not None:
            self.disk = DiskStore(disk.path, disk.size, self.fingerprint, fsync=disk.fsync, rescan_s=disk.rescan_s)
            # Reads keep normal priority: the forward waits for them (a SCHED_IDLE reader runs only when a
            # core is idle).
            self.reader = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvx-read")
            self.writer = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvx-write",
                                             initializer=_background_priority)
            n_staging = 2 * self.config.io_threads
            self._staging = [torch.empty(self.chunk_shape(self.config.chunk_size), dtype=self.chunk_dtype,
                                         pin_memory=pin) for _ in range(n_staging)]
            self._staging_free = list(range(n_staging))
        self.engine = TransferEngine(lay.device)
        log.info("kvx: worker %d/%d registered %s, format %s, %d CPU slots, disk %s", self.shard, self.shards,
                 lay, self.fmt, n_slots, disk.path if disk else None)

    @property
    def chunk_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fmt == "pages" else self.layout.dtype

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        if self.fmt == "pages":
            return self.layout.page_shape(tokens // self.layout.block_size)
        return self.layout.canonical_shape(tokens)

    def _blocks_view(self, chunk: torch.Tensor, first_block: int, n_blocks: int, layers=None) -> torch.Tensor:
        """The part of a chunk tensor that holds vLLM blocks [first_block, first_block + n_blocks)."""
        unit = self.ratio if self.fmt == "pages" else self.geom.block_size
        view = chunk.narrow(2, first_block * unit, n_blocks * unit)
        return view if layers is None else view[layers[0]: layers[1]]

    def _kernel_ids(self, block_ids: list[int]) -> list[int]:
        if self.ratio == 1:
            return block_ids
        return [b * self.ratio + r for b in block_ids for r in range(self.ratio)]

    def _gather(self, layout: KVLayout, block_ids, out: torch.Tensor) -> None:
        fn = ops.gather_pages if self.fmt == "pages" else ops.gather_blocks
        fn(layout, self._kernel_ids(block_ids), out, max_ctas=self.config.max_ctas)

    def _scatter(self, layout: KVLayout, block_ids, src: torch.Tensor) -> None:
        fn = ops.scatter_pages if self.fmt == "pages" else ops.scatter_blocks
        fn(layout, self._kernel_ids(block_ids), src, max_ctas=self.config.max_ctas)

    def _slot_view(self, slot: int, tokens: int) -> torch.Tensor:
        return self._blocks_view(self.pool.slot(slot), 0, tokens // self.geom.block_size)

    # ------------------------------------------------------------------ per step
    def handle_preemptions(self, meta: KVXMetadata | None) -> None:
        """Fence saves still reading blocks of requests that were preempted or have finished."""
        if meta is not None:
            self._fence_reqs.update(meta.preempted)
        if not self._fence_reqs:
            return
        for s in self._saves:
            if s.job is not None and s.save.req_id in self._fence_reqs:
                try:
                    self.engine.fence(s.job)
                except Exception:  # reported by _poll_saves
                    pass
        self._fence_reqs.clear()

    def bind(self, meta: KVXMetadata) -> None:
        self._meta = meta
        self._loads_started = False

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or self.layout is None or self._loads_started:
            return
        self._loads_started = True   # start each step's loads once, even if called again
        for spec in meta.loads:
            load = self._start_load(spec)
            if spec.is_async:
                self._async_loads[spec.req_id] = load
            else:
                self._sync_loads.append(load)
                if load.early is not None:
                    self._fence_job(load, load.early)
                if self.fence_loads_at_start:
                    for job in load.jobs:
                        self._fence_job(load, job)

    def _start_load(self, spec: LoadSpec) -> _Load:
        t0 = time.perf_counter()
        sources: list[tuple[ChunkLoad, Future]] = []
        load = _Load(spec, [], {ch.key: ch.block_ids for ch in spec.chunks})
        for ch in spec.chunks:
            self.outcomes.started(ch.block_ids)
            if ch.tier == "cpu":
                f: Future = Future()
                f.set_result(self._slot_view(ch.slot, ch.tokens))
                sources.append((ch, f))
            else:
                sources.append((ch, self.reader.submit(self._read_chunk, ch, load)))

        def scatter(chunks: list[tuple[ChunkLoad, Future]], a: int, b: int, sub: KVLayout, last: bool) -> None:
            for ch, fut in chunks:
                try:
                    src = fut.result()
                except Exception as e:  # noqa: BLE001 - any read failure means "recompute"
                    with load.lock:
                        if ch.key not in load.failed:
                            load.failed.add(ch.key)
                            self.throttle.warning(_cause("load", e), "kvx: request %s: chunk %s not loaded (%s); "
                                                  "vLLM recomputes it", spec.req_id, ch.key, e)
                    continue
                self._scatter(sub, ch.block_ids, self._blocks_view(src, ch.first_block, len(ch.block_ids),
                                                                   (a, b)))
            if last:
                self._stats["load_ms"] += (time.perf_counter() - t0) * 1e3

        # A chunk whose last block also receives this step's tokens goes first, all layers at once, and is
        # fenced before the forward (start_load_kv); the rest is fenced layer group by layer group.
        early = [(ch, f) for ch, f in sources if ch.before_forward]
        rest = [(ch, f) for ch, f in sources if not ch.before_forward]
        if early:
            load.early = self.engine.submit(lambda: scatter(early, 0, self.layout.num_layers, self.layout, False),
                                            name=f"load {spec.req_id} before forward")
        for g, (a, b, sub) in enumerate(self.groups):
            last = g == len(self.groups) - 1
            load.jobs.append(self.engine.submit(lambda a=a, b=b, sub=sub, last=last: scatter(rest, a, b, sub, last),
                                                name=f"load {spec.req_id} group {g}"))
        self._stats["loaded_chunks"] += len(spec.chunks)
        self._stats["loaded_blocks"] += sum(len(c.block_ids) for c in spec.chunks)
        return load

    def _read_chunk(self, ch: ChunkLoad, load: _Load) -> torch.Tensor:
        """Read and verify one chunk file; promote it into its CPU slot; return a copyable source."""
        data = self.disk.get(rank_key(ch.key, self.shard, self.shards) if self.shards > 1 else ch.key,
                             self.chunk_shape(ch.tokens), self.chunk_dtype)
        self._stats["disk_reads"] += 1
        if ch.slot is not None:
            dst = self._slot_view(ch.slot, ch.tokens)
            dst.copy_(data)
            return dst
        if self.layout.device.type == "cuda":      # the kernel reads host memory only when pinned
            pinned = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            pinned.copy_(data)
            with load.lock:
                load.keep.append(pinned)           # alive until the copy jobs finished
            return pinned
        return data

    def wait_for_layer_load(self, layer_name: str) -> None:
        g = self.group_of.get(layer_name)
        if g is None:
            return
        for load in self._sync_loads:
            self._fence(load, g)

    def _fence(self, load: _Load, g: int) -> None:
        self._fence_job(load, load.jobs[g])

    def _fence_job(self, load: _Load, job: Job) -> None:
        try:
            self.engine.fence(job)
        except Exception as e:  # noqa: BLE001 - the copy itself failed: recompute every chunk
            self._fail_all(load, e)

    def _fail_all(self, load: _Load, e: BaseException) -> None:
        with load.lock:
            if len(load.failed) < len(load.spec.chunks):
                self.throttle.error(_cause("copy", e), "kvx: request %s: load failed (%s); vLLM recomputes it",
                                    load.spec.req_id, e)
                load.failed.update(load.blocks)

    def _finish_load(self, load: _Load) -> None:
        for job in ([load.early] if load.early is not None else []) + load.jobs:
            try:
                job.wait()
            except Exception as e:  # noqa: BLE001
                self._fail_all(load, e)
        for ch in load.spec.chunks:
            if ch.key in load.failed:
                self._errors.update(ch.block_ids)
                self.outcomes.failed(ch.block_ids)
                self._out.failed_blocks.extend(ch.block_ids)
                self._stats["load_errors"] += 1
            if ch.tier == "disk" and ch.slot is not None:
                _count(self._out.unstored if ch.key in load.failed else self._out.stored, ch.key)
        load.keep.clear()
        _count(self._out.loads_done, load.spec.req_id)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Nothing per layer: chunks are saved for all layers at once in wait_for_save."""

    def wait_for_save(self) -> None:
        meta = self._meta
        for load in self._sync_loads:        # every sync load of this step is complete by now
            self._finish_load(load)
        self._sync_loads = []
        if meta is None or self.layout is None or not meta.saves:
            return
        marker = self.engine.marker()
        t0 = time.perf_counter()
        for s in meta.saves:
            if s.deps and self.outcomes.taints(s.deps):
                # computed against KV that never arrived: vLLM recomputes it, and the scheduler plans the
                # chunk again once it has
                if s.slot is not None:
                    _count(self._out.unstored, s.key)
                if s.to_disk:
                    _count(self._out.disk_done, s.key)
                self._stats["saves_dropped"] += 1
                continue
            rec = _Save(s, None)
            if s.from_slot is not None:
                src = self._slot_view(s.from_slot, s.tokens)
            else:
                if s.slot is not None:
                    dest = self._slot_view(s.slot, s.tokens)
                else:
                    rec.staging = self._acquire_staging()
                    dest = self._blocks_view(self._staging[rec.staging], 0, s.tokens // self.geom.block_size)
                rec.job = self.engine.submit(lambda s=s, dest=dest: self._gather(self.layout, s.block_ids, dest),
                                             after=marker, name=f"save {s.key}")
                src = dest
            if s.to_disk:
                if self.writes:
                    rec.disk = self.writer.submit(self._write_chunk, s, src, rec.job)
                else:
                    _count(self._out.disk_done, s.key)
            self._saves.append(rec)
            self._stats["saved_chunks"] += 1
        if self.layout.device.type == "cpu":
            for rec in self._saves:
                if rec.job is not None:
                    try:
                        rec.job.wait()
                    except Exception:  # noqa: BLE001 - reported by _poll_saves
                        pass
            self._stats["save_ms"] += (time.perf_counter() - t0) * 1e3

    def _write_chunk(self, s: ChunkSave, src: torch.Tensor, job: Job | None) -> bool:
        if job is not None:
            job.wait()
        key = rank_key(s.key, self.shard, self.shards) if self.shards > 1 else s.key
        t0 = time.perf_counter()
        written = self.disk.put(key, src, {"tokens": str(s.tokens), "format": self.fmt})
        self._stats["disk_write_ms"] += (time.perf_counter() - t0) * 1e3
        return written

    def _acquire_staging(self) -> int:
        with self._staging_cv:
            while not self._staging_free:
                self._staging_cv.wait(timeout=0.05)
                self._poll_saves(block=False)
            return self._staging_free.pop()

    def _release_staging(self, idx: int) -> None:
        with self._staging_cv:
            self._staging_free.append(idx)
            self._staging_cv.notify_all()

    def _poll_saves(self, block: bool = False) -> None:
        keep = []
        for rec in self._saves:
            s = rec.save
            if rec.job is not None and not rec.reported_cpu:
                if block:
                    _settle(rec.job.wait)
                if rec.job.done():
                    rec.reported_cpu = True
                    err = rec.job.error()
                    if err is not None:
                        self.throttle.error(_cause("save", err), "kvx: saving chunk %s failed: %s", s.key, err)
                        self._stats["save_errors"] += 1
                    if s.slot is not None:
                        _count(self._out.unstored if err is not None else self._out.stored, s.key)
            if rec.disk is not None:
                if block:
                    _settle(rec.disk.result)
                if rec.disk.done():
                    err = rec.disk.exception()
                    if isinstance(err, StoreFullError):     # expected under pressure: the chunk stays uncached
                        self.throttle.warning(_cause("disk full", err), "kvx: chunk %s not written to disk: %s",
                                              s.key, err)
                        self._stats["disk_full"] += 1
                    elif err is not None:
                        self.throttle.error(_cause("disk write", err), "kvx: writing chunk %s to disk failed: %s",
                                            s.key, err)
                        self._stats["disk_write_errors"] += 1
                    elif rec.disk.result():
                        self._stats["disk_writes"] += 1
                    _count(self._out.disk_done, s.key)
                    rec.disk = None
            cpu_pending = rec.job is not None and not rec.reported_cpu
            if cpu_pending or rec.disk is not None:
                keep.append(rec)
            elif rec.staging is not None:
                self._release_staging(rec.staging)
        self._saves = keep

    # ------------------------------------------------------------------ results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._fence_reqs.update(finished_req_ids)
        done = set()
        for rid, load in list(self._async_loads.items()):
            if all(j.done() for j in load.jobs) and (load.early is None or load.early.done()):
                self._finish_load(load)
                del self._async_loads[rid]
                done.add(rid)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_worker_meta(self) -> KVXWorkerMetadata | None:
        self._poll_saves(block=False)
        out, self._out = self._out, KVXWorkerMetadata()
        return None if out.is_empty() else out

    def take_stats(self) -> dict:
        """Counters since the last call (vLLM reports them per step); ``totals`` keeps the sum."""
        stats, self._stats = dict(self._stats), Counter()
        self.totals.update(stats)
        return stats

    def clear(self) -> None:
        self._meta = None

    def close(self) -> None:
        """Finish every copy and write (a shutdown must not leave half-written state)."""
        for load in list(self._async_loads.values()) + self._sync_loads:
            for j in load.jobs:
                try:
                    j.wait()
                except Exception:  # noqa: BLE001
                    pass
        self._poll_saves(block=True)
        for pool in (self.reader, self.writer):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
        if self.pool is not None:
            self.pool.close()
        if self.disk is not None:
            self.disk.close()

