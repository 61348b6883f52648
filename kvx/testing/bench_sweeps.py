"""The copy benchmark's GPU sections (:mod:`kvx.testing.bench`): one layer's copies of a step (and as the worker issues
them), both directions at once, and the host <-> device sweep of raw pages (auto against dma and staged).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from ..kernels import ops
from ..kernels.layout import KVLayout
from . import make_kv_caches
from .bench_paths import _random_, _usable, check_copy, host_paths, path_fn, staging_buffer
from .bench_timing import Clock, _time_queued, machine

KiB, MiB = 1 << 10, 1 << 20
HOST = "cuda<->pinned"  # the ``where`` of a table row whose contiguous side is pinned host memory


# ---------------------------------------------------------------------------------------- one layer's copies
@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A model's KV per layer (LBNHC, bf16) and the connector's chunk."""

    name: str
    layers: int
    heads: int
    head_size: int
    block_size: int
    chunk: int  # tokens

    @property
    def chunk_layer_bytes(self) -> int:
        return 2 * self.chunk * self.heads * self.head_size * 2  # K and V, bf16

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk // self.block_size


LLAMA3_8B = LayerShape("llama3-8b", 32, 8, 128, 16, 256)  # 1 MiB per chunk and layer
TINY = LayerShape("tiny", 4, 2, 64, 16, 32)  # the CPU smoke runs: 16 KiB per chunk and layer
LAYER_CHUNKS = (1, 2, 8, 32)  # one layer's copy of a step of C chunks (C MiB for llama3-8b)
BATCH_CHUNKS = (1, 2, 8)  # ... and as the worker issues it (a plan of C chunks over every layer)
BIDIR_CHUNKS = 8  # each way, every layer (256 MiB for llama3-8b)
_SHARED: dict = {}  # the 32-layer cache the layer and bidir sections share (built once per run)


def _model_cache(shape: LayerShape, device: str) -> KVLayout:
    """A ``shape.layers``-layer LBNHC cache of 2 x BIDIR_CHUNKS chunks of blocks (+ vLLM's null block 0)."""
    key = (shape, device)
    if key not in _SHARED:
        _SHARED.clear()
        caches = make_kv_caches(
            "LBNHC",
            num_layers=shape.layers,
            num_blocks=1 + 2 * BIDIR_CHUNKS * shape.blocks_per_chunk,
            block_size=shape.block_size,
            num_heads=shape.heads,
            head_size=shape.head_size,
            dtype=torch.bfloat16,
            device=device,
            generator=torch.Generator().manual_seed(2),
        )
        _SHARED[key] = KVLayout.from_tensors(caches, "LBNHC")
    return _SHARED[key]


def worker_layer(layout: KVLayout, op: str, copies) -> tuple[Callable[[], None], int]:
    """One layer of a step's copies as the connector's worker issues them: a compiled plan
    (:class:`kvx.kernels.plan.Copies`) of ``copies`` (``(block ids, host buffer)``) by the config's default
    ``copy_path``, planned per layer with the default ``staging_bytes`` budget's buffers
    (:class:`kvx.connector.cache.RegisteredKV`); returns a call running layer 0's legs on the current stream (the
    worker puts a leg's DMA and reshape on two queues), and the copies' count. The engine's job bookkeeping is not in
    it: ``bench_pipeline.py`` times the hooks whole."""
    from ..connector.config import KVXConfig
    from ..kernels.plan import Copies

    cfg = KVXConfig.from_extra_config({})
    batch = Copies(layout, path=cfg.copy_path if layout.device.type == "cuda" else "staged")
    for ids, buf in copies:
        batch.add(op, ids, buf)
    capacity = cfg.staging_bytes // 4
    plan = batch.plan([(i, i + 1) for i in range(layout.num_layers)], capacity)
    lo, hi = plan.range_legs(0)
    staging = torch.empty(capacity, dtype=torch.uint8, device=layout.device) if plan.staged else None

    def run() -> None:
        plan.run(staging, None, lo, hi)

    return run, len(batch)


