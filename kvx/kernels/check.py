"""The checks of a copy's arguments: what :mod:`kvx.kernels.plan` runs on every copy before it is planned.

Each raises TypeError / ValueError naming the argument, what was expected and what was given (STYLE.md), never
an assert. Ids are checked on the host, without a device sync; an id list up to :data:`SMALL_IDS` long is checked
as Python ints (a step's chunks: ~10x faster than torch ops). Stateless; any thread.
"""

from __future__ import annotations

import array
import os
from collections.abc import Sequence

import torch

from .._ext import BUILD_HINT, ERROR
from .._ext import C as _C
from .layout import KVLayout, Op, byte_span, non_overlapping

IMPLS = ("reference", "cpu", "triton", "cuda", "cuda_sim")
PATHS = ("kernel", "dma", "staged", "auto")  # how a copy crosses between its buffer and the blocks (None: by rule)
SMALL_IDS = 4096
_INT = {int}


def triton_usable(device: torch.device) -> bool:
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
    if triton_usable(device):
        impls.append("triton")
    if device.type == "cuda" and _C is not None and getattr(_C, "has_cuda", False):
        impls.append("cuda")
    if device.type == "cpu" and _C is not None and getattr(_C, "has_cuda_sim", False):
        impls.append("cuda_sim")
    return impls


_AVAILABLE: dict[tuple[torch.device, bool], list[str]] = {}


def pick_impl(impl: str | None, layout: KVLayout) -> str:
    """The implementation to run for a cache like ``layout``'s: ``impl``, checked, or the fastest available."""
    if impl is None and layout.device.type == "cpu" and _C is not None:
        return "cpu"
    key = (layout.device, os.environ.get("TRITON_INTERPRET") == "1")
    avail = _AVAILABLE.get(key)
    if avail is None:
        avail = _AVAILABLE[key] = available_impls(layout.device)
    if impl is None:
        for cand in ("cpu",) if layout.device.type == "cpu" else ("cuda", "triton"):
            if cand in avail:
                return cand
        if layout.device.type == "cpu":
            raise RuntimeError(BUILD_HINT.format(err=ERROR))
        raise RuntimeError(
            f"no kernel for a cache on {layout.device}: kvx._C was built without CUDA and triton "
            "is not importable; rebuild with nvcc on PATH (KVX_CUDA=1) or pass impl='reference'"
        )
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl not in avail:
        if _C is None:
            raise RuntimeError(BUILD_HINT.format(err=ERROR))
        raise ValueError(
            f"impl: {impl!r} cannot run for a cache on {layout.device} here (available: {avail}"
            f"{'; the Triton interpreter needs TRITON_INTERPRET=1' if impl == 'triton' else ''})"
        )
    return impl


def as_ids(name: str, ids) -> tuple[torch.Tensor | array.array, list[int] | None]:
    """``ids`` as int64 on the host, and as a list of ints when it came as one or is short (the checks read it). A list
    of ints (a worker's) becomes an ``array.array`` of int64, an order of magnitude cheaper than a tensor of it (every
    copy pays it): read its length with ``len`` and its address with :func:`ids_address`, or :func:`ids_tensor` for a
    tensor; anything else an int64 CPU tensor."""
    if type(ids) is list and ids and len(ids) <= SMALL_IDS and set(map(type, ids)) <= _INT:
        return array.array("q", ids), ids
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
        t = ids.to(torch.int64).contiguous()
        return t, (t.tolist() if t.numel() <= SMALL_IDS else None)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not hasattr(ids, "__array__"):
        raise TypeError(f"{name}: expected a CPU integer tensor or a sequence of ints, got {type(ids).__name__}")
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: expected a sequence of ints, got {type(ids).__name__} ({e})") from None
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.int64), []
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected integers, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(t.shape)}")
    t = t.to(torch.int64).contiguous()
    return t, (t.tolist() if t.numel() <= SMALL_IDS else None)


def ids_tensor(ids) -> torch.Tensor:
    """Ids as :func:`as_ids` returns them, as an int64 CPU tensor (sharing an array's memory)."""
    return torch.frombuffer(ids, dtype=torch.int64) if type(ids) is array.array else ids


def ids_address(ids) -> int:
    return ids.buffer_info()[0] if type(ids) is array.array else ids.data_ptr()


def check_ids(name: str, ids, small: list[int] | None, op: Op, layout: KVLayout) -> None:
    """Ids in range (slots: negative = padding) and, for a scatter, distinct (``ids``: as :func:`as_ids` gives them)."""
    n = len(small) if small is not None else ids.numel()
    if n == 0:
        return
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


