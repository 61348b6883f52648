"""Copy-kernel benchmark: time, GB/s and % of a roof measured in the same run, next to baselines.

CPU: the roof is a plain memcpy of the same number of bytes (glibc memcpy split over the same thread
pool); the baseline is torch indexing per layer and plane (what ExampleConnector-style code does,
= ``impl="reference"``).
GPU: roofs are a device-to-device copy and a pinned host copy of the same bytes; baselines are torch
indexing and one ``cudaMemcpyAsync`` per (layer, block) page.

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

from . import ops
from .layout import KVLayout
from .testing import make_kv_caches


@dataclasses.dataclass
class Case:
    op: str            # gather_blocks, scatter_slots, gather_pages, ...
    layout: str
    dtype: torch.dtype
    block_size: int
    tokens: int
    layers: int
    heads: int
    head_size: int

    @property
    def label(self) -> str:
        return (f"{self.op} {self.layout} {str(self.dtype)[6:]} bs{self.block_size} T{self.tokens} "
                f"L{self.layers} {self.heads}x{self.head_size}")


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
            for op in ("gather_blocks", "scatter_blocks", "gather_slots", "scatter_slots", "gather_pages",
                       "scatter_pages"):
                cases.append(Case(op, "LBNHC", bf16, bs, tokens, layers, 8, 128))           # 256 B rows
            if not quick:
                for op in ("gather_blocks", "gather_slots", "scatter_slots"):
                    cases.append(Case(op, "mla", bf16, bs, tokens, layers, 1, 576))        # 1152 B rows
                    cases.append(Case(op, "flash", bf16, bs, tokens, layers, 8, 128))      # 2 KiB rows
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
    for fn in fns:       # warm-up
        fn()
    if on_gpu:
        torch.cuda.synchronize()
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(repeats)] for _ in fns]
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
    caches = make_kv_caches(case.layout, num_layers=case.layers, num_blocks=num_blocks + 16,
                            block_size=case.block_size, num_heads=case.heads, head_size=case.head_size,
                            dtype=case.dtype, device=device, generator=g)
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
    from . import _C

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


def run(device: str = "cpu", quick: bool = False, repeats: int = 15, impls: list[str] | None = None,
        log: Callable[[str], None] = print) -> list[Row]:
    """Run the benchmark table for ``device`` ("cpu" or "cuda") and return its rows."""
    g = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    on_gpu = device.startswith("cuda")
    avail = ops.available_impls(device)
    impls = [i for i in (impls or ["cuda", "triton", "cpu", "reference"]) if i in avail]
    homes = [False, True] if on_gpu else [False]   # HBM, pinned host
    for case in (gpu_cases(quick) if on_gpu else cpu_cases(quick)):
        for host in homes:
            lay, ids, buf, nbytes = _setup(case, device, host, g)
            gather = case.op.startswith("gather")
            where = device + ("<->pinned" if host else "")
            # roof: the same bytes as one plain copy
            flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat_b = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else device,
                                 pin_memory=host)
            flat_a.fill_(1)
            flat_b.fill_(2)
            if on_gpu:
                src, dst = (flat_a, flat_b) if gather else (flat_b, flat_a)
                fns = [lambda: dst.copy_(src, non_blocking=True)]
            else:
                from . import _C
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
                log(f"{where:14s} {case.label:58s} {r.impl:18s} {r.ms:9.3f} ms {r.gbs:8.2f} GB/s "
                    f"{r.pct_roof:6.1f}% roof")
            rows += case_rows
            lay = buf = flat_a = flat_b = fns = None   # free this case's buffers before the next
    return rows


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
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


def write_results(rows: list[Row], path_stem: str, title: str, command: str) -> None:
    """Write ``<stem>.csv`` and ``<stem>.md`` (a table per device + the ratios that matter)."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    with open(path_stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["device", "op", "layout", "dtype", "block_size", "tokens", "layers", "heads", "head_size",
                    "impl", "bytes", "ms", "GB/s", "pct_roof"])
        for r in rows:
            c = r.case
            w.writerow([r.device, c.op, c.layout, str(c.dtype)[6:], c.block_size, c.tokens, c.layers, c.heads,
                        c.head_size, r.impl, r.bytes, f"{r.ms:.4f}", f"{r.gbs:.3f}", f"{r.pct_roof:.1f}"])
    lines = [f"# {title}", "", f"Machine: {machine()}; torch {torch.__version__}.", "",
             f"Reproduce: `{command}`", "",
             "Bytes = payload copied (read once + written once). `% roof` = GB/s over the memcpy of the same "
             "bytes measured in the same run (CPU: glibc memcpy on the same threads; GPU: device copy or "
             "pinned host copy). `x torch` = speed-up over torch indexing.", "",
             "| where | case | impl | ms | GB/s | % roof | x torch |", "|---|---|---|---:|---:|---:|---:|"]
    torch_ms = {(r.device, r.case.label): r.ms for r in rows if r.impl == "torch-index"}
    for r in rows:
        base = torch_ms.get((r.device, r.case.label))
        speed = f"{base / r.ms:.1f}x" if base else ""
        lines.append(f"| {r.device} | {r.case.label} | {r.impl} | {r.ms:.3f} | {r.gbs:.2f} | {r.pct_roof:.0f}% | "
                     f"{speed} |")
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--impls", default=None, help="comma-separated subset of kvx.ops.IMPLS")
    ap.add_argument("--out", default=None, help="results path stem (default: benchmarks/results/copy_<device>)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {args.repeats}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is present")
    impls = args.impls.split(",") if args.impls else None
    rows = run(args.device, args.quick, args.repeats, impls)
    stem = args.out or os.path.join("benchmarks", "results", f"copy_{args.device.split(':')[0]}")
    cmd = "python benchmarks/bench_copy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(rows, stem, f"kvx copy kernels on {args.device}", cmd.strip())
    print(f"wrote {stem}.md and {stem}.csv")
    return 0