@dataclasses.dataclass
class LayerRow:
    chunks: int
    direction: str  # "h2d" (scatter_blocks, a load) or "d2h" (gather_blocks, a save)
    row: str  # "plain copy", a host path, or "batch"
    ops: int  # copies one timed call issues (batch: one per chunk)
    bytes: int
    gpu_ms: float
    host_ms: float
    plain_ms: float  # GPU time of the plain copy of the same bytes
    behind: int

    @property
    def gbs(self) -> float:
        return self.bytes / (self.gpu_ms * 1e-3) / 1e9

    @property
    def x_plain(self) -> float:
        return self.gpu_ms / self.plain_ms


LAYER_COLUMNS = [
    "shape",
    "chunks",
    "direction",
    "row",
    "ops",
    "bytes",
    "gpu_us",
    "host_us",
    "GB/s",
    "x_plain",
    "host_behind",
    "smoke",
    "machine",
]


def run_layer(
    device: str = "cuda",
    quick: bool = False,
    log: Callable[[str], None] = print,
    shape: LayerShape | None = None,
    chunks: tuple[int, ...] = LAYER_CHUNKS,
    batch_chunks: tuple[int, ...] = BATCH_CHUNKS,
    errors: list[str] | None = None,
) -> list[LayerRow]:
    """One layer's copies of a step (see the module docstring), on the current stream."""
    on_gpu = device.startswith("cuda")
    shape = shape or (LLAMA3_8B if on_gpu else TINY)
    errors = errors if errors is not None else []
    clock = Clock(device)
    g = torch.Generator().manual_seed(3)
    dev = torch.device(device)
    bpc = shape.blocks_per_chunk
    n_ops, rounds = (10, 3) if quick else (20, 5)
    one = KVLayout.from_tensors(
        make_kv_caches(
            "LBNHC",
            num_layers=1,
            num_blocks=2 * max(chunks) * bpc,
            block_size=shape.block_size,
            num_heads=shape.heads,
            head_size=shape.head_size,
            dtype=torch.bfloat16,
            device=device,
            generator=g,
        ),
        "LBNHC",
    )
    model = _model_cache(shape, device)
    # the batch rows' chunks: every layer of max(batch_chunks) chunks, as CPU-tier slots hold them (head-major
    # when there are several KV heads: a worker's slots then are, kvx.connector.cache.RegisteredKV.head_major)
    nb = max(batch_chunks, default=0)
    L, P, T, H, D = model.canonical_shape(shape.chunk)
    slots = [
        _random_(torch.empty((H, L, P, T, D), dtype=torch.bfloat16, pin_memory=on_gpu), dev, g).movedim(0, 3)
        for _ in range(nb)
    ]
    order = (1 + torch.randperm(model.num_blocks - 1, generator=g)).tolist()
    slot_blocks = [order[i * bpc : (i + 1) * bpc] for i in range(nb)]
    rows: list[LayerRow] = []
    for c in chunks:
        ids = torch.randperm(one.num_blocks, generator=g)[: c * bpc]
        host = _random_(
            torch.empty(one.canonical_shape(c * shape.chunk), dtype=torch.bfloat16, pin_memory=on_gpu), dev, g
        )
        nbytes = host.numel() * 2
        flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        for direction, op in (("d2h", "gather_blocks"), ("h2d", "scatter_blocks")):
            src, dst = (flat_dev, flat_host) if direction == "d2h" else (flat_host, flat_dev)
            named: list = [("plain copy", lambda: dst.copy_(src, non_blocking=True), None)]
            staging = staging_buffer(one, op, ids.numel())
            for p in host_paths(device, op):
                check = lambda f, op=op: check_copy(op, one, ids, host, f)  # noqa: E731
                named.append((p, path_fn(op, one, ids, host, p, staging), check))
            n_batch = 0
            if c in batch_chunks:
                run, n_batch = worker_layer(model, op, [(slot_blocks[i], slots[i]) for i in range(c)])
                named.append(("batch", run, None))
            usable = _usable(named, errors, f"layer {c} chunk(s) {direction}", log)
            res = _time_queued([u[1] for u in usable], clock, n_ops, rounds)
            plain = res[0].gpu_ms if usable and usable[0][0] == "plain copy" else math.nan
            for (label, _), q in zip(usable, res):
                r = LayerRow(
                    c,
                    direction,
                    label,
                    n_batch if label == "batch" else 1,
                    nbytes,
                    q.gpu_ms,
                    q.host_ms,
                    plain,
                    q.behind,
                )
                rows.append(r)
                log(
                    f"layer {shape.name} {c:3d} chunk(s) {direction} {label:11s} GPU {r.gpu_ms * 1e3:9.1f} us "
                    f"({r.gbs:6.1f} GB/s, {r.x_plain:5.2f}x plain)  host {r.host_ms * 1e3:8.1f} us/op"
                    f"{'  HOST BEHIND' if r.behind else ''}"
                )
    return rows