def buffer_shape(op: Op, layout: KVLayout, n: int, split: bool = False) -> tuple[tuple[int, ...], torch.dtype, str]:
    """The contiguous side of ``op`` over ``n`` ids: (shape, dtype, what it is called in errors)."""
    if op.pages and split:
        return layout.page_heads_shape(n), torch.uint8, "raw-page chunk split by head [L, S, n, H, segment_bytes / H]"
    if op.pages:
        return layout.page_shape(n), torch.uint8, "raw-page chunk [L, S, n, segment_bytes]"
    shape = layout.canonical_shape(n if op.slots else n * layout.block_size)
    return shape, layout.dtype, "canonical chunk [L, P, T, H, D]"


def check_buffer(arg: str, buf: torch.Tensor, op: Op, layout: KVLayout, n: int) -> torch.device:
    """``buf`` is the contiguous side of ``op`` over ``n`` ids: type, dtype, shape, dense rows, the cache's device or
    pinned host memory, no self-overlap for an output, no overlap with the cache. Returns its device."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(buf).__name__}")
    shape, dtype, what = buffer_shape(op, layout, n, op.pages and buf.dim() == 5)
    if buf.dtype != dtype:
        raise TypeError(f"{arg}: expected dtype {dtype} for the {what}, got {buf.dtype}")
    if buf.shape != shape:
        raise ValueError(f"{arg}: expected shape {tuple(shape)} for the {what}, got {tuple(buf.shape)}")
    contiguous = buf.is_contiguous()
    if not contiguous and buf.numel() and buf.stride(-1) != 1 and shape[-1] > 1:
        raise ValueError(f"{arg}: expected rows contiguous in memory (last stride 1), got stride {buf.stride()}")
    dev, bdev = layout.device, buf.device
    if dev.type == "cpu":
        if bdev.type != "cpu":
            raise ValueError(f"{arg}: expected a CPU tensor for a CPU cache, got {bdev}")
    elif bdev != dev and not (bdev.type == "cpu" and buf.is_pinned()):
        raise ValueError(
            f"{arg}: expected a tensor on {dev} or in pinned host memory, got "
            f"{'pageable host memory' if bdev.type == 'cpu' else bdev}"
        )
    if op.gather and not contiguous and not non_overlapping(buf.shape, buf.stride()):
        raise ValueError(
            f"{arg}: its elements overlap in memory (stride {buf.stride()}); the output must not alias itself"
        )
    if bdev == dev and buf.numel():
        lo, hi = byte_span(buf)
        hull_lo, hull_hi = layout.hull
        if lo < hull_hi and hull_lo < hi:  # near the cache: which layer it overlaps, if any
            for (plo, phi), l in layout.spans:
                if lo < phi and plo < hi:
                    raise ValueError(
                        f"{arg}: overlaps the paged KV cache ({layout.layer_names[l]}); the "
                        "contiguous side must be separate memory"
                    )
    return bdev


def check_staging(staging, device: torch.device, nbytes: int = 0) -> None:
    """A staging buffer as the host <-> device paths take one: a contiguous uint8 tensor on the cache's ``device``
    of at least ``nbytes`` bytes, 16-byte aligned; TypeError / ValueError naming ``staging`` otherwise."""
    if not isinstance(staging, torch.Tensor):
        raise TypeError(f"staging: expected a uint8 tensor on {device}, got {type(staging).__name__}")
    if staging.dtype != torch.uint8 or staging.device != device or not staging.is_contiguous():
        raise ValueError(
            f"staging: expected a contiguous uint8 tensor on {device}, got {staging.dtype} on "
            f"{staging.device}{'' if staging.is_contiguous() else ' (not contiguous)'}"
        )
    if staging.numel() < nbytes:
        raise ValueError(f"staging: expected at least {nbytes} bytes for this leg, got {staging.numel()}")
    if staging.data_ptr() % 16:
        raise ValueError(f"staging: expected a 16-byte aligned buffer, got address {staging.data_ptr():#x}")


def as_op(op: str | Op, buf) -> Op:
    """``op`` (an op's name or :class:`Op`), with its buffer present; errors name both."""
    try:
        op = Op(op)
    except ValueError:
        raise ValueError(f"op: expected one of {tuple(o.value for o in Op)}, got {op!r}") from None
    if buf is None:
        raise TypeError(f"{'out' if op.gather else 'src'}: expected a tensor, got None")
    return op
