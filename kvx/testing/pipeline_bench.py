"""The layer-wise pipeline under test in ``benchmarks/bench_pipeline.py``: a synthetic per-layer forward
(:class:`Compute`) and a :class:`kvx.connector.worker.KVXWorker` built by hand and driven through vLLM's per-step hooks
(:class:`Bench`). See that script's docstring for what it measures.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch

from .. import engine as kvx_engine
from ..connector.config import KVXConfig
from ..connector.metadata import FAILED, ChunkLoad, ChunkSave, KVXMetadata, LoadSpec
from ..connector.worker import KVXWorker
from ..kernels import ops
from . import ResultTally, make_kv_caches
from .bench_timing import Clock
from .host_time import geometry

NO_KVX = "no kvx"  # the variant with no hook called: the host-time baseline
MAX_PAD_MS = 250.0  # the longest pad before a run (a host slower than its pad is counted "behind")


# ------------------------------------------------------------------ compute (Clock: kvx.testing.bench)
class Compute:
    """A synthetic per-layer forward on the current stream, sized to take ``target_ms``.

    ``matmul``: ``k`` square matmuls of size ``n`` (CUDA: bf16, the largest ``n`` of 4096..512 whose one
    matmul takes <= a third of the target, so rounding to whole matmuls errs by <= ~17%; CPU: float32,
    n = 64). ``sleep`` (CUDA): ``torch.cuda._sleep`` of the matching cycle count."""

    _unit_ms: dict[tuple, float] = {}

    def __init__(self, kind: str, clock: Clock, device: torch.device, target_ms: float):
        self.kind, self.clock, self.device = kind, clock, device
        self.target_ms = target_ms
        if kind == "sleep":
            if not clock.cuda:
                raise ValueError("--compute sleep: torch.cuda._sleep needs --device cuda")
            self.cycles = max(1, int(target_ms * clock.cycles_per_ms))
            self.desc = f"sleep {self.cycles} cycles"
            return
        if kind != "matmul":
            raise ValueError(f"--compute: expected matmul or sleep, got {kind!r}")
        sizes = (4096, 2048, 1024, 512) if clock.cuda else (64,)
        dtype = torch.bfloat16 if clock.cuda else torch.float32
        for n in sizes:
            unit = self._matmul_ms(n, dtype)
            if unit <= target_ms / 3:
                break
        self.n, self.k = n, max(1, round(target_ms / unit))
        self.a = torch.randn(n, n, dtype=dtype, device=device) / math.sqrt(n)
        self.b = torch.randn(n, n, dtype=dtype, device=device) / math.sqrt(n)
        self.c = torch.empty(n, n, dtype=dtype, device=device)
        self.desc = f"matmul {n}^2 x {self.k}"

    def _matmul_ms(self, n: int, dtype: torch.dtype) -> float:
        key = (str(self.device), n, dtype)
        if key not in self._unit_ms:
            a = torch.randn(n, n, dtype=dtype, device=self.device)
            c = torch.empty_like(a)
            reps = 10 if self.clock.cuda else 50
            per = self.clock.time_ms(lambda: [torch.mm(a, a, out=c) for _ in range(reps)], 5, pad_ms=5.0)
            self._unit_ms[key] = per / reps
        return self._unit_ms[key]

    def __call__(self) -> None:
        if self.kind == "sleep":
            torch.cuda._sleep(self.cycles)
        else:
            for _ in range(self.k):
                torch.mm(self.a, self.b, out=self.c)


# ------------------------------------------------------------------ the worker under test
@contextlib.contextmanager
def _copy_queue(value: str | None):
    """Set ``KVX_COPY_QUEUE`` for the run (read when the worker registers its caches), then restore it."""
    old = os.environ.get(kvx_engine.ENV)
    if value is not None:
        os.environ[kvx_engine.ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(kvx_engine.ENV, None)
        else:
            os.environ[kvx_engine.ENV] = old


class Bench:
    """A KVXWorker on per-layer caches of one shape, with the blocks and CPU slots for every case.

    Blocks: 0 is vLLM's null block and never used; a load of n chunks fills blocks [1, 1 + n*bpc) from slots
    [0, n); save step k writes and saves blocks [1 + k*n*bpc, 1 + (k+1)*n*bpc) into slots [k*n, (k+1)*n)."""

    def __init__(self, shape, args, device: torch.device, clock: Clock):
        self.shape, self.args, self.device, self.clock = shape, args, device, clock
        self.block, self.chunk = args.block_size, args.chunk_size
        self.bpc = self.chunk // self.block
        max_n = max(args.chunks)
        self.num_blocks = 1 + (args.save_steps + 1) * max_n * self.bpc
        geom, page_bytes = geometry(shape.layers, shape.kv_heads, shape.head_size, self.block, args.dtype)
        self.chunk_bytes = shape.layers * page_bytes * self.bpc
        self.layer_chunk_bytes = page_bytes * self.bpc  # one chunk of one layer
        slots = args.save_steps * max_n
        self.config = KVXConfig.from_extra_config(
            {
                "chunk_size": self.chunk,
                "tiers": [{"type": "cpu", "size": slots * self.chunk_bytes}],
                "layerwise": True,
                "save_layerwise": True,
                **({"copy_path": args.copy_path} if args.copy_path else {}),
            }
        )
        self.copy_path = self.config.copy_path  # what the worker was configured with
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        self.caches = make_kv_caches(
            args.layout,
            num_layers=shape.layers,
            num_blocks=self.num_blocks,
            block_size=self.block,
            num_heads=shape.kv_heads,
            head_size=shape.head_size,
            dtype=args.dtype,
            device=device,
        )
        self.worker = KVXWorker(self.config, geom, "canonical", "bench-pipeline")
        self.worker.register_kv_caches(dict(zip(self.names, self.caches)), args.layout, self.num_blocks)
        self.engine = self.worker.engine
        self.pool = self.worker.pool
        self.side = torch.cuda.Stream(device) if clock.cuda else None
        self.expected_loads = 0
        self.expected_saves = 0
        self.tally = ResultTally()  # transfer ids of the hand-built metadata

    def set_mode(self, layerwise: bool = True, save_layerwise: bool = True) -> None:
        """What KVXConnector does with the config: the worker reads ``save_layerwise`` per step from its
        config, and ``fence_loads_at_start`` is ``not layerwise``."""
        self.worker.config = self.config.model_copy(update={"layerwise": layerwise, "save_layerwise": save_layerwise})
        self.worker.loads.fence_at_start = not layerwise

    def close(self) -> None:
        self.worker.close()

    # -------------------------------------------------------------- blocks and metadata
    def chunk_blocks(self, first: int, i: int) -> list[int]:
        start = first + i * self.bpc
        return list(range(start, start + self.bpc))

    def load_meta(self, n: int, loads: bool) -> KVXMetadata:
        """A prefix hit on n chunks (CPU tier); the step computes its last token into the next block."""
        chunks = [
            ChunkLoad(
                key=f"hit{i}", tier="cpu", slot=i, block_ids=self.chunk_blocks(1, i), first_block=0, tokens=self.chunk
            )
            for i in range(n)
        ]
        spec = [LoadSpec(req_id="hit", chunks=chunks, is_async=False, xfer=self.tally.id("load", "hit"))]
        spec = spec if loads else []
        return KVXMetadata(loads=spec, forward_blocks=[1 + n * self.bpc])

    def save_metas(self, n: int, saves: bool) -> list[KVXMetadata]:
        """K prefill steps of n chunks each (saved when ``saves``), then one step saving nothing."""
        metas = []
        for k in range(self.args.save_steps + 1):
            first = 1 + k * n * self.bpc
            blocks = list(range(first, first + n * self.bpc))
            chunk_saves = (
                [
                    ChunkSave(
                        req_id=f"r{k}",
                        key=f"s{k}c{i}",
                        block_ids=self.chunk_blocks(first, i),
                        tokens=self.chunk,
                        slot=k * n + i,
                        slot_xfer=self.tally.id("slot", f"s{k}c{i}"),
                    )
                    for i in range(n)
                ]
                if saves and k < self.args.save_steps
                else []
            )
            metas.append(KVXMetadata(saves=chunk_saves, forward_blocks=blocks))
        return metas

    # -------------------------------------------------------------- one layer's copy (calibration)
    def layer_copy_ms(self, n: int, direction: str) -> float:
        """One layer's copy of n chunks as the worker issues it (layer 0's legs of one batch of them all, planned
        by the worker's cache: its copy path and staging buffers), both steps on a side stream."""
        cache = self.worker.cache
        batch = cache.copies()
        for i in range(n):
            op = "scatter_blocks" if direction == "h2d" else "gather_blocks"
            batch.add(op, self.chunk_blocks(1, i), cache.slot(i))
        plan = cache.plan(batch)
        lo, hi = plan.range_legs(0)
        staging = self.engine.ring("save" if batch.gather else "load").buffers[0] if plan.staged else None

        def copy():
            plan.run(staging, None, lo, hi)

        ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        with ctx:
            ms = self.clock.time_ms(copy, self.args.repeats, pad_ms=20.0)
        self.clock.sync()
        return ms

    # -------------------------------------------------------------- steps
    def _step(self, meta: KVXMetadata, compute, hooks: bool = True) -> tuple:
        if not hooks:  # the same step without kvx: the markers and the compute alone
            f0 = self.clock.mark()
            for _ in self.names:
                if compute is not None:
                    compute()
            f1 = self.clock.mark()
            return f0, f1, self.clock.mark()
        w = self.worker
        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        f0 = self.clock.mark()
        for i, name in enumerate(self.names):
            w.wait_for_layer_load(name)
            if compute is not None:
                compute()
            w.save_kv_layer(name, self.caches[i], None)
        f1 = self.clock.mark()
        w.wait_for_save()
        end = self.clock.mark()
        w.get_finished(set())
        errors = w.get_block_ids_with_load_errors()
        out = w.build_worker_meta()
        w.clear()
        if errors or (out is not None and (out.failed_blocks or any(FAILED in o for o in out.results.values()))):
            raise RuntimeError(f"the worker reported failed copies: load errors {sorted(errors)[:8]}, {out}")
        return f0, f1, end

    def run(self, metas: list[KVXMetadata], compute, pad_ms: float, hooks: bool = True) -> dict:
        """Steps back to back from an idle GPU, behind a pad; the times of the sequence (ms). ``hooks`` False:
        the same steps without kvx (``metas`` must then copy nothing)."""
        if not hooks and any(m.loads or m.saves for m in metas):
            raise ValueError("run: the steps without kvx must not load or save")
        self.clock.sync()
        self.clock.pad(pad_ms)
        t0 = time.perf_counter()
        start = self.clock.mark()
        marks = [self._step(m, compute, hooks) for m in metas]
        saves = any(m.saves for m in metas)
        if saves and self.clock.cuda:
            saved = self.clock.mark(self.engine.stream_of("save"))  # after every gather queued so far
        elif saves:
            self.engine.flush()
            saved = self.clock.mark()
        else:
            saved = None
        host_ms = (time.perf_counter() - t0) * 1e3
        self.clock.sync()
        self.worker.build_worker_meta()  # collect what finished since
        self.expected_loads += sum(len(c.chunks) for m in metas for c in m.loads)
        self.expected_saves += sum(len(m.saves) for m in metas)
        return {
            "step": self.clock.ms(start, marks[-1][2]),
            "fwd": sum(self.clock.ms(f0, f1) for f0, f1, _ in marks),
            "saved": self.clock.ms(start, saved) if saved is not None else None,
            "host": host_ms,
            "behind": self.clock.cuda and host_ms > pad_ms,
        }

    def measure(self, variants: dict, warmup: int, repeats: int) -> tuple[dict, float]:
        """``variants``: name -> (set_mode kwargs, metas, compute). Warm-up (the first without a pad, which
        sizes the pad), then the variants interleaved in every repeat. Returns name -> list of runs."""
        host, pad_ms = [], 0.0
        for _ in range(max(1, warmup)):
            for name, (mode, metas, compute) in variants.items():
                self.set_mode(**mode)
                host.append(self.run(metas, compute, pad_ms=pad_ms, hooks=name != NO_KVX)["host"])
            pad_ms = min(MAX_PAD_MS, 1.5 * max(host) + 1.0) if self.clock.cuda else 0.0
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, (mode, metas, compute) in variants.items():
                self.set_mode(**mode)
                runs[name].append(self.run(metas, compute, pad_ms, hooks=name != NO_KVX))
        self.set_mode()
        return runs, pad_ms

    # -------------------------------------------------------------- checks
    def check_loaded(self, n: int) -> None:
        """The blocks a load filled hold their slot's bytes."""
        for i in range(n):
            got = ops.gather_blocks(self.worker.layout, self.chunk_blocks(1, i)).cpu()
            if not torch.equal(got.view(torch.int16), self.worker.cache.slot(i).view(torch.int16)):
                raise RuntimeError(f"{self.shape.name}: blocks of loaded chunk {i} do not hold CPU slot {i}")

    def check_saved(self, n: int) -> None:
        """Every saved slot holds its blocks' bytes."""
        for k in range(self.args.save_steps):
            first = 1 + k * n * self.bpc
            for i in range(n):
                got = ops.gather_blocks(self.worker.layout, self.chunk_blocks(first, i)).cpu()
                if not torch.equal(got.view(torch.int16), self.worker.cache.slot(k * n + i).view(torch.int16)):
                    raise RuntimeError(
                        f"{self.shape.name}: CPU slot {k * n + i} does not hold the blocks saved into it"
                    )

    def check_counts(self) -> None:
        """The worker counted every chunk this script asked it to load and save, and no error."""
        stats = self.worker.take_stats()
        got = (stats.get("loaded_chunks", 0), stats.get("saved_chunks", 0))
        if got != (self.expected_loads, self.expected_saves):
            raise RuntimeError(
                f"{self.shape.name}: the worker loaded/saved {got} chunks, expected "
                f"{(self.expected_loads, self.expected_saves)}"
            )
        bad = {k: v for k, v in stats.items() if "error" in k and v}
        if bad:
            raise RuntimeError(f"{self.shape.name}: the worker counted errors: {bad}")


# ------------------------------------------------------------------ the cases