def write_layer_csv(rows: list[LayerRow], path: str, shape_name: str, smoke: bool) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(LAYER_COLUMNS)
        for r in rows:
            w.writerow(
                [
                    shape_name,
                    r.chunks,
                    r.direction,
                    r.row,
                    r.ops,
                    r.bytes,
                    f"{r.gpu_ms * 1e3:.3f}",
                    f"{r.host_ms * 1e3:.3f}",
                    f"{r.gbs:.3f}",
                    f"{r.x_plain:.5g}",
                    r.behind,
                    smoke,
                    machine(),
                ]
            )


def layer_md(rows: list[LayerRow], shape: LayerShape, smoke: bool) -> list[str]:
    lines = [
        f"## One layer's copy of a step{' (SMOKE RUN on CPU, not a measurement)' if smoke else ''}",
        "",
        f"{shape.name} ({shape.layers} layers x {shape.heads} x {shape.head_size}, bf16, block {shape.block_size}, "
        f"chunk {shape.chunk} tokens: {shape.chunk_layer_bytes / MiB:g} MiB per chunk and layer). One op per row "
        "moving one layer of C chunks between the cache and pinned host memory (`batch`: one layer of a compiled plan "
        "of C chunks, one add per chunk, on the 32-layer cache, as the worker runs it); N ops queued back to back "
        "behind a `torch.cuda._sleep` pad: `GPU us` = per op on the stream, `host us` = issuing one op. "
        "`x plain` = GPU time over the plain copy of the same bytes. Targets: staged (>= 1 MiB) within 1.5x of "
        "the plain copy; one layer's batch <= 15 us of host time.",
        "",
        "| chunks | bytes | direction | row | ops | GPU us | GB/s | x plain | host us | host behind |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.chunks} | {_fmt_bytes(r.bytes)} | {r.direction} | {r.row} | {r.ops} | {r.gpu_ms * 1e3:.1f} | "
            f"{r.gbs:.1f} | {r.x_plain:.2f}x | {r.host_ms * 1e3:.1f} | {r.behind or ''} |"
        )
    return lines


# ---------------------------------------------------------------------------------------- both directions at once
@dataclasses.dataclass
class BidirRow:
    path: str  # "plain copies (roof)" or a host path
    bytes: int  # each way
    ms: float  # from a common start until both ends landed
    roof_ms: float

    @property
    def gbs(self) -> float:
        return 2 * self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def pct_roof(self) -> float:
        return 100.0 * self.roof_ms / self.ms


BIDIR_COLUMNS = ["shape", "chunks", "path", "bytes_each_way", "ms", "GB/s", "pct_roof", "smoke", "machine"]


