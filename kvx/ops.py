"""The one door to the copy kernels: validate, then run the chosen implementation.

Ops (``layout`` is a :class:`kvx.layout.KVLayout` describing ``L`` layers of ``P`` planes):

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

All layers move in one call. Ids are a CPU integer tensor or a Python sequence: they are checked on
the host (no device sync) and uploaded with the copy. The contiguous side may be a strided view (rows
dense); for a CUDA cache it may live in pinned host memory, which the kernel reads or writes directly.

Implementations (``impl=``): ``"reference"`` (pure torch), ``"cpu"`` (C++ threads, GIL released),
``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"cuda"``. ``None`` picks the fastest
available for the cache's device: ``cpu`` on CPU, ``cuda`` then ``triton`` on CUDA.
:func:`available_impls` lists what this install can run.

Ops launch on the caller's current stream (``with torch.cuda.stream(s):`` to use another) and never
synchronize the host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from . import reference
from .layout import ContigDesc, CopyPlan, KVLayout, PagedDesc, _byte_span, non_overlapping

IMPLS = ("reference", "cpu", "triton", "cuda")

_BLOCKS, _SLOTS = 0, 1
_GATHER, _SCATTER = 0, 1

try:  # the compiled extension is optional at import time; the ops say how to build it
    from . import _C  # type: ignore[attr-defined]
    _C_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C = None
    _C_ERROR = str(e)

_BUILD_HINT = ("the compiled extension kvx._C is not available ({err}); build it with `pip install .` "
               "(or `pip install -e .`) from the kvx source tree, with a C++17 compiler on PATH")


def _triton_usable(device: torch.device) -> bool:
    if _C is None:  # the Triton launcher takes its plan (row merging, word width) from kvx._C
        return False
    try:
        from .triton_kernels import copy as _  # noqa: F401
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


def _require_ext():
    if _C is None:
        raise RuntimeError(_BUILD_HINT.format(err=_C_ERROR))
    return _C


# ---------------------------------------------------------------------------------------- ops
def gather_blocks(layout: KVLayout, block_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                  max_ctas: int = 0) -> torch.Tensor:
    """Copy whole blocks of every layer into the canonical chunk ``[L, P, n*N, H, D]`` (returned)."""
    return _run("blocks", _GATHER, layout, block_ids, out, impl, max_ctas)


def scatter_blocks(layout: KVLayout, block_ids, src: torch.Tensor, *, impl: str | None = None,
                   max_ctas: int = 0) -> None:
    """Write the canonical chunk ``src`` ``[L, P, n*N, H, D]`` into blocks ``block_ids`` of every layer."""
    _run("blocks", _SCATTER, layout, block_ids, src, impl, max_ctas)


def gather_slots(layout: KVLayout, slot_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                 max_ctas: int = 0) -> torch.Tensor:
    """Copy single tokens (``slot = block * N + offset``) into ``[L, P, n, H, D]`` (returned).

    Rows of padding slots (negative ids) are left as they were in ``out``.
    """
    return _run("slots", _GATHER, layout, slot_ids, out, impl, max_ctas)


def scatter_slots(layout: KVLayout, slot_ids, src: torch.Tensor, *, impl: str | None = None,
                  max_ctas: int = 0) -> None:
    """Write ``src`` ``[L, P, n, H, D]`` into the listed slots; negative slots are skipped."""
    _run("slots", _SCATTER, layout, slot_ids, src, impl, max_ctas)


def gather_pages(layout: KVLayout, block_ids, out: torch.Tensor | None = None, *, impl: str | None = None,
                 max_ctas: int = 0) -> torch.Tensor:
    """Copy the raw bytes of whole pages into ``[L, S, n, segment_bytes]`` uint8 (returned)."""
    return _run("pages", _GATHER, layout, block_ids, out, impl, max_ctas)


def scatter_pages(layout: KVLayout, block_ids, src: torch.Tensor, *, impl: str | None = None,
                  max_ctas: int = 0) -> None:
    """Write raw pages ``src`` ``[L, S, n, segment_bytes]`` uint8 into blocks ``block_ids``."""
    _run("pages", _SCATTER, layout, block_ids, src, impl, max_ctas)


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


def _check_ids(name: str, ids: torch.Tensor, kind: str, layout: KVLayout, direction: int) -> None:
    if ids.numel() == 0:
        return
    if kind == "slots":
        limit = layout.num_blocks * layout.block_size
        hi = int(ids.max())
        if hi >= limit:
            raise ValueError(f"{name}: expected slot ids in [0, {limit}) or negative for padding "
                             f"({layout.num_blocks} blocks x {layout.block_size} tokens), got max {hi}")
        if direction == _SCATTER:
            valid = ids[ids >= 0]
            if valid.unique().numel() != valid.numel():
                raise ValueError(f"{name}: expected distinct slot ids for a scatter (two rows would write the "
                                 "same slot), got duplicates")
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= layout.num_blocks:
        raise ValueError(f"{name}: expected block ids in [0, {layout.num_blocks}), got "
                         f"{'min ' + str(lo) if lo < 0 else 'max ' + str(hi)}")
    if direction == _SCATTER and ids.unique().numel() != ids.numel():
        raise ValueError(f"{name}: expected distinct block ids for a scatter (two chunks would write the same "
                         "block), got duplicates")


def _check_buffer(arg: str, buf: torch.Tensor, kind: str, layout: KVLayout, n: int, direction: int) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(buf).__name__}")
    if kind == "pages":
        shape, dtype = layout.page_shape(n), torch.uint8
        what = "raw-page chunk [L, S, n, segment_bytes]"
    else:
        shape = layout.canonical_shape(n * layout.block_size if kind == "blocks" else n)
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
    if direction == _GATHER and not non_overlapping(buf.shape, buf.stride()):
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


def _plan(kind: str, layout: KVLayout, buf: torch.Tensor, n: int) -> CopyPlan:
    item = buf.element_size()
    layer_stride, plane_stride, token_stride, head_stride = (int(s) * item for s in buf.stride()[:4])
    if kind == "pages":
        # [L, S, n, segment_bytes]: segments are the planes, ids the tokens, one "head" of one segment
        g = layout.page
        paged = PagedDesc(plane_stride=g.segment_stride, block_stride=layout.paged.block_stride, token_stride=0,
                          head_stride=0, num_blocks=layout.num_blocks, num_planes=g.segments, block_size=1,
                          num_heads=1)
        contig = ContigDesc(layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride,
                            head_stride=g.segment_bytes)
        return CopyPlan(paged, contig, g.segment_bytes, layout.num_layers, n, _BLOCKS)
    contig = ContigDesc(layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride,
                        head_stride=head_stride)
    return CopyPlan(layout.paged, contig, layout.row_bytes, layout.num_layers, n,
                    _BLOCKS if kind == "blocks" else _SLOTS)


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


_REFERENCE = {
    ("blocks", _GATHER): reference.gather_blocks, ("blocks", _SCATTER): reference.scatter_blocks,
    ("slots", _GATHER): reference.gather_slots, ("slots", _SCATTER): reference.scatter_slots,
    ("pages", _GATHER): reference.gather_pages, ("pages", _SCATTER): reference.scatter_pages,
}


def _run(kind: str, direction: int, layout: KVLayout, ids, buf, impl, max_ctas):
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout: expected a kvx.layout.KVLayout, got {type(layout).__name__}")
    if layout.opaque and kind != "pages":
        raise ValueError(f"layout: {layout.name!r} pages are packed by the attention backend (opaque bytes); only "
                         "whole pages can be copied (gather_pages/scatter_pages), not tokens or canonical chunks")
    if kind == "pages" and layout.page is None:
        layout.page_shape(0)  # raises the explanatory error
    id_name = "slot_ids" if kind == "slots" else "block_ids"
    ids = _as_ids(id_name, ids)
    _check_ids(id_name, ids, kind, layout, direction)
    n = ids.numel()
    if buf is None:
        if direction == _SCATTER:
            raise TypeError("src: expected a tensor to scatter, got None")
        shape = layout.page_shape(n) if kind == "pages" else layout.canonical_shape(
            n * layout.block_size if kind == "blocks" else n)
        buf = torch.empty(shape, dtype=torch.uint8 if kind == "pages" else layout.dtype, device=layout.device)
    _check_buffer("out" if direction == _GATHER else "src", buf, kind, layout, n, direction)
    if not isinstance(max_ctas, int) or max_ctas < 0:
        raise ValueError(f"max_ctas: expected an int >= 0 (0 = no cap), got {max_ctas!r}")
    impl = _pick_impl(impl, layout, buf)
    if n == 0:
        return buf
    if impl == "reference":
        _REFERENCE[(kind, direction)](layout, ids, buf)
        return buf
    plan = _plan(kind, layout, buf, n)
    if impl == "cpu":
        paged, contig = _c_descs(plan)
        _C.cpu_copy(layout.layer_ptrs().data_ptr(), plan.num_layers, ids.data_ptr(), n, buf.data_ptr(),
                    paged, contig, plan.row_bytes, plan.mode, direction)
    elif impl == "cuda":
        _run_cuda(plan, layout, ids, buf, direction, max_ctas)
    else:
        _run_triton(plan, layout, ids, buf, direction)
    return buf


def _device_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def _run_cuda(plan: CopyPlan, layout: KVLayout, ids, buf, direction, max_ctas):
    # The caller's current stream on the cache's device; entering it also makes that device current.
    stream = torch.cuda.current_stream(layout.device)
    with torch.cuda.stream(stream):
        ids_dev = _device_ids(ids, layout.device)
        contig = buf.data_ptr()
        if buf.device.type == "cpu":
            contig = _C.cuda_host_device_pointer(contig)
        _C.cuda_copy(layout.layer_ptrs().data_ptr(), layout.layer_ptrs(layout.device).data_ptr(), plan.num_layers,
                     ids_dev.data_ptr(), plan.num_ids, contig, *_c_descs(plan), plan.row_bytes, plan.mode,
                     direction, stream.cuda_stream, max_ctas)


def _run_triton(plan: CopyPlan, layout: KVLayout, ids, buf, direction):
    from .triton_kernels import copy as tk

    if layout.device.type == "cuda":
        # The caller's current stream on the cache's device; entering it also makes that device current.
        with torch.cuda.stream(torch.cuda.current_stream(layout.device)):
            tk.copy_rows(plan, layout.layer_ptrs(), _device_ids(ids, layout.device), buf, direction,
                         anchor=layout.plane_views(0)[0])
    else:
        tk.copy_rows(plan, layout.layer_ptrs(), ids, buf, direction, anchor=layout.plane_views(0)[0])
