"""The one door to the copy kernels: validate, then run the chosen implementation.

Ops (``layout`` is a :class:`kvx.kernels.layout.KVLayout` describing ``L`` layers of ``P`` planes):

==================  ===========================  ===============================================
op                  ids                          contiguous side
==================  ===========================  ===============================================
``gather_blocks``   block ids ``[n]``            out ``[L, P, n*N, H, D]`` (canonical chunk)
``scatter_blocks``  block ids ``[n]``, unique    src ``[L, P, n*N, H, D]``
``gather_slots``    slot ids ``[n]``, ``<0`` pad  out ``[L, P, n, H, D]``; padding rows untouched
``scatter_slots``   slot ids ``[n]``, unique      src ``[L, P, n, H, D]``; padding rows skipped
``gather_pages``    block ids ``[n]``            out ``[L, S, n, segment_bytes]`` uint8 (raw pages)
``scatter_pages``   block ids ``[n]``, unique    src ``[L, S, n, segment_bytes]`` uint8
==================  ===========================  ===============================================

All layers move in one call. :class:`CopyBatch` checks several such copies once and then runs them layer
range by layer range (a layer-wise pipeline: every chunk of a step, one layer at a time), on CPU in one
parallel region per range. Ids are a CPU integer tensor or a Python sequence: they are checked on
the host (no device sync) and uploaded with the copy. The contiguous side may be a strided view (rows
dense); for a CUDA cache it may live in pinned host memory, which the kernel reads or writes directly.

Implementations (``impl=``): ``"reference"`` (pure torch), ``"cpu"`` (C++ threads, GIL released),
``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"cuda"``, and ``"cuda_sim"``: the CUDA copy
kernel's own source (body and launch decisions) run on CPU caches for every thread of its grid, on a
device of :data:`CUDA_SIM_SM_COUNT` SMs, each vector access checked for alignment, bounds (the layer
tensor's and the contiguous side's extent) and double writes; a violation raises ``kvx._C.CudaSimFault``
naming the CTA, thread, row and address. It is a test tool (one CPU thread emulating the grid), built
whenever kvx is built with nvcc. ``None`` picks the fastest available for the cache's device: ``cpu`` on
CPU, ``cuda`` then ``triton`` on CUDA. :func:`available_impls` lists what this install can run.

Ops launch on the caller's current stream (``with torch.cuda.stream(s):`` to use another) and never
synchronize the host.

Host <-> device path (``impl="cuda"``, contiguous side in pinned host memory). Two ways move the bytes:
the copy kernel reading/writing the mapped host memory over PCIe (capped at :data:`H2D_MAX_CTAS` = 8
thread blocks, so at most 8 SMs, whatever ``max_ctas`` says above that), or DMA on the copy engines (no
SM): the copy listed as runs of bytes contiguous on both sides (adjacent rows and blocks merged), issued
with ``cudaMemcpyBatchAsync`` (CUDA >= 12.8, on any stream but the legacy default one) or one
``cudaMemcpyAsync`` per run. Each DMA run has a fixed cost, so small pieces go faster through the kernel
and large ones through DMA. Per call, ``path=None`` takes DMA when the copy's runs average at least
:func:`h2d_dma_min_bytes` bytes, else the kernel. That threshold is measured once per device and process
(:func:`calibrate_h2d`: both paths timed with CUDA events on runs of 4 KiB .. 1 MiB, each direction, about
20 ms and one sync of its own stream, lazily at the first such copy unless called before) and chosen by
:func:`choose_dma_min_bytes`; ``KVX_H2D_DMA_MIN_BYTES`` (bytes, ``0`` = always DMA) replaces the
measurement. ``path="kernel"`` or ``path="dma"`` forces one (``"dma"`` also works with the contiguous side
on the device). Other implementations take ``path=None`` only.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence

import torch

from . import reference
from .layout import ContigDesc, CopyPlan, KVLayout, Op, PagedDesc, _byte_span, non_overlapping

IMPLS = ("reference", "cpu", "triton", "cuda", "cuda_sim")
PATHS = ("kernel", "dma")   # host <-> device paths of impl "cuda" (``path=``); None = by the measured rule

H2D_MAX_CTAS = 8            # thread blocks (so SMs) the copy kernel may use for a host <-> device copy
CUDA_SIM_SM_COUNT = 132     # SMs of the device impl "cuda_sim" emulates (an H100 SXM): its grid's fill cap
DMA_NEVER = 2**63 - 1       # a DMA threshold no copy reaches: always the kernel
H2D_ENV = "KVX_H2D_DMA_MIN_BYTES"

_DIRECTIONS = ("gather", "scatter")   # index = Op.c_direction

# the compiled extension (None when it failed to import: the ops then say how to build it)
from .._ext import BUILD_HINT as _BUILD_HINT
from .._ext import ERROR as _C_ERROR
from .._ext import C as _C
from .._ext import require as _require_ext


def _triton_usable(device: torch.device) -> bool:
    if _C is None:  # the Triton launcher takes its plan (row merging, word width) from kvx._C
        return False
    try:
        from ..triton_kernels import copy as _  # noqa: F401
    except Exception:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def available_impls(device: str | torch.device = "cpu") -> list[str]:
    """Implementations that can run for a cache on ``device`` with this install."""
    device = torch.device(device)
    impls = ["reference"]
    if device.type == "cpu" and _C is not None:
        impls.append("cpu")
    if _triton_usable(device):
        impls.append("triton")
    if device.type == "cuda" and _C is not None and getattr(_C, "has_cuda", False):
        impls.append("cuda")
    if device.type == "cpu" and _C is not None and getattr(_C, "has_cuda_sim", False):
        impls.append("cuda_sim")
    return impls


def get_num_threads() -> int:
    """Threads used by the ``cpu`` implementation."""
    return _require_ext().cpu_get_num_threads()


def set_num_threads(n: int) -> None:
    """Threads used by the ``cpu`` implementation (default: ``KVX_NUM_THREADS`` or all cores)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    _require_ext()
    _C.cpu_set_num_threads(n)


