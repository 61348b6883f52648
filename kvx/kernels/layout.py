"""The layout model: one descriptor for every paged KV layout kvx copies.

A :class:`KVLayout` describes ``L`` layers of a paged KV cache with identical geometry. Whatever the
physical layout, each layer is seen as ``P`` *plane views* of logical shape ``[B, N, H, D]``
(blocks, tokens per block, heads, head size): ``P = 2`` (K and V) for standard attention, ``P = 1``
for MLA. Those views are plain strided torch views, so the pure-torch reference indexes them
directly, and their byte strides are the descriptor the compiled kernels use (``csrc/kv_layout.h``)::

    row(l, p, b, t, h) = base[l] + p*plane_stride + b*block_stride + t*token_stride + h*head_stride

Supported layout names (``LAYOUTS``):

=============  ===============================  ==================================================
name           tensor per layer                 meaning
=============  ===============================  ==================================================
``LBNHC``      ``[B, H, N, 2D]`` view           vLLM >= 0.32, token-major page, K|V packed in C
``LBHNC``      ``[B, H, N, 2D]`` view           vLLM >= 0.32, head-major page, K|V packed in C
``BLNHC``      ``[B, H, N, 2D]`` view           block-outer: layers of a block share one region
``BLHNC``      ``[B, H, N, 2D]`` view           block-outer, head-major page
``flash``      ``[2, B, N, H, D]``              legacy vLLM flash-attention (K plane, V plane)
``flashinfer`` ``[B, 2, N, H, D]``              legacy FlashInfer
``mla``        ``[B, N, C]`` or ``[B, 1, N, C]``  MLA latent cache (one plane, one head, no V)
``cpu``        ``[B, H, N, 2D]`` view           vLLM CPU backend: ISA-packed page, opaque bytes
=============  ===============================  ==================================================

The ``cpu`` layout's page content is packed by the attention kernel for its ISA, so only whole pages
may be copied; token-granular or canonical copies of it are refused.

Two contiguous formats are defined here (see :meth:`KVLayout.canonical_shape` and
:meth:`KVLayout.page_shape`): the *canonical* chunk ``[L, P, T, H, D]`` in the cache dtype, which does
not depend on the layout or block size, and the *raw page* chunk ``[L, S, n, segment_bytes]`` (uint8),
the fast path when source and destination layouts are identical. Where each KV head's bytes are one run of a
page segment (:attr:`KVLayout.page_head_bytes`), a raw-page chunk may also be seen split by head,
``[L, S, n, H, segment_bytes / H]``: the same bytes, whose head dim may have any stride (a head-major buffer).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence

import torch

LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "flash", "flashinfer", "mla", "cpu")
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
_PACKED = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")


@dataclasses.dataclass(frozen=True)
class PagedDesc:
    """Byte geometry of the paged side, mirrored by ``kvx::PagedDesc`` in ``csrc/kv_layout.h``."""

    plane_stride: int
    block_stride: int
    token_stride: int
    head_stride: int
    num_blocks: int
    num_planes: int
    block_size: int
    num_heads: int


@dataclasses.dataclass(frozen=True)
class ContigDesc:
    """Byte strides of the contiguous side over ``[layers, planes, tokens, heads]`` (rows are dense),
    mirrored by ``kvx::ContigDesc`` in ``csrc/kv_layout.h``."""

    layer_stride: int
    plane_stride: int
    token_stride: int
    head_stride: int


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """How one block of one layer lies in memory: ``segments`` runs of ``segment_bytes`` bytes,
    ``segment_stride`` bytes apart (one run for every vLLM >= 0.32 layout, K and V runs for ``flash``)."""

    segments: int
    segment_stride: int
    segment_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.segments * self.segment_bytes


class Op(enum.Enum):
    """A copy op of :mod:`kvx.kernels.ops`: which way (gather: paged cache -> contiguous side; scatter: back) and
    what the ids name (whole blocks, single slots, raw pages of whole blocks). The value is the op's name: its
    function in :mod:`kvx.kernels.ops` and the ``op`` of :meth:`kvx.kernels.plan.Copies.add`.

    The one encoding of an op in Python; the extension's integers (:attr:`c_mode`, :attr:`c_direction`) are
    read only where a kernel is called. Each member's facts are plain attributes, set once below (a copy's checks
    read several of them on every call, and a property of an enum is a function call per read). Immutable: any thread.

    - ``gather``: paged cache -> contiguous side (False: a scatter, contiguous side -> paged cache);
    - ``slots``: the ids are slots (``block * N + offset``; negative = padding), one token each;
    - ``pages``: the ids are blocks copied as raw pages (``[L, S, n, segment_bytes]`` uint8);
    - ``id_name``: the ids' argument name, as errors say it;
    - ``c_mode``: the extension's id mode (``kvx::CopyParams::mode``): 0 block ids (pages too), 1 slot ids;
    - ``c_direction``: the extension's direction argument: 0 gather, 1 scatter.
    """

    GATHER_BLOCKS = "gather_blocks"
    SCATTER_BLOCKS = "scatter_blocks"
    GATHER_SLOTS = "gather_slots"
    SCATTER_SLOTS = "scatter_slots"
    GATHER_PAGES = "gather_pages"
    SCATTER_PAGES = "scatter_pages"


for _op in Op:
    _op.gather = _op.value.startswith("gather_")
    _op.slots = _op.value.endswith("_slots")
    _op.pages = _op.value.endswith("_pages")
    _op.id_name = "slot_ids" if _op.slots else "block_ids"
    _op.c_mode = 1 if _op.slots else 0
    _op.c_direction = 0 if _op.gather else 1
del _op


@dataclasses.dataclass(frozen=True)
class CopyGeometry:
    """Everything a kernel needs for one copy, mirrored by ``kvx::CopyParams`` (before collapsing): what
    :func:`copy_geometry` reads off the layout and the contiguous side.

    ``mode`` is the extension's id mode, :attr:`Op.c_mode` (0 block ids, 1 slot ids). :func:`c_descs` hands
    ``paged`` and ``contig`` to the compiled kernels field by field, by name (``kvx._C.PagedDesc`` /
    ``kvx._C.ContigDesc``).
    """

    paged: PagedDesc
    contig: ContigDesc
    row_bytes: int
    num_layers: int
    num_ids: int
    mode: int


def _dense_page(dims: list[tuple[int, int]], row_bytes: int) -> PageGeometry | None:
    """Merge (size, stride) dims of a page into one contiguous run plus at most one segment dim."""
    run = row_bytes
    rest = []
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if not rest and stride == run:
            run *= size
        else:
            rest.append((size, stride))
    if not rest:
        return PageGeometry(1, 0, run)
    if len(rest) == 1 and rest[0][1] >= run:
        return PageGeometry(rest[0][0], rest[0][1], run)
    return None


def non_overlapping(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when no two index tuples of a strided view address the same element."""
    extent = 1
    for size, stride in sorted((d for d in zip(sizes, strides) if d[0] > 1), key=lambda d: abs(d[1])):
        if abs(stride) < extent:
            return False
        extent = abs(stride) * size
    return True


