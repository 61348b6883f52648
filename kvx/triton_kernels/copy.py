"""Triton implementation of the paged <-> contiguous KV copy (the ``triton`` impl of :mod:`kvx.kernels.plan`).

The address math is the one of ``csrc/kv_layout.h`` (authoritative; read it first). The paged side is
``L`` layers with identical geometry; the row of (layer ``l``, plane ``p``, block ``b``, token ``t``,
head ``h``) is ``row_bytes`` contiguous bytes at::

    layer_ptrs[l] + p*plane_stride + b*block_stride + t*token_stride + h*head_stride

The contiguous side ``buf`` is ``[L, P, T, H, row_bytes]`` with arbitrary byte strides over the first
four dims (rows are dense). Entries ``e = (l*P + p)*num_ids + i`` each cover ``iter_tokens x
iter_heads`` rows (block mode: contiguous tokens ``[i*N, (i+1)*N)``; slot mode: one token, contiguous
token ``i``, a negative slot is padding and is skipped), after the row merging of ``collapse_rows()``.

The host-side plan is not re-implemented here: row merging (``collapse_rows()``), the strides that move an
address (``moving_strides()``) and the alignment (``copy_width()``) come from ``kv_layout.h`` through
``kvx._C.plan_launch``, so this launcher and the C++ kernels cannot drift apart. ``kvx._C`` is therefore
required (it is always built; without it ``kvx.kernels.ops`` reports the triton impl unavailable).

How it maps to Triton:

- Every address is an *int64 offset from one anchor tensor* (``anchor``: the first layer's first plane,
  on the cache's device). The kernel takes only that tensor as a pointer and reaches the other layers
  and the contiguous side by int64 offsets from it. This is what lets the contiguous side be pinned
  host memory seen through UVA on a CUDA cache (a CPU tensor cannot be a Triton pointer argument), and
  it also works in the interpreter, where pointers are plain process addresses.
- The word is the widest integer type (int64 > int32 > int16 > int8) that divides every address,
  stride and the row length: ``min(copy_width(), 8)`` bytes; values are moved as integers, so the copy is
  bit-exact for every cache dtype (one compiled kernel per word width, not per dtype).
- When every address is 16-byte aligned (``copy_width() == 16``), offsets are passed in 16-byte units and
  scaled in the kernel by a constexpr, which lets the compiler prove alignment and emit 128-bit
  loads/stores.
- One program copies a tile of ``BLOCK_R`` rows x ``BLOCK_C`` words (a 2-D tile with masks, so rows of
  any length work, from 1 word to 128 KiB pages), up to ``COL_ITERS`` tiles along a row; grid axis 1
  covers the rest of long rows.

How it was checked without a GPU (triton 3.9.0, no device on the development machine):

- Correctness: ``kvx.kernels.ops.*(impl="triton")`` against ``impl="reference"``, bit-exact, under
  ``TRITON_INTERPRET=1`` on CPU tensors, for every layout, bf16/fp16/fp32/uint8, odd head sizes,
  misaligned and non-contiguous contiguous sides, padding slots; also with the GPU tile choice forced,
  with tiny tiles (column loops, grid axis 1 > 1) and with int64 index math.
- Compilation: the launches :func:`copy_rows` would issue (:func:`_launch_args`) were specialized with
  the JIT's own binder (``create_function_from_signature`` + ``JITFunction._pack_args``) and compiled
  with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` for sm_80, sm_90 and
  sm_100, down to cubin (ptxas): no spills; on sm_90 at most 58 registers for 16-byte-aligned rows with
  32-bit index math (96 with int64 index math, 79 for unaligned narrow words), and
  the PTX moves them with ``ld/st.global.v2.b64`` (128-bit) accesses.

Shapes of :func:`copy_rows` (``n = plan.num_ids``):
    layer_ptrs: ``[L]`` int64 on the CPU, absolute base address of each layer's paged cache
    ids:        ``[n]`` int64 on the cache's device, block ids (mode 0) or slot ids (mode 1)
    buf:        ``[L, P, T, H, D]`` (canonical) or ``[L, S, n, segment_bytes]`` uint8 (raw pages), on
                the cache's device or, for a CUDA cache, in pinned host memory
    anchor:     any tensor on the cache's device whose ``data_ptr()`` is ``layer_ptrs[0]``
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .._ext import C as _C  # the host-side plan (kv_layout.h); always built
from ..kernels.layout import c_descs as _c_descs

if TYPE_CHECKING:  # pragma: no cover
    from kvx.kernels.layout import CopyGeometry

_BLOCKS, _SLOTS = 0, 1
_GATHER, _SCATTER = 0, 1

# Scalar arguments are annotated int64 and not specialized: by default Triton's JIT types an int argument
# by its value (i32 when it fits, i64 otherwise, a constexpr when it equals 1), so every new geometry or
# buffer distance could compile another kernel, and 32-bit products of offsets would overflow (caches
# exceed 2 GiB; offsets from the anchor span the address space).
_SCALARS = (
    "contig_off",
    "total_rows",
    "row_units",
    "num_ids",
    "num_planes",
    "block_size",
    "iter_heads",
    "rows_per_entry",
    "p_plane",
    "p_block",
    "p_token",
    "p_head",
    "c_layer",
    "c_plane",
    "c_token",
    "c_head",
)


@triton.jit(do_not_specialize=_SCALARS)
def _copy_rows_kernel(
    anchor_ptr,  # uint8 alias of the anchor: its address is layer_ptrs[0], the origin of every offset
    layer_off_ptr,  # [num_layers] int64: offset of each layer's base from anchor_ptr, in units
    ids_ptr,  # [num_ids] int64: block ids (MODE 0) or slot ids (MODE 1, < 0 = padding)
    # Offsets and strides below are in units of VEC words (16 bytes when every address allows it).
    contig_off: tl.int64,  # offset of the contiguous side's base from anchor_ptr
    total_rows: tl.int64,  # num_layers * num_planes * num_ids * rows_per_entry
    row_units: tl.int64,  # length of a row (after merging)
    num_ids: tl.int64,
    num_planes: tl.int64,
    block_size: tl.int64,
    iter_heads: tl.int64,
    rows_per_entry: tl.int64,
    p_plane: tl.int64,
    p_block: tl.int64,
    p_token: tl.int64,
    p_head: tl.int64,  # paged strides
    c_layer: tl.int64,
    c_plane: tl.int64,
    c_token: tl.int64,
    c_head: tl.int64,  # contiguous strides
    WORD: tl.constexpr,  # tl.int64 / int32 / int16 / int8: the type every load/store moves
    VEC: tl.constexpr,  # words per unit: 16 // word size when every address is 16-byte aligned, else 1
    IDX: tl.constexpr,  # tl.int32 when row indices and slots fit (cheaper divisions), else tl.int64
    MODE: tl.constexpr,  # 0 = block ids, 1 = slot ids
    GATHER: tl.constexpr,  # True: paged -> contiguous; False: contiguous -> paged
    BLOCK_R: tl.constexpr,  # rows per tile
    BLOCK_C: tl.constexpr,  # words per tile row (power of two)
    COL_ITERS: tl.constexpr,  # tiles per program along a row; grid axis 1 covers the rest of long rows
):
    # Row -> (entry, token, head) -> (layer, plane, id index): entry_offsets() and row_*_offset() of
    # kv_layout.h, vectorized over the BLOCK_R rows of this tile. The divisions run in IDX (32-bit when
    # the host proved it safe: a 64-bit division is ~3x the instructions) and the results are widened to
    # int64 before any product with a stride.
    rows = tl.program_id(0).to(IDX) * BLOCK_R + tl.arange(0, BLOCK_R).to(IDX)
    ok = rows < total_rows.to(IDX)
    rpe = rows_per_entry.to(IDX)
    nh = iter_heads.to(IDX)
    nid = num_ids.to(IDX)
    npl = num_planes.to(IDX)
    e = rows // rpe
    r = rows - e * rpe
    t = r // nh
    h = (r - t * nh).to(tl.int64)
    lp = e // nid
    i = e - lp * nid
    layer = lp // npl
    plane = (lp - layer * npl).to(tl.int64)

    ident = tl.load(ids_ptr + i, mask=ok, other=0)
    if MODE == 0:
        block = ident
        token = t.to(tl.int64)
        ctok = i.to(tl.int64) * block_size + token
    else:
        ok = ok & (ident >= 0)  # padding slot: nothing to copy
        slot = tl.maximum(ident, 0).to(IDX)
        bs = block_size.to(IDX)
        blk = slot // bs
        block = blk.to(tl.int64)
        token = (slot - blk * bs + t).to(tl.int64)  # t == 0: one token per slot entry
        ctok = (i + t).to(tl.int64)

    layer_base = tl.load(layer_off_ptr + layer, mask=ok, other=0)
    paged = layer_base + plane * p_plane + block * p_block + token * p_token + h * p_head
    contig = contig_off + layer.to(tl.int64) * c_layer + plane * c_plane + ctok * c_token + h * c_head
    # Units -> words. Multiplying by the constexpr VEC is what tells the compiler each row starts on a
    # 16-byte boundary, so that it emits 128-bit accesses.
    if GATHER:
        src = paged * VEC
        dst = contig * VEC
    else:
        src = contig * VEC
        dst = paged * VEC

    base = anchor_ptr.to(tl.pointer_type(WORD), bitcast=True)
    cols = tl.arange(0, BLOCK_C).to(tl.int64)
    row_words = row_units * VEC  # a multiple of VEC, so the mask is uniform over each 16-byte vector
    c_begin = tl.program_id(1).to(tl.int64) * (COL_ITERS * BLOCK_C)
    n_iter = tl.minimum(tl.cdiv(row_words - c_begin, BLOCK_C), COL_ITERS)
    for k in range(0, n_iter):
        c = c_begin + k * BLOCK_C + cols
        m = ok[:, None] & (c < row_words)[None, :]
        # Streaming: the data is touched once, keep it from evicting the model's working set from L2.
        v = tl.load(base + (src[:, None] + c[None, :]), mask=m, eviction_policy="evict_first")
        tl.store(base + (dst[:, None] + c[None, :]), v, mask=m, eviction_policy="evict_first")


# The interpreter costs a few ms per program instance (Python work per op) plus numpy work proportional
# to the tile, so it wants few big tiles; a GPU wants many small programs with few registers each.
_INTERPRETED = type(_copy_rows_kernel).__name__ == "InterpretedFunction"
_INTERP_TILE = 1 << 17  # words per tile in the interpreter (1 MiB of int64): 1 program per MiB
_GPU_TILE = 1024  # words per tile: 8 per thread at 4 warps (each needs two 64-bit addresses);
# at most 58 registers and no spills for 16-byte-aligned rows on sm_90
_GPU_MAX_ROWS = 256  # rows per tile: the per-row index math of 8 rows/thread took 96 registers
_GPU_COL_ITERS = 4  # tiles per program along a long row (32 KiB of int64 per program)
_GPU_MIN_PROGRAMS = 1024  # below this, give long rows one tile per program (fill ~132 SMs x 8)
_GPU_NUM_WARPS = 4
_IDX32_LIMIT = 1 << 31  # indices below this may be divided in int32

# Word type per word size in bytes. Triton has no 128-bit integer type: a 16-byte copy_width() moves int64
# words two per 16-byte unit (VEC = 2), which the compiler turns into 128-bit accesses.
_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
_LAYER_TABLES: dict[tuple, tuple] = {}  # (device, unit, anchor, layer ptrs) -> (table, ready event, host copy)
_LAYER_TABLES_MAX = 64


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _host_device_pointer(ptr: int) -> int:
    """Device alias of pinned host memory. With UVA, memory from cudaHostAlloc (torch's pinned allocator)
    has the same address on host and device; ask the CUDA runtime when the compiled extension has it, for
    memory that was registered instead."""
    if getattr(_C, "has_cuda", False):
        return int(_C.cuda_host_device_pointer(ptr))
    return ptr


def _layer_table(ptrs: list[int], anchor_ptr: int, unit: int, device: torch.device) -> torch.Tensor:
    """``[L]`` int64 offsets of each layer from the anchor in ``unit`` bytes, on ``device``.

    On a GPU the table is uploaded once per (layout, unit) and cached, so an op costs no host -> device
    copy of it. The upload is asynchronous (pinned source, no host sync); the current stream waits for
    its event, so a later op on another stream cannot read the table before it has landed.
    """
    offs = [(p - anchor_ptr) // unit for p in ptrs]
    if device.type == "cpu":
        return torch.tensor(offs, dtype=torch.int64)
    key = (device, unit, anchor_ptr, tuple(ptrs))
    entry = _LAYER_TABLES.get(key)
    if entry is None:
        if len(_LAYER_TABLES) >= _LAYER_TABLES_MAX:
            _LAYER_TABLES.pop(next(iter(_LAYER_TABLES)))
        host = torch.tensor(offs, dtype=torch.int64).pin_memory()  # kept alive with the entry
        table = host.to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        entry = (table, ready, host)
        _LAYER_TABLES[key] = entry
    table, ready, _ = entry
    torch.cuda.current_stream(device).wait_event(ready)
    return table


def _tiles(total_rows: int, row_words: int, vec: int, interpreted: bool = _INTERPRETED) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_C, COL_ITERS, grid axis 1) for ``total_rows`` rows of ``row_words`` words, ``vec``
    words per 16-byte-aligned vector (1: unaligned)."""
    if interpreted:
        # As few programs as the tile allows (a 1 MiB gather took 62 ms in 16 programs, 12 ms in one).
        block_c = min(_next_pow2(row_words), _INTERP_TILE)
        block_r = min(_next_pow2(total_rows), max(1, _INTERP_TILE // block_c))
        return block_r, block_c, triton.cdiv(row_words, block_c), 1
    # Unaligned words are loaded one by one, each with its own 64-bit addresses: half the tile keeps the
    # registers near the aligned case's (an 8 x 128 int16 tile took 128 registers, 4 x 128 took 64).
    tile = _GPU_TILE if vec > 1 else _GPU_TILE // 2
    block_c = min(_next_pow2(row_words), tile)
    block_r = min(tile // block_c, _GPU_MAX_ROWS)
    col_iters = 1
    if (
        row_words >= _GPU_COL_ITERS * block_c
        and triton.cdiv(total_rows, block_r) * triton.cdiv(row_words, _GPU_COL_ITERS * block_c) >= _GPU_MIN_PROGRAMS
    ):
        col_iters = _GPU_COL_ITERS
    # Grid axis 1 is limited to 65535 programs: rows of more than ~64 Mi words get more tiles each.
    col_iters = max(col_iters, triton.cdiv(triton.cdiv(row_words, block_c), 65535))
    return block_r, block_c, col_iters, triton.cdiv(row_words, block_c * col_iters)


def copy_rows(
    plan: CopyGeometry,
    layer_ptrs: torch.Tensor,
    ids: torch.Tensor,
    buf: torch.Tensor,
    direction: int,
    anchor: torch.Tensor,
) -> None:
    """Copy every row of ``plan`` between the paged cache and ``buf`` (see the module docstring for shapes).

    Args:
        plan: geometry of both sides (byte strides), before row merging.
        layer_ptrs: ``[L]`` int64 CPU tensor of layer base addresses.
        ids: ``[num_ids]`` int64 block or slot ids on the cache's device.
        buf: the contiguous side.
        direction: 0 = gather (paged -> ``buf``), 1 = scatter (``buf`` -> paged).
        anchor: tensor on the cache's device starting at ``layer_ptrs[0]`` (the first layer's first plane).

    Launches one kernel on the current stream; no host sync. Arguments are assumed validated by
    :mod:`kvx.kernels.ops`; only what would otherwise corrupt memory silently is checked here.
    """
    if direction not in (_GATHER, _SCATTER):
        raise ValueError(f"direction: expected 0 (gather) or 1 (scatter), got {direction!r}")
    if plan.mode not in (_BLOCKS, _SLOTS):
        raise ValueError(f"plan.mode: expected 0 (blocks) or 1 (slots), got {plan.mode!r}")
    device = anchor.device
    if _INTERPRETED and device.type != "cpu":
        # The interpreter copies tensor arguments to host memory, so offsets from the anchor would land
        # in that copy, not in the other layers.
        raise RuntimeError(
            f"anchor: the Triton interpreter (TRITON_INTERPRET=1) only runs CPU caches, got "
            f"a cache on {device}; unset TRITON_INTERPRET to run on the GPU"
        )
    if not _INTERPRETED and device.type != "cuda":
        raise RuntimeError(
            f"anchor: Triton needs a CUDA cache, got {device}; set TRITON_INTERPRET=1 before "
            "importing kvx.triton_kernels to run CPU caches in the interpreter"
        )
    if ids.dtype != torch.int64 or ids.device != device or ids.numel() != plan.num_ids:
        raise ValueError(
            f"ids: expected {plan.num_ids} int64 ids on {device}, got {ids.numel()} {ids.dtype} on {ids.device}"
        )
    ptrs = [int(p) for p in layer_ptrs.tolist()]
    if len(ptrs) != plan.num_layers or ptrs[0] != anchor.data_ptr():
        raise ValueError(
            f"layer_ptrs: expected {plan.num_layers} addresses starting at anchor.data_ptr() "
            f"({anchor.data_ptr():#x}), got {len(ptrs)} starting at {ptrs[0] if ptrs else None}"
        )

    # Triton launches on the current device: make it the cache's (the caller only set the stream).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        launch = _launch_args(plan, ptrs, ids, buf, direction, anchor)
        if launch is None:
            return
        grid, args, meta = launch
        _copy_rows_kernel[grid](*args, **meta)


def _launch_args(
    plan: CopyGeometry, ptrs: list[int], ids: torch.Tensor, buf: torch.Tensor, direction: int, anchor: torch.Tensor
) -> tuple[tuple[int, int], tuple, dict] | None:
    """Grid, arguments and meta-parameters of the kernel launch for ``plan`` (``None``: nothing to copy).

    Kept apart from :func:`copy_rows` so a compile check can build the exact launch without a GPU.
    """
    device = anchor.device
    contig_ptr = buf.data_ptr()
    if buf.device.type == "cpu" and device.type == "cuda":
        contig_ptr = _host_device_pointer(contig_ptr)
    # plan_launch() of kv_layout.h: collapse_rows(), then the strides whose index is always 0 set to 0
    # (they must not narrow the word nor be divided into units), and copy_width() over the rest.
    launch = _C.plan_launch(*_c_descs(plan), plan.row_bytes, plan.num_layers, plan.num_ids, plan.mode, ptrs, contig_ptr)
    p = launch.params
    row_bytes, iter_heads = p.row_bytes, p.iter_heads
    rows_per_entry = p.iter_tokens * iter_heads
    total_rows = plan.num_layers * p.paged.num_planes * plan.num_ids * rows_per_entry
    if total_rows == 0 or row_bytes == 0:
        return None

    # One alignment, two uses: CUDA moves copy_width() bytes per vector; Triton's widest word is int64, so
    # it moves min(width, 8)-byte words and, when width == 16, passes offsets in 16-byte units (VEC = 2
    # words per unit) so that the compiler can prove 128-bit alignment. unit == width in every case.
    unit = launch.width  # bytes per unit of the offsets passed to the kernel
    word = min(unit, 8)
    word_dtype = _WORDS[word]
    row_words = row_bytes // word
    block_r, block_c, col_iters, grid_c = _tiles(total_rows, row_words, unit // word)
    idx32 = total_rows + block_r < _IDX32_LIMIT and (
        plan.mode == _BLOCKS or p.paged.num_blocks * p.paged.block_size < _IDX32_LIMIT
    )
    paged = (p.paged.plane_stride, p.paged.block_stride, p.paged.token_stride, p.paged.head_stride)
    contig = (p.contig.layer_stride, p.contig.plane_stride, p.contig.token_stride, p.contig.head_stride)

    anchor_ptr = ptrs[0]
    # The kernel sees the anchor as bytes: its element type is part of Triton's compile key, so passing the
    # cache-typed view would compile one kernel per cache dtype (bf16, fp16, ...) for the same copy.
    anchor_bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(
        anchor.untyped_storage(), anchor.storage_offset() * anchor.element_size(), (1,), (1,)
    )
    table = _layer_table(ptrs, anchor_ptr, unit, device)
    grid = (triton.cdiv(total_rows, block_r), grid_c)
    args = (
        anchor_bytes,
        table,
        ids,
        (contig_ptr - anchor_ptr) // unit,
        total_rows,
        row_bytes // unit,
        plan.num_ids,
        p.paged.num_planes,
        p.paged.block_size,
        iter_heads,
        rows_per_entry,
        *(s // unit for s in paged),
        *(s // unit for s in contig),
    )
    meta = dict(
        WORD=word_dtype,
        VEC=unit // word,
        IDX=tl.int32 if idx32 else tl.int64,
        MODE=plan.mode,
        GATHER=direction == _GATHER,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        COL_ITERS=col_iters,
    )
    if not _INTERPRETED:
        meta["num_warps"] = _GPU_NUM_WARPS
    return grid, args, meta
