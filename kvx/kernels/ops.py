"""The copy ops: one copy between a paged KV cache and a contiguous buffer, every layer in one call.

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

Each op is the one door of :mod:`kvx.kernels.plan` with one copy: checked, planned, run now. Several copies at once
(a step's chunks, layer by layer) are a :class:`kvx.kernels.plan.Copies` of their own. Ids are a CPU integer tensor
or a Python sequence: they are checked on the host (no device sync) and uploaded with the copy. The contiguous side
may be a strided view (rows dense); for a CUDA cache it may live in pinned host memory.

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

``path=`` (:mod:`kvx.kernels.plan`): host <-> device copies of impl ``cuda`` (the contiguous side in pinned host
memory) go by DMA straight into the blocks when their runs are large (:mod:`kvx.kernels.dma` holds that rule and
its calibration), else staged through device memory (``staging=``, or at most
:data:`kvx.kernels.plan.ONE_OFF_STAGING_BYTES` taken for the call); ``"kernel"``, ``"dma"`` or ``"staged"`` forces
one. The rule's public names are re-exported here (:func:`calibrate_h2d`, ...).
"""

from __future__ import annotations

import numpy as np
import torch

from .._ext import require as _require_ext
from .check import IMPLS, PATHS, available_impls  # noqa: F401 - the ops' own names
from .dma import (  # noqa: F401 - the host <-> device rule (path=None follows it); its public names are the ops' too
    DMA_NEVER,
    H2D_ENV,
    H2D_MAX_CTAS,
    H2DCalibration,
    calibrate_h2d,
    choose_dma_min_bytes,
    dma_threshold,
    h2d_dma_min_bytes,
    h2d_env_min_bytes,
)
from .layout import KVLayout, Op
from .plan import CUDA_SIM_SM_COUNT, Copies  # noqa: F401


def get_num_threads() -> int:
    """Threads used by the ``cpu`` implementation."""
    return _require_ext().cpu_get_num_threads()


def set_num_threads(n: int) -> None:
    """Threads used by the ``cpu`` implementation (default: ``KVX_NUM_THREADS`` or all cores)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    _require_ext().cpu_set_num_threads(n)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` between CPU tensors of one shape and dtype whose last dim is dense, on the calling thread
    alone: one memcpy per row (``kvx._C.copy_runs``), rows that continue each other merged. For I/O threads (a
    tier read into a KV head's strided slice of a chunk): ATen's copy starts a parallel region, which on a busy CPU
    engine waits for the cores the model computes on, many times longer than the copy itself takes on one
    thread."""
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
    return _one(Op.GATHER_BLOCKS, layout, block_ids, out, impl, max_ctas, path, staging)


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
    _one(Op.SCATTER_BLOCKS, layout, block_ids, src, impl, max_ctas, path, staging)


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
    return _one(Op.GATHER_SLOTS, layout, slot_ids, out, impl, max_ctas, path, staging)


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
    _one(Op.SCATTER_SLOTS, layout, slot_ids, src, impl, max_ctas, path, staging)


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
    return _one(Op.GATHER_PAGES, layout, block_ids, out, impl, max_ctas, path, staging)


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
    _one(Op.SCATTER_PAGES, layout, block_ids, src, impl, max_ctas, path, staging)


def _one(op: Op, layout: KVLayout, ids, buf, impl, max_ctas, path, staging):
    """One op: a set of one copy, checked, planned and run now (:class:`kvx.kernels.plan.Copies`)."""
    copies = Copies(layout, path=path, impl=impl, max_ctas=max_ctas)
    buf = copies.add(op, ids, buf)
    copies.run(staging)
    return buf


def staging_bytes(layout: KVLayout, op: str | Op, num_ids: int) -> int:
    """Bytes of the staging buffer that holds a whole ``op`` of ``num_ids`` ids on path ``"staged"`` in one leg
    (a smaller one, of at least one id of one layer, splits the copy)."""
    op = Op(op)
    if op.pages:
        per_id = layout.page_shape(1)[1] * layout.page.segment_bytes
    elif op.slots:
        per_id = layout.num_planes * layout.num_heads * layout.row_bytes
    else:
        per_id = layout.num_planes * layout.block_size * layout.num_heads * layout.row_bytes
    return layout.num_layers * num_ids * per_id