class KVLayout:
    """Descriptor of ``L`` layers of a paged KV cache (see the module docstring).

    Build it with :meth:`from_tensors` or :meth:`from_vllm`; it keeps the layer tensors alive.

    Attributes:
        name: layout name (one of ``LAYOUTS``).
        num_layers, num_planes, num_blocks, block_size, num_heads, head_size: logical geometry;
            ``head_size`` is the row length in elements (``2D`` content for ``cpu``).
        dtype, device: of the cache.
        opaque: page content is backend-packed (``cpu``): only whole pages may be copied.
        paged: byte geometry for the kernels.
        page: contiguous runs per block, or ``None`` when a block is not made of at most one kind
            of run (raw-page copies are then refused).
    """

    def __init__(
        self,
        name: str,
        layers: Sequence[torch.Tensor],
        planes: Sequence[Sequence[torch.Tensor]],
        layer_names: Sequence[str] | None = None,
    ):
        if not layers:
            raise ValueError("layers: expected at least one layer tensor, got none")
        self.name = name
        self.layers = tuple(layers)
        self.layer_names = (
            tuple(layer_names) if layer_names is not None else tuple(f"layer.{i}" for i in range(len(layers)))
        )
        self.opaque = name == "cpu"
        p0 = planes[0][0]
        self.dtype = p0.dtype
        self.device = p0.device
        self.num_layers = len(layers)
        self.num_planes = len(planes[0])
        self.num_blocks, self.block_size, self.num_heads, self.head_size = (int(s) for s in p0.shape)
        item = p0.element_size()
        self.itemsize = item
        if p0.stride(3) != 1 and self.head_size > 1:
            raise ValueError(
                f"layers: rows must be contiguous (stride 1 along the head dim), got plane "
                f"strides {tuple(p0.stride())} for layout {name!r}"
            )
        plane_stride = (planes[0][1].data_ptr() - p0.data_ptr()) if self.num_planes == 2 else 0
        self.paged = PagedDesc(
            plane_stride,
            p0.stride(0) * item,
            p0.stride(1) * item,
            p0.stride(2) * item,
            self.num_blocks,
            self.num_planes,
            self.block_size,
            self.num_heads,
        )
        self.row_bytes = self.head_size * item
        for i, (t, ps) in enumerate(zip(layers, planes)):
            q = ps[0]
            if (
                tuple(q.shape) != tuple(p0.shape)
                or q.stride() != p0.stride()
                or q.dtype != p0.dtype
                or q.device != p0.device
                or len(ps) != self.num_planes
                or (self.num_planes == 2 and ps[1].data_ptr() - q.data_ptr() != plane_stride)
            ):
                raise ValueError(
                    f"layers[{i}]: expected the geometry of layers[0] (shape {tuple(layers[0].shape)}, stride "
                    f"{layers[0].stride()}, {layers[0].dtype}, {layers[0].device}), got shape {tuple(t.shape)}, "
                    f"stride {t.stride()}, {t.dtype}, {t.device}"
                )
        sizes = (self.num_planes, self.num_blocks, self.block_size, self.num_heads, self.head_size)
        strides = (plane_stride // item if self.num_planes == 2 else 0, *p0.stride())
        if plane_stride % item or not non_overlapping(sizes, strides):
            raise ValueError(
                f"layers: the rows of layout {name!r} overlap in memory (shape "
                f"{tuple(layers[0].shape)}, stride {layers[0].stride()}); cannot copy into it"
            )
        self.page = _dense_page(
            [
                (self.num_planes, plane_stride),
                (self.block_size, self.paged.token_stride),
                (self.num_heads, self.paged.head_stride),
            ],
            self.row_bytes,
        )
        self._planes = tuple(tuple(ps) for ps in planes)
        self.spans = tuple((byte_span(pl), i) for i, ps in enumerate(self._planes) for pl in ps)  # ((lo, hi), layer)
        self.hull = (min(lo for (lo, _), _ in self.spans), max(hi for (_, hi), _ in self.spans))  # every layer's bytes
        self._bounds: torch.Tensor | None = None
        self._c_paged: dict = {}
        self._plan_tables: tuple[int, int, int] | None = None
        self._layer_ptrs = torch.tensor([ps[0].data_ptr() for ps in planes], dtype=torch.int64)
        self._device_tables: dict[torch.device, torch.Tensor] = {}
        self._ranges: dict[tuple[int, int], KVLayout] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tensors(
        cls, tensors: torch.Tensor | Sequence[torch.Tensor], layout: str, layer_names: Sequence[str] | None = None
    ) -> KVLayout:
        """Describe one layer tensor, or a sequence of per-layer tensors, in the named layout.

        Args:
            tensors: per-layer caches, shaped as the table in the module docstring says.
            layout: one of ``LAYOUTS`` (``NHD``/``HND`` are accepted for ``LBNHC``/``LBHNC``).
        """
        name = _ALIASES.get(layout, layout) if isinstance(layout, str) else layout
        if name not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS} (or NHD/HND), got {layout!r}")
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        planes = [_plane_views(name, t, i) for i, t in enumerate(tensors)]
        return cls(name, tensors, planes, layer_names)

    @classmethod
    def from_vllm(
        cls, kv_caches: Mapping[str, torch.Tensor], layout: object, *, use_mla: bool = False, backend: str | None = None
    ) -> KVLayout:
        """Describe the per-layer views vLLM passes to ``register_kv_caches``.

        Args:
            kv_caches: ``layer_name -> view``: ``[B, H, N, C]`` (``C = 2D`` with K|V packed), or
                ``[B, N, C]`` / ``[B, 1, N, C]`` for MLA.
            layout: the resolved ``KVCacheLayout`` (enum or name, e.g. ``"LBNHC"``).
            use_mla: the model uses MLA (one latent plane, no V).
            backend: attention backend name; ``"CPU_ATTN"`` (vLLM's CPU backend) makes pages opaque.
        Layers that alias the same memory (shared KV) are described once, in first-seen order.
        """
        if not kv_caches:
            raise ValueError("kv_caches: expected at least one layer, got an empty mapping")
        lname = getattr(layout, "name", layout)
        lname = _ALIASES.get(lname, lname)
        if use_mla:
            name = "mla"
        elif backend is not None and backend.upper().startswith("CPU"):
            name = "cpu"
        elif lname in _PACKED:
            name = lname
        else:
            raise ValueError(
                f"layout: expected a vLLM KVCacheLayout among {_PACKED} (or NHD/HND), got "
                f"{layout!r}; head-outer layouts (LHBNC, BHLNC) have no per-block page"
            )
        seen: dict[tuple, str] = {}
        names, tensors = [], []
        for lname_, t in kv_caches.items():
            key = (t.data_ptr(), tuple(t.shape), t.stride())
            if key in seen:
                continue
            seen[key] = lname_
            names.append(lname_)
            tensors.append(t)
        return cls.from_tensors(tensors, name, names)

    # ------------------------------------------------------------------ geometry
    def plane_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The ``P`` logical views ``[B, N, H, D]`` of one layer (K, V or the MLA plane)."""
        return self._planes[layer]

    def canonical_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the canonical chunk ``[L, P, T, H, D]`` holding ``num_tokens`` tokens."""
        return (self.num_layers, self.num_planes, num_tokens, self.num_heads, self.head_size)

    def page_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of the raw-page chunk ``[L, S, n, segment_bytes]`` (uint8) holding ``num_blocks`` blocks."""
        if self.page is None:
            raise ValueError(
                f"layout: {self.name!r} with strides {self.layers[0].stride()} has no "
                "contiguous page per block; use the canonical format"
            )
        return (self.num_layers, self.page.segments, num_blocks, self.page.segment_bytes)

    def page_heads_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of the raw-page chunk split by head, ``[L, S, n, H, segment_bytes / H]`` (uint8), holding
        ``num_blocks`` blocks: only where :attr:`page_head_bytes` is set."""
        run = self.page_head_bytes
        if run is None:
            raise ValueError(
                f"layout: {self.name!r} with strides {self.layers[0].stride()} does not hold each of its "
                f"{self.num_heads} KV heads as one run of a page; a raw-page chunk cannot be split by head"
            )
        return (*self.page_shape(num_blocks)[:3], self.num_heads, run)

    @property
    def page_head_bytes(self) -> int | None:
        """Bytes of one KV head in a page segment when the segment is the heads' runs one after another (heads
        outermost: ``HND`` layouts, the CPU backend's pages); None otherwise, or with one head."""
        g = self.page
        if g is None or self.num_heads < 2 or g.segment_bytes % self.num_heads:
            return None
        run = g.segment_bytes // self.num_heads
        return run if self.paged.head_stride == run else None

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.num_planes * self.block_size * self.num_heads * self.row_bytes

    @functools.cached_property
    def most_id_bytes(self) -> int:
        """The most bytes one id of any op moves in one layer (a block, or a raw page): the smallest staging buffer
        that fits any copy's leg."""
        return max(self.page_bytes, self.page.page_bytes if self.page is not None else 0)

    def layer_range(self, start: int, end: int) -> KVLayout:
        """Layers ``[start, end)`` as a layout of their own (cached: one object, and one device table, per
        range)."""
        if not (0 <= start < end <= self.num_layers):
            raise ValueError(f"start, end: expected 0 <= start < end <= {self.num_layers}, got {start}, {end}")
        if (start, end) == (0, self.num_layers):
            return self
        sub = self._ranges.get((start, end))
        if sub is None:
            sub = KVLayout(self.name, self.layers[start:end], self._planes[start:end], self.layer_names[start:end])
            self._ranges[(start, end)] = sub
        return sub

    def layer_ptrs(self, device: torch.device | None = None) -> torch.Tensor:
        """int64 base address of each layer, on ``device`` (cached; the CPU table when ``None``)."""
        if device is None or torch.device(device).type == "cpu":
            return self._layer_ptrs
        device = torch.device(device)
        table = self._device_tables.get(device)
        if table is None:
            table = self._layer_ptrs.to(device)
            self._device_tables[device] = table
        return table

    def plan_tables(self) -> tuple[int, int, int]:
        """``(layer table, device layer table (0 on CPU), layer bounds)`` addresses for a compiled plan (cached)."""
        tables = self._plan_tables
        if tables is None:
            dev = self.layer_ptrs(self.device).data_ptr() if self.device.type == "cuda" else 0
            tables = self._plan_tables = (self._layer_ptrs.data_ptr(), dev, self.layer_bounds().data_ptr())
        return tables

    def layer_bounds(self) -> torch.Tensor:
        """int64 ``[L, 2]``: each layer tensor's byte extent ``[lo, hi)`` (what the CUDA kernel's emulation holds each
        layer's accesses to; cached)."""
        if self._bounds is None:
            self._bounds = torch.tensor([byte_span(t) for t in self.layers], dtype=torch.int64)
        return self._bounds

    def c_paged(self, op: Op, split: bool = False):
        """The paged side of ``op`` as ``kvx._C.PagedDesc`` (cached per kind: blocks and slots, raw pages, raw pages
        split by head)."""
        key = (op.pages, split)
        desc = self._c_paged.get(key)
        if desc is None:
            desc = self._c_paged[key] = c_paged_desc(paged_desc(op, self, split))
        return desc

    def __repr__(self) -> str:
        return (
            f"KVLayout({self.name}, layers={self.num_layers}, planes={self.num_planes}, "
            f"blocks={self.num_blocks}, block_size={self.block_size}, heads={self.num_heads}, "
            f"head_size={self.head_size}, {self.dtype}, {self.device})"
        )


