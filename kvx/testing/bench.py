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
import collections
import contextlib
import csv
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from .. import _ext
from ..kernels import ops
from ..kernels.layout import KVLayout, Op
from . import make_kv_caches

KiB, MiB = 1 << 10, 1 << 20
HOST = "cuda<->pinned"  # the ``where`` of a table row whose contiguous side is pinned host memory


# ---------------------------------------------------------------------------------------- clocks and load
class Clock:
    """Points on the current stream: CUDA events (read after a synchronize), ``perf_counter`` on CPU."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cycles_per_ms = self._sleep_rate() if self.cuda else 0.0

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pad(self, ms: float) -> None:
        """Keep the current stream busy for ``ms`` while the host queues what follows (CUDA)."""
        if self.cuda and ms > 0:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def time_ms(self, fn, repeats: int, pad_ms: float = 0.0) -> float:
        """Median time of ``fn`` on the current stream: events around each call, all calls queued behind a
        pad (CUDA), so the host's cost of issuing them is not timed; ``perf_counter`` on CPU."""
        fn()
        self.sync()
        self.pad(pad_ms)
        marks = []
        for _ in range(repeats):
            a = self.mark()
            fn()
            marks.append((a, self.mark()))
        self.sync()
        return statistics.median(self.ms(a, b) for a, b in marks)

    @staticmethod
    def _sleep_rate() -> float:
        """``torch.cuda._sleep`` cycles per millisecond on this GPU."""
        cycles = 2_000_000
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        evs = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            evs.append((a, b))
        torch.cuda.synchronize()
        return cycles / statistics.median(a.elapsed_time(b) for a, b in evs)


class GemmLoad:
    """A bf16 GEMM loop (``n^3``, every SM busy, as a prefill's GEMMs) on a stream of its own, kept topped up by
    the host while copies run on another stream (``h2d_probe.py`` of the first GPU run did the same with 300
    8192^3 matmuls queued at once). The host queues batches of about ``batch_ms`` and counts what is still
    queued by an event after each batch, so the queue never drains during a timed round and the tail left to
    wait for when a case ends is short."""

    def __init__(self, device: torch.device, n: int = 8192, batch_ms: float = 10.0):
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.c = torch.empty_like(self.a)
            for _ in range(3):
                torch.mm(self.a, self.a, out=self.c)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(5):
                torch.mm(self.a, self.a, out=self.c)
            t1.record()
        t1.synchronize()
        self.unit_ms = t0.elapsed_time(t1) / 5
        self.per_batch = max(1, round(batch_ms / self.unit_ms))
        self.batch_ms = self.per_batch * self.unit_ms
        self.desc = f"bf16 GEMM {n}x{n}x{n} loop ({self.unit_ms:.2f} ms each, alone)"
        self._pending: collections.deque = collections.deque()

    def top_up(self, ahead_ms: float) -> None:
        """Queue GEMMs until at least ``ahead_ms`` of them (by their time alone) have not finished yet."""
        while self._pending and self._pending[0].query():
            self._pending.popleft()
        with torch.cuda.stream(self.stream):
            while len(self._pending) * self.batch_ms < ahead_ms:
                for _ in range(self.per_batch):
                    torch.mm(self.a, self.a, out=self.c)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._pending.append(ev)

    def busy(self) -> bool:
        """GEMMs are still queued or running (so they ran throughout whatever was issued after the last top-up)."""
        return bool(self._pending) and not self._pending[-1].query()

    def drain(self) -> None:
        self.stream.synchronize()
        self._pending.clear()


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


def _time_under_load(fns: list[Callable[[], None]], repeats: int, load: GemmLoad, idle_ms: list[float]) -> list[float]:
    """Median milliseconds of each fn (on the current stream) while ``load`` runs its GEMMs on its own stream:
    rounds of every fn in turn, each round issued behind at least twice its length of queued GEMMs (the first
    guessed from the idle times, 3x: the UVA kernel ran 3x slower under the GEMMs of the first GPU run); a round
    after which the GEMMs had drained is not counted (and the next gets more ahead). NaN where no round counted."""
    for fn in fns:
        fn()
    torch.cuda.current_stream().synchronize()
    round_ms = 3.0 * sum(idle_ms) + 5.0
    kept: list[list[float]] = [[] for _ in fns]
    tries = 0
    while len(kept[0]) < repeats and tries < 2 * repeats + 2:
        tries += 1
        load.top_up(2.0 * round_ms + 10.0)
        evs = []
        for fn in fns:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            evs.append((a, b))
        evs[-1][1].synchronize()
        covered = load.busy()
        times = [a.elapsed_time(b) for a, b in evs]
        round_ms = sum(times) * (1.0 if covered else 2.0)
        if covered:
            for k, t in zip(kept, times):
                k.append(t)
    load.drain()
    return [statistics.median(k) if k else math.nan for k in kept]


@dataclasses.dataclass
class Queued:
    """One fn timed by :func:`_time_queued`: milliseconds per call on the device and on the host."""

    gpu_ms: float
    host_ms: float
    behind: int  # rounds in which the host took longer to queue the calls than the pad lasted


