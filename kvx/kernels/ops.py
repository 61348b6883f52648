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

Host <-> device copies of impl ``cuda`` (contiguous side in pinned host memory) go through the copy kernel or
by DMA: :mod:`kvx.kernels.dma` holds that rule (``path=None``) and its calibration; ``path="kernel"`` or
``path="dma"`` forces one (``"dma"`` also works with the contiguous side on the device). Other implementations
take ``path=None`` only. The rule's public names are re-exported here (:func:`calibrate_h2d`, ...).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import torch

# the compiled extension (None when it failed to import: the ops then say how to build it)
from .._ext import BUILD_HINT as _BUILD_HINT
from .._ext import ERROR as _C_ERROR
from .._ext import C as _C
from .._ext import require as _require_ext
from . import reference
from .dma import (  # noqa: F401 - the host <-> device rule (path=None follows it); its public names are the ops' too
    DMA_NEVER,
    H2D_ENV,
    H2D_MAX_CTAS,
    PATHS,
    H2DCalibration,
    calibrate_h2d,
    choose_dma_min_bytes,
    dma_min_run_bytes,
    h2d_dma_min_bytes,
    h2d_env_min_bytes,
)
from .layout import ContigDesc, CopyPlan, KVLayout, Op, PagedDesc, _byte_span, non_overlapping