def paged_desc(op: Op, layout: KVLayout, split: bool = False) -> PagedDesc:
    """The paged side of ``op``: the layout's rows (blocks, slots), or its pages (``[L, S, n, segment_bytes]``: segments
    as planes, ids as tokens, one "head" of one segment; ``split``, ``[L, S, n, H, run]``: each head a run)."""
    if not op.pages:
        return layout.paged
    g = layout.page
    heads = layout.num_heads if split else 1
    run = layout.page_head_bytes if split else g.segment_bytes
    return PagedDesc(
        plane_stride=g.segment_stride,
        block_stride=layout.paged.block_stride,
        token_stride=0,
        head_stride=run if heads > 1 else 0,
        num_blocks=layout.num_blocks,
        num_planes=g.segments,
        block_size=1,
        num_heads=heads,
    )


def copy_geometry(op: Op, layout: KVLayout, buf: torch.Tensor, n: int) -> CopyGeometry:
    """One copy's geometry: ``op`` over ``n`` ids between ``layout`` and the contiguous side ``buf`` (checked)."""
    item = buf.element_size()
    layer_stride, plane_stride, token_stride, head_stride = (int(s) * item for s in buf.stride()[:4])
    split = op.pages and buf.dim() == 5
    if op.pages:
        row = layout.page_head_bytes if split else layout.page.segment_bytes
        if not split:
            head_stride = row
    else:
        row = layout.row_bytes
    contig = ContigDesc(
        layer_stride=layer_stride, plane_stride=plane_stride, token_stride=token_stride, head_stride=head_stride
    )
    return CopyGeometry(paged_desc(op, layout, split), contig, row, layout.num_layers, n, op.c_mode)


