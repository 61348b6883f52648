"""Layer-wise loads and saves of the connector's worker against a synthetic forward, on a GPU.

Two targets of the layer-wise pipeline, measured on :class:`kvx.connector.worker.KVXWorker` built by hand
(as ``tests/worker/test_worker_pipeline.py`` builds it: an ``EngineGeometry``, a ``KVXConfig`` with a CPU tier,
per-layer caches as vLLM >= 0.32 hands them over; no vLLM) and driven through vLLM's per-step hooks with
hand-written ``KVXMetadata``::

    handle_preemptions -> bind -> start_load_kv
      -> per layer: wait_for_layer_load, compute(), save_kv_layer
    -> wait_for_save -> get_finished -> get_block_ids_with_load_errors -> build_worker_meta

``compute()`` is a synthetic per-layer kernel on the compute stream (the current stream): a loop of square
bf16 matmuls (``--compute matmul``: with n >= 2048 its tiles fill every SM of an H100, as a prefill's GEMMs
do, so the copy kernels compete for SMs; the short targets of small copies get n = 1024 or 512, which leave
SMs free) or ``torch.cuda._sleep`` (``--compute sleep``: one thread spinning, so the copies compete for
nothing and only the pipeline's structure shows). Its length is calibrated: one layer's copy of the
step's chunks (the H2D scatter for loads, the D2H gather for saves, as the worker issues them, one batch,
``max_ctas`` from the config) is timed with CUDA events, then the matmul count or the sleep cycles are sized
to ``factor x`` that time.

**Loads** (target: with ``layerwise: true`` and a per-layer compute of equal length, >= 80% of the copy
time hidden). One step loading N chunks from CPU-tier slots (pinned) into the cache, timed on the compute
stream from before ``start_load_kv`` to after ``wait_for_save``: ``T_compute`` (the step without loads),
``T_copy`` (loads, no compute), ``T_overlap`` (both). hidden = 1 - (T_overlap - T_compute) / T_copy. The
baseline is ``layerwise: false`` (every load fenced in ``start_load_kv``; KVXConnector sets
``fence_loads_at_start`` from it, and so does this script), where nothing can be hidden.

**Saves** (target: with ``save_layerwise: true`` the forward slows down by <= 5%; ``save_layerwise:
false``, all layers' gathers queued in ``wait_for_save``, stays an option where it is faster). K prefill
steps back to back, each writing and saving N chunks (disjoint blocks, CPU slots), then one step that saves
nothing, so that the gathers an all-at-once save queues after a forward also have a next forward to
overlap (and slow down), as they do in an engine. Forward = the sum over the K + 1 steps of the time between
events around the layers; slowdown = forward with saves / forward without - 1. "saved at" = from the first
step's start until the last gather landed (an event on the save stream). Run with the compute equal to the
save copy (``--save-compute 1``, the hard case) and longer (8: about what an 8B model's layer computes for
2048 tokens on an H100 against its 8 MiB of KV over PCIe, 1.5 ms vs 0.17 ms by a FLOP count; an estimate).

**Host time** (targets: the hooks' host time less that of the same step without kvx <= 1 ms for a step loading
or saving 8 chunks over 32 layers, <= 5 us per layer for a step with nothing to copy). Every case also runs
``no kvx``: the same steps (markers, compute) with no hook called; ``host_over_ms`` in the CSV is a variant's
host time less that one's, per step (a save run's K + 1 steps are charged to its K saving steps).

kvx runs its DEFAULT config (``max_ctas``, the host <-> device copy path, the staging budget: what a user gets);
``--copy-path`` (``kv_connector_extra_config`` ``copy_path``: auto, staged, dma, kernel) runs another, to compare.

Every run is preceded by a ``torch.cuda._sleep`` pad on the compute stream, 1.5x the longest host time the
hooks took in a warm-up run: the host queues the whole step before the GPU reaches it, so the events time the GPU
work (vLLM's async scheduling and CUDA graphs keep its host ahead too). ``host ms`` is reported; a run in
which the host took longer than its pad is counted (``host behind`` in the CSV, a warning in the markdown).
Medians of ``--repeats`` runs after ``--warmup`` runs, the variants interleaved within each repeat, the GPU
idle between runs. After each case the copied bytes are compared (bit-exact) with their sources: the timed
copies happened.

    python benchmarks/bench_pipeline.py [--device cuda] [--shapes llama3-8b,llama3.2-1b] [--chunks 1,2,4,8]
        [--compute matmul,sleep] [--save-compute 1,8] [--repeats 10] [--quick] [--copy-path staged]

``--host-only`` (no GPU needed): the hooks' host time where CI runs, every host-time target of the GPU run measured
through the compiled path with :class:`kvx.engine.NullEngine` (everything a CUDA engine does on the host but the CUDA
calls, which it counts), against the same steps without kvx: a step loading or saving 1 and 8 chunks, a step with
nothing to copy, one layer's batch, one op (:mod:`kvx.testing.host_time`); writes ``host_cpu.{md,csv}`` under
``--out`` (default ``benchmarks/results``).

Writes benchmarks/results/pipeline_cuda.{md,csv} (``--quick``: one shape, 1 and 8 chunks, 5 repeats).
``--device cpu`` (the tiny shape, 1 and 2 chunks of 32 tokens, 2 repeats, ``--quick`` or not) runs the same
code path on a CPU cache with the ``thread`` copy queue (``KVX_COPY_QUEUE=thread``) and a small torch matmul as
the compute, into a temporary directory (or ``--out``), labelled a smoke run: it proves that the script runs
(``tests/bench/test_bench_pipeline.py``); CPU numbers say nothing about the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from kvx.kernels import ops
from kvx.testing.bench import Clock, cpu_name
from kvx.testing.bench_timing import median
from kvx.testing.pipeline_bench import MAX_PAD_MS, NO_KVX, Bench, Compute, _copy_queue  # noqa: F401 - its names

LOAD_TARGET = 0.80  # hidden fraction of the load copy time, layerwise, compute of equal length
SAVE_TARGET = 0.05  # forward slowdown with save_layerwise
HOST_STEP_TARGET_MS = 1.0  # hooks' host time over the step without kvx, a step loading or saving 8 chunks
HOST_IDLE_TARGET_US = 5.0  # ... per layer, a step with nothing to copy
HOST_MODES = ("compute only", "layerwise", "all at start", "no saves", "save_layerwise", "all at once")
TIE = 0.01  # differences below 1% of the reference time are ties (noise)


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int  # per rank
    head_size: int

    def label(self) -> str:
        return f"{self.name} ({self.layers}L x {self.kv_heads}x{self.head_size})"


SHAPES = {
    s.name: s
    for s in [
        Shape("llama3-8b", 32, 8, 128),  # Llama-3-8B at TP 1 (Qwen-2.5-7B: 28 x 4 x 128)
        Shape("llama3.2-1b", 16, 8, 64),  # Llama-3.2-1B
        Shape("tiny", 4, 2, 64),  # the CPU smoke run
    ]
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def bench_loads(b: Bench, n: int, kind: str) -> list[dict]:
    args = b.args
    copy_ms = b.layer_copy_ms(n, "h2d")
    compute = Compute(kind, b.clock, b.device, copy_ms)
    hit, miss = b.load_meta(n, loads=True), b.load_meta(n, loads=False)
    lw, start = {"layerwise": True}, {"layerwise": False}
    runs, pad_ms = b.measure(
        {
            "compute only": (lw, [miss], compute),
            "copy only": (lw, [hit], None),
            "layerwise": (lw, [hit], compute),
            "all at start": (start, [hit], compute),
            NO_KVX: (lw, [miss], compute),
        },
        args.warmup,
        args.repeats,
    )
    b.check_loaded(n)
    med = {name: median(r["step"] for r in rs) for name, rs in runs.items()}
    host0 = median(r["host"] for r in runs[NO_KVX])
    rows = []
    for name, rs in runs.items():
        hidden = None
        if name in ("layerwise", "all at start"):
            hidden = 1.0 - (med[name] - med["compute only"]) / med["copy only"]
        rows.append(
            _row(
                b,
                "load",
                n,
                compute,
                1.0,
                name,
                copy_layer_ms=copy_ms,
                step_ms=med[name],
                compute_ms=med["compute only"],
                copy_ms=med["copy only"],
                hidden=hidden,
                runs=rs,
                pad_ms=pad_ms,
                host_nokvx_ms=host0,
                steps=1,
            )
        )
    return rows


def bench_saves(b: Bench, n: int, kind: str) -> list[dict]:
    args = b.args
    copy_ms = b.layer_copy_ms(n, "d2h")
    rows = []
    plain, saving = b.save_metas(n, saves=False), b.save_metas(n, saves=True)
    for factor in args.save_compute:
        compute = Compute(kind, b.clock, b.device, factor * copy_ms)
        runs, pad_ms = b.measure(
            {
                "no saves": ({}, plain, compute),
                "save_layerwise": ({"save_layerwise": True}, saving, compute),
                "all at once": ({"save_layerwise": False}, saving, compute),
                NO_KVX: ({}, plain, compute),
            },
            args.warmup,
            args.repeats,
        )
        b.check_saved(n)
        fwd0 = median(r["fwd"] for r in runs["no saves"])
        host0 = median(r["host"] for r in runs[NO_KVX])
        for name, rs in runs.items():
            fwd = median(r["fwd"] for r in rs)
            saved = median(r["saved"] for r in rs) if name not in ("no saves", NO_KVX) else None
            rows.append(
                _row(
                    b,
                    "save",
                    n,
                    compute,
                    factor,
                    name,
                    copy_layer_ms=copy_ms,
                    step_ms=median(r["step"] for r in rs),
                    fwd_ms=fwd,
                    fwd_nosave_ms=fwd0,
                    slowdown=fwd / fwd0 - 1.0,
                    saved_ms=saved,
                    runs=rs,
                    pad_ms=pad_ms,
                    host_nokvx_ms=host0,
                    # a saving run's K + 1 steps are charged to its K saving steps; the others per step
                    steps=args.save_steps if name in ("save_layerwise", "all at once") else args.save_steps + 1,
                )
            )
    return rows


COLUMNS = [
    "section",
    "shape",
    "layers",
    "kv_heads",
    "head_size",
    "dtype",
    "layout",
    "block_size",
    "chunk_tokens",
    "chunks",
    "layer_bytes",
    "compute",
    "compute_desc",
    "compute_factor",
    "mode",
    "copy_layer_ms",
    "step_ms",
    "compute_ms",
    "copy_ms",
    "hidden_frac",
    "fwd_ms",
    "fwd_nosave_ms",
    "slowdown_pct",
    "saved_ms",
    "host_ms",
    "host_nokvx_ms",
    "host_over_ms",
    "pad_ms",
    "host_behind",
    "repeats",
    "device",
    "copy_queue",
    "copy_path",
    "max_ctas",
    "smoke",
]


def _row(
    b: Bench,
    section: str,
    n: int,
    compute: Compute,
    factor: float,
    mode: str,
    *,
    runs,
    pad_ms,
    copy_layer_ms,
    step_ms,
    compute_ms=None,
    copy_ms=None,
    hidden=None,
    fwd_ms=None,
    fwd_nosave_ms=None,
    slowdown=None,
    saved_ms=None,
    host_nokvx_ms=None,
    steps=1,
) -> dict:
    s, a = b.shape, b.args
    host = median(r["host"] for r in runs)
    return {
        "section": section,
        "shape": s.name,
        "layers": s.layers,
        "kv_heads": s.kv_heads,
        "head_size": s.head_size,
        "dtype": str(a.dtype).removeprefix("torch."),
        "layout": a.layout,
        "block_size": b.block,
        "chunk_tokens": b.chunk,
        "chunks": n,
        "layer_bytes": n * b.layer_chunk_bytes,
        "compute": compute.kind,
        "compute_desc": compute.desc,
        "compute_factor": factor,
        "mode": mode,
        "copy_layer_ms": copy_layer_ms,
        "step_ms": step_ms,
        "compute_ms": compute_ms,
        "copy_ms": copy_ms,
        "hidden_frac": hidden,
        "fwd_ms": fwd_ms,
        "fwd_nosave_ms": fwd_nosave_ms,
        "slowdown_pct": None if slowdown is None else 100.0 * slowdown,
        "saved_ms": saved_ms,
        "host_ms": host,
        "host_nokvx_ms": host_nokvx_ms,
        # the hooks' host time per step over the same steps without kvx
        "host_over_ms": None if host_nokvx_ms is None or mode == NO_KVX else (host - host_nokvx_ms) / steps,
        "pad_ms": pad_ms,
        "host_behind": sum(bool(r["behind"]) for r in runs),
        "repeats": len(runs),
        "device": a.device,
        "copy_queue": b.engine.mode,
        "copy_path": b.copy_path,
        "max_ctas": b.config.max_ctas,
        "smoke": not b.clock.cuda,
    }


# ------------------------------------------------------------------ results
def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


def save_winner(nosave: dict, lw: dict, once: dict) -> str:
    """The faster save mode of one case: the smaller forward (what the engine's steps wait for), unless the
    two differ by < 1% of the forward without saves; then the earlier "saved at" (how soon the CPU tier
    holds the chunks), unless that differs by < 1% too."""
    ref = nosave["fwd_ms"]
    if abs(lw["fwd_ms"] - once["fwd_ms"]) >= TIE * ref:
        return "save_layerwise" if lw["fwd_ms"] < once["fwd_ms"] else "all at once"
    if abs(lw["saved_ms"] - once["saved_ms"]) >= TIE * max(lw["saved_ms"], once["saved_ms"]):
        return "save_layerwise (saved sooner)" if lw["saved_ms"] < once["saved_ms"] else "all at once (saved sooner)"
    return "tie"


def write_results(
    rows: list[dict], stem: str, args, device_name: str, command: str, elapsed: float, notes: list[str]
) -> None:
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    smoke = not args.device.startswith("cuda")
    title = (
        f"# SMOKE RUN, not a measurement: kvx layer-wise pipeline on CPU ({device_name})"
        if smoke
        else f"# kvx layer-wise pipeline on {device_name}"
    )
    lines = [title, ""]
    if smoke:
        lines += [
            "This run proves that `benchmarks/bench_pipeline.py` runs (same code path, the `thread` copy "
            "queue, a small float32 matmul as the compute). The targets are GPU targets; CPU numbers say "
            "nothing about them (the thread queue has one layer group: nothing is layer-wise).",
            "",
        ]
    lines += [
        f"torch {torch.__version__}; KV {str(args.dtype).removeprefix('torch.')}, layout {args.layout}, block "
        f"{args.block_size}, chunk {args.chunk_size} tokens; median of {args.repeats} runs after "
        f"{args.warmup} warm-up; total {elapsed:.0f} s.",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    lines += notes
    loads = [r for r in rows if r["section"] == "load"]
    if loads:
        lines += [
            "## Loads: copy time hidden behind the forward",
            "",
            f"Target: with `layerwise: true` and a per-layer compute of equal length, >= "
            f"{100 * LOAD_TARGET:.0f}% of the copy time hidden. One step loading N chunks from the CPU tier "
            "(pinned) while the forward runs; step times from before `start_load_kv` to after "
            "`wait_for_save` on the compute stream. hidden = 1 - (overlap - compute) / copy. `all at start`: "
            "`layerwise: false` (every load fenced in `start_load_kv`), the baseline.",
            "",
            "| shape | chunks | KV per layer | compute | copy ms | compute ms | compute / copy | layerwise ms "
            "| hidden | all at start ms | hidden | target |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for key in _keys(loads, ("shape", "chunks", "compute")):
            case = {r["mode"]: r for r in loads if (r["shape"], r["chunks"], r["compute"]) == key}
            lw, st = case["layerwise"], case["all at start"]
            ok = "n/a (CPU smoke)" if smoke else "met" if lw["hidden_frac"] >= LOAD_TARGET else "MISSED"
            lines.append(
                f"| {_label(lw)} | {lw['chunks']} | {_mib(lw['layer_bytes'])} | {lw['compute_desc']} | "
                f"{lw['copy_ms']:.3f} | {lw['compute_ms']:.3f} | {lw['compute_ms'] / lw['copy_ms']:.2f} | "
                f"{lw['step_ms']:.3f} | {100 * lw['hidden_frac']:.0f}% | {st['step_ms']:.3f} | "
                f"{100 * st['hidden_frac']:.0f}% | >= {100 * LOAD_TARGET:.0f}%: {ok} |"
            )
        lines.append("")
    saves = [r for r in rows if r["section"] == "save"]
    if saves:
        lines += [
            "## Saves: forward slowdown, save_layerwise true vs false",
            "",
            f"Target: with `save_layerwise: true` the forward slows down by <= {100 * SAVE_TARGET:.0f}%. "
            f"{args.save_steps} prefill steps back to back, each writing and saving N chunks to the CPU tier, "
            "then one step saving nothing; forward = sum over the steps of events around the layers; "
            "slowdown = forward / forward without saves - 1; saved at = from the first step's start until "
            "the last gather landed. `compute x copy`: the per-layer compute over one layer's save copy, as "
            "sized (as measured: the forward without saves per layer over the copy timed alone). "
            "`faster`: the smaller forward, or when the forwards are within 1%, the earlier saved at.",
            "",
            "| shape | chunks | KV per layer | compute | compute x copy | forward ms, no saves | "
            "save_layerwise: forward ms | slowdown | saved at ms | all at once: forward ms | slowdown | "
            "saved at ms | target | faster |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        wins: dict[str, list[str]] = {}
        for key in _keys(saves, ("shape", "chunks", "compute", "compute_factor")):
            case = {r["mode"]: r for r in saves if (r["shape"], r["chunks"], r["compute"], r["compute_factor"]) == key}
            n0, lw, once = case["no saves"], case["save_layerwise"], case["all at once"]
            ok = "n/a (CPU smoke)" if smoke else "met" if lw["slowdown_pct"] <= 100 * SAVE_TARGET else "MISSED"
            win = save_winner(n0, lw, once)
            ratio = n0["fwd_ms"] / ((args.save_steps + 1) * lw["layers"]) / lw["copy_layer_ms"]
            wins.setdefault(win.split(" (")[0], []).append(
                f"{lw['shape']} x{lw['chunks']} {lw['compute']} x{lw['compute_factor']:g}"
            )
            lines.append(
                f"| {_label(lw)} | {lw['chunks']} | {_mib(lw['layer_bytes'])} | {lw['compute_desc']} | "
                f"{lw['compute_factor']:g} ({ratio:.2f}) | {n0['fwd_ms']:.3f} | {lw['fwd_ms']:.3f} | "
                f"{lw['slowdown_pct']:+.1f}% | {lw['saved_ms']:.3f} | {once['fwd_ms']:.3f} | "
                f"{once['slowdown_pct']:+.1f}% | {once['saved_ms']:.3f} | <= {100 * SAVE_TARGET:.0f}%: "
                f"{ok} | {win} |"
            )
        lines += ["", "Which save mode wins (by the rule above):", ""]
        for win in ("save_layerwise", "all at once", "tie"):
            if win in wins:
                lines.append(f"- {win}: {len(wins[win])} case(s): {'; '.join(wins[win])}")
        lines.append("")
    over = [r for r in rows if r["host_over_ms"] is not None and r["mode"] in HOST_MODES]
    if over:
        lines += [
            "## Host time of the hooks",
            "",
            f"Targets: a step loading or saving 8 chunks <= {HOST_STEP_TARGET_MS:g} ms of host time over the same step "
            f"without kvx (`{NO_KVX}`: markers and compute, no hook called); a step with nothing to copy <= "
            f"{HOST_IDLE_TARGET_US:g} us per layer. Medians of the runs' host times; a save run's K + 1 steps are "
            "charged to its K saving steps.",
            "",
            "| section | shape | chunks | compute | variant | host ms | no kvx ms | over per step ms "
            "| over per layer us | target |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---|",
        ]
        for r in over:
            per_layer = 1e3 * r["host_over_ms"] / r["layers"]
            if r["mode"] in ("compute only", "no saves"):
                limit, ok = f"<= {HOST_IDLE_TARGET_US:g} us/layer", per_layer <= HOST_IDLE_TARGET_US
            elif r["chunks"] == 8 and r["mode"] in ("layerwise", "save_layerwise"):
                limit, ok = f"<= {HOST_STEP_TARGET_MS:g} ms", r["host_over_ms"] <= HOST_STEP_TARGET_MS
            else:
                limit, ok = "", None
            verdict = "" if ok is None else "n/a (CPU smoke)" if smoke else "met" if ok else "MISSED"
            lines.append(
                f"| {r['section']} | {_label(r)} | {r['chunks']} | {r['compute_desc']} | {r['mode']} | "
                f"{r['host_ms']:.3f} | {r['host_nokvx_ms']:.3f} | {r['host_over_ms']:.3f} | {per_layer:.1f} | "
                f"{limit}{': ' + verdict if verdict else ''} |"
            )
        lines.append("")
    behind = [r for r in rows if r["host_behind"]]
    if behind:
        lines += [
            f"Warning: in {sum(r['host_behind'] for r in behind)} run(s) the host took longer than its pad "
            "(the hooks blocked the host, or issue more slowly than the GPU runs the step): those times "
            "include host time; see `host_ms`, `pad_ms`, `host_behind` in the CSV.",
            "",
        ]
    lines += [
        "Per-case details (the compute's matmul count or sleep cycles, the host time of the hooks, every "
        f"variant): `{os.path.basename(stem)}.csv`."
    ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def _label(r: dict) -> str:
    return f"{r['shape']} ({r['layers']}L x {r['kv_heads']}x{r['head_size']})"


def _keys(rows: list[dict], fields: tuple[str, ...]) -> list[tuple]:
    seen = []
    for r in rows:
        k = tuple(r[f] for f in fields)
        if k not in seen:
            seen.append(k)
    return seen


def _config_note(b: Bench) -> list[str]:
    """The worker's copy settings (its config's: the defaults unless --copy-path), and the kernel-or-DMA rule's
    calibration where this kvx has one."""
    cfg = b.config
    lines = [
        f"kvx config: `max_ctas` {cfg.max_ctas}, `copy_path` {b.copy_path}, `staging_bytes` {_mib(cfg.staging_bytes)}"
        + (" (defaults)" if b.args.copy_path is None else f" (--copy-path {b.args.copy_path})")
        + f"; copy queue {b.engine.mode}."
    ]
    if b.clock.cuda:
        cal = ops.calibrate_h2d(b.device)  # cached: the worker calibrated when it registered its caches
        fmt = [
            "/".join("never" if x == ops.DMA_NEVER else _mib(x) for x in per_direction)
            for per_direction in cal.dma_min_bytes
        ]
        lines[0] += (
            f" DMA straight into blocks from a mean run of (batches of {'/'.join(map(str, cal.pieces))} pieces): "
            f"{fmt[0]} device->host, {fmt[1]} host->device (calibrate_h2d)."
        )
    return lines + [""]


# ------------------------------------------------------------------ main
def host_only(args, command: str) -> int:
    """``--host-only``: the host-time table of every target (``host_cpu.md``, ``host_cpu.csv``)."""
    import platform
    import subprocess

    from kvx.testing import host_time as H

    chunks = tuple(_ints(args.chunks)) if args.chunks else (1, 8)
    names = [s for s in (args.shapes or "llama3-8b").split(",") if s]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not chunks or min(chunks) < 1:
        raise SystemExit(
            f"--shapes, --chunks: expected names among {', '.join(SHAPES)} and counts >= 1, got {names}, {chunks}"
        )
    repeats, warmup = args.repeats or 200, args.warmup if args.warmup is not None else 20
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    speed = [H.python_speed_us()]
    rows = []
    for name in names:
        s = SHAPES[name]
        w = H.Worker(
            H.Shape(s.name, s.layers, s.kv_heads, s.head_size, args.block_size, args.chunk_size or 256), max(chunks)
        )
        try:
            rows += H.measure(w, chunks, warmup, repeats, 5 * repeats)
        finally:
            w.close()
    speed.append(H.python_speed_us())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    header = [
        f"# Host time of the hooks, compiled path, null engine: {cpu_name()}",
        "",
        f"Reproduce: `{command}` ({time.perf_counter() - t0:.1f} s; kvx {commit or '?'}, "
        f"Python {platform.python_version()}, torch {torch.__version__}).",
        "",
        "What a CUDA engine does on the host, measured on this machine: the worker plans every step's copies once and "
        "issues them through the compiled path (kvx._C: plans, run lists, launches, the ordering rules, the staging "
        "rings) on `kvx.engine.NullEngine`, which makes no CUDA call but counts each one it would make (each costs a "
        "few microseconds on a GPU host: the last columns). Against the same step without kvx (the loop over the "
        f"layers, no hook called). Shapes: {', '.join(names)}; medians of {repeats} steps (ops: {5 * repeats}) after "
        f"{warmup} warm-up ones, each step followed by its baseline, every variant run in turn in each of 10 rounds (a "
        "slow phase of a shared machine falls on all alike).",
        "",
        f"This machine's speed during the run: `sum(range(1000))` took {speed[0]:.1f} us before and {speed[1]:.1f} us "
        "after (this 2-core VM quiet: ~13.5 us; in its slow phases, ~18-19 us, every figure grows alike).",
    ]
    H.write_md(os.path.join(out, "host_cpu.md"), rows, header)
    H.write_csv(os.path.join(out, "host_cpu.csv"), rows)
    for target, limit, measured, met in H.targets(rows):
        print(f"{'met   ' if met else 'MISSED'} {target}: {measured} ({limit})")
    print(f"wrote {os.path.join(out, 'host_cpu.md')} and host_cpu.csv")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="CUDA: one shape, 1 and 8 chunks, 5 repeats")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--chunks", default=None, help="chunks per step, comma-separated (default 1,2,4,8)")
    ap.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default 256; CPU 32)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="LBNHC", help="a vLLM layout kvx.testing.make_kv_caches builds")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compute", default=None, help="matmul,sleep (CUDA default both; CPU: matmul)")
    ap.add_argument(
        "--save-compute",
        default=None,
        help="per-layer compute over the layer's save copy, comma-separated (default 1,8)",
    )
    ap.add_argument("--save-steps", type=int, default=None, help="prefill steps saving per run (default 3)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs per variant (default 2)")
    ap.add_argument(
        "--copy-path",
        default=None,
        help="the worker's host <-> device copy path (kv_connector_extra_config copy_path: auto, staged, dma, "
        "kernel); default: the config's default",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results path stem (default benchmarks/results/pipeline_cuda; CPU: a temporary directory); --host-only: "
        "a directory (default benchmarks/results) for host_cpu.md and host_cpu.csv",
    )
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="the hooks' host time on this machine (no GPU): the compiled path with a null engine, against the same "
        "steps without kvx (kvx.testing.host_time); the llama3-8b shape, 1 and 8 chunks unless --shapes/--chunks",
    )
    args = ap.parse_args(argv)
    command = ("python benchmarks/bench_pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.host_only:
        return host_only(args, command)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is present")
    if not cuda and args.device != "cpu":
        ap.error(f"--device: expected cuda or cpu, got {args.device!r}")
    tiny = not cuda  # a CPU run is a smoke run: small defaults
    args.shapes = [
        s
        for s in (args.shapes or ("tiny" if tiny else "llama3-8b" if args.quick else "llama3-8b,llama3.2-1b")).split(
            ","
        )
        if s
    ]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: expected names among {', '.join(SHAPES)}, got {', '.join(unknown)}")
    args.chunks = _ints(args.chunks or ("1,2" if tiny else "1,8" if args.quick else "1,2,4,8"))
    args.chunk_size = args.chunk_size or (32 if tiny else 256)
    args.compute = [c for c in (args.compute or ("matmul,sleep" if cuda else "matmul")).split(",") if c]
    args.save_compute = _floats(args.save_compute or ("1" if tiny else "1,8"))
    args.save_steps = args.save_steps or (2 if tiny else 3)
    args.repeats = args.repeats or (2 if tiny else 5 if args.quick else 10)  # CPU: --quick changes nothing
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    try:
        args.dtype = getattr(torch, args.dtype)
        assert isinstance(args.dtype, torch.dtype)
    except (AttributeError, AssertionError):
        ap.error(f"--dtype: expected a torch dtype name such as bfloat16, got {args.dtype!r}")
    if (
        args.chunk_size % args.block_size
        or not args.chunks
        or min(args.chunks) < 1
        or args.repeats < 1
        or args.save_steps < 1
        or not args.save_compute
        or min(args.save_compute) <= 0
    ):
        ap.error(
            f"expected --chunk-size a multiple of --block-size, chunks, repeats, save steps and save-compute "
            f"factors > 0; got chunk size {args.chunk_size}, block size {args.block_size}, chunks {args.chunks}, "
            f"repeats {args.repeats}, save steps {args.save_steps}, save-compute {args.save_compute}"
        )
    if not cuda and "sleep" in args.compute:
        ap.error("--compute sleep: torch.cuda._sleep needs --device cuda")
    stem = args.out or (
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline_cuda")
        if cuda
        else os.path.join(tempfile.mkdtemp(prefix="kvx-bench-pipeline-"), "pipeline_cpu_smoke")
    )

    device = torch.device(args.device)
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    rows: list[dict] = []
    device_name = torch.cuda.get_device_name(device) if cuda else cpu_name()
    notes = (
        [
            "Every run starts from an idle GPU behind a `torch.cuda._sleep` pad on the compute stream, 1.5x the "
            f"longest host time the hooks took in a warm-up run (at most {MAX_PAD_MS:.0f} ms): the host has queued the "
            "whole run before the GPU reaches it, so the events time GPU work, as in an engine whose host runs "
            "ahead (async scheduling, CUDA graphs). The hooks' own host time per run is `host_ms` in the CSV; where it "
            "exceeds the step's GPU time, a step of an engine whose host does not run ahead is host-bound.",
            "",
        ]
        if cuda
        else []
    )

    def flush() -> None:  # the results so far: a run cut short by a timeout keeps what it measured
        write_results(rows, stem, args, device_name, command, time.perf_counter() - t0, notes)

    stream = torch.cuda.Stream(device) if cuda else None
    # the compute stream: markers and fences go on it (a non-default stream: the DMA path's batched copies
    # do not run on the legacy default stream, and vLLM's forward does not run there either)
    with _copy_queue(None if cuda else "thread"), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        clock = Clock(device)
        for name in args.shapes:
            b = Bench(SHAPES[name], args, device, clock)
            try:
                if name == args.shapes[0]:
                    notes[:0] = _config_note(b)
                for n in args.chunks:
                    for kind in args.compute:
                        print(f"{b.shape.label()}: {n} chunk(s), {kind}: loads", flush=True)
                        rows += bench_loads(b, n, kind)
                        flush()
                        print(f"{b.shape.label()}: {n} chunk(s), {kind}: saves", flush=True)
                        rows += bench_saves(b, n, kind)
                        flush()
                clock.sync()
                b.check_counts()
            finally:
                b.close()
    flush()
    print(f"wrote {stem}.md and {stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