def run_bidir(
    device: str = "cuda",
    quick: bool = False,
    repeats: int = 10,
    log: Callable[[str], None] = print,
    shape: LayerShape | None = None,
    errors: list[str] | None = None,
) -> list[BidirRow]:
    """A load (scatter_blocks) and a save (gather_blocks) of BIDIR_CHUNKS chunks over every layer at once, on two
    streams from a common start event (CUDA; CPU smoke: one after the other)."""
    on_gpu = device.startswith("cuda")
    shape = shape or (LLAMA3_8B if on_gpu else TINY)
    errors = errors if errors is not None else []
    dev = torch.device(device)
    g = torch.Generator().manual_seed(4)
    lay = _model_cache(shape, device)
    nb = BIDIR_CHUNKS * shape.blocks_per_chunk
    perm = 1 + torch.randperm(lay.num_blocks - 1, generator=g)
    ids_in, ids_out = perm[:nb], perm[nb : 2 * nb]
    shp = lay.canonical_shape(BIDIR_CHUNKS * shape.chunk)
    h_in = _random_(torch.empty(shp, dtype=torch.bfloat16, pin_memory=on_gpu), dev, g)
    h_out = torch.empty(shp, dtype=torch.bfloat16, pin_memory=on_gpu)
    nbytes = h_in.numel() * 2
    f_hin, f_hout = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2))
    f_din, f_dout = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    named: list = [
        (
            "plain copies (roof)",
            (lambda: f_din.copy_(f_hin, non_blocking=True), lambda: f_hout.copy_(f_dout, non_blocking=True)),
            lambda pair: [f() for f in pair],
        )
    ]
    for p in host_paths(device, "scatter_blocks"):
        st_in = staging_buffer(lay, "scatter_blocks", nb) if p == "staged" else None
        st_out = staging_buffer(lay, "gather_blocks", nb) if p == "staged" else None
        pair = (
            path_fn("scatter_blocks", lay, ids_in, h_in, p, st_in),
            path_fn("gather_blocks", lay, ids_out, h_out, p, st_out),
        )

        def check(pair, p=p):
            check_copy("scatter_blocks", lay, ids_in, h_in, pair[0])
            check_copy("gather_blocks", lay, ids_out, h_out, pair[1])

        named.append((p, pair, check))
    usable = _usable(named, errors, "both directions", log)
    s1 = torch.cuda.Stream(dev) if on_gpu else None
    s2 = torch.cuda.Stream(dev) if on_gpu else None

    def both(pair) -> float:
        load, save = pair
        if not on_gpu:
            t0 = time.perf_counter()
            load()
            save()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        a, b1, b2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        s1.wait_event(a)
        s2.wait_event(a)
        with torch.cuda.stream(s1):
            load()
            b1.record(s1)
        with torch.cuda.stream(s2):
            save()
            b2.record(s2)
        torch.cuda.synchronize()
        return max(a.elapsed_time(b1), a.elapsed_time(b2))

    times: list[list[float]] = [[] for _ in usable]
    for r in range(repeats + 2):  # 2 warm-up rounds
        for i, (_, pair) in enumerate(usable):
            t = both(pair)
            if r >= 2:
                times[i].append(t)
    ms = [statistics.median(t) for t in times]
    roof = ms[0] if usable and usable[0][0] == "plain copies (roof)" else math.nan
    rows = [BidirRow(label, nbytes, t, roof) for (label, _), t in zip(usable, ms)]
    for r in rows:
        log(
            f"both directions {_fmt_bytes(nbytes)} each way  {r.path:20s} {r.ms:8.3f} ms {r.gbs:7.1f} GB/s "
            f"{r.pct_roof:5.0f}% roof"
        )
    return rows


def write_bidir_csv(rows: list[BidirRow], path: str, shape_name: str, smoke: bool) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(BIDIR_COLUMNS)
        for r in rows:
            w.writerow(
                [
                    shape_name,
                    BIDIR_CHUNKS,
                    r.path,
                    r.bytes,
                    f"{r.ms:.4f}",
                    f"{r.gbs:.3f}",
                    f"{r.pct_roof:.1f}",
                    smoke,
                    machine(),
                ]
            )


