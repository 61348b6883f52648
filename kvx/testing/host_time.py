"""Host time of the worker's hooks and of one op, on a machine without a GPU: ``bench_pipeline.py --host-only``.

vLLM calls ``wait_for_layer_load`` and ``save_kv_layer`` inside the model's forward, layer by layer, on the host thread
that launches the model's kernels: whatever they cost on the host lands on the forward. This measures that cost where
CI runs, with :class:`kvx.engine.NullEngine`: the worker plans and issues every copy through the compiled path exactly
as on a CUDA engine (plans, run lists, launches decided, the ordering rules, the staging rings), and the CUDA API
calls themselves are not made but counted (``kvx._C.NullQueues``; each costs a few microseconds on a GPU host: count
them per layer to add that).

Steps (a :class:`kvx.connector.worker.KVXWorker` on per-layer caches as vLLM >= 0.32 hands them over, CPU tier, hand-
built metadata; the hooks in vLLM's order)::

    handle_preemptions -> bind -> start_load_kv -> per layer: wait_for_layer_load, save_kv_layer
    -> wait_for_save -> get_finished -> get_block_ids_with_load_errors -> build_worker_meta

against the same step without kvx (the same loop over the layers, no hook called). Variants: a step loading N chunks
from the CPU tier, a step saving N chunks (``save_layerwise``), a step with nothing to copy (a decode step: its forward
writes one block); one layer's batch (the per-layer hook of a step with N chunks: its compiled call, layers after the
first); one op (``ops.gather_blocks`` of one chunk, staged and auto, checked, planned and issued). Medians of
``repeats`` timed runs after a warm-up, the variant and its baseline interleaved.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .bench_timing import median

HOST_STEP_1_MS = 0.3  # a step loading or saving 1 chunk over 32 layers, over the step without kvx
HOST_STEP_8_MS = 1.0  # ... 8 chunks
HOST_IDLE_US = 5.0  # a step with nothing to copy, per layer
HOST_LAYER_US = 15.0  # one layer's batch of copies (1-8 chunks)
HOST_OP_US = 20.0  # one op


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int = 16
    chunk: int = 256


LLAMA3_8B = Shape("llama3-8b", 32, 8, 128)


@dataclasses.dataclass
class Row:
    variant: str  # "load", "save", "nothing", "layer load", "layer save", "op"
    chunks: int
    host_us: float  # per step (per call for "layer" and "op")
    base_us: float  # the same step without kvx (0 for "layer" and "op")
    layers: int
    calls: dict  # CUDA API calls a CUDA engine would make, per step (per call)

    @property
    def over_us(self) -> float:
        return self.host_us - self.base_us


def python_speed_us(repeats: int = 200) -> float:
    """A fixed piece of Python (``sum(range(1000))``), median microseconds: this machine's speed at the time, printed
    beside the figures (a shared VM's slow phases slow every figure alike: ~13.5 us on the 2-core VM when quiet,
    ~18-19 in a slow phase)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sum(range(1000))
        samples.append(time.perf_counter() - t0)
    return _median_us(samples)


def _median_us(samples: list[float]) -> float:
    return median(samples) * 1e6


def geometry(layers: int, kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype):
    """The :class:`kvx.connector.common.EngineGeometry` of a dense-attention model of this shape (one worker holding
    every KV head), and one block's bytes of one layer: what the benchmarks' workers are built with."""
    from ..connector.common import EngineGeometry

    page_bytes = 2 * block_size * kv_heads * head_size * torch.empty((), dtype=dtype).element_size()
    geom = EngineGeometry(
        block_size=block_size,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=dtype,
        use_mla=False,
        opaque=False,
        isa="",
        page_bytes=page_bytes,
    )
    return geom, page_bytes


