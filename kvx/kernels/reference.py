"""Pure-torch reference of every copy op: the oracle the compiled kernels are tested against.

Same semantics as :mod:`kvx.kernels.ops` (which validates the arguments and then may call these): it indexes
the layout's logical plane views ``[B, N, H, D]`` with torch, so it shares no address arithmetic with
the kernels. Negative slots are padding: skipped on read and on write.

Every tensor is indexed through a same-size integer view (:func:`_bits`), so a copy moves bits whatever
the dtype: torch has no CPU ``index_copy`` for float8 (the dtype of vLLM's ``fp8_inc`` caches), and no
value is ever converted on the way.

Shapes (``L`` layers, ``P`` planes, ``n`` ids, ``N`` block size, ``H`` heads, ``D`` head size):
    canonical chunk: ``[L, P, n*N or n, H, D]`` in the cache dtype
    raw pages:       ``[L, S, n, segment_bytes]`` uint8, or split by head ``[L, S, n, H, segment_bytes / H]``
"""

from __future__ import annotations

import torch

from .layout import KVLayout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer type of its element size (same shape and strides, same memory); a
    16-byte dtype (no such integer type; torch indexes complex128 natively) as itself."""
    int_dtype = _INT_OF_SIZE.get(t.element_size())
    return t if int_dtype is None else t.view(int_dtype)


def _planes(layout: KVLayout, layer: int) -> list[torch.Tensor]:
    return [_bits(p) for p in layout.plane_views(layer)]


def gather_blocks(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[l, p, i*N + t] = plane(l, p)[block_ids[i], t]`` for every token ``t`` of each block."""
    ids = block_ids.to(layout.device)
    bits = _bits(out)
    for l in range(layout.num_layers):
        for p, plane in enumerate(_planes(layout, l)):
            bits[l, p].copy_(plane[ids].reshape(-1, layout.num_heads, layout.head_size))
    return out


def scatter_blocks(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_blocks`: write ``src`` into the listed blocks."""
    ids = block_ids.to(layout.device)
    n = ids.numel()
    src = _bits(src)
    for l in range(layout.num_layers):
        for p, plane in enumerate(_planes(layout, l)):
            plane[ids] = src[l, p].reshape(n, layout.block_size, layout.num_heads, layout.head_size).to(plane.device)


def _split_slots(layout: KVLayout, slot_ids: torch.Tensor):
    slots = slot_ids.to(layout.device)
    valid = (slots >= 0).nonzero().squeeze(1)
    s = slots[valid]
    return valid, s // layout.block_size, s % layout.block_size


def gather_slots(layout: KVLayout, slot_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[l, p, i] = plane(l, p)[slot // N, slot % N]`` for every non-negative ``slot_ids[i]``."""
    valid, blocks, tokens = _split_slots(layout, slot_ids)
    valid = valid.to(out.device)
    bits = _bits(out)
    for l in range(layout.num_layers):
        for p, plane in enumerate(_planes(layout, l)):
            bits[l, p].index_copy_(0, valid, plane[blocks, tokens].to(out.device))
    return out


def scatter_slots(layout: KVLayout, slot_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_slots`; padding slots leave the cache untouched."""
    valid, blocks, tokens = _split_slots(layout, slot_ids)
    valid = valid.to(src.device)
    src = _bits(src)
    for l in range(layout.num_layers):
        for p, plane in enumerate(_planes(layout, l)):
            plane[blocks, tokens] = src[l, p].index_select(0, valid).to(plane.device)


def _page_views(layout: KVLayout, layer: int) -> torch.Tensor:
    """``[B, S, segment_bytes]`` uint8 view of one layer's pages, built from its storage."""
    plane = layout.plane_views(layer)[0]
    raw = torch.empty(0, dtype=torch.uint8, device=plane.device).set_(plane.untyped_storage())
    g = layout.page
    return raw.as_strided(
        (layout.num_blocks, g.segments, g.segment_bytes),
        (layout.paged.block_stride, g.segment_stride, 1),
        plane.storage_offset() * plane.element_size(),
    )


def gather_pages(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[l, s, i] = segment s of block block_ids[i] of layer l``, as bytes."""
    ids = block_ids.to(layout.device)
    for l in range(layout.num_layers):
        pages = _page_views(layout, l)[ids].transpose(0, 1)
        out[l].copy_(pages.unflatten(-1, out.shape[3:]) if out.dim() == 5 else pages)
    return out


def scatter_pages(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_pages`."""
    ids = block_ids.to(layout.device)
    for l in range(layout.num_layers):
        pages = _page_views(layout, l)
        seg = src[l].flatten(-2) if src.dim() == 5 else src[l]  # split by head: the heads' runs side by side
        pages[ids] = seg.transpose(0, 1).to(pages.device)
