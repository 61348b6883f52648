"""Copy-kernel benchmark: time, GB/s and % of a roof measured in the same run, next to baselines.

Sections (``--sections``; CPU runs ``table``, CUDA all four):

``table`` (``<stem>.{csv,md}``): every op on chunk sets of 36 MiB .. 1 GiB.
  CPU: the roof is a plain memcpy of the same number of bytes (glibc memcpy split over the same thread pool);
  the baseline is torch indexing per layer and plane (what ExampleConnector-style code does,
  = ``impl="reference"``).
  GPU, on device (HBM): impl cuda and triton against a device-to-device copy of the same bytes.
  GPU, cache <-> pinned host: the host paths of impl cuda (``kernel``: the UVA copy kernel; ``dma``: batched DMA
  straight between host and blocks, raw pages only; ``staged``: one DMA into a preallocated device staging
  buffer + an on-device reshape; ``auto``: ``path=None``, what kvx picks), triton (UVA) and torch indexing,
  against a pinned copy of the same bytes; each row timed twice: on an idle GPU, and while a bf16 GEMM loop
  runs on another stream (the roof of that column is the pinned copy timed under the same load).
``layer`` (``<stem>_layer.csv``): one layer's copy of a step (llama3-8b: 32 layers x 8 heads x 128, bf16, block
  16, chunk 256 tokens = 1 MiB per chunk and layer) of 1, 2, 8, 32 chunks, each path against a plain copy of
  the same bytes (GPU time per op, as a ratio), with the host time per op; and one layer of a compiled plan of
  1, 2, 8 chunks as the worker runs it (one add per chunk, ``run(i, i + 1)`` on the 32-layer cache).
  N ops are queued back to back behind a ``torch.cuda._sleep`` pad: GPU time = events around them / N,
  host time = wall clock of the enqueue loop / N.
``bidir`` (``<stem>_bidir.csv``): a 32-layer load of 8 chunks and a save of 8 chunks (256 MiB each) at once on
  two streams; aggregate GB/s against two plain copies at once.
``h2d`` (``copy_h2d_<device>.{csv,md}`` beside the stem): what the worker issues per layer for raw pages: one
  op of n pieces (n = 16, 128: 1 and 8 chunks of 16 blocks) of 4 KiB .. 1 MiB each (no two adjacent), by
  dma, staged, kernel and auto, timed as in ``layer``; for each point, whether auto is within 5% of the
  faster of dma and staged.

On CPU, ``layer``, ``bidir`` and ``h2d`` run as smoke runs (tiny shapes, the CPU paths, labelled as such):
they prove the code runs, not how fast anything is. Paths this kvx build lacks (``ops.PATHS``) are left out
and the output says so. Every row of a host path is checked bit-exact against impl ``reference`` once before
it is timed; a row that fails its check or raises is left out and listed under "Errors".

Bytes moved are counted explicitly: the payload (rows copied), each read once and written once.
Run ``python benchmarks/bench_copy.py --help`` (or ``kvx bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import math
import os
import sys
import traceback
from collections.abc import Callable

import torch

from .. import _ext
from ..kernels import ops
from ..kernels.layout import KVLayout, Op
from . import make_kv_caches
from .bench_paths import (  # noqa: F401 - the benchmark's names, also where callers knew them
    _random_,
    _usable,
    check_copy,
    host_paths,
    path_fn,
    staging_buffer,
)
from .bench_sweeps import (  # noqa: F401
    _H2D_DIRECTIONS,
    _SHARED,
    AUTO_SLACK,
    BATCH_CHUNKS,
    BIDIR_CHUNKS,
    H2D_COUNTS,
    H2D_ROOF,
    LAYER_CHUNKS,
    LLAMA3_8B,
    TINY,
    BidirRow,
    H2DRow,
    LayerRow,
    LayerShape,
    auto_verdicts,
    bidir_md,
    layer_md,
    run_bidir,
    run_h2d,
    run_layer,
    worker_layer,
    write_bidir_csv,
    write_h2d_results,
    write_layer_csv,
)
from .bench_timing import (  # noqa: F401
    Clock,
    GemmLoad,
    Queued,
    _time_interleaved,
    _time_queued,
    _time_under_load,
    cpu_name,
    machine,
)

KiB, MiB = 1 << 10, 1 << 20
HOST = "cuda<->pinned"  # the ``where`` of a table row whose contiguous side is pinned host memory


# ---------------------------------------------------------------------------------------- the table
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
    load_ms: float | None = None  # under the GEMM loop (cache <-> pinned rows on CUDA)
    load_roof_gbs: float | None = None  # the pinned copy of the same bytes under the same load

    @property
    def gbs(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def pct_roof(self) -> float:
        return 100.0 * self.gbs / self.roof_gbs

    @property
    def load_gbs(self) -> float | None:
        return None if self.load_ms is None else self.bytes / (self.load_ms * 1e-3) / 1e9

    @property
    def load_pct_roof(self) -> float | None:
        return None if self.load_ms is None else 100.0 * self.load_gbs / self.load_roof_gbs


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


GPU_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash", "flashinfer", "mla")  # vLLM's GPU cache layouts
GPU_OPS = ("gather_blocks", "scatter_blocks", "gather_pages", "scatter_pages")  # canonical chunks, raw pages


def gpu_cases(quick: bool) -> list[Case]:
    """Every GPU layout, canonical chunks and raw pages, both directions (the targets' cases), then slots.
    Chunk sets: 8 heads x 128 bf16 at T tokens x L layers = T x L x 4 KiB (``--quick``: 4096 x 8 = 128 MiB);
    mla (1 x 576) gets twice the tokens (``--quick``: 72 MiB), so every on-device set is >= 64 MiB."""
    bf16 = torch.bfloat16
    shapes = [(4096, 8)] if quick else [(4096, 32), (16384, 32)]
    sizes = (16,) if quick else (16, 128)
    cases = []
    for tokens, layers in shapes:
        for bs in sizes:
            for layout in GPU_LAYOUTS:
                heads, hs, t = (1, 576, 2 * tokens) if layout == "mla" else (8, 128, tokens)
                for op in GPU_OPS:
                    cases.append(Case(op, layout, bf16, bs, t, layers, heads, hs))
            for op in ("gather_slots", "scatter_slots"):
                cases.append(Case(op, "LBNHC", bf16, bs, tokens, layers, 8, 128))
    return cases


def _cache(case: Case, device: str) -> KVLayout:
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
        generator=torch.Generator().manual_seed(1),
    )
    return KVLayout.from_tensors(caches, case.layout)


def _setup(case: Case, device: str, host: bool, g: torch.Generator, lay: KVLayout | None = None, rand: bool = False):
    """The case's cache (``lay``, or a new one), ids and contiguous buffer (``host``: pinned), and its bytes.
    ``rand``: random bytes in the buffer (else ones)."""
    kind = case.op.split("_")[1]
    num_blocks = case.tokens // case.block_size
    lay = lay if lay is not None else _cache(case, device)
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
    if rand:
        _random_(buf, torch.device(device), g)
    else:
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
    checkpoint: Callable[[list[Row]], None] | None = None,
    errors: list[str] | None = None,
    gemm: bool = True,
    info: dict | None = None,
) -> list[Row]:
    """Run the benchmark table for ``device`` ("cpu" or "cuda") and return its rows; ``checkpoint(rows)``
    after each case (results so far), failures of single rows appended to ``errors``. ``gemm``: on CUDA,
    time the cache <-> pinned rows under the GEMM loop too (``info["gemm"]``: what it ran)."""
    info = info if info is not None else {}
    g = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    errors = errors if errors is not None else []
    on_gpu = device.startswith("cuda")
    avail = ops.available_impls(device)
    impls = [i for i in (impls or ["cuda", "triton", "cpu", "reference"]) if i in avail]
    homes = [False, True] if on_gpu else [False]  # HBM, pinned host
    load = None
    caches: dict[tuple, KVLayout] = {}
    for case in gpu_cases(quick) if on_gpu else cpu_cases(quick):
        key = (case.layout, case.dtype, case.block_size, case.tokens, case.layers, case.heads, case.head_size)
        if key not in caches:
            caches.clear()  # one cache at a time: the cases of one geometry are adjacent
            caches[key] = _cache(case, device)
        for host in homes:
            lay, ids, buf, nbytes = _setup(case, device, host, g, lay=caches[key], rand=on_gpu)
            gather = case.op.startswith("gather")
            where = HOST if host else device
            # roof: the same bytes as one plain copy
            flat_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat_b = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else device, pin_memory=host)
            flat_a.fill_(1)
            flat_b.fill_(2)
            if on_gpu:
                src, dst = (flat_a, flat_b) if gather else (flat_b, flat_a)
                named = [("memcpy (roof)", lambda: dst.copy_(src, non_blocking=True), None)]
            else:
                _C = _ext.require()
                named = [("memcpy (roof)", lambda: _C.cpu_memcpy(flat_b.data_ptr(), flat_a.data_ptr(), nbytes), None)]
            fn = getattr(ops, case.op)
            for impl in impls:
                if impl == "reference" and case.tokens * case.layers > 4096 * 32 and not on_gpu:
                    continue  # torch indexing at 1 GiB takes seconds per repeat; 4k x 32L shows the ratio
                if impl == "cuda" and host:
                    staging = staging_buffer(lay, case.op, ids.numel())
                    for p in host_paths(device, case.op):
                        pf = path_fn(case.op, lay, ids, buf, p, staging)
                        named.append((f"kvx-cuda {p}", pf, lambda f, op=case.op: check_copy(op, lay, ids, buf, f)))
                    continue
                label = "torch-index" if impl == "reference" else f"kvx-{impl}"
                named.append((label, lambda impl=impl: fn(lay, ids, buf, impl=impl), None))
            if on_gpu and case.op.endswith("pages") and lay.page is not None and not quick:
                stream = torch.cuda.current_stream().cuda_stream
                named.append(("memcpyAsync/block", _per_block_memcpy(lay, ids, buf, gather, stream), None))
            usable = _usable(named, errors, f"{where} {case.label}", log)
            labels, fns = [u[0] for u in usable], [u[1] for u in usable]
            ms = _time_interleaved(fns, repeats, on_gpu)
            load_ms: list[float | None] = [None] * len(fns)
            if host and gemm:
                if load is None:
                    load = GemmLoad(torch.device(device))
                    info["gemm"] = load.desc
                    log(f"GEMM load: {load.desc}")
                load_ms = _time_under_load(fns, repeats, load, ms)
            roof = nbytes / (ms[0] * 1e-3) / 1e9
            load_roof = None if load_ms[0] is None else nbytes / (load_ms[0] * 1e-3) / 1e9
            case_rows = [
                Row(where, case, label, nbytes, t, roof, lt, load_roof) for label, t, lt in zip(labels, ms, load_ms)
            ]
            for r in case_rows:
                under = (
                    "" if r.load_ms is None else f" | GEMM loop: {r.load_gbs:8.2f} GB/s {r.load_pct_roof:6.1f}% roof"
                )
                log(
                    f"{where:14s} {case.label:58s} {r.impl:18s} {r.ms:9.3f} ms {r.gbs:8.2f} GB/s "
                    f"{r.pct_roof:6.1f}% roof{under}"
                )
            rows += case_rows
            lay = buf = flat_a = flat_b = named = usable = fns = None  # free this case's buffers before the next
        if checkpoint is not None:
            checkpoint(rows)
    return rows


TABLE_COLUMNS = [
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
    "load_ms",
    "load_GB/s",
    "load_pct_roof",
    "machine",
]


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def write_table_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TABLE_COLUMNS)
        name = machine()
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
                    _f(r.load_ms, ".4f"),
                    _f(r.load_gbs, ".3f"),
                    _f(r.load_pct_roof, ".1f"),
                    name,
                ]
            )


def table_md(rows: list[Row], gemm_desc: str | None = None) -> list[str]:
    on_gpu = any(r.device.startswith("cuda") for r in rows)
    lines = [
        "Bytes = payload copied (read once + written once). `% roof` = GB/s over the memcpy of the same "
        "bytes measured in the same run (CPU: glibc memcpy on the same threads; GPU: device copy or "
        "pinned host copy). `x torch` = speed-up over torch indexing.",
        "",
    ]
    if on_gpu:
        lines += [
            f"`{HOST}` rows: `kvx-cuda <path>` = impl cuda with `path=` kernel (the UVA copy kernel), dma "
            "(batched DMA between host and blocks), staged (one DMA + an on-device reshape, staging buffer "
            "preallocated), auto (`path=None`); `kvx-triton` reads/writes host memory over UVA. `GEMM loop` "
            "columns: the same copies on a side stream while "
            f"{gemm_desc or 'a bf16 GEMM loop'} runs on another stream; their roof is the pinned copy timed "
            "under the same load.",
            "",
            "| where | case | impl | ms | GB/s | % roof | GEMM loop: GB/s | % roof | x torch |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += ["| where | case | impl | ms | GB/s | % roof | x torch |", "|---|---|---|---:|---:|---:|---:|"]
    torch_ms = {(r.device, r.case.label): r.ms for r in rows if r.impl == "torch-index"}
    for r in rows:
        base = torch_ms.get((r.device, r.case.label))
        speed = f"{base / r.ms:.1f}x" if base else ""
        load = f" {_f(r.load_gbs, '.2f')} | {_f(r.load_pct_roof, '.0f')}{'%' if r.load_ms else ''} |" if on_gpu else ""
        lines.append(
            f"| {r.device} | {r.case.label} | {r.impl} | {r.ms:.3f} | {r.gbs:.2f} | {r.pct_roof:.0f}% |{load} {speed} |"
        )
    return lines


def write_results(rows: list[Row], path_stem: str, title: str, command: str) -> None:
    """Write ``<stem>.csv`` and ``<stem>.md`` (the table alone)."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    write_table_csv(rows, path_stem + ".csv")
    _write_md(path_stem + ".md", title, command, [table_md(rows)])


def _write_md(path: str, title: str, command: str, sections: list[list[str]], errors: list[str] = ()) -> None:
    lines = [f"# {title}", "", f"Machine: {machine()}; torch {torch.__version__}.", "", f"Reproduce: `{command}`", ""]
    for s in sections:
        lines += s + [""]
    if errors:
        lines += ["## Errors (rows left out)", ""] + [f"- {e}" for e in errors] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


SECTIONS = ("table", "layer", "bidir", "h2d")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx bench", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda when present)",
    )
    ap.add_argument("--quick", action="store_true", help="small shapes, fewer repeats (CUDA: the GPU run's size)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 15; CUDA --quick 7)")
    ap.add_argument("--impls", default=None, help="table: comma-separated subset of kvx.kernels.ops.IMPLS")
    ap.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated of {', '.join(SECTIONS)} (default: table on CPU, all on CUDA; on CPU the others "
        "are smoke runs)",
    )
    ap.add_argument("--no-gemm", action="store_true", help="table: skip the timings under the GEMM loop")
    ap.add_argument(
        "--out",
        default=None,
        help="results path stem (default: benchmarks/results/copy_<device>; layer and bidir CSVs get _layer and "
        "_bidir; the host <-> device sweep goes to copy_h2d_<device> beside it)",
    )
    ap.add_argument("--h2d-only", action="store_true", help="only the host <-> device sweep (= --sections h2d)")
    args = ap.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is present")
    sections = ["h2d"] if args.h2d_only else (args.sections.split(",") if args.sections else None)
    sections = sections or (list(SECTIONS) if on_gpu else ["table"])
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: expected names among {', '.join(SECTIONS)}, got {', '.join(bad)}")
    repeats = args.repeats if args.repeats is not None else (7 if on_gpu and args.quick else 15)
    if repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {repeats}")
    impls = args.impls.split(",") if args.impls else None
    dev = args.device.split(":")[0]
    stem = args.out or os.path.join("benchmarks", "results", f"copy_{dev}")
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    cmd = ("python benchmarks/bench_copy.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if on_gpu and args.device != "cuda":
        torch.cuda.set_device(torch.device(args.device))
    smoke = not on_gpu
    shape = LLAMA3_8B if on_gpu else TINY
    title = f"kvx copy kernels on {args.device}"
    md: dict[str, list[str]] = {}
    errors: list[str] = []
    failed: list[str] = []
    info: dict = {}

    def flush_md() -> None:
        _write_md(stem + ".md", title, cmd, [md[s] for s in SECTIONS if s in md], errors)

    # the copies run on a side stream, as kvx's engine issues them (and batched DMA does not run on the legacy
    # default stream)
    ctx = torch.cuda.stream(torch.cuda.Stream()) if on_gpu else contextlib.nullcontext()
    with ctx:
        for section in [s for s in SECTIONS if s in sections]:
            try:
                if section == "table":

                    def checkpoint(rows: list[Row]) -> None:
                        write_table_csv(rows, stem + ".csv")
                        md["table"] = ["## Copies of a chunk set", ""] + table_md(rows, info.get("gemm"))
                        flush_md()

                    rows = run(
                        args.device,
                        args.quick,
                        repeats,
                        impls,
                        checkpoint=checkpoint,
                        errors=errors,
                        gemm=not args.no_gemm,
                        info=info,
                    )
                    checkpoint(rows)
                    print(f"wrote {stem}.md and {stem}.csv")
                elif section == "layer":
                    lrows = run_layer(args.device, args.quick, errors=errors)
                    write_layer_csv(lrows, stem + "_layer.csv", shape.name, smoke)
                    md["layer"] = layer_md(lrows, shape, smoke)
                    flush_md()
                    print(f"wrote {stem}_layer.csv")
                elif section == "bidir":
                    brows = run_bidir(args.device, args.quick, min(repeats, 10), errors=errors)
                    write_bidir_csv(brows, stem + "_bidir.csv", shape.name, smoke)
                    md["bidir"] = bidir_md(brows, shape, smoke)
                    flush_md()
                    print(f"wrote {stem}_bidir.csv")
                else:
                    h2d_stem = os.path.join(os.path.dirname(stem), f"copy_h2d_{dev}")
                    h2d_rows, cal = run_h2d(
                        args.device,
                        args.quick,
                        errors=errors,
                        checkpoint=lambda r: write_h2d_results(r, None, h2d_stem, cmd, smoke),
                    )
                    write_h2d_results(h2d_rows, cal, h2d_stem, cmd, smoke)
                    print(f"wrote {h2d_stem}.md and {h2d_stem}.csv")
            except Exception:  # noqa: BLE001 - the other sections still run; the exit status says it failed
                traceback.print_exc()
                failed.append(section)
                errors.append(f"section {section} failed: {traceback.format_exc().splitlines()[-1]}")
                if on_gpu:
                    torch.cuda.synchronize()
    _SHARED.clear()
    if errors:
        if md:
            flush_md()
        print("errors:\n  " + "\n  ".join(errors), file=sys.stderr)
    return 1 if failed or errors else 0