class Worker:
    """A worker of ``shape`` with a null engine, a CPU tier of ``slots`` chunks and caches for the steps' blocks.
    Blocks: 0 is vLLM's null block; a load of n chunks fills blocks [1, 1 + n*bpc) from slots [0, n); a save of n
    chunks reads blocks [1 + n_max*bpc, ...) into slots [n_max, n_max + n)."""

    def __init__(self, shape: Shape, n_max: int, layout: str = "LBNHC", dtype=torch.bfloat16):
        from ..connector.config import KVXConfig
        from ..connector.worker import KVXWorker
        from ..engine import NullEngine
        from . import ResultTally, make_kv_caches

        self.shape, self.n_max = shape, n_max
        self.bpc = shape.chunk // shape.block_size
        geom, page_bytes = geometry(shape.layers, shape.kv_heads, shape.head_size, shape.block_size, dtype)
        chunk_bytes = shape.layers * page_bytes * self.bpc
        self.config = KVXConfig.from_extra_config(
            {
                "chunk_size": shape.chunk,
                "tiers": [{"type": "cpu", "size": 2 * n_max * chunk_bytes}],
                "layerwise": True,
                "save_layerwise": True,
            }
        )
        self.num_blocks = 2 + 2 * n_max * self.bpc
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        # untouched memory: the null engine copies nothing, so the caches' pages are never committed
        caches = make_kv_caches(
            layout,
            num_layers=shape.layers,
            num_blocks=self.num_blocks,
            block_size=shape.block_size,
            num_heads=shape.kv_heads,
            head_size=shape.head_size,
            dtype=dtype,
            device="cpu",
            fill=False,
        )
        self.worker = KVXWorker(self.config, geom, "canonical", "bench-host-time")
        self.worker.engine = NullEngine(torch.device("cpu"))
        self.worker.register_kv_caches(dict(zip(self.names, caches)), layout, self.num_blocks)
        self.engine = self.worker.engine
        self.tally = ResultTally()

    def blocks(self, first: int, i: int) -> list[int]:
        start = first + i * self.bpc
        return list(range(start, start + self.bpc))

    def load_meta(self, n: int):
        from ..connector.metadata import ChunkLoad, KVXMetadata, LoadSpec

        chunks = [ChunkLoad(f"hit{i}", "cpu", i, self.blocks(1, i), 0, self.shape.chunk) for i in range(n)]
        spec = LoadSpec("hit", chunks, False, self.tally.id("load", "hit"))
        return KVXMetadata(loads=[spec], forward_blocks=[1 + n * self.bpc])

    def save_meta(self, n: int):
        from ..connector.metadata import ChunkSave, KVXMetadata

        first = 1 + self.n_max * self.bpc
        saves = [
            ChunkSave(
                "r",
                f"s{i}",
                self.blocks(first, i),
                self.shape.chunk,
                self.n_max + i,
                slot_xfer=self.tally.id("slot", "s"),
            )
            for i in range(n)
        ]
        return KVXMetadata(saves=saves, forward_blocks=[b for s in saves for b in s.block_ids])

    def nothing_meta(self):
        from ..connector.metadata import KVXMetadata

        return KVXMetadata(forward_blocks=[1])

    def step(self, meta, layer_times: list[float] | None = None) -> float:
        """One step through every hook; its host time (s). ``layer_times``: each layer's hook time, appended."""
        w, clock = self.worker, time.perf_counter
        t0 = clock()
        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        for name in self.names:
            if layer_times is not None:
                a = clock()
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, None, None)
                layer_times.append(clock() - a)
            else:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, None, None)
        w.wait_for_save()
        w.get_finished(set())
        w.get_block_ids_with_load_errors()
        w.build_worker_meta()
        w.clear()
        return clock() - t0

    def no_kvx(self, meta) -> float:
        """The same step without kvx: the loop over the layers, no hook called."""
        t0 = time.perf_counter()
        for _name in self.names:
            pass
        return time.perf_counter() - t0

    def close(self) -> None:
        self.worker.close()


_CALLS = ("records", "waits", "dma_calls", "launches", "uploads")