IMPLS = ("reference", "cpu", "triton", "cuda", "cuda_sim")
CUDA_SIM_SM_COUNT = 132  # SMs of the device impl "cuda_sim" emulates (an H100 SXM): its grid's fill cap


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


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` between CPU tensors of one shape and dtype whose last dim is dense, on the calling thread
    alone: one memcpy per row (``kvx._C.copy_runs``), rows that continue each other merged. For I/O threads (a
    tier read into a KV head's strided slice of a chunk): ATen's copy starts a parallel region, which on a busy CPU
    engine waits for cores the model computes on (measured: 12 ms for a 4 MiB head of a chunk on 2 busy cores,
    0.17 ms on one thread)."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError(
            f"dst, src: expected CPU tensors of one shape and dtype, got {dst.dtype}{list(dst.shape)} on "
            f"{dst.device} and {src.dtype}{list(src.shape)} on {src.device}"
        )
    if dst.numel() == 0:
        return
    if dst.dim() == 0 or dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError(f"dst, src: expected a dense last dim, got strides {dst.stride()} and {src.stride()}")
    item = dst.element_size()
    row = dst.shape[-1] * item

    def offsets(t: torch.Tensor) -> np.ndarray:  # numpy: no ATen parallel region here either
        off = np.zeros((), dtype=np.int64)
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            off = off[..., None] + np.arange(size, dtype=np.int64) * (stride * item)
        return off.reshape(-1)

    d, s = offsets(dst), offsets(src)
    starts = np.flatnonzero(np.r_[True, (np.diff(d) != row) | (np.diff(s) != row)])  # rows that continue merge
    sizes = np.diff(np.r_[starts, d.size]) * row
    d, s = np.ascontiguousarray(d[starts]), np.ascontiguousarray(s[starts])
    _require_ext().copy_runs(
        d.ctypes.data, s.ctypes.data, sizes.ctypes.data, d.size, dst.data_ptr(), src.data_ptr(), num_threads=1
    )


# ---------------------------------------------------------------------------------------- ops
def gather_blocks(
    layout: KVLayout,
    block_ids,
    out: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy whole blocks of every layer into the canonical chunk ``[L, P, n*N, H, D]`` (returned)."""
    return _run(Op.GATHER_BLOCKS, layout, block_ids, out, impl, max_ctas, path, staging)


def scatter_blocks(
    layout: KVLayout,
    block_ids,
    src: torch.Tensor,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> None:
    """Write the canonical chunk ``src`` ``[L, P, n*N, H, D]`` into blocks ``block_ids`` of every layer."""
    _run(Op.SCATTER_BLOCKS, layout, block_ids, src, impl, max_ctas, path, staging)


def gather_slots(
    layout: KVLayout,
    slot_ids,
    out: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy single tokens (``slot = block * N + offset``) into ``[L, P, n, H, D]`` (returned).

    Rows of padding slots (negative ids) are left as they were in ``out``.
    """
    return _run(Op.GATHER_SLOTS, layout, slot_ids, out, impl, max_ctas, path, staging)


def scatter_slots(
    layout: KVLayout,
    slot_ids,
    src: torch.Tensor,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> None:
    """Write ``src`` ``[L, P, n, H, D]`` into the listed slots; negative slots are skipped."""
    _run(Op.SCATTER_SLOTS, layout, slot_ids, src, impl, max_ctas, path, staging)


def gather_pages(
    layout: KVLayout,
    block_ids,
    out: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy the raw bytes of whole pages into ``[L, S, n, segment_bytes]`` uint8 (returned)."""
    return _run(Op.GATHER_PAGES, layout, block_ids, out, impl, max_ctas, path, staging)


def scatter_pages(
    layout: KVLayout,
    block_ids,
    src: torch.Tensor,
    *,
    impl: str | None = None,
    max_ctas: int = 0,
    path: str | None = None,
    staging: torch.Tensor | None = None,
) -> None:
    """Write raw pages ``src`` ``[L, S, n, segment_bytes]`` uint8 into blocks ``block_ids``."""
    _run(Op.SCATTER_PAGES, layout, block_ids, src, impl, max_ctas, path, staging)


# ---------------------------------------------------------------------------------------- validation
def _as_ids(name: str, ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise ValueError(
                f"{name}: expected a CPU tensor or a sequence of ints (ids are checked on the "
                f"host, without a device sync), got a tensor on {ids.device}"
            )
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


_SMALL_IDS = 4096  # id lists up to this long are checked as Python ints (a step's chunks: ~10x faster than torch ops)


def _check_ids(name: str, ids: torch.Tensor, op: Op, layout: KVLayout) -> None:
    n = ids.numel()
    if n == 0:
        return
    small = ids.tolist() if n <= _SMALL_IDS else None
    if op.slots:
        limit = layout.num_blocks * layout.block_size
        hi = max(small) if small is not None else int(ids.max())
        if hi >= limit:
            raise ValueError(
                f"{name}: expected slot ids in [0, {limit}) or negative for padding "
                f"({layout.num_blocks} blocks x {layout.block_size} tokens), got max {hi}"
            )
        if not op.gather:
            if small is not None:
                valid = [s for s in small if s >= 0]
                distinct = len(set(valid)) == len(valid)
            else:
                valid = ids[ids >= 0]
                distinct = valid.unique().numel() == valid.numel()
            if not distinct:
                raise ValueError(
                    f"{name}: expected distinct slot ids for a scatter (two rows would write the "
                    "same slot), got duplicates"
                )
        return
    lo, hi = (min(small), max(small)) if small is not None else (int(ids.min()), int(ids.max()))
    if lo < 0 or hi >= layout.num_blocks:
        raise ValueError(
            f"{name}: expected block ids in [0, {layout.num_blocks}), got "
            f"{'min ' + str(lo) if lo < 0 else 'max ' + str(hi)}"
        )
    if not op.gather:
        distinct = len(set(small)) == n if small is not None else ids.unique().numel() == n
        if not distinct:
            raise ValueError(
                f"{name}: expected distinct block ids for a scatter (two chunks would write the same block), "
                "got duplicates"
            )


def _check_buffer(arg: str, buf: torch.Tensor, op: Op, layout: KVLayout, n: int) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(buf).__name__}")
    if op.pages and buf.dim() == 5:
        shape, dtype = layout.page_heads_shape(n), torch.uint8
        what = "raw-page chunk split by head [L, S, n, H, segment_bytes / H]"
    elif op.pages:
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
        raise ValueError(
            f"{arg}: expected a tensor on {dev} or in pinned host memory, got "
            f"{'pageable host memory' if buf.device.type == 'cpu' else buf.device}"
        )
    if op.gather and not non_overlapping(buf.shape, buf.stride()):
        raise ValueError(
            f"{arg}: its elements overlap in memory (stride {buf.stride()}); the output must not alias itself"
        )
    if buf.numel() and buf.device == dev:
        lo, hi = _byte_span(buf)
        for (plo, phi), l in layout.spans:
            if lo < phi and plo < hi:
                raise ValueError(
                    f"{arg}: overlaps the paged KV cache ({layout.layer_names[l]}); the "
                    "contiguous side must be separate memory"
                )


def _pick_impl(impl: str | None, layout: KVLayout, buf: torch.Tensor) -> str:
    avail = available_impls(layout.device)
    if impl is None:
        for cand in ("cpu",) if layout.device.type == "cpu" else ("cuda", "triton"):
            if cand in avail:
                return cand
        if layout.device.type == "cpu":
            raise RuntimeError(_BUILD_HINT.format(err=_C_ERROR))
        raise RuntimeError(
            f"no kernel for a cache on {layout.device}: kvx._C was built without CUDA and triton "
            "is not importable; rebuild with nvcc on PATH (KVX_CUDA=1) or pass impl='reference'"
        )
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl not in avail:
        if _C is None:
            raise RuntimeError(_BUILD_HINT.format(err=_C_ERROR))
        raise ValueError(
            f"impl: {impl!r} cannot run for a cache on {layout.device} here (available: {avail}"
            f"{'; the Triton interpreter needs TRITON_INTERPRET=1' if impl == 'triton' else ''})"
        )
    return impl


def _plan(op: Op, layout: KVLayout, buf: torch.Tensor, n: int) -> CopyPlan:
    item = buf.element_size()
    layer_stride, plane_stride, token_stride, head_stride = (int(s) * item for s in buf.stride()[:4])
    if op.pages:
        # [L, S, n, segment_bytes]: segments are the planes, ids the tokens, one "head" of one segment; split by head,
        # [L, S, n, H, run]: each head a run of its segment, at the buffer's head stride
        g = layout.page
        if buf.dim() == 5:
            heads, run = layout.num_heads, layout.page_head_bytes
        else:
            heads, run, head_stride = 1, g.segment_bytes, g.segment_bytes
        paged = PagedDesc(
            plane_stride=g.segment_stride,
            block_stride=layout.paged.block_stride,
            token_stride=0,
            head_stride=run if heads > 1 else 0,
            num_blocks=layout.num_blocks,
            num_planes=g.segments,
            block_size=1,
            num_heads=heads,
        )
        contig = ContigDesc(
            layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride, head_stride=head_stride
        )
        return CopyPlan(paged, contig, run, layout.num_layers, n, op.c_mode)
    contig = ContigDesc(
        layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride, head_stride=head_stride
    )
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
    return (
        ext.PagedDesc(**{f: getattr(plan.paged, f) for f in _PAGED_FIELDS}),
        ext.ContigDesc(**{f: getattr(plan.contig, f) for f in _CONTIG_FIELDS}),
    )


def _c_copy_args(plan: CopyPlan, ids: int, contig: int, op: Op) -> dict:
    """The arguments every ``kvx._C`` copy function shares, by the bindings' own names (a renamed or missing one is
    a TypeError, never a swapped stride or id count): the copy's plan, the ids' and the contiguous side's
    addresses, the op's direction. The callers add the layer tables and what their function takes besides."""
    paged, contig_strides = _c_descs(plan)
    return dict(
        num_layers=plan.num_layers,
        ids=ids,
        num_ids=plan.num_ids,
        contig=contig,
        paged=paged,
        contig_strides=contig_strides,
        row_bytes=plan.row_bytes,
        mode=plan.mode,
        direction=op.c_direction,
    )


_REFERENCE = {op: getattr(reference, op.value) for op in Op}  # the oracle's function of the same name


def _check(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path):
    """Validate one op's arguments; returns ``(ids, buf, impl)``: the ids as an int64 CPU tensor, the buffer
    (allocated for a gather without ``out``) and the implementation to run."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
    if layout.opaque and not op.pages:
        raise ValueError(
            f"layout: {layout.name!r} pages are packed by the attention backend (opaque bytes); only "
            "whole pages can be copied (gather_pages/scatter_pages), not tokens or canonical chunks"
        )
    if op.pages and layout.page is None:
        layout.page_shape(0)  # raises the explanatory error
    ids = _as_ids(op.id_name, ids)
    _check_ids(op.id_name, ids, op, layout)
    n = ids.numel()
    if buf is None:
        if not op.gather:
            raise TypeError("src: expected a tensor to scatter, got None")
        shape = layout.page_shape(n) if op.pages else layout.canonical_shape(n if op.slots else n * layout.block_size)
        buf = torch.empty(shape, dtype=torch.uint8 if op.pages else layout.dtype, device=layout.device)
    _check_buffer("out" if op.gather else "src", buf, op, layout, n)
    if not isinstance(max_ctas, int) or max_ctas < 0:
        raise ValueError(f"max_ctas: expected an int >= 0 (0 = no cap), got {max_ctas!r}")
    if path is not None and path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
    impl = _pick_impl(impl, layout, buf)
    cpu_cache = layout.device.type == "cpu"
    if path == "kernel" and impl != "cuda":
        raise ValueError(
            f"path: 'kernel' forces the CUDA copy kernel over host memory, which only impl 'cuda' has; "
            f"this copy runs impl {impl!r} (cache on {layout.device}): pass path=None"
        )
    if path in ("dma", "staged") and impl != "cuda" and not cpu_cache:
        raise ValueError(
            f"path: {path!r} crosses between host memory and the device by DMA, which among the CUDA impls only "
            f"impl 'cuda' has; this copy runs impl {impl!r}: pass path=None"
        )
    if path == "staged" and not cpu_cache and buf.device.type != "cpu":
        raise ValueError(
            f"path: 'staged' stages a host buffer on the device; {'out' if op.gather else 'src'} is already on "
            f"{buf.device}: pass path=None"
        )
    return ids, buf, impl


def _run(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path, staging=None):
    if staging is not None:
        if path not in (None, "staged"):
            raise ValueError(f"staging: only path 'staged' (or None) uses a staging buffer, got path {path!r}")
        check_staging(staging, layout.device)
    ids, buf, impl = _check(op, layout, ids, buf, impl, max_ctas, path)
    if not ids.numel():
        return buf
    if path in ("dma", "staged") and layout.device.type == "cpu":
        _run_host_path(op, layout, ids, buf, impl, path, staging)  # the CPU twins of the PCIe paths
    else:
        _execute(op, layout, ids, buf, impl, max_ctas, path, staging=staging)
    return buf


def check_staging(staging, device: torch.device, nbytes: int = 0) -> None:
    """A staging buffer as the host <-> device paths take one: a contiguous uint8 tensor on the cache's ``device``
    of at least ``nbytes`` bytes; TypeError / ValueError naming ``staging`` otherwise."""
    if not isinstance(staging, torch.Tensor):
        raise TypeError(f"staging: expected a uint8 tensor on {device}, got {type(staging).__name__}")
    if staging.dtype != torch.uint8 or staging.device != device or not staging.is_contiguous():
        raise ValueError(
            f"staging: expected a contiguous uint8 tensor on {device}, got {staging.dtype} on "
            f"{staging.device}{'' if staging.is_contiguous() else ' (not contiguous)'}"
        )
    if staging.numel() < nbytes:
        raise ValueError(f"staging: expected at least {nbytes} bytes for this part, got {staging.numel()}")


def as_op(op: str | Op, buf) -> Op:
    """``op`` (an op's name or :class:`Op`) for a batch's ``add``, with its buffer present; errors name both."""
    try:
        op = Op(op)
    except ValueError:
        raise ValueError(f"op: expected one of {tuple(o.value for o in Op)}, got {op!r}") from None
    if buf is None:
        raise TypeError(f"{'out' if op.gather else 'src'}: expected a tensor, got None")
    return op


def staging_bytes(layout: KVLayout, op: str | Op, num_ids: int) -> int:
    """Bytes of the staging buffer that holds a whole ``op`` of ``num_ids`` ids on path ``"staged"`` in one part
    (a smaller one, of at least one id of one layer, splits the copy)."""
    op = Op(op)
    if op.pages:
        per_id = layout.page_shape(1)[1] * layout.page.segment_bytes
    elif op.slots:
        per_id = layout.num_planes * layout.num_heads * layout.row_bytes
    else:
        per_id = layout.num_planes * layout.block_size * layout.num_heads * layout.row_bytes
    return layout.num_layers * num_ids * per_id


def _run_host_path(op: Op, layout: KVLayout, ids, buf, impl, path, staging=None) -> None:
    """One op by a host <-> device path (:mod:`kvx.kernels.staged`), on the current stream: the parts in order,
    each DMA and reshape in the direction's order (a stream orders a staging buffer's reuse)."""
    from .staged import TransferBatch

    batch = TransferBatch(layout, path=path, impl=impl)
    batch.add(op, ids, buf)
    cap = None
    if path == "staged":
        if staging is None:
            staging = torch.empty(max(batch.nbytes, 16), dtype=torch.uint8, device=layout.device)
        cap = staging.numel()
        if cap < batch.min_staging_bytes():
            raise ValueError(
                f"staging: expected at least {batch.min_staging_bytes()} bytes (one block of one layer of this copy), "
                f"got {cap}"
            )
    for part in batch.plan(capacity=cap):
        batch.run(part, staging)


def _run_reference(op: Op, layout: KVLayout, ids, buf, plan, max_ctas, path, ids_dev, staging) -> None:
    _REFERENCE[op](layout, ids, buf)


def _run_cpu(op: Op, layout: KVLayout, ids, buf, plan, max_ctas, path, ids_dev, staging) -> None:
    _C.cpu_copy(layer_ptrs=layout.layer_ptrs().data_ptr(), **_c_copy_args(plan, ids.data_ptr(), buf.data_ptr(), op))


def _execute(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path, ids_dev=None, staging=None) -> None:
    """Run a validated copy (:func:`_check`) by its implementation's entry of :data:`_BACKENDS`. ``ids_dev``: the
    ids already on the cache's device (CUDA); ``staging``: path ``"staged"``'s buffer (allocated when None)."""
    plan = None if impl == "reference" else _plan(op, layout, buf, ids.numel())
    _BACKENDS[impl](op, layout, ids, buf, plan, max_ctas, path, ids_dev, staging)


@dataclasses.dataclass(slots=True)
class _Copy:
    """One copy of a :class:`CopyBatch`, checked by :meth:`CopyBatch.add`. Owned by its batch: added and run by
    the batch's thread (a copy job), never by two threads at once."""

    op: Op
    ids: torch.Tensor  # int64, on the CPU
    buf: torch.Tensor  # the contiguous side, every layer of the batch's layout
    impl: str
    ids_dev: torch.Tensor | None = None  # impl "cuda": the ids on the device, uploaded by the first run


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

    def __init__(self, layout: KVLayout, *, impl: str | None = None, max_ctas: int = 0, path: str | None = None):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self._impl, self._max_ctas, self._path = impl, max_ctas, path
        self._items: list[_Copy] = []
        self._bytes = 0  # of every copy, every layer: the transfer a run is part of
        self._claims = ScatterClaims(layout)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, op: str | Op, ids, buf: torch.Tensor) -> None:
        op = as_op(op, buf)
        ids, buf, impl = _check(op, self.layout, ids, buf, self._impl, self._max_ctas, self._path)
        self.add_checked(op, ids, buf, impl)

    def add_checked(self, op: Op, ids: torch.Tensor, buf: torch.Tensor, impl: str) -> None:
        """``add`` for arguments :func:`_check` already checked (``ids``: int64 CPU; ``impl``: the one it picked)."""
        if not ids.numel():
            return
        if not op.gather:
            self._claims.claim(op, ids)
        self._items.append(_Copy(op, ids, buf, impl))
        self._bytes += buf.numel() * buf.element_size()

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
                if item.impl == "cuda" and item.ids_dev is None:  # the ids go to the device once, not per range
                    item.ids_dev = _device_ids(item.ids, layout.device)
                _execute(item.op, sub, item.ids, part, item.impl, self._max_ctas, self._path, item.ids_dev)
                i += 1
                continue
            # CPU: this copy and the following ones of the same geometry, in one call
            j = i + 1
            while (
                j < len(self._items)
                and (nxt := self._items[j]).op is item.op
                and nxt.impl == "cpu"
                and nxt.buf.stride() == buf.stride()
                and nxt.buf.dtype == buf.dtype
            ):
                j += 1
            plan = _plan(item.op, sub, part, item.ids.numel())
            paged, contig = _c_descs(plan)
            offset = start * buf.stride(0) * buf.element_size()
            group = self._items[i:j]
            _C.cpu_copy_many(
                sub.layer_ptrs().data_ptr(),
                plan.num_layers,
                [it.ids.data_ptr() for it in group],
                [it.ids.numel() for it in group],
                [it.buf.data_ptr() + offset for it in group],
                paged,
                contig,
                plan.row_bytes,
                plan.mode,
                item.op.c_direction,
                whole_bytes=self._bytes,
            )
            i = j


class ScatterClaims:
    """The blocks and slots the scatters of one batch write: a batch runs its copies in no defined order, so no
    two of its scatters may write one byte. Owned by its batch (one thread)."""

    def __init__(self, layout: KVLayout):
        self.block_size = layout.block_size
        self._blocks: set[int] = set()  # written by the scatters so far: whole blocks,
        self._slots: set[int] = set()  # single slots,
        self._slot_blocks: set[int] = set()  # and the blocks those slots are in

    def claim(self, op: Op, ids: torch.Tensor) -> None:
        """Record a scatter's ids; ValueError naming them if an earlier scatter of the batch writes them."""
        if op.slots:
            slots = [s for s in ids.tolist() if s >= 0]
            blocks = {s // self.block_size for s in slots}
            clash = self._slots.intersection(slots) or blocks & self._blocks
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
        raise ValueError(
            f"{op.id_name}: expected blocks and slots no earlier scatter of this batch writes (copies "
            f"of a batch run in no defined order), got {sorted(clash)[:8]} again"
        )


def _device_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _run_cuda(op: Op, layout: KVLayout, ids, buf, plan: CopyPlan, max_ctas, path, ids_dev=None, staging=None):
    # The caller's current stream on the cache's device; entering it also makes that device current.
    stream = torch.cuda.current_stream(layout.device)
    host = buf.device.type == "cpu"
    with torch.cuda.stream(stream):
        # Host memory crosses PCIe on the copy engines: DMA straight into the blocks when the runs are large enough
        # (the C++ side declines, issuing nothing, when they average less than the rule's threshold), else staged.
        min_run = dma_min_run_bytes(layout.device, op, path, host, plan.num_ids)
        if min_run < DMA_NEVER and _C.cuda_copy_dma(
            layer_ptrs_host=layout.layer_ptrs().data_ptr(),
            contig_on_host=host,
            stream=stream.cuda_stream,
            min_run_bytes=min_run,
            **_c_copy_args(plan, ids.data_ptr(), buf.data_ptr(), op),
        ):
            return
        if host and path != "kernel":
            _run_host_path(op, layout, ids, buf, "cuda", "staged", staging)
            return
        if ids_dev is None:
            ids_dev = _device_ids(ids, layout.device)
        contig = buf.data_ptr()
        if host:
            contig = _C.cuda_host_device_pointer(contig)
            # PCIe saturates with a few SMs; more would only take them from the model
            max_ctas = min(max_ctas, H2D_MAX_CTAS) if max_ctas else H2D_MAX_CTAS
        _C.cuda_copy(
            layer_ptrs_host=layout.layer_ptrs().data_ptr(),
            layer_ptrs_dev=layout.layer_ptrs(layout.device).data_ptr(),
            stream=stream.cuda_stream,
            max_ctas=max_ctas,
            **_c_copy_args(plan, ids_dev.data_ptr(), contig, op),
        )


def _cuda_sim_args(plan: CopyPlan, layout: KVLayout, ids: torch.Tensor, buf: torch.Tensor) -> tuple:
    """``(bounds, args)`` for one validated copy: ``args`` are the arguments of ``kvx._C.cuda_sim_copy`` up to
    ``contig_strides``; ``bounds`` is the int64 ``[L, 2]`` tensor of per-layer ``[lo, hi)`` they point to (hold
    it while the call runs; the checker's tests narrow a bound in it).

    The bounds are the views' extents, not their storages': each layer tensor's byte span (so an access into
    another layer of a shared allocation counts as out of bounds) and the contiguous side's span.
    """
    bounds = torch.tensor([_byte_span(t) for t in layout.layers], dtype=torch.int64)
    lo, hi = _byte_span(buf)
    return bounds, (
        layout.layer_ptrs().data_ptr(),
        bounds.data_ptr(),
        plan.num_layers,
        ids.data_ptr(),
        plan.num_ids,
        buf.data_ptr(),
        lo,
        hi,
        *_c_descs(plan),
    )


def _run_cuda_sim(op: Op, layout: KVLayout, ids, buf, plan: CopyPlan, max_ctas, path, ids_dev, staging):
    _bounds, args = _cuda_sim_args(plan, layout, ids, buf)  # held: the call reads the bounds by address
    _C.cuda_sim_copy(*args, plan.row_bytes, plan.mode, op.c_direction, CUDA_SIM_SM_COUNT, max_ctas)


def _run_triton(op: Op, layout: KVLayout, ids, buf, plan: CopyPlan, max_ctas, path, ids_dev, staging):
    from ..triton_kernels import copy as tk

    if layout.device.type == "cuda":
        # The caller's current stream on the cache's device; entering it also makes that device current.
        with torch.cuda.stream(torch.cuda.current_stream(layout.device)):
            tk.copy_rows(
                plan,
                layout.layer_ptrs(),
                _device_ids(ids, layout.device),
                buf,
                op.c_direction,
                anchor=layout.plane_views(0)[0],
            )
    else:
        tk.copy_rows(plan, layout.layer_ptrs(), ids, buf, op.c_direction, anchor=layout.plane_views(0)[0])


# impl -> its runner: every one takes (op, layout, ids, buf, plan, max_ctas, path, ids_dev, staging), a validated copy
_BACKENDS = {
    "reference": _run_reference,
    "cpu": _run_cpu,
    "cuda": _run_cuda,
    "cuda_sim": _run_cuda_sim,
    "triton": _run_triton,
}