def bidir_md(rows: list[BidirRow], shape: LayerShape, smoke: bool) -> list[str]:
    lines = [
        f"## Both directions at once{' (SMOKE RUN on CPU, not a measurement)' if smoke else ''}",
        "",
        f"A load (scatter_blocks) and a save (gather_blocks) of {BIDIR_CHUNKS} chunks x {shape.layers} layers "
        f"({shape.name}) each, on two streams from one start event; time until both landed; GB/s = both ways' "
        "bytes / time; `% roof` = two plain copies of the same bytes at once over it. Target: >= 80 GB/s together.",
        "",
        "| path | each way | ms | GB/s together | % roof |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.path} | {_fmt_bytes(r.bytes)} | {r.ms:.3f} | {r.gbs:.1f} | {r.pct_roof:.0f}% |")
    return lines


# ---------------------------------------------------------------------------------------- host <-> device sweep
H2D_PIECES = tuple(k * KiB for k in (4, 8, 16, 32, 64, 128, 256, 512, 1024))
H2D_COUNTS = (16, 128)  # pieces per layer: 1 and 8 chunks of 16 blocks
H2D_ROOF = "pinned copy (roof)"
_H2D_DIRECTIONS = (("device->host", "gather_pages"), ("host->device", "scatter_pages"))
AUTO_SLACK = 1.05  # auto within 5% of the faster of dma and staged


@dataclasses.dataclass
class H2DRow:
    direction: str  # "device->host" (gather_pages) or "host->device" (scatter_pages)
    piece_bytes: int  # bytes of one page = one contiguous run
    pieces: int
    bytes: int
    path: str  # H2D_ROOF or a host path
    gpu_ms: float  # per op, queued behind a pad
    host_ms: float  # per op
    roof_ms: float
    behind: int

    @property
    def gbs(self) -> float:
        return self.bytes / (self.gpu_ms * 1e-3) / 1e9

    @property
    def pct_roof(self) -> float:
        return 100.0 * self.roof_ms / self.gpu_ms


def auto_verdicts(rows: list[H2DRow]) -> list[dict]:
    """Per (direction, pieces, piece size): the faster of dma and staged (by GPU time; those measured), auto's
    time over it, and whether that is within AUTO_SLACK."""
    by: dict[tuple, dict[str, H2DRow]] = {}
    for r in rows:
        by.setdefault((r.direction, r.pieces, r.piece_bytes), {})[r.path] = r
    out = []
    for (direction, pieces, piece), paths in by.items():
        cands = [paths[p] for p in ("dma", "staged") if p in paths]
        auto = paths.get("auto")
        if not cands or auto is None:
            continue
        best = min(cands, key=lambda r: r.gpu_ms)
        ratio = auto.gpu_ms / best.gpu_ms
        out.append(
            dict(
                direction=direction,
                pieces=pieces,
                piece_bytes=piece,
                best=best.path,
                compared=",".join(c.path for c in cands),
                auto_x_best=ratio,
                within=ratio <= AUTO_SLACK,
            )
        )
    return out