def _snapshot(queues) -> dict:
    return {k: getattr(queues, k) for k in _CALLS}


class _Variant:
    """One thing timed: ``fn()`` returns its seconds (a list: several samples), ``base()`` its baseline's; the samples
    kept, and the CUDA calls counted on ``queues`` while it runs."""

    def __init__(self, name: str, chunks: int, fn, base=None, queues=None, layers: int = 1):
        self.name, self.chunks, self.fn, self.base, self.queues, self.layers = name, chunks, fn, base, queues, layers
        self.samples: list[float] = []
        self.base_samples: list[float] = []
        self.calls = dict.fromkeys(_CALLS, 0)
        self.runs = 0

    def run(self, n: int, keep: bool) -> None:
        before = _snapshot(self.queues) if self.queues is not None else None
        for _ in range(n):
            t = self.fn()
            b = self.base() if self.base is not None else 0.0
            if keep:
                if isinstance(t, list):
                    self.samples.extend(t)
                else:
                    self.samples.append(t)
                self.base_samples.append(b)
        if before is not None and keep:
            now = _snapshot(self.queues)
            for k in _CALLS:
                self.calls[k] += now[k] - before[k]
            self.runs += n

    def row(self) -> Row:
        calls = {k: v / self.runs for k, v in self.calls.items()} if self.runs else {}
        base = _median_us(self.base_samples) if self.base is not None else 0.0
        return Row(self.name, self.chunks, _median_us(self.samples), base, self.layers, calls)