_PAGED_FIELDS = tuple(f.name for f in dataclasses.fields(PagedDesc))
_CONTIG_FIELDS = tuple(f.name for f in dataclasses.fields(ContigDesc))


def c_paged_desc(paged: PagedDesc):
    """``paged`` as ``kvx._C.PagedDesc``, built field by field, by name: the constructor is keyword-only, so a field
    missing or renamed on either side is a TypeError and a reordering cannot swap strides silently."""
    from .._ext import require

    return require().PagedDesc(**{f: getattr(paged, f) for f in _PAGED_FIELDS})


def c_descs(geometry: CopyGeometry) -> tuple:
    """``geometry``'s descriptors as ``(kvx._C.PagedDesc, kvx._C.ContigDesc)``, by name (see :func:`c_paged_desc`):
    what the compiled kernels, their emulation and the Triton launcher's planning take."""
    from .._ext import require

    contig = require().ContigDesc(**{f: getattr(geometry.contig, f) for f in _CONTIG_FIELDS})
    return c_paged_desc(geometry.paged), contig


def c_copy_args(geometry: CopyGeometry, ids: int, contig: int, op: Op) -> dict:
    """The arguments every ``kvx._C`` copy function shares, by the bindings' own names (a renamed or missing one is
    a TypeError, never a swapped stride or id count)."""
    paged, contig_strides = c_descs(geometry)
    return dict(
        num_layers=geometry.num_layers,
        ids=ids,
        num_ids=geometry.num_ids,
        contig=contig,
        paged=paged,
        contig_strides=contig_strides,
        row_bytes=geometry.row_bytes,
        mode=geometry.mode,
        direction=op.c_direction,
    )


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) a strided tensor touches."""
    ptr = t.data_ptr()
    if t.is_contiguous():
        return (ptr, ptr + t.numel() * t.element_size())
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return (ptr, ptr)
        if stride > 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    item = t.element_size()
    return (ptr + lo * item, ptr + (hi + 1) * item)


def _plane_views(name: str, t: torch.Tensor, i: int) -> tuple[torch.Tensor, ...]:
    """Logical ``[B, N, H, D]`` views of one layer tensor in layout ``name``."""

    def bad(expected: str) -> ValueError:
        return ValueError(
            f"tensors[{i}]: layout {name!r} expects {expected}, got shape {tuple(t.shape)} with stride {t.stride()}"
        )

    if name in _PACKED or name == "cpu":
        if t.dim() != 4:
            raise bad("a 4-D [blocks, heads, tokens, content] view")
        B, H, N, C = t.shape
        if H > 1 and N > 1:
            token_major = t.stride(2) > t.stride(1)
            if token_major != (name in ("LBNHC", "BLNHC")) and name != "cpu":
                raise bad(f"{'token' if name in ('LBNHC', 'BLNHC') else 'head'}-major pages")
            if name == "cpu" and token_major:
                raise bad("head-major pages (the CPU backend supports LBHNC only)")
        if name == "cpu":
            return (t.permute(0, 2, 1, 3),)
        if C % 2:
            raise bad("an even content dim (K and V packed as [K|V])")
        D = C // 2
        return (t[..., :D].permute(0, 2, 1, 3), t[..., D:].permute(0, 2, 1, 3))
    if name == "flash":
        if t.dim() != 5 or t.shape[0] != 2:
            raise bad("[2, blocks, tokens, heads, head_size]")
        return (t[0], t[1])
    if name == "flashinfer":
        if t.dim() != 5 or t.shape[1] != 2:
            raise bad("[blocks, 2, tokens, heads, head_size]")
        return (t[:, 0], t[:, 1])
    if name == "mla":
        if t.dim() == 4 and t.shape[1] == 1:
            return (t.permute(0, 2, 1, 3),)
        if t.dim() != 3:
            raise bad("[blocks, tokens, latent] or [blocks, 1, tokens, latent]")
        return (t.unsqueeze(2),)
    raise AssertionError(name)