def run_h2d(
    device: str = "cuda",
    quick: bool = False,
    log: Callable[[str], None] = print,
    pieces: tuple[int, ...] | None = None,
    counts: tuple[int, ...] = H2D_COUNTS,
    errors: list[str] | None = None,
    checkpoint: Callable[[list[H2DRow]], None] | None = None,
):
    """The host <-> device sweep (see the module docstring) on the current stream: returns ``(rows, calibration)``
    (the calibration of the kernel-or-DMA rule where this kvx has one, else None).

    Each piece size is a one-layer vLLM >= 0.32 LBNHC cache (bf16, one head of 64: 256 bytes per token) whose
    block size makes one page ``piece`` bytes; even block ids only (no two pages adjacent: every page is its
    own run)."""
    on_gpu = device.startswith("cuda")
    pieces = pieces or (H2D_PIECES if on_gpu else (4 * KiB, 64 * KiB))
    errors = errors if errors is not None else []
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    clock = Clock(device)
    cal = None
    if on_gpu:
        cal = ops.calibrate_h2d()
    rounds = 3 if quick else 5
    rows: list[H2DRow] = []
    for piece in pieces:
        for n in counts:
            lay = KVLayout.from_tensors(
                make_kv_caches(
                    "LBNHC",
                    num_layers=1,
                    num_blocks=2 * n,
                    block_size=piece // 256,
                    num_heads=1,
                    head_size=64,
                    dtype=torch.bfloat16,
                    device=device,
                    generator=g,
                ),
                "LBNHC",
            )
            if lay.page is None or lay.page.segments != 1 or lay.page_bytes != piece:
                raise RuntimeError(f"h2d sweep: expected one {piece}-byte page per block, got {lay.page}")
            ids = 2 * torch.randperm(n, generator=g)
            buf = _random_(torch.empty(lay.page_shape(n), dtype=torch.uint8, pin_memory=on_gpu), dev, g)
            nbytes = buf.numel()
            flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
            # ~4 ms of copying per timed batch at ~25 GB/s, 4 .. 50 ops
            n_ops = max(4, min(50, int(4e-3 * 25e9 / nbytes)))
            for direction, op in _H2D_DIRECTIONS:
                src, dst = (flat_dev, flat_host) if op.startswith("gather") else (flat_host, flat_dev)
                named: list = [(H2D_ROOF, lambda: dst.copy_(src, non_blocking=True), None)]
                staging = staging_buffer(lay, op, n)
                for p in host_paths(device, op):
                    check = lambda f, op=op: check_copy(op, lay, ids, buf, f)  # noqa: E731
                    named.append((p, path_fn(op, lay, ids, buf, p, staging), check))
                usable = _usable(named, errors, f"h2d {direction} {n} x {_fmt_bytes(piece)}", log)
                res = _time_queued([u[1] for u in usable], clock, n_ops, rounds)
                roof = res[0].gpu_ms if usable and usable[0][0] == H2D_ROOF else math.nan
                for (label, _), q in zip(usable, res):
                    r = H2DRow(direction, piece, n, nbytes, label, q.gpu_ms, q.host_ms, roof, q.behind)
                    rows.append(r)
                    log(
                        f"{direction:13s} {n:4d} x {_fmt_bytes(piece):>8s}  {label:18s} GPU {q.gpu_ms * 1e3:9.1f} us "
                        f"{r.gbs:7.2f} GB/s {r.pct_roof:6.1f}% roof  host {q.host_ms * 1e3:7.1f} us"
                    )
            lay = buf = flat_dev = flat_host = named = usable = None  # free before the next size
            if checkpoint is not None:
                checkpoint(rows)
    return rows, cal


def _fmt_bytes(b: int) -> str:
    if b == ops.DMA_NEVER:
        return "never"
    return f"{b // MiB} MiB" if b >= MiB and b % MiB == 0 else f"{b // KiB} KiB" if b % KiB == 0 else f"{b} B"


H2D_COLUMNS = [
    "direction",
    "pieces",
    "piece_bytes",
    "bytes",
    "path",
    "gpu_us",
    "host_us",
    "GB/s",
    "pct_roof",
    "host_behind",
    "auto_x_best",
    "auto_within_5pct",
    "smoke",
    "machine",
]