# ---------------------------------------------------------------------------------------- ops
def gather_blocks(layout: KVLayout, block_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                  max_ctas: int = 0, path: str | None = None) -> torch.Tensor:
    """Copy whole blocks of every layer into the canonical chunk ``[L, P, n*N, H, D]`` (returned)."""
    return _run(Op.GATHER_BLOCKS, layout, block_ids, out, impl, max_ctas, path)


def scatter_blocks(layout: KVLayout, block_ids, src: torch.Tensor, *, impl: str | None = None,
                   max_ctas: int = 0, path: str | None = None) -> None:
    """Write the canonical chunk ``src`` ``[L, P, n*N, H, D]`` into blocks ``block_ids`` of every layer."""
    _run(Op.SCATTER_BLOCKS, layout, block_ids, src, impl, max_ctas, path)


def gather_slots(layout: KVLayout, slot_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                 max_ctas: int = 0, path: str | None = None) -> torch.Tensor:
    """Copy single tokens (``slot = block * N + offset``) into ``[L, P, n, H, D]`` (returned).

    Rows of padding slots (negative ids) are left as they were in ``out``.
    """
    return _run(Op.GATHER_SLOTS, layout, slot_ids, out, impl, max_ctas, path)


def scatter_slots(layout: KVLayout, slot_ids, src: torch.Tensor, *, impl: str | None = None,
                  max_ctas: int = 0, path: str | None = None) -> None:
    """Write ``src`` ``[L, P, n, H, D]`` into the listed slots; negative slots are skipped."""
    _run(Op.SCATTER_SLOTS, layout, slot_ids, src, impl, max_ctas, path)


def gather_pages(layout: KVLayout, block_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                 max_ctas: int = 0, path: str | None = None) -> torch.Tensor:
    """Copy the raw bytes of whole pages into ``[L, S, n, segment_bytes]`` uint8 (returned)."""
    return _run(Op.GATHER_PAGES, layout, block_ids, out, impl, max_ctas, path)


def scatter_pages(layout: KVLayout, block_ids, src: torch.Tensor, *, impl: str | None = None,
                  max_ctas: int = 0, path: str | None = None) -> None:
    """Write raw pages ``src`` ``[L, S, n, segment_bytes]`` uint8 into blocks ``block_ids``."""
    _run(Op.SCATTER_PAGES, layout, block_ids, src, impl, max_ctas, path)


