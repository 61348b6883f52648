"""Copy-kernel benchmark: time, GB/s and % of a roof measured in the same run, next to baselines.

CPU: the roof is a plain memcpy of the same number of bytes (glibc memcpy split over the same thread
pool); the baseline is torch indexing per layer and plane (what ExampleConnector-style code does,
= ``impl="reference"``).
GPU: roofs are a device-to-device copy and a pinned host copy of the same bytes; baselines are torch
indexing and one ``cudaMemcpyAsync`` per (layer, block) page.
GPU, host <-> device sweep (``copy_h2d_cuda.{csv,md}``): raw pages of 2 KiB .. 1 MiB between the cache and
pinned host memory, through the UVA copy kernel (at most 8 SMs), DMA (batched), the path kvx's measured
rule picks, and one ``cudaMemcpyAsync`` per page; with the calibration the rule was drawn from.

Bytes moved are counted explicitly: the payload (rows copied), each read once and written once.
Run ``python benchmarks/bench_copy.py --help`` (or ``kvx bench``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .. import _ext
from ..kernels import ops
from ..kernels.layout import KVLayout, Op
from . import make_kv_caches


@dataclasses.dataclass
class Case:
    op: str  # gather_blocks, scatter_slots, gather_pages, ...
    layout: str
    dtype: torch.dtype
    block_size: int
    tokens: int
    layers: int
    heads: int
    head_size: int

    @property
    def label(self) -> str:
        return (
            f"{self.op} {self.layout} {str(self.dtype)[6:]} bs{self.block_size} T{self.tokens} "
            f"L{self.layers} {self.heads}x{self.head_size}"
        )


@dataclasses.dataclass
class Row:
    device: str
    case: Case
    impl: str
    bytes: int
    ms: float
    roof_gbs: float

    @property
    def gbs(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def pct_roof(self) -> float:
        return 100.0 * self.gbs / self.roof_gbs


def cpu_cases(quick: bool) -> list[Case]:
    bf16 = torch.bfloat16
    if quick:
        shapes = [(4096, 4)]
    else:
        shapes = [(4096, 8), (4096, 32), (32768, 8)]
    cases = []
    for tokens, layers in shapes:
        for bs in (16, 128):
            for op in Op:
                cases.append(Case(op.value, "LBNHC", bf16, bs, tokens, layers, 8, 128))  # 256 B rows
            if not quick:
                for op in ("gather_blocks", "gather_slots", "scatter_slots"):
                    cases.append(Case(op, "mla", bf16, bs, tokens, layers, 1, 576))  # 1152 B rows
                    cases.append(Case(op, "flash", bf16, bs, tokens, layers, 8, 128))  # 2 KiB rows
    return cases


def gpu_cases(quick: bool) -> list[Case]:
    bf16 = torch.bfloat16
    shapes = [(4096, 8)] if quick else [(4096, 32), (16384, 32), (65536, 8)]
    cases = []
    for tokens, layers in shapes:
        for bs in (16, 128):
            for op in ("gather_blocks", "scatter_blocks", "gather_slots", "gather_pages", "scatter_pages"):
                cases.append(Case(op, "LBNHC", bf16, bs, tokens, layers, 8, 128))
            cases.append(Case("gather_blocks", "mla", bf16, bs, tokens, layers, 1, 576))
            cases.append(Case("gather_pages", "mla", bf16, bs, tokens, layers, 1, 576))
    return cases


def _time_interleaved(fns: list[Callable[[], None]], repeats: int, on_gpu: bool) -> list[float]:
    """Median milliseconds of each fn, timing them in turn within every repeat, so drift of the machine
    (other load, frequency, page cache) hits the roof and the kernels alike."""
    for fn in fns:  # warm-up
        fn()
    if on_gpu:
        torch.cuda.synchronize()
        events = [
            [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
            for _ in fns
        ]
        for r in range(repeats):
            for fn, ev in zip(fns, events):
                ev[r][0].record()
                fn()
                ev[r][1].record()
        torch.cuda.synchronize()
        return [statistics.median(a.elapsed_time(b) for a, b in ev) for ev in events]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def _setup(case: Case, device: str, host: bool, g: torch.Generator):
    kind = case.op.split("_")[1]
    num_blocks = case.tokens // case.block_size
    caches = make_kv_caches(
        case.layout,
        num_layers=case.layers,
        num_blocks=num_blocks + 16,
        block_size=case.block_size,
        num_heads=case.heads,
        head_size=case.head_size,
        dtype=case.dtype,
        device=device,
        generator=g,
    )
    lay = KVLayout.from_tensors(caches, case.layout)
    if kind == "slots":
        # vLLM's slot mapping: the tokens of a request fill its (scattered) blocks in order
        blocks = torch.randperm(num_blocks + 16, generator=g)[:num_blocks]
        ids = (blocks[:, None] * case.block_size + torch.arange(case.block_size)).reshape(-1)
        shape, dtype = lay.canonical_shape(case.tokens), case.dtype
    else:
        ids = torch.randperm(num_blocks + 16, generator=g)[:num_blocks]
        if kind == "pages":
            shape, dtype = lay.page_shape(num_blocks), torch.uint8
        else:
            shape, dtype = lay.canonical_shape(case.tokens), case.dtype
    buf = torch.empty(shape, dtype=dtype, device="cpu" if host else device, pin_memory=host and device != "cpu")
    buf.fill_(1)
    nbytes = buf.numel() * buf.element_size()
    return lay, ids, buf, nbytes


def _per_block_memcpy(lay: KVLayout, ids: torch.Tensor, buf: torch.Tensor, gather: bool, stream: int):
    """Baseline: one cudaMemcpyAsync per (layer, block) page (vLLM's old swap_blocks)."""
    _C = _ext.require()
    g = lay.page
    page = g.segment_bytes
    n = ids.numel()
    dsts, srcs = [], []
    for l in range(lay.num_layers):
        base = int(lay.layer_ptrs()[l])
        for s in range(g.segments):
            for i, b in enumerate(ids.tolist()):
                paged = base + b * lay.paged.block_stride + s * g.segment_stride
                flat = buf.data_ptr() + ((l * g.segments + s) * n + i) * page
                dsts.append(flat if gather else paged)
                srcs.append(paged if gather else flat)
    d = torch.tensor(dsts, dtype=torch.int64)
    s_ = torch.tensor(srcs, dtype=torch.int64)
    sizes = torch.full((len(dsts),), page, dtype=torch.int64)
    return lambda: _C.cuda_memcpy_each(d.data_ptr(), s_.data_ptr(), sizes.data_ptr(), len(dsts), stream)


def run(
    device: str = "cpu",
    quick: bool = False,
    repeats: int = 15,
    impls: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Run the benchmark table for ``device`` ("cpu" or "cuda") and return its rows."""
    g = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    on_gpu = device.startswith("cuda")
    avail = ops.available_impls(device)
    impls = [i for i in (impls or ["cuda", "triton", "cpu", "reference"]) if i in avail]
    homes = [False, True] if on_gpu else [False]  # HBM, pinned host
    for case in gpu_cases(quick) if on_gpu else cpu_cases(quick):
        for host in homes:
            lay, ids, buf, nbytes = _setup(case, device, host, g)
            gather = case.op.startswith("gather")
            where = device + ("<->pinned" if host else "")
            # roof: the same bytes as one plain copy
            flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat_b = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else device, pin_memory=host)
            flat_a.fill_(1)
            flat_b.fill_(2)
            if on_gpu:
                src, dst = (flat_a, flat_b) if gather else (flat_b, flat_a)
                fns = [lambda: dst.copy_(src, non_blocking=True)]
            else:
                _C = _ext.require()
                fns = [lambda: _C.cpu_memcpy(flat_b.data_ptr(), flat_a.data_ptr(), nbytes)]
            labels = ["memcpy (roof)"]
            fn = getattr(ops, case.op)
            for impl in impls:
                if impl == "reference" and case.tokens * case.layers > 4096 * 32 and not on_gpu:
                    continue  # torch indexing at 1 GiB takes seconds per repeat; 4k x 32L shows the ratio
                fns.append(lambda impl=impl: fn(lay, ids, buf, impl=impl))
                labels.append("torch-index" if impl == "reference" else f"kvx-{impl}")
            if on_gpu and case.op.endswith("pages") and lay.page is not None:
                fns.append(_per_block_memcpy(lay, ids, buf, gather, torch.cuda.current_stream().cuda_stream))
                labels.append("memcpyAsync/block")
            ms = _time_interleaved(fns, repeats, on_gpu)
            roof = nbytes / (ms[0] * 1e-3) / 1e9
            case_rows = [Row(where, case, label, nbytes, t, roof) for label, t in zip(labels, ms)]
            for r in case_rows:
                log(
                    f"{where:14s} {case.label:58s} {r.impl:18s} {r.ms:9.3f} ms {r.gbs:8.2f} GB/s "
                    f"{r.pct_roof:6.1f}% roof"
                )
            rows += case_rows
            lay = buf = flat_a = flat_b = fns = None  # free this case's buffers before the next
    return rows


# ---------------------------------------------------------------------------------------- host <-> device sweep
KiB, MiB = 1 << 10, 1 << 20
H2D_PIECES = (2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
H2D_PATHS = ("pinned copy (roof)", "kernel (<=8 SMs)", "DMA", "kvx auto", "memcpyAsync/block")
_H2D_DIRECTIONS = (("device->host", "gather_pages"), ("host->device", "scatter_pages"))


@dataclasses.dataclass
class H2DRow:
    direction: str  # "device->host" (gather_pages) or "host->device" (scatter_pages)
    piece_bytes: int  # bytes of one page = one contiguous run
    pieces: int
    bytes: int
    path: str  # one of H2D_PATHS
    ms: float
    roof_ms: float
    each_ms: float  # one cudaMemcpyAsync per page, same bytes
    auto_path: str  # what the rule picks for this piece size: "kernel" or "dma"

    @property
    def gbs(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def pct_roof(self) -> float:
        return 100.0 * self.roof_ms / self.ms

    @property
    def x_each(self) -> float:
        return self.each_ms / self.ms


def run_h2d(quick: bool = False, repeats: int = 15, log: Callable[[str], None] = print):
    """The host <-> device sweep on the current CUDA device: returns ``(rows, calibration)``.

    Each piece size is a vLLM >= 0.32 LBNHC cache (bf16, one head of 64: 256 bytes per token) whose block
    size makes one page of one layer ``piece`` bytes; 8 layers, even block ids only (no two pages adjacent:
    every page is its own run), ``32 MiB`` per copy (``8 MiB`` with ``quick``), all on a side stream (as
    kvx's engine copies). The rule's threshold comes from :func:`kvx.kernels.dma.calibrate_h2d`, measured first.
    """
    g = torch.Generator().manual_seed(0)
    stream = torch.cuda.Stream()
    cal = ops.calibrate_h2d()
    total = (8 if quick else 32) * MiB
    layers = 8
    rows: list[H2DRow] = []
    with torch.cuda.stream(stream):
        for piece in H2D_PIECES:
            n = max(1, total // (layers * piece))
            caches = make_kv_caches(
                "LBNHC",
                num_layers=layers,
                num_blocks=2 * n,
                block_size=piece // 256,
                num_heads=1,
                head_size=64,
                dtype=torch.bfloat16,
                device="cuda",
                generator=g,
            )
            lay = KVLayout.from_tensors(caches, "LBNHC")
            if lay.page is None or lay.page.segments != 1 or lay.page_bytes != piece:
                raise RuntimeError(f"h2d sweep: expected one {piece}-byte page per block and layer, got {lay.page}")
            ids = 2 * torch.randperm(n, generator=g)
            buf = torch.empty(lay.page_shape(n), dtype=torch.uint8, pin_memory=True)
            buf.fill_(1)
            nbytes = buf.numel()
            flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            for direction, op in _H2D_DIRECTIONS:
                gather = op.startswith("gather")
                fn = getattr(ops, op)
                src, dst = (flat_dev, flat_host) if gather else (flat_host, flat_dev)
                rule = ops.h2d_dma_min_bytes(direction="gather" if gather else "scatter")
                fns = [
                    lambda: dst.copy_(src, non_blocking=True),
                    lambda: fn(lay, ids, buf, impl="cuda", path="kernel"),
                    lambda: fn(lay, ids, buf, impl="cuda", path="dma"),
                    lambda: fn(lay, ids, buf, impl="cuda"),
                    _per_block_memcpy(lay, ids, buf, gather, stream.cuda_stream),
                ]
                ms = _time_interleaved(fns, repeats, True)
                auto = "dma" if piece >= rule else "kernel"
                for label, t in zip(H2D_PATHS, ms):
                    r = H2DRow(direction, piece, n * layers, nbytes, label, t, ms[0], ms[-1], auto)
                    log(
                        f"{direction:13s} {piece // KiB:5d} KiB x {r.pieces:6d}  {label:20s} {t:9.3f} ms "
                        f"{r.gbs:8.2f} GB/s {r.pct_roof:6.1f}% roof {r.x_each:6.1f}x memcpyAsync/block"
                    )
                    rows.append(r)
            lay = caches = buf = flat_dev = flat_host = fns = None  # free before the next size
    return rows, cal


def _fmt_bytes(b: int) -> str:
    if b == ops.DMA_NEVER:
        return "never"
    return f"{b // MiB} MiB" if b >= MiB and b % MiB == 0 else f"{b // KiB} KiB" if b % KiB == 0 else f"{b} B"


def write_h2d_results(rows: list[H2DRow], cal, path_stem: str, command: str) -> None:
    """Write ``<stem>.csv`` (every path) and ``<stem>.md`` (a row per direction and piece size, then the
    calibration sweep the rule was drawn from)."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    with open(path_stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "direction",
                "piece_bytes",
                "pieces",
                "bytes",
                "path",
                "ms",
                "GB/s",
                "pct_roof",
                "x_memcpy_per_block",
                "rule_picks",
            ]
        )
        for r in rows:
            w.writerow(
                [
                    r.direction,
                    r.piece_bytes,
                    r.pieces,
                    r.bytes,
                    r.path,
                    f"{r.ms:.4f}",
                    f"{r.gbs:.3f}",
                    f"{r.pct_roof:.1f}",
                    f"{r.x_each:.2f}",
                    r.auto_path,
                ]
            )
    thresholds = f"device->host {_fmt_bytes(cal.dma_min_bytes[0])}, host->device {_fmt_bytes(cal.dma_min_bytes[1])}"
    lines = [
        f"# kvx host <-> device copies on {machine()}",
        "",
        f"torch {torch.__version__}. Reproduce: `{command}`",
        "",
        "Raw pages (one page of one layer = one piece, no two adjacent) between an LBNHC cache and pinned "
        "host memory, 8 layers, on a side stream. GB/s = bytes / time (each byte crosses PCIe once); "
        "`% roof` = over one pinned copy of the same bytes; `x block` = speed-up over one `cudaMemcpyAsync` "
        f"per page. Kernel: the UVA copy kernel capped at {ops.H2D_MAX_CTAS} CTAs (so <= "
        f"{ops.H2D_MAX_CTAS} SMs). DMA: "
        f"{'`cudaMemcpyBatchAsync`' if cal.batched else 'one `cudaMemcpyAsync` per run (no batched API)'}. "
        f"kvx auto: the rule, DMA from a mean run of {thresholds} (measured by `kvx.kernels.dma.calibrate_h2d`, "
        "below). Targets: the chosen path >= 45 GB/s, and >= 5x per-block `cudaMemcpyAsync` for pieces "
        "<= 16 KiB.",
        "",
        "| direction | piece | pieces | roof GB/s | kernel GB/s | DMA GB/s | per-block GB/s | kernel x block | "
        "DMA x block | auto: path | auto GB/s | auto x block |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    by = {(r.direction, r.piece_bytes, r.path): r for r in rows}
    for direction, _ in _H2D_DIRECTIONS:
        for piece in sorted({r.piece_bytes for r in rows}):
            if (direction, piece, H2D_PATHS[0]) not in by:
                continue
            roof, kern, dma, auto, each = (by[(direction, piece, p)] for p in H2D_PATHS)
            lines.append(
                f"| {direction} | {_fmt_bytes(piece)} | {kern.pieces} | {roof.gbs:.1f} | {kern.gbs:.1f} | "
                f"{dma.gbs:.1f} | {each.gbs:.1f} | {kern.x_each:.1f}x | {dma.x_each:.1f}x | "
                f"{auto.auto_path} | {auto.gbs:.1f} | {auto.x_each:.1f}x |"
            )
    lines += [
        "",
        f"Calibration (`kvx.kernels.dma.calibrate_h2d`, {cal.device}): ms per copy of `runs` runs of "
        "`run` bytes, kernel vs DMA; the threshold is the smallest size from which DMA is at least as fast at "
        f"every larger size. Threshold: {thresholds}.",
        "",
        "| run | runs | d->h kernel ms | d->h DMA ms | h->d kernel ms | h->d DMA ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, b in enumerate(cal.run_bytes):
        lines.append(
            f"| {_fmt_bytes(b)} | {cal.runs[i]} | {cal.kernel_ms[0][i]:.4f} | {cal.dma_ms[0][i]:.4f} | "
            f"{cal.kernel_ms[1][i]:.4f} | {cal.dma_ms[1][i]:.4f} |"
        )
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def cpu_name() -> str:
    """The CPU model and core count, for result files."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def machine() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()


def write_results(rows: list[Row], path_stem: str, title: str, command: str) -> None:
    """Write ``<stem>.csv`` and ``<stem>.md`` (a table per device + the ratios that matter)."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    with open(path_stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "device",
                "op",
                "layout",
                "dtype",
                "block_size",
                "tokens",
                "layers",
                "heads",
                "head_size",
                "impl",
                "bytes",
                "ms",
                "GB/s",
                "pct_roof",
            ]
        )
        for r in rows:
            c = r.case
            w.writerow(
                [
                    r.device,
                    c.op,
                    c.layout,
                    str(c.dtype)[6:],
                    c.block_size,
                    c.tokens,
                    c.layers,
                    c.heads,
                    c.head_size,
                    r.impl,
                    r.bytes,
                    f"{r.ms:.4f}",
                    f"{r.gbs:.3f}",
                    f"{r.pct_roof:.1f}",
                ]
            )
    lines = [
        f"# {title}",
        "",
        f"Machine: {machine()}; torch {torch.__version__}.",
        "",
        f"Reproduce: `{command}`",
        "",
        "Bytes = payload copied (read once + written once). `% roof` = GB/s over the memcpy of the same "
        "bytes measured in the same run (CPU: glibc memcpy on the same threads; GPU: device copy or "
        "pinned host copy). `x torch` = speed-up over torch indexing.",
        "",
        "| where | case | impl | ms | GB/s | % roof | x torch |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    torch_ms = {(r.device, r.case.label): r.ms for r in rows if r.impl == "torch-index"}
    for r in rows:
        base = torch_ms.get((r.device, r.case.label))
        speed = f"{base / r.ms:.1f}x" if base else ""
        lines.append(
            f"| {r.device} | {r.case.label} | {r.impl} | {r.ms:.3f} | {r.gbs:.2f} | {r.pct_roof:.0f}% | {speed} |"
        )
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx bench", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda when present)",
    )
    ap.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--impls", default=None, help="comma-separated subset of kvx.kernels.ops.IMPLS")
    ap.add_argument(
        "--out",
        default=None,
        help="results path stem (default: benchmarks/results/copy_<device>; "
        "the CUDA host <-> device sweep goes to copy_h2d_cuda beside it)",
    )
    ap.add_argument("--h2d-only", action="store_true", help="CUDA: only the host <-> device sweep")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {args.repeats}")
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is present")
    if args.h2d_only and not on_gpu:
        ap.error("--h2d-only: the host <-> device sweep needs --device cuda")
    impls = args.impls.split(",") if args.impls else None
    stem = args.out or os.path.join("benchmarks", "results", f"copy_{args.device.split(':')[0]}")
    cmd = ("python benchmarks/bench_copy.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if not args.h2d_only:
        rows = run(args.device, args.quick, args.repeats, impls)
        write_results(rows, stem, f"kvx copy kernels on {args.device}", cmd)
        print(f"wrote {stem}.md and {stem}.csv")
    if on_gpu:
        if args.device != "cuda":
            torch.cuda.set_device(torch.device(args.device))
        h2d_rows, cal = run_h2d(args.quick, args.repeats)
        h2d_stem = os.path.join(os.path.dirname(stem), "copy_h2d_cuda")
        write_h2d_results(h2d_rows, cal, h2d_stem, cmd)
        print(f"wrote {h2d_stem}.md and {h2d_stem}.csv")
    return 0