def _time_queued(fns: list[Callable[[], None]], clock: Clock, n_ops: int, rounds: int) -> list[Queued]:
    """Per fn: ``n_ops`` calls queued back to back behind a ``torch.cuda._sleep`` pad (twice the host time the
    calls took unpadded, + 1 ms), so the host is done before the GPU starts them: GPU time per call = events
    around the calls / ``n_ops``; host time per call = wall clock of the enqueue loop / ``n_ops``
    (``overhead_probe.py`` of the first GPU run). Medians of ``rounds`` rounds, the fns interleaved. On CPU
    both are the wall clock per call."""
    for fn in fns:
        fn()
        fn()
    clock.sync()
    unpadded = []
    for fn in fns:
        t0 = time.perf_counter()
        for _ in range(n_ops):
            fn()
        unpadded.append((time.perf_counter() - t0) * 1e3)
        clock.sync()
    gpu: list[list[float]] = [[] for _ in fns]
    host: list[list[float]] = [[] for _ in fns]
    behind = [0] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            pad_ms = min(500.0, 2.0 * unpadded[i] + 1.0)
            clock.pad(pad_ms)
            a = clock.mark()
            t0 = time.perf_counter()
            for _ in range(n_ops):
                fn()
            h_ms = (time.perf_counter() - t0) * 1e3
            b = clock.mark()
            clock.sync()
            gpu[i].append(clock.ms(a, b) / n_ops)
            host[i].append(h_ms / n_ops)
            behind[i] += int(clock.cuda and h_ms > pad_ms)
    return [Queued(statistics.median(g), statistics.median(h), bh) for g, h, bh in zip(gpu, host, behind)]


# ---------------------------------------------------------------------------------------- host paths
def staging_buffer(layout: KVLayout, op: str, num_ids: int) -> torch.Tensor:
    """A device staging buffer big enough for ``op`` of ``num_ids`` ids on ``layout`` (``ops.staging_bytes``)."""
    return torch.empty(ops.staging_bytes(layout, op, num_ids), dtype=torch.uint8, device=layout.device)


def host_paths(device: str | torch.device, op: str) -> list[str]:
    """The host <-> device paths to time for ``op`` on a cache on ``device``, in table order: on CUDA
    ``kernel`` (the UVA kernel), ``dma`` (raw pages only: a canonical chunk's runs are single rows),
    ``staged`` and ``auto`` (``path=None``); on CPU (a smoke run) ``staged`` and ``auto``."""
    cuda = torch.device(device).type == "cuda"
    out = ["kernel"] if cuda else []
    if cuda and op.endswith("_pages"):
        out.append("dma")
    return out + ["staged", "auto"]


def path_fn(op: str, layout: KVLayout, ids, buf: torch.Tensor, path: str, staging: torch.Tensor | None = None):
    """``ops.<op>`` on ``path`` (``auto``: ``path=None``): impl cuda on a CUDA cache, the default on CPU."""
    fn = getattr(ops, op)
    impl = "cuda" if layout.device.type == "cuda" else None
    if path == "auto":
        return lambda: fn(layout, ids, buf, impl=impl)
    if path == "staged":
        staging = staging if staging is not None else staging_buffer(layout, op, len(ids))
        return lambda: fn(layout, ids, buf, impl=impl, path="staged", staging=staging)
    return lambda: fn(layout, ids, buf, impl=impl, path=path)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_copy(op: str, layout: KVLayout, ids, buf: torch.Tensor, fn: Callable[[], None]) -> None:
    """Run ``fn`` (``op`` between ``layout``'s blocks ``ids`` and ``buf``) once and compare the bytes with impl
    ``reference``; raises ``RuntimeError`` naming the first differing byte."""
    gather = op.startswith("gather")
    if gather:
        want = getattr(ops, op)(layout, ids, impl="reference")
        _bytes_of(buf).fill_(0x5A)
        fn()
        got = buf
    else:
        want = buf
        fn()
        got = getattr(ops, "gather_" + op.split("_", 1)[1])(layout, ids, impl="reference")
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    a, b = _bytes_of(got).to(layout.device), _bytes_of(want).to(layout.device)
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0])
        raise RuntimeError(f"{op}: byte {i} of {a.numel()} differs from impl 'reference' ({int(a[i])} != {int(b[i])})")


def _random_(buf: torch.Tensor, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Random bytes into ``buf`` (generated on ``device``: a GPU fills 1 GiB in milliseconds)."""
    flat = _bytes_of(buf)
    if device.type == "cuda":
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=device), non_blocking=False)
    else:
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    return buf


def _usable(named: list[tuple[str, Callable, Callable | None]], errors: list[str], where: str, log) -> list:
    """The ``(label, fn)`` of ``named`` whose check (or, without one, a first call) passes; the others are
    logged and listed in ``errors``."""
    out = []
    for label, fn, check in named:
        try:
            (check or (lambda f: f()))(fn)
            out.append((label, fn))
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            msg = f"{where} {label}: {type(e).__name__}: {e}"
            errors.append(msg)
            log(f"ERROR {msg}")
    return out


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
    (:class:`kvx.connector.cache.WorkerCache`); returns a call running layer 0's parts on the current stream (the worker
    puts a part's DMA and reshape on two queues), and the copies' count. The engine's job bookkeeping is not in it:
    ``bench_pipeline.py`` times the hooks whole."""
    from ..connector.config import KVXConfig
    from ..kernels.plan import Copies

    cfg = KVXConfig.from_extra_config({})
    batch = Copies(layout, path=cfg.copy_path if layout.device.type == "cuda" else "staged")
    for ids, buf in copies:
        batch.add(op, ids, buf)
    capacity = cfg.staging_bytes // 4
    plan = batch.plan([(i, i + 1) for i in range(layout.num_layers)], capacity)
    lo, hi = plan.range_parts(0)
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
    # when there are several KV heads: a worker's slots then are, kvx.connector.cache.WorkerCache.head_major)
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


# ---------------------------------------------------------------------------------------- main
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