def write_h2d_results(rows: list[H2DRow], cal, path_stem: str, command: str, smoke: bool = False) -> None:
    """Write ``<stem>.csv`` (every path; the auto verdict on the auto rows) and ``<stem>.md`` (a row per direction,
    count and piece size; then the calibration of the kernel-or-DMA rule, where this kvx has one)."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    verdict = {(v["direction"], v["pieces"], v["piece_bytes"]): v for v in auto_verdicts(rows)}
    with open(path_stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(H2D_COLUMNS)
        for r in rows:
            v = verdict.get((r.direction, r.pieces, r.piece_bytes)) if r.path == "auto" else None
            w.writerow(
                [
                    r.direction,
                    r.pieces,
                    r.piece_bytes,
                    r.bytes,
                    r.path,
                    f"{r.gpu_ms * 1e3:.3f}",
                    f"{r.host_ms * 1e3:.3f}",
                    f"{r.gbs:.3f}",
                    f"{r.pct_roof:.1f}",
                    r.behind,
                    "" if v is None else f"{v['auto_x_best']:.5g}",
                    "" if v is None else v["within"],
                    smoke,
                    machine(),
                ]
            )
    paths = [p for p in ("dma", "staged", "kernel", "auto") if any(r.path == p for r in rows)]
    missing = [p for p in ("dma", "staged") if p not in paths]
    title = f"# kvx host <-> device copies per layer on {machine()}"
    lines = [
        title + (" (SMOKE RUN on CPU, not a measurement)" if smoke else ""),
        "",
        f"torch {torch.__version__}. Reproduce: `{command}`",
        "",
        "What the worker issues per layer for raw pages: one op of n pieces (pages of one layer, no two adjacent) "
        "between the cache and pinned host memory, on a side stream. N ops queued back to back behind a "
        "`torch.cuda._sleep` pad: GB/s from the GPU time per op; `host us` = issuing one op. `% roof` = a "
        "pinned copy of the same bytes over the path. Paths: dma (batched DMA between host and blocks), staged "
        "(one DMA into a device staging buffer + an on-device reshape), kernel (the UVA copy kernel), auto "
        f"(`path=None`). Target: auto within {100 * (AUTO_SLACK - 1):.0f}% of the faster of dma and staged (GPU time)."
        + (f" Not in this kvx build: {', '.join(missing)}." if missing else ""),
        "",
        "| direction | pieces | piece | bytes | roof GB/s | "
        + " | ".join(f"{p} GB/s" for p in paths)
        + " | "
        + " | ".join(f"{p} host us" for p in paths)
        + " | faster | auto / faster | auto within 5% |",
        "|---|---:|---:|---:|---:|" + "---:|" * (2 * len(paths)) + "---|---:|---|",
    ]
    by = {(r.direction, r.pieces, r.piece_bytes, r.path): r for r in rows}
    for direction, _ in _H2D_DIRECTIONS:
        for n in sorted({r.pieces for r in rows}):
            for piece in sorted({r.piece_bytes for r in rows}):
                roof = by.get((direction, n, piece, H2D_ROOF))
                if roof is None:
                    continue
                cells = [by.get((direction, n, piece, p)) for p in paths]
                v = verdict.get((direction, n, piece))
                lines.append(
                    f"| {direction} | {n} | {_fmt_bytes(piece)} | {_fmt_bytes(roof.bytes)} | {roof.gbs:.1f} | "
                    + " | ".join("" if c is None else f"{c.gbs:.1f}" for c in cells)
                    + " | "
                    + " | ".join("" if c is None else f"{c.host_ms * 1e3:.1f}" for c in cells)
                    + " | "
                    + (f"{v['best']} | {v['auto_x_best']:.2f}x | {'yes' if v['within'] else 'NO'} |" if v else "| | |")
                )
    if cal is not None:
        try:
            lines += _calibration_md(cal)
        except Exception as e:  # noqa: BLE001 - informative only
            lines += ["", f"Calibration: not shown ({e})."]
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def _calibration_md(cal) -> list[str]:
    """The DMA-or-staged rule's calibration (:class:`kvx.kernels.dma.H2DCalibration`) as a table."""
    lines = [
        "",
        f"Calibration (`kvx.kernels.dma.calibrate_h2d`, {cal.device}): ms per copy of `pieces` pieces of `run` "
        "bytes, DMA straight into the pieces vs staged; DMA from the threshold of the batch size nearest a copy's.",
        "",
        "| pieces | run | d->h staged ms | d->h DMA ms | h->d staged ms | h->d DMA ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for k, n in enumerate(cal.pieces):
        for i, b in enumerate(cal.run_bytes[k]):
            lines.append(
                f"| {n} | {_fmt_bytes(b)} | {cal.staged_ms[0][k][i]:.4f} | {cal.dma_ms[0][k][i]:.4f} | "
                f"{cal.staged_ms[1][k][i]:.4f} | {cal.dma_ms[1][k][i]:.4f} |"
            )
        thresholds = (_fmt_bytes(cal.dma_min_bytes[0][k]), _fmt_bytes(cal.dma_min_bytes[1][k]))
        lines.append(f"| {n} | threshold | {thresholds[0]} | | {thresholds[1]} | |")
    return lines