def measure(w: Worker, chunks: tuple[int, ...], warmup: int, repeats: int, op_repeats: int, rounds: int = 10):
    """Every variant (see the module docstring), ``repeats`` samples each (ops: ``op_repeats``), in ``rounds`` rounds:
    each round runs a share of every variant in turn, so that a slow phase of the machine (a shared VM's) falls on all
    of them alike; medians over every round's samples. Returns a :class:`Row` per variant."""
    from .._ext import require
    from ..kernels.layout import Op
    from ..kernels.plan import Copies

    L = w.shape.layers
    q = w.engine.queues
    variants: list[_Variant] = []
    for kind, make in (("load", w.load_meta), ("save", w.save_meta)):
        for n in chunks:

            def step(make=make, n=n):
                return w.step(make(n))  # the metadata is the scheduler's work: a few us, in no variant's baseline

            def layers(make=make, n=n):
                per_step: list[float] = []
                w.step(make(n), per_step)
                return per_step[1:]  # the first layer of a save plans the step's gathers

            variants.append(_Variant(kind, n, step, lambda: w.no_kvx(None), q, L))
            variants.append(_Variant(f"layer {kind}", n, layers))
    variants.append(_Variant("nothing", 0, lambda: w.step(w.nothing_meta()), lambda: w.no_kvx(None), q, L))
    lay = w.worker.layout
    out = torch.empty(lay.canonical_shape(w.shape.chunk), dtype=lay.dtype)
    staging = torch.empty(w.config.staging_bytes // 4, dtype=torch.uint8)
    ids = w.blocks(1, 0)
    for path in ("staged", "auto"):
        oq = require().NullQueues()

        def op(path=path, oq=oq):
            t0 = time.perf_counter()
            copies = Copies(lay, path=path, sm_count=w.engine.sm_count)  # kvx.kernels.ops._one, on the null queues
            copies.add(Op.GATHER_BLOCKS, ids, out)
            copies.run(staging, queues=oq)
            return time.perf_counter() - t0

        variants.append(_Variant(f"op {path}", 1, op, None, oq, L))
    for v in variants:
        v.run(max(1, warmup), keep=False)
    for _ in range(rounds):
        for v in variants:
            v.run(max(1, (op_repeats if v.name.startswith("op ") else repeats) // rounds), keep=True)
    return [v.row() for v in variants]


def targets(rows: list[Row]) -> list[tuple[str, str, str, bool]]:
    """(target, limit, measured, met) per target of the host-time issue."""
    by = {(r.variant, r.chunks): r for r in rows}
    out = []
    for n, limit in ((1, HOST_STEP_1_MS), (8, HOST_STEP_8_MS)):
        for variant, what in (("load", "loading"), ("save", "saving")):
            r = by.get((variant, n))
            if r is not None:
                ms = r.over_us / 1e3
                out.append(
                    (
                        f"hooks' host time, a step {what} {n} chunk{'s' if n > 1 else ''} over {r.layers} layers",
                        f"<= {limit:g} ms over no kvx",
                        f"{ms:.3f} ms ({r.host_us:.1f} us vs {r.base_us:.1f} us)",
                        ms <= limit,
                    )
                )
    r = by.get(("nothing", 0))
    if r is not None:
        per = r.over_us / r.layers
        out.append(
            (
                "a step with nothing to copy",
                f"<= {HOST_IDLE_US:g} us per layer",
                f"{per:.2f} us per layer ({r.over_us:.1f} us a step)",
                per <= HOST_IDLE_US,
            )
        )
    layer = [r for r in rows if r.variant.startswith("layer ")]
    if layer:
        worst = max(layer, key=lambda r: r.host_us)
        detail = ", ".join(f"{r.variant.split()[1]} x{r.chunks} {r.host_us:.2f}" for r in layer)
        out.append(
            (
                "one layer's batch of copies (1-8 chunks): the layer's hooks",
                f"<= {HOST_LAYER_US:g} us",
                f"worst {worst.host_us:.2f} us ({detail})",
                worst.host_us <= HOST_LAYER_US,
            )
        )
    ops = [r for r in rows if r.variant.startswith("op ")]
    if ops:
        worst = max(ops, key=lambda r: r.host_us)
        detail = ", ".join(f"{r.variant.split()[1]} {r.host_us:.1f}" for r in ops)
        out.append(
            (
                "one op (ops.gather_blocks of a chunk: check, plan, issue)",
                f"<= {HOST_OP_US:g} us",
                f"worst {worst.host_us:.1f} us ({detail})",
                worst.host_us <= HOST_OP_US,
            )
        )
    return out


def write_md(path: str, rows: list[Row], header: list[str]) -> None:
    lines = [*header, "", "| target | limit | measured | verdict |", "|---|---|---|---|"]
    for name, limit, measured, met in targets(rows):
        lines.append(f"| {name} | {limit} | {measured} | {'met' if met else 'MISSED'} |")
    lines += [
        "",
        "Every variant (host time per step; `layer`: per layer's hooks, layers after the first; `op`: per op). CUDA "
        "API calls a CUDA engine would make (counted by the null engine), per step or call, and per layer:",
        "",
        "| variant | chunks | host us | no kvx us | over us | over per layer us | event records | stream waits "
        "| DMA calls | launches | id uploads | CUDA calls per layer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r.calls
        total = sum(c.values()) if c else 0
        per_layer = total / r.layers if c and r.layers else 0
        cells = (
            [f"{c.get(k, 0):.1f}" for k in ("records", "waits", "dma_calls", "launches", "uploads")] if c else [""] * 5
        )
        lines.append(
            f"| {r.variant} | {r.chunks} | {r.host_us:.1f} | {r.base_us:.2f} | {r.over_us:.1f} | "
            f"{r.over_us / r.layers:.2f} | {' | '.join(cells)} | {per_layer:.2f} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_csv(path: str, rows: list[Row]) -> None:
    import csv

    keys = ("records", "waits", "dma_calls", "launches", "uploads")
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["variant", "chunks", "host_us", "base_us", "over_us", "layers", *keys])
        for r in rows:
            out.writerow(
                [r.variant, r.chunks, f"{r.host_us:.3f}", f"{r.base_us:.3f}", f"{r.over_us:.3f}", r.layers]
                + [f"{r.calls.get(k, 0):.2f}" for k in keys]
            )