# ---------------------------------------------------------------------------------------- host <-> device rule
@dataclasses.dataclass(frozen=True)
class H2DCalibration:
    """What :func:`calibrate_h2d` measured on one device: milliseconds per copy of ``runs[i]`` runs of
    ``run_bytes[i]`` bytes each (device memory <-> pinned host), by the kernel (``H2D_MAX_CTAS`` CTAs) and
    by DMA, for ``gather`` (device -> host) and ``scatter`` (host -> device), and the thresholds
    :func:`choose_dma_min_bytes` drew from them.

    ``kernel_ms[d][i]`` / ``dma_ms[d][i]``: direction ``d`` (0 gather, 1 scatter), size ``i``.
    ``dma_min_bytes[d]``: DMA from this mean run size on (:data:`DMA_NEVER`: never).
    ``batched``: DMA went through ``cudaMemcpyBatchAsync`` (else one ``cudaMemcpyAsync`` per run).
    """

    device: torch.device
    run_bytes: tuple[int, ...]
    runs: tuple[int, ...]
    kernel_ms: tuple[tuple[float, ...], tuple[float, ...]]
    dma_ms: tuple[tuple[float, ...], tuple[float, ...]]
    dma_min_bytes: tuple[int, int]
    batched: bool


def choose_dma_min_bytes(run_bytes: Sequence[int], kernel_ms: Sequence[float], dma_ms: Sequence[float]) -> int:
    """The DMA threshold from timings of both paths over increasing run sizes.

    Returns the smallest measured size from which DMA is at least as fast as the kernel at that size and
    every larger one (a tie goes to DMA: it uses no SM), or :data:`DMA_NEVER` when the kernel wins at the
    largest size. Sizes below the smallest measured one stay with the kernel. A size where the kernel wins
    above one where DMA won (noise near the crossover) moves the threshold up past it.

    Args:
        run_bytes: ``[n]`` strictly increasing run sizes in bytes.
        kernel_ms, dma_ms: ``[n]`` time per copy of each path at each size (any unit, the same for both).
    """
    sizes, k_ms, d_ms = list(run_bytes), list(kernel_ms), list(dma_ms)
    if not sizes:
        raise ValueError("run_bytes: expected at least one run size, got none")
    if len(k_ms) != len(sizes) or len(d_ms) != len(sizes):
        raise ValueError(f"kernel_ms, dma_ms: expected one time per run size ({len(sizes)}), got {len(k_ms)} and "
                         f"{len(d_ms)}")
    for i, b in enumerate(sizes):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or (i and b <= sizes[i - 1]):
            raise ValueError(f"run_bytes: expected strictly increasing positive ints, got {sizes}")
    for name, ts in (("kernel_ms", k_ms), ("dma_ms", d_ms)):
        if any(not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0 for t in ts):
            raise ValueError(f"{name}: expected positive finite times, got {ts}")
    threshold = DMA_NEVER
    for b, k, d in reversed(list(zip(sizes, k_ms, d_ms))):
        if d > k:
            break
        threshold = b
    return threshold


def h2d_env_min_bytes() -> int | None:
    """``KVX_H2D_DMA_MIN_BYTES`` as bytes (None when unset); ValueError naming it when malformed."""
    raw = os.environ.get(H2D_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{H2D_ENV}: expected a non-negative integer (the mean run size in bytes from which "
                         f"host <-> device copies use DMA; 0 = always), got {raw!r}")
    return value


def _cuda_device(device) -> torch.device:
    try:
        dev = torch.device("cuda" if device is None else device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device: expected a CUDA device, got {device!r} ({e})") from None
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    return dev


def h2d_dma_min_bytes(device: str | torch.device | None = None, direction: str = "scatter") -> int:
    """Mean run size in bytes from which a host <-> device copy of impl ``cuda`` uses DMA (``path=None``).

    ``KVX_H2D_DMA_MIN_BYTES`` when set, else the threshold :func:`calibrate_h2d` measured on ``device``
    (measuring it on first use). ``direction``: ``"gather"`` (device -> host) or ``"scatter"`` (host ->
    device). :data:`DMA_NEVER` means the kernel always.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction: expected 'gather' (device -> host) or 'scatter' (host -> device), got "
                         f"{direction!r}")
    dev = _cuda_device(device)
    env = h2d_env_min_bytes()
    if env is not None:
        return env
    return calibrate_h2d(dev).dma_min_bytes[_DIRECTIONS.index(direction)]


_CAL_RUN_BYTES = tuple(4096 << k for k in range(9))    # 4 KiB .. 1 MiB
_CAL_BYTES = 2 << 20        # bytes per timed copy: 4 .. 256 runs of a size
_CAL_REPEATS = 3
_CALIBRATIONS: dict[torch.device, H2DCalibration] = {}
_CAL_LOCK = threading.Lock()


def calibrate_h2d(device: str | torch.device | None = None, *, force: bool = False) -> H2DCalibration:
    """Measure the kernel-or-DMA threshold of host <-> device copies on ``device`` (cached per process).

    Times, on a stream of its own, copies of ``n`` runs of each size in 4 KiB .. 1 MiB (2 MiB per copy, 4 to
    256 runs) between device memory and pinned host memory, through the kernel (``H2D_MAX_CTAS`` CTAs) and
    through DMA, in both directions, with CUDA events; about 20 ms, and it synchronizes its own stream. The
    ops call it on their first host <-> device copy with ``path=None`` (unless ``KVX_H2D_DMA_MIN_BYTES`` is
    set); call it earlier to keep that out of the first copy. ``force=True`` measures again.
    """
    dev = _cuda_device(device)
    ext = _require_ext()
    if not getattr(ext, "has_cuda", False):
        raise RuntimeError("calibrate_h2d: kvx._C was built without the CUDA kernels; rebuild with nvcc on PATH "
                           "(KVX_CUDA=1)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _CAL_LOCK:
        cal = None if force else _CALIBRATIONS.get(dev)
        if cal is None:
            cal = _measure_h2d(ext, dev)
            _CALIBRATIONS[dev] = cal
    return cal


def _time_copy(fn, stream) -> float:
    """Milliseconds per call of ``fn`` (which enqueues one copy on ``stream``), back to back after a warm-up,
    from an idle stream so that the host's cost of issuing the copies is timed too."""
    fn()
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(_CAL_REPEATS):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / _CAL_REPEATS


def _measure_h2d(ext, dev: torch.device) -> H2DCalibration:
    runs = tuple(max(4, min(256, _CAL_BYTES // b)) for b in _CAL_RUN_BYTES)
    most = max(n * b for n, b in zip(runs, _CAL_RUN_BYTES))
    kernel_ms: tuple[list[float], list[float]] = ([], [])
    dma_ms: tuple[list[float], list[float]] = ([], [])
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(dev)   # not the legacy default stream: DMA may batch, as on kvx's copy stream
        with torch.cuda.stream(stream):
            # runs of b bytes: every other b-byte piece of `paged` (never adjacent), dense in `host`
            paged = torch.empty(2 * most, dtype=torch.uint8, device=dev)
            host = torch.empty(most, dtype=torch.uint8, pin_memory=True)
            host_alias = ext.cuda_host_device_pointer(host.data_ptr())
            ids = torch.arange(max(runs), dtype=torch.int64)
            ids_dev = ids.to(dev)
            layers = torch.tensor([paged.data_ptr()], dtype=torch.int64)
            layers_dev = layers.to(dev)
            for b, n in zip(_CAL_RUN_BYTES, runs):
                pd = ext.PagedDesc(plane_stride=0, block_stride=2 * b, token_stride=0, head_stride=0, num_blocks=n,
                                   num_planes=1, block_size=1, num_heads=1)
                cd = ext.ContigDesc(layer_stride=n * b, plane_stride=0, token_stride=b, head_stride=b)
                for op in (Op.GATHER_BLOCKS, Op.SCATTER_BLOCKS):
                    def kernel(op=op, n=n, b=b, pd=pd, cd=cd):
                        ext.cuda_copy(layers.data_ptr(), layers_dev.data_ptr(), 1, ids_dev.data_ptr(), n, host_alias,
                                      pd, cd, b, op.c_mode, op.c_direction, stream.cuda_stream, H2D_MAX_CTAS)

                    def dma(op=op, n=n, b=b, pd=pd, cd=cd):
                        ext.cuda_copy_dma(layers.data_ptr(), 1, ids.data_ptr(), n, host.data_ptr(), True, pd, cd, b,
                                          op.c_mode, op.c_direction, stream.cuda_stream, 0)

                    kernel_ms[op.c_direction].append(_time_copy(kernel, stream))
                    dma_ms[op.c_direction].append(_time_copy(dma, stream))
    k = (tuple(kernel_ms[0]), tuple(kernel_ms[1]))
    m = (tuple(dma_ms[0]), tuple(dma_ms[1]))
    return H2DCalibration(dev, _CAL_RUN_BYTES, runs, k, m,
                          (choose_dma_min_bytes(_CAL_RUN_BYTES, k[0], m[0]),
                           choose_dma_min_bytes(_CAL_RUN_BYTES, k[1], m[1])),
                          bool(ext.cuda_batch_memcpy()))


# ---------------------------------------------------------------------------------------- validation
def _as_ids(name: str, ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor or a sequence of ints (ids are checked on the "
                             f"host, without a device sync), got a tensor on {ids.device}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{name}: expected an integer tensor, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(ids.shape)}")
        return ids.to(torch.int64).contiguous()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not hasattr(ids, "__array__"):
        raise TypeError(f"{name}: expected a CPU integer tensor or a sequence of ints, got {type(ids).__name__}")
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: expected a sequence of ints, got {type(ids).__name__} ({e})") from None
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected integers, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _check_ids(name: str, ids: torch.Tensor, op: Op, layout: KVLayout) -> None:
    if ids.numel() == 0:
        return
    if op.slots:
        limit = layout.num_blocks * layout.block_size
        hi = int(ids.max())
        if hi >= limit:
            raise ValueError(f"{name}: expected slot ids in [0, {limit}) or negative for padding "
                             f"({layout.num_blocks} blocks x {layout.block_size} tokens), got max {hi}")
        if not op.gather:
            valid = ids[ids >= 0]
            if valid.unique().numel() != valid.numel():
                raise ValueError(f"{name}: expected distinct slot ids for a scatter (two rows would write the "
                                 "same slot), got duplicates")
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= layout.num_blocks:
        raise ValueError(f"{name}: expected block ids in [0, {layout.num_blocks}), got "
                         f"{'min ' + str(lo) if lo < 0 else 'max ' + str(hi)}")
    if not op.gather and ids.unique().numel() != ids.numel():
        raise ValueError(f"{name}: expected distinct block ids for a scatter (two chunks would write the same "
                         "block), got duplicates")


def _check_buffer(arg: str, buf: torch.Tensor, op: Op, layout: KVLayout, n: int) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(buf).__name__}")
    if op.pages:
        shape, dtype = layout.page_shape(n), torch.uint8
        what = "raw-page chunk [L, S, n, segment_bytes]"
    else:
        shape = layout.canonical_shape(n if op.slots else n * layout.block_size)
        dtype, what = layout.dtype, "canonical chunk [L, P, T, H, D]"
    if buf.dtype != dtype:
        raise TypeError(f"{arg}: expected dtype {dtype} for the {what}, got {buf.dtype}")
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{arg}: expected shape {tuple(shape)} for the {what}, got {tuple(buf.shape)}")
    if buf.numel() and buf.stride(-1) != 1 and shape[-1] > 1:
        raise ValueError(f"{arg}: expected rows contiguous in memory (last stride 1), got stride {buf.stride()}")
    dev = layout.device
    if dev.type == "cpu":
        if buf.device.type != "cpu":
            raise ValueError(f"{arg}: expected a CPU tensor for a CPU cache, got {buf.device}")
    elif buf.device != dev and not (buf.device.type == "cpu" and buf.is_pinned()):
        raise ValueError(f"{arg}: expected a tensor on {dev} or in pinned host memory, got "
                         f"{'pageable host memory' if buf.device.type == 'cpu' else buf.device}")
    if op.gather and not non_overlapping(buf.shape, buf.stride()):
        raise ValueError(f"{arg}: its elements overlap in memory (stride {buf.stride()}); the output must not "
                         "alias itself")
    if buf.numel() and buf.device == dev:
        lo, hi = _byte_span(buf)
        for (plo, phi), l in layout.spans:
            if lo < phi and plo < hi:
                raise ValueError(f"{arg}: overlaps the paged KV cache ({layout.layer_names[l]}); the "
                                 "contiguous side must be separate memory")


def _pick_impl(impl: str | None, layout: KVLayout, buf: torch.Tensor) -> str:
    avail = available_impls(layout.device)
    if impl is None:
        for cand in (("cpu",) if layout.device.type == "cpu" else ("cuda", "triton")):
            if cand in avail:
                return cand
        if layout.device.type == "cpu":
            raise RuntimeError(_BUILD_HINT.format(err=_C_ERROR))
        raise RuntimeError(f"no kernel for a cache on {layout.device}: kvx._C was built without CUDA and triton "
                           "is not importable; rebuild with nvcc on PATH (KVX_CUDA=1) or pass impl='reference'")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl not in avail:
        if _C is None:
            raise RuntimeError(_BUILD_HINT.format(err=_C_ERROR))
        raise ValueError(f"impl: {impl!r} cannot run for a cache on {layout.device} here (available: {avail}"
                         f"{'; the Triton interpreter needs TRITON_INTERPRET=1' if impl == 'triton' else ''})")
    return impl


def _plan(op: Op, layout: KVLayout, buf: torch.Tensor, n: int) -> CopyPlan:
    item = buf.element_size()
    layer_stride, plane_stride, token_stride, head_stride = (int(s) * item for s in buf.stride()[:4])
    if op.pages:
        # [L, S, n, segment_bytes]: segments are the planes, ids the tokens, one "head" of one segment
        g = layout.page
        paged = PagedDesc(plane_stride=g.segment_stride, block_stride=layout.paged.block_stride, token_stride=0,
                          head_stride=0, num_blocks=layout.num_blocks, num_planes=g.segments, block_size=1,
                          num_heads=1)
        contig = ContigDesc(layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride,
                            head_stride=g.segment_bytes)
        return CopyPlan(paged, contig, g.segment_bytes, layout.num_layers, n, op.c_mode)
    contig = ContigDesc(layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride,
                        head_stride=head_stride)
    return CopyPlan(layout.paged, contig, layout.row_bytes, layout.num_layers, n, op.c_mode)


_PAGED_FIELDS = tuple(f.name for f in dataclasses.fields(PagedDesc))
_CONTIG_FIELDS = tuple(f.name for f in dataclasses.fields(ContigDesc))


def _c_descs(plan: CopyPlan) -> tuple:
    """``plan``'s descriptors as ``(kvx._C.PagedDesc, kvx._C.ContigDesc)``, built field by field, by name.

    Both constructors are keyword-only, so a field missing or renamed on either side is a TypeError and a
    reordering of fields cannot swap strides silently. Used by every compiled backend (CPU, CUDA and the
    Triton launcher's planning).
    """
    ext = _require_ext()
    return (ext.PagedDesc(**{f: getattr(plan.paged, f) for f in _PAGED_FIELDS}),
            ext.ContigDesc(**{f: getattr(plan.contig, f) for f in _CONTIG_FIELDS}))


_REFERENCE = {op: getattr(reference, op.value) for op in Op}   # the oracle's function of the same name


def _check(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path):
    """Validate one op's arguments; returns ``(ids, buf, impl)``: the ids as an int64 CPU tensor, the buffer
    (allocated for a gather without ``out``) and the implementation to run."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
    if layout.opaque and not op.pages:
        raise ValueError(f"layout: {layout.name!r} pages are packed by the attention backend (opaque bytes); only "
                         "whole pages can be copied (gather_pages/scatter_pages), not tokens or canonical chunks")
    if op.pages and layout.page is None:
        layout.page_shape(0)  # raises the explanatory error
    ids = _as_ids(op.id_name, ids)
    _check_ids(op.id_name, ids, op, layout)
    n = ids.numel()
    if buf is None:
        if not op.gather:
            raise TypeError("src: expected a tensor to scatter, got None")
        shape = layout.page_shape(n) if op.pages else layout.canonical_shape(
            n if op.slots else n * layout.block_size)
        buf = torch.empty(shape, dtype=torch.uint8 if op.pages else layout.dtype, device=layout.device)
    _check_buffer("out" if op.gather else "src", buf, op, layout, n)
    if not isinstance(max_ctas, int) or max_ctas < 0:
        raise ValueError(f"max_ctas: expected an int >= 0 (0 = no cap), got {max_ctas!r}")
    if path is not None and path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
    impl = _pick_impl(impl, layout, buf)
    if path is not None and impl != "cuda":
        raise ValueError(f"path: {path!r} picks between the CUDA copy kernel and DMA, which only impl 'cuda' has; "
                         f"this copy runs impl {impl!r} (cache on {layout.device}): pass path=None")
    return ids, buf, impl


def _run(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path):
    ids, buf, impl = _check(op, layout, ids, buf, impl, max_ctas, path)
    if ids.numel():
        _execute(op, layout, ids, buf, impl, max_ctas, path)
    return buf


def _execute(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path, ids_dev=None) -> None:
    """Run a validated copy (:func:`_check`). ``ids_dev``: the ids already on the cache's device (CUDA)."""
    if impl == "reference":
        _REFERENCE[op](layout, ids, buf)
        return
    plan = _plan(op, layout, buf, ids.numel())
    if impl == "cpu":
        paged, contig = _c_descs(plan)
        _C.cpu_copy(layout.layer_ptrs().data_ptr(), plan.num_layers, ids.data_ptr(), plan.num_ids, buf.data_ptr(),
                    paged, contig, plan.row_bytes, plan.mode, op.c_direction)
    elif impl == "cuda":
        _run_cuda(plan, layout, ids, buf, op, max_ctas, path, ids_dev)
    elif impl == "cuda_sim":
        _run_cuda_sim(plan, layout, ids, buf, op, max_ctas)
    else:
        _run_triton(plan, layout, ids, buf, op)


@dataclasses.dataclass(slots=True)
class _Copy:
    """One copy of a :class:`CopyBatch`, checked by :meth:`CopyBatch.add`. Owned by its batch: added and run by
    the batch's thread (a copy job), never by two threads at once."""

    op: Op
    ids: torch.Tensor                       # int64, on the CPU
    buf: torch.Tensor                       # the contiguous side, every layer of the batch's layout
    impl: str
    ids_dev: torch.Tensor | None = None     # impl "cuda": the ids on the device, uploaded by the first run


class CopyBatch:
    """Copies between one paged cache and contiguous buffers, validated once and then run layer range by
    layer range: what a layer-wise pipeline issues for each layer (every chunk of a step), without paying
    each op's argument checks per layer, and on CPU in one parallel region per range.

    ``add(op, ids, buf)`` takes the arguments of the op of that name (``"scatter_blocks"``, ... or its
    :class:`kvx.kernels.layout.Op`), with
    ``buf`` holding every layer of ``layout``, and checks them as the op does (same errors). ``run(a, b)``
    copies layers ``[a, b)`` of every added copy, in the order added; ``run()`` all layers. Copies of one
    batch must not overlap (a scatter's blocks are distinct across the batch, as within one op); the CPU
    implementation runs those that share a geometry together, in any order.
    """

    def __init__(self, layout: KVLayout, *, impl: str | None = None, max_ctas: int = 0,
                 path: str | None = None):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self._impl, self._max_ctas, self._path = impl, max_ctas, path
        self._items: list[_Copy] = []
        self._bytes = 0                    # of every copy, every layer: the transfer a run is part of
        self._blocks: set[int] = set()     # written by the scatters so far: whole blocks,
        self._slots: set[int] = set()      # single slots,
        self._slot_blocks: set[int] = set()  # and the blocks those slots are in

    def __len__(self) -> int:
        return len(self._items)

    def add(self, op: str | Op, ids, buf: torch.Tensor) -> None:
        try:
            op = Op(op)
        except ValueError:
            raise ValueError(f"op: expected one of {tuple(o.value for o in Op)}, got {op!r}") from None
        if buf is None:
            raise TypeError(f"{'out' if op.gather else 'src'}: expected a tensor, got None")
        ids, buf, impl = _check(op, self.layout, ids, buf, self._impl, self._max_ctas, self._path)
        if not ids.numel():
            return
        if not op.gather:
            self._claim(op, ids)
        self._items.append(_Copy(op, ids, buf, impl))
        self._bytes += buf.numel() * buf.element_size()

    def _claim(self, op: Op, ids: torch.Tensor) -> None:
        """Refuse a scatter that writes what an earlier scatter of the batch writes (their order within a
        batch is not defined)."""
        if op.slots:
            slots = [s for s in ids.tolist() if s >= 0]
            blocks = {s // self.layout.block_size for s in slots}
            clash = (self._slots.intersection(slots) or blocks & self._blocks)
            if not clash:
                self._slots.update(slots)
                self._slot_blocks |= blocks
                return
        else:
            blocks = set(ids.tolist())
            clash = blocks & (self._blocks | self._slot_blocks)
            if not clash:
                self._blocks |= blocks
                return
        raise ValueError(f"{op.id_name}: expected blocks and slots no earlier scatter of this batch writes (copies "
                         f"of a batch run in no defined order), got {sorted(clash)[:8]} again")

    def run(self, start: int = 0, end: int | None = None) -> None:
        """Copy layers ``[start, end)`` (``end`` None: the last layer) of every added copy."""
        layout = self.layout
        end = layout.num_layers if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= layout.num_layers):
            raise ValueError(f"start, end: expected 0 <= start < end <= {layout.num_layers}, got {start}, {end}")
        sub = layout if (start, end) == (0, layout.num_layers) else layout.layer_range(start, end)
        i = 0
        while i < len(self._items):
            item = self._items[i]
            buf = item.buf
            part = buf.narrow(0, start, end - start) if sub is not layout else buf
            if item.impl != "cpu":
                if item.impl == "cuda" and item.ids_dev is None:   # the ids go to the device once, not per range
                    item.ids_dev = _device_ids(item.ids, layout.device)
                _execute(item.op, sub, item.ids, part, item.impl, self._max_ctas, self._path, item.ids_dev)
                i += 1
                continue
            # CPU: this copy and the following ones of the same geometry, in one call
            j = i + 1
            while j < len(self._items) and (nxt := self._items[j]).op is item.op and nxt.impl == "cpu" \
                    and nxt.buf.stride() == buf.stride() and nxt.buf.dtype == buf.dtype:
                j += 1
            plan = _plan(item.op, sub, part, item.ids.numel())
            paged, contig = _c_descs(plan)
            offset = start * buf.stride(0) * buf.element_size()
            group = self._items[i:j]
            _C.cpu_copy_many(sub.layer_ptrs().data_ptr(), plan.num_layers, [it.ids.data_ptr() for it in group],
                             [it.ids.numel() for it in group], [it.buf.data_ptr() + offset for it in group],
                             paged, contig, plan.row_bytes, plan.mode, item.op.c_direction, whole_bytes=self._bytes)
            i = j


def _device_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _run_cuda(plan: CopyPlan, layout: KVLayout, ids, buf, op: Op, max_ctas, path, ids_dev=None):
    # The caller's current stream on the cache's device; entering it also makes that device current.
    stream = torch.cuda.current_stream(layout.device)
    host = buf.device.type == "cpu"
    with torch.cuda.stream(stream):
        if path == "dma" or (path is None and host):
            # DMA from the host-side tables; the C++ side declines (nothing issued) when the runs average
            # fewer bytes than the threshold, and the kernel below takes the copy.
            min_run = 0 if path == "dma" else h2d_dma_min_bytes(layout.device, _DIRECTIONS[op.c_direction])
            if min_run < DMA_NEVER and _C.cuda_copy_dma(
                    layout.layer_ptrs().data_ptr(), plan.num_layers, ids.data_ptr(), plan.num_ids, buf.data_ptr(),
                    host, *_c_descs(plan), plan.row_bytes, plan.mode, op.c_direction, stream.cuda_stream, min_run):
                return
        if ids_dev is None:
            ids_dev = _device_ids(ids, layout.device)
        contig = buf.data_ptr()
        if host:
            contig = _C.cuda_host_device_pointer(contig)
            # PCIe saturates with a few SMs; more would only take them from the model
            max_ctas = min(max_ctas, H2D_MAX_CTAS) if max_ctas else H2D_MAX_CTAS
        _C.cuda_copy(layout.layer_ptrs().data_ptr(), layout.layer_ptrs(layout.device).data_ptr(), plan.num_layers,
                     ids_dev.data_ptr(), plan.num_ids, contig, *_c_descs(plan), plan.row_bytes, plan.mode,
                     op.c_direction, stream.cuda_stream, max_ctas)


def _cuda_sim_args(plan: CopyPlan, layout: KVLayout, ids: torch.Tensor, buf: torch.Tensor) -> tuple:
    """``(bounds, args)`` for one validated copy: ``args`` are the arguments of ``kvx._C.cuda_sim_copy`` up to
    ``contig_strides``; ``bounds`` is the int64 ``[L, 2]`` tensor of per-layer ``[lo, hi)`` they point to (hold
    it while the call runs; the checker's tests narrow a bound in it).

    The bounds are the views' extents, not their storages': each layer tensor's byte span (so an access into
    another layer of a shared allocation counts as out of bounds) and the contiguous side's span.
    """
    bounds = torch.tensor([_byte_span(t) for t in layout.layers], dtype=torch.int64)
    lo, hi = _byte_span(buf)
    return bounds, (layout.layer_ptrs().data_ptr(), bounds.data_ptr(), plan.num_layers, ids.data_ptr(),
                    plan.num_ids, buf.data_ptr(), lo, hi, *_c_descs(plan))


def _run_cuda_sim(plan: CopyPlan, layout: KVLayout, ids, buf, op: Op, max_ctas):
    _bounds, args = _cuda_sim_args(plan, layout, ids, buf)   # held: the call reads the bounds by address
    _C.cuda_sim_copy(*args, plan.row_bytes, plan.mode, op.c_direction, CUDA_SIM_SM_COUNT, max_ctas)


def _run_triton(plan: CopyPlan, layout: KVLayout, ids, buf, op: Op):
    from ..triton_kernels import copy as tk

    if layout.device.type == "cuda":
        # The caller's current stream on the cache's device; entering it also makes that device current.
        with torch.cuda.stream(torch.cuda.current_stream(layout.device)):
            tk.copy_rows(plan, layout.layer_ptrs(), _device_ids(ids, layout.device), buf, op.c_direction,
                         anchor=layout.plane_views(0)[0])
    else:
        tk.copy_rows(plan, layout.layer_ptrs(), ids, buf, op.c_direction, anchor=layout.plane_views(0)[0])
