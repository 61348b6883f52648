"""Copies between a paged KV cache and host memory, planned into parts: the host <-> device data path.

A :class:`TransferBatch` holds the copies of one direction a worker issues for a step (every chunk of a load, or of
a save), each between the paged cache and a host-side buffer: pinned host memory for a CUDA cache, CPU memory for a
CPU cache. It checks them once (the ops' checks, same errors), then :meth:`TransferBatch.plan` cuts them into
*parts*, each a layer range and, where a layer's copies exceed the staging budget, a share of the copies. A part
moves by one of three paths (``path``, :data:`PATHS`):

``"staged"`` (the default across PCIe)
    two steps. :meth:`~TransferBatch.dma`: one batched DMA (:func:`kvx._C.cuda_copy_runs`, the copy engines, no
    SM) between the host buffers and a *staging buffer* on the cache's device; :meth:`~TransferBatch.reshape`: one
    launch of the copy kernel per op of the part between the staging buffer and the blocks, inside HBM. A load
    runs ``dma`` then ``reshape``, a save ``reshape`` (the gather) then ``dma``. The staging buffer is an argument,
    as ``out=`` is for the ops: this module holds no device memory; the transfer engine owns a bounded ring of
    them (:class:`kvx.engine.StagingRing`) and orders their reuse (:class:`kvx.engine.BlockOrder` rule 5).
``"dma"``
    one step, :meth:`~TransferBatch.dma`: the runs of contiguous bytes between the host buffers and the blocks
    (``kvx._C.plan_runs``), one batched DMA: raw pages whose pieces are large enough.
``"kernel"``
    one step, :meth:`~TransferBatch.reshape`: the copy kernel between the host buffers and the blocks (on CUDA the
    UVA kernel reading and writing mapped host memory over PCIe; on CPU the CPU kernel): no staging.
``"auto"``
    ``"dma"`` when every copy's runs straight into the blocks average at least the rule's threshold for a batch of
    this many pieces per layer (:func:`kvx.kernels.dma.dma_threshold`: measured on CUDA), else ``"staged"``;
    decided by :meth:`~TransferBatch.plan`.

The staging buffer of a part, for its layers ``[start, end)``: per layer, one region per op (*group*) of the part,
each the group's pieces back to back in the canonical order of the op's contiguous side, ``[P, T, H, D]`` (blocks,
slots) or ``[S, n, segment_bytes]`` (pages), so that every group is one strided view the copy kernel takes as it
takes ``out=`` (its ids concatenated), and every piece of every plane is one DMA run (planes merge into one run
where they are adjacent on both sides: a whole chunk's layer is one run). Head-major host buffers (``[H, L, P, T,
D]`` seen as ``[L, P, T, H, D]``; raw pages split by head, ``[H, L, S, n, run]``) are staged head-major, ``[H, P, T,
D]``, so that a head's piece of a layer is one run. ::

    staging = [layer start] [group 0: P x T0 x H x D][group 1: ...] [layer start + 1] [group 0] ...

A group whose host buffers are all head-major (``[H, L, P, T, D]`` in memory, seen as ``[L, P, T, H, D]``: a
connector worker's when it holds several KV heads, so that each head's part of a chunk is one run in host memory)
is staged head-major, ``H x P x T0 x D``, so that each head's tokens still cross in one run: a whole chunk's layer is
then one run per head.

On a CPU cache every path runs too (the DMA is :func:`kvx._C.copy_runs`, a memcpy of the same run list; the
reshape is the ``cpu`` impl or another CPU impl): the deferred copy queue runs the CUDA code path this way, so CI
executes these plans, their run lists and the reshape views bit for bit.

Who runs what: a batch is built and planned on the worker's thread; :meth:`dma` and :meth:`reshape` run inside copy
jobs (CUDA: issued on the job's stream, ``stream`` = its ``cuda_stream`` handle; CPU: on the copy queue's thread).
The first reshape of a CUDA batch uploads the ids of every part once, on its stream (every reshape of a batch runs
on the same queue). A batch is used by one thread at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._ext import C as _C
from ..engine import torch_stream
from . import ops
from .dma import dma_threshold
from .layout import KVLayout, Op

PATHS = ("kernel", "dma", "staged", "auto")  # how a batch crosses between host memory and the cache's device

_OP_ORDER = (Op.SCATTER_BLOCKS, Op.SCATTER_SLOTS, Op.SCATTER_PAGES, Op.GATHER_BLOCKS, Op.GATHER_SLOTS, Op.GATHER_PAGES)


@dataclasses.dataclass(slots=True)
class _Item:
    """One copy of a batch, checked by :meth:`TransferBatch.add`."""

    op: Op
    ids: torch.Tensor  # int64, CPU
    buf: torch.Tensor  # host side, every layer: [L, P, T, H, D], or uint8 [L, S, n, seg] or [L, S, n, H, run]
    unit: int  # entries of the contiguous side's dim 2 per id: block_size for blocks, 1 for slots and pages
    id_bytes: int  # bytes one id moves in one layer
    heads_outer: bool = False  # each head's tokens (pages) are adjacent in buf (a head-major buffer)


@dataclasses.dataclass(slots=True)
class _Group:
    """One reshape launch of a part: every piece of the part with one op, staged side by side."""

    op: Op
    pieces: list[tuple[int, int, int]]  # (item, first id, end id)
    ids: torch.Tensor  # the pieces' ids, concatenated (int64, CPU)
    offset: int  # byte offset of the group inside one layer of the part's staging
    entries: int  # extent of the staging view's dim 2: tokens (blocks, slots) or pages
    ids_at: int = 0  # offset of its ids in the batch's id table (uploaded once on CUDA)
    heads_outer: bool = False  # staged head-major, [H, P, entries, D], as its host buffers are
    split: bool = False  # raw pages split by head ([S, entries, H, run]), as its host buffers are


@dataclasses.dataclass(slots=True)
class _Spec:
    """What every layer of a share of the batch's copies moves: its groups, its staging bytes per layer, and one
    layer's DMA runs as a template (layer ``l``'s runs: the host side plus ``l`` times each run's host layer
    stride; the device side plus the layer's staging offset, or the layer's base address for DMA into blocks).
    Parts of the same share (one per layer, layer-wise) use one spec: planning costs once, not once per layer."""

    groups: list[_Group]
    layer_bytes: int
    host: torch.Tensor | None = None  # [n] int64: host addresses of layer 0's runs
    host_ls: torch.Tensor | None = None  # [n] int64: each run's host layer stride (its buffer's)
    dev: torch.Tensor | None = None  # [n] int64: device-side offsets of layer 0's runs
    size: torch.Tensor | None = None  # [n] int64
    host_all: torch.Tensor | None = None  # [L, n] int64: every layer's host addresses (made once, when first asked)
    dev_all: torch.Tensor | None = None  # [L, n] int64: path "dma": every layer's block addresses


@dataclasses.dataclass(slots=True)
class Part:
    """A share of a batch that moves as one unit: layers ``[start, end)`` of some copies. ``nbytes``: the bytes it
    moves, which is the staging it needs on path ``"staged"``. Built by :meth:`TransferBatch.plan`; read-only to
    callers."""

    start: int
    end: int
    nbytes: int
    spec: _Spec
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (dsts, srcs, sizes): the DMA plan
    launches: dict = dataclasses.field(default_factory=dict)  # CUDA: group index -> the kernel's arguments

    @property
    def groups(self) -> list[_Group]:
        return self.spec.groups

    @property
    def layer_bytes(self) -> int:
        """Staging bytes per layer."""
        return self.spec.layer_bytes


class TransferBatch:
    """Copies of one direction between one paged cache and host buffers, checked once and planned into
    :class:`Part` s (see the module docstring).

    ``add(op, ids, buf)`` takes the arguments of the op of that name (:mod:`kvx.kernels.ops`) with ``buf`` on the
    host side (pinned for a CUDA cache) and holding every layer of ``layout``, and checks them as the op does. Every
    copy of a batch has the same direction; scatters must not write one block twice (as within one op).
    ``impl``: the kernel of the reshape (``None``: the ops' default for the cache's device).
    """

    def __init__(self, layout: KVLayout, *, path: str = "staged", impl: str | None = None, max_ctas: int = 0):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
        if path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        self.layout, self.path, self._impl, self._max_ctas = layout, path, impl, max_ctas
        self._items: list[_Item] = []
        self._gather: bool | None = None
        self._claims = ops.ScatterClaims(layout)
        self._kernel: ops.CopyBatch | None = None  # path "kernel"
        self._ids_host: torch.Tensor | None = None
        self._ids_dev: torch.Tensor | None = None
        self.impl: str | None = None  # the reshape's implementation, once a copy was added

    def __len__(self) -> int:
        return len(self._items)

    @property
    def gather(self) -> bool:
        """The batch copies paged -> host (a save); False: host -> paged (a load)."""
        return bool(self._gather)

    @property
    def nbytes(self) -> int:
        """Bytes the whole batch moves (every layer)."""
        return sum(it.id_bytes * it.ids.numel() for it in self._items) * self.layout.num_layers

    @property
    def staged(self) -> bool:
        """Its parts need a staging buffer (path ``"auto"``: once :meth:`resolve_path` decided)."""
        return self.path == "staged"

    def add(self, op: str | Op, ids, buf: torch.Tensor) -> None:
        op = ops.as_op(op, buf)
        lay = self.layout
        ids, buf, impl = ops._check(op, lay, ids, buf, self._impl, self._max_ctas, None)
        arg = "out" if op.gather else "src"
        if self.path != "kernel" and lay.device.type == "cuda" and buf.device.type != "cpu":
            raise ValueError(
                f"{arg}: expected pinned host memory for path {self.path!r} (the device side is the staging buffer "
                f"or the blocks), got a tensor on {buf.device}"
            )
        if self._gather is not None and op.gather != self._gather:
            raise ValueError(
                f"op: expected {'gathers' if self._gather else 'scatters'} only (one direction per batch), "
                f"got {op.value}"
            )
        if not ids.numel():
            return
        if not op.gather:
            self._claims.claim(op, ids)
        self._gather, self.impl = op.gather, impl
        if op.pages:
            unit, id_bytes = 1, lay.page.page_bytes
        elif op.slots:
            unit, id_bytes = 1, lay.num_planes * lay.num_heads * lay.row_bytes
        else:
            unit, id_bytes = lay.block_size, lay.num_planes * lay.block_size * lay.num_heads * lay.row_bytes
        # a head-major host buffer ([H, L, P, T, D] seen as [L, P, T, H, D]; raw pages split by head: [H, L, S, n, run]
        # seen as [L, S, n, H, run]): staged head-major too, so that each head's tokens cross in one DMA run
        heads_outer = buf.dim() == 5 and lay.num_heads > 1 and buf.stride(2) == buf.shape[4] and buf.stride(4) == 1
        self._items.append(_Item(op, ids, buf, unit, id_bytes, heads_outer))
        if self.path == "kernel":
            if self._kernel is None:
                uva = lay.device.type == "cuda" and impl == "cuda"
                self._kernel = ops.CopyBatch(
                    lay, impl=self._impl, max_ctas=self._max_ctas, path="kernel" if uva else None
                )
            self._kernel.add_checked(op, ids, buf, impl)

    # ------------------------------------------------------------------ planning
    def min_staging_bytes(self) -> int:
        """The smallest staging buffer a part of this batch can use: one id of one layer."""
        return max((it.id_bytes for it in self._items), default=0)

    def resolve_path(self) -> str:
        """Path ``"auto"``: decide it now (``"dma"`` or ``"staged"``, see the module docstring); the path."""
        if self.path == "auto" and self._items:
            pieces = sum(it.ids.numel() for it in self._items)
            threshold = dma_threshold(self.layout.device, "gather" if self.gather else "scatter", pieces)
            self.path = "dma" if all(self._direct_fits(it, threshold) for it in self._items) else "staged"
        return self.path

    def _direct_fits(self, it: _Item, min_run: int) -> bool:
        """Whether one layer of ``it``'s runs straight into the blocks average at least ``min_run`` bytes."""
        sub = self.layout.layer_range(0, 1)
        buf = it.buf.narrow(0, 0, 1)
        plan = ops._plan(it.op, sub, buf, it.ids.numel())
        runs = _C.plan_runs(
            layer_ptrs=sub.layer_ptrs().data_ptr(),
            min_run_bytes=min_run,
            **ops._c_copy_args(plan, it.ids.data_ptr(), buf.data_ptr(), it.op),
        )
        return runs is not None

    def plan(self, ranges: Sequence[tuple[int, int]] | None = None, capacity: int | None = None) -> list[Part]:
        """The parts, in order: for each layer range of ``ranges`` (default: all layers at once), as many parts as
        ``capacity`` (bytes of one staging buffer; path ``"staged"`` only) requires: whole ranges when a range's
        copies fit, else fewer layers, else the copies of one layer split by ids (never less than one id of one
        layer: ValueError naming ``capacity``)."""
        lay = self.layout
        ranges = [(0, lay.num_layers)] if ranges is None else list(ranges)
        for a, b in ranges:
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= lay.num_layers):
                raise ValueError(
                    f"ranges: expected (start, end) with 0 <= start < end <= {lay.num_layers}, got {(a, b)}"
                )
        if not self._items:
            return []
        self.resolve_path()
        per_layer = sum(it.id_bytes * it.ids.numel() for it in self._items)
        specs: dict[tuple, _Spec] = {}
        whole = self._pieces_all()

        def part(a: int, b: int, pieces: list[tuple[int, int, int]]) -> Part:
            key = tuple(pieces)
            spec = specs.get(key)
            if spec is None:
                spec = specs[key] = self._spec(pieces)
            return Part(a, b, spec.layer_bytes * (b - a), spec, self._runs(spec, a, b))

        if self.path != "staged":
            parts = [part(a, b, whole) for a, b in ranges]
        else:
            if capacity is None:
                raise ValueError("capacity: expected the staging buffer's bytes for path 'staged', got None")
            least = self.min_staging_bytes()
            if capacity < least:
                raise ValueError(
                    f"capacity: expected at least {least} bytes (one block of one layer of this batch) for a "
                    f"staging buffer, got {capacity}"
                )
            parts = []
            for a, b in ranges:
                layers = min(b - a, capacity // per_layer)
                if layers >= 1:
                    for s in range(a, b, layers):
                        parts.append(part(s, min(b, s + layers), whole))
                    continue
                for pieces in self._split(capacity):
                    for layer in range(a, b):
                        parts.append(part(layer, layer + 1, pieces))
        self._index_ids(list(specs.values()))
        return parts

    def _pieces_all(self) -> list[tuple[int, int, int]]:
        return [(i, 0, it.ids.numel()) for i, it in enumerate(self._items)]

    def _split(self, capacity: int) -> list[list[tuple[int, int, int]]]:
        """The copies of one layer in shares of at most ``capacity`` bytes, in order, cut between ids."""
        shares, cur, used = [], [], 0
        for i, it in enumerate(self._items):
            lo, n = 0, it.ids.numel()
            while lo < n:
                fit = (capacity - used) // it.id_bytes
                if fit <= 0:
                    shares.append(cur)
                    cur, used = [], 0
                    continue
                hi = min(n, lo + fit)
                cur.append((i, lo, hi))
                used += (hi - lo) * it.id_bytes
                lo = hi
        if cur:
            shares.append(cur)
        return shares

    def _spec(self, pieces: list[tuple[int, int, int]]) -> _Spec:
        groups, offset = [], 0
        for op in _OP_ORDER:
            mine = [p for p in pieces if self._items[p[0]].op is op]
            if not mine:
                continue
            ids = torch.cat([self._items[i].ids[lo:hi] for i, lo, hi in mine])
            entries = sum((hi - lo) * self._items[i].unit for i, lo, hi in mine)
            outer = all(self._items[i].heads_outer for i, _, _ in mine)
            split = op.pages and all(self._items[i].buf.dim() == 5 for i, _, _ in mine)
            if op.pages and not split and any(self._items[i].buf.dim() == 5 for i, _, _ in mine):
                # one staged view per group: a batch's raw pages are all split by head or none (a worker's are)
                raise ValueError(
                    "op: raw-page buffers split by head ([L, S, n, H, run]) and whole ([L, S, n, segment_bytes]) in "
                    "one batch; add each kind to a batch of its own"
                )
            groups.append(_Group(op, mine, ids, offset, entries, heads_outer=outer, split=split))
            offset += sum((hi - lo) * self._items[i].id_bytes for i, lo, hi in mine)
        spec = _Spec(groups, offset)
        if self.path == "staged":
            self._staged_template(spec)
        elif self.path == "dma":
            self._direct_template(spec)
        return spec

    def _index_ids(self, specs: list[_Spec]) -> None:
        """One id table for every group of every spec (CUDA: uploaded once, by the first reshape)."""
        at, tables = 0, []
        for spec in specs:
            for g in spec.groups:
                g.ids_at = at
                at += g.ids.numel()
                tables.append(g.ids)
        self._ids_host = torch.cat(tables) if tables else torch.empty(0, dtype=torch.int64)
        self._ids_dev = None

    # ------------------------------------------------------------------ run lists
    def _entry_bytes(self, op: Op) -> int:
        lay = self.layout
        return lay.page.segment_bytes if op.pages else lay.num_heads * lay.row_bytes

    def _planes(self, op: Op) -> int:
        return self.layout.page.segments if op.pages else self.layout.num_planes

    def _staged_template(self, spec: _Spec) -> None:
        """One layer's DMA runs of a staged spec: every piece's window of every plane (and head, staged head-major),
        host side by address (layer 0), staging side by offset in the part's layer, merged where both sides
        continue for every layer."""
        host, stage, size, ls = [], [], [], []
        lay = self.layout
        for g in spec.groups:
            eb, planes = self._entry_bytes(g.op), self._planes(g.op)
            at = 0  # entries of the group before this piece
            for i, lo, hi in g.pieces:
                it = self._items[i]
                n = (hi - lo) * it.unit
                layer_stride = it.buf.stride(0) * it.buf.element_size()
                for a, b in _valid_spans(it, lo, hi):  # entries [a, b) of the piece (padding slots skipped)
                    # [P, b-a, H, D], [S, b-a, seg] or (raw pages split by head) [S, b-a, H, run]
                    win = it.buf[0].narrow(1, lo * it.unit + a, b - a)
                    if g.heads_outer:  # staging [H, P, entries, D]: a head's rows of a plane are one region
                        row = win.shape[-1] * win.element_size()
                        runs = [
                            _window_runs(
                                win[p, :, h : h + 1], row, g.offset + ((h * planes + p) * g.entries + at + a) * row
                            )
                            for h in range(lay.num_heads)
                            for p in range(planes)
                        ]
                    else:
                        runs = [
                            _window_runs(win[p], eb, g.offset + (p * g.entries + at + a) * eb) for p in range(planes)
                        ]
                    for run_host, run_stage, run_size in runs:
                        host += run_host
                        stage += run_stage
                        size += run_size
                        ls += [layer_stride] * len(run_host)
                at += n
        if host:
            spec.host, spec.dev, spec.size, spec.host_ls = _merge_runs(
                torch.tensor(host, dtype=torch.int64),
                torch.tensor(stage, dtype=torch.int64),
                torch.tensor(size, dtype=torch.int64),
                torch.tensor(ls, dtype=torch.int64),
            )

    def _direct_template(self, spec: _Spec) -> None:
        """One layer's DMA runs straight between each copy's host buffer and its blocks (``kvx._C.plan_runs``, the
        function the CUDA DMA executor issues from), the device side as offsets from layer 0's base."""
        sub = self.layout.layer_range(0, 1)
        base = int(sub.layer_ptrs()[0])
        host, dev, size, ls = [], [], [], []
        for g in spec.groups:
            for i, lo, hi in g.pieces:
                it = self._items[i]
                ids = it.ids[lo:hi].contiguous()
                buf = it.buf.narrow(0, 0, 1).narrow(2, lo * it.unit, (hi - lo) * it.unit)
                plan = ops._plan(it.op, sub, buf, ids.numel())
                dsts, srcs, sizes = (
                    torch.from_numpy(a)
                    for a in _C.plan_runs(
                        layer_ptrs=sub.layer_ptrs().data_ptr(),
                        min_run_bytes=0,
                        **ops._c_copy_args(plan, ids.data_ptr(), buf.data_ptr(), it.op),
                    )
                )
                h, d = (dsts, srcs) if self.gather else (srcs, dsts)
                host.append(h)
                dev.append(d - base)
                size.append(sizes)
                ls.append(torch.full_like(h, it.buf.stride(0) * it.buf.element_size()))
        if host:
            spec.host, spec.dev, spec.size, spec.host_ls = (
                torch.cat(host),
                torch.cat(dev),
                torch.cat(size),
                torch.cat(ls),
            )

    def _runs(self, spec: _Spec, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layers ``[a, b)`` of ``spec``'s run template: ``(dsts, srcs, sizes)`` in the batch's direction (staged: the
        staging side as offsets from the buffer). Every layer's host side is computed once per spec (one tensor op
        for the whole batch); a part's runs are views of it."""
        if self.path == "kernel":
            return None
        if spec.host is None:
            e = torch.empty(0, dtype=torch.int64)
            return e, e, e
        if spec.host_all is None:
            layers = torch.arange(self.layout.num_layers, dtype=torch.int64)[:, None]
            spec.host_all = spec.host[None, :] + layers * spec.host_ls[None, :]  # [L, n]
            if self.path == "dma":
                spec.dev_all = spec.dev[None, :] + self.layout.layer_ptrs()[:, None]  # [L, n]
        if b - a == 1:  # a layer-wise part: rows of the matrices, no new tensor
            host = spec.host_all[a]
            dev = spec.dev_all[a] if self.path == "dma" else spec.dev
            return (host, dev, spec.size) if self.gather else (dev, host, spec.size)
        host = spec.host_all[a:b].reshape(-1)
        if self.path == "dma":
            dev = spec.dev_all[a:b].reshape(-1)
        else:
            layers = torch.arange(b - a, dtype=torch.int64)[:, None]
            dev = (spec.dev[None, :] + layers * spec.layer_bytes).reshape(-1)
        size = spec.size if b - a == 1 else spec.size.repeat(b - a)
        return (host, dev, size) if self.gather else (dev, host, size)

    # ------------------------------------------------------------------ running
    def run(self, part: Part, staging: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Every step of ``part`` on one stream, in the direction's order (a load: DMA then reshape; a save: the
        reverse): a stream orders a staging buffer's reuse. (The connector puts the two steps on two queues.)"""
        if self.path == "kernel":
            self.reshape(part, None, stream)
        elif self.path == "dma":
            self.dma(part, None, stream)
        elif self.gather:
            self.reshape(part, staging, stream)
            self.dma(part, staging, stream)
        else:
            self.dma(part, staging, stream)
            self.reshape(part, staging, stream)

    def dma(self, part: Part, staging: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Move ``part`` between the host buffers and ``staging`` (path ``"staged"``) or the blocks (``"dma"``).
        ``stream``: the CUDA stream handle to issue on (default: the current stream)."""
        if self.path == "kernel":
            raise RuntimeError("dma: path 'kernel' has no DMA step (reshape() copies between host and blocks)")
        dsts, srcs, sizes = part.runs
        dst_base = src_base = 0
        if self.path == "staged":
            _check_staging(staging, part, self.layout)
            if self.gather:
                src_base = staging.data_ptr()
            else:
                dst_base = staging.data_ptr()
        if self.layout.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(self.layout.device).cuda_stream
            _C.cuda_copy_runs(
                dsts.data_ptr(),
                srcs.data_ptr(),
                sizes.data_ptr(),
                sizes.numel(),
                dst_base,
                src_base,
                not self.gather,
                self.gather,
                stream,
            )
        else:
            _C.copy_runs(dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), sizes.numel(), dst_base, src_base)

    def reshape(self, part: Part, staging: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Move ``part`` between ``staging`` and the blocks (path ``"staged"``: one launch per op of the part), or
        between the host buffers and the blocks (``"kernel"``)."""
        lay = self.layout
        if self.path == "kernel":
            if lay.device.type == "cuda":
                with torch.cuda.stream(torch_stream(stream, lay.device)):
                    self._kernel.run(part.start, part.end)
            else:
                self._kernel.run(part.start, part.end)
            return
        if self.path != "staged":
            raise RuntimeError("reshape: path 'dma' has no reshape step (dma() copies between host and blocks)")
        _check_staging(staging, part, lay)
        sub = lay.layer_range(part.start, part.end)
        cuda = lay.device.type == "cuda" and self.impl == "cuda"
        if cuda:
            if stream is None:
                stream = torch.cuda.current_stream(lay.device).cuda_stream
            if self._ids_dev is None:  # every part's ids, once, on the stream every reshape of the batch runs on
                with torch.cuda.stream(torch_stream(stream, lay.device)):
                    self._ids_dev = self._ids_host.pin_memory().to(lay.device, non_blocking=True)
        for k, g in enumerate(part.groups):
            if cuda:
                launch = part.launches.get(k)
                if launch is None:  # the kernel's arguments, by name, but for the staging and ids' addresses
                    launch = part.launches[k] = self._launch_args(sub, part, g, staging)
                launch["ids"] = self._ids_dev.data_ptr() + 8 * g.ids_at
                launch["contig"] = staging.data_ptr() + g.offset
                # on-device: the launch's own fill cap (the copy is short; more CTAs finish it sooner)
                _C.cuda_copy(stream=stream, max_ctas=0, **launch)
            elif lay.device.type == "cuda":  # another CUDA impl (triton): on the job's stream, as the kernel is
                with torch.cuda.stream(torch_stream(stream, lay.device)):
                    ops._execute(g.op, sub, g.ids, self._view(staging, part, g), self.impl, 0, None)
            else:
                ops._execute(g.op, sub, g.ids, self._view(staging, part, g), self.impl, 0, None)

    def _view(self, staging: torch.Tensor, part: Part, g: _Group) -> torch.Tensor:
        """The group's region of ``staging``, as the op's contiguous side for layers ``[start, end)``."""
        lay = self.layout
        layers = part.end - part.start
        if g.op.pages:
            seg, segments = lay.page.segment_bytes, lay.page.segments
            if g.split:  # [layers, S, entries, H, run]: staged head-major ([H, S, entries, run]) or page-major
                run, h = lay.page_head_bytes, lay.num_heads
                shape = (layers, segments, g.entries, h, run)
                if g.heads_outer:
                    strides = (part.layer_bytes, g.entries * run, run, segments * g.entries * run, 1)
                else:
                    strides = (part.layer_bytes, g.entries * seg, seg, run, 1)
                return staging.as_strided(shape, strides, g.offset)
            shape = (layers, segments, g.entries, seg)
            strides = (part.layer_bytes, g.entries * seg, seg, 1)
            return staging.as_strided(shape, strides, g.offset)
        item = lay.itemsize
        hd = lay.num_heads * lay.head_size
        shape = (layers, lay.num_planes, g.entries, lay.num_heads, lay.head_size)
        if g.heads_outer:  # [H, P, entries, D]
            d = lay.head_size
            strides = (part.layer_bytes // item, g.entries * d, d, lay.num_planes * g.entries * d, 1)
        else:
            strides = (part.layer_bytes // item, g.entries * hd, hd, lay.head_size, 1)
        usable = staging.numel() // item * item
        return staging[:usable].view(lay.dtype).as_strided(shape, strides, g.offset // item)

    def _launch_args(self, sub: KVLayout, part: Part, g: _Group, staging: torch.Tensor) -> dict:
        view = self._view(staging, part, g)
        plan = ops._plan(g.op, sub, view, g.ids.numel())
        args = ops._c_copy_args(plan, 0, 0, g.op)
        args.update(layer_ptrs_host=sub.layer_ptrs().data_ptr(), layer_ptrs_dev=sub.layer_ptrs(sub.device).data_ptr())
        return args


def _check_staging(staging: torch.Tensor | None, part: Part, layout: KVLayout) -> None:
    ops.check_staging(staging, layout.device, part.nbytes)
    if staging.data_ptr() % 16:
        raise ValueError(f"staging: expected a 16-byte aligned buffer, got address {staging.data_ptr():#x}")


def _valid_spans(it: _Item, lo: int, hi: int) -> list[tuple[int, int]]:
    """The spans of entries of ids ``[lo, hi)`` of a copy that move bytes, relative to entry ``lo * unit``: all of
    them, except that padding slots (negative ids) are left out (a gather leaves their rows as they were)."""
    if not it.op.slots:
        return [(0, (hi - lo) * it.unit)]
    valid = (it.ids[lo:hi] >= 0).tolist()
    spans, start = [], None
    for j, ok in enumerate(valid + [False]):
        if ok and start is None:
            start = j
        elif not ok and start is not None:
            spans.append((start, j))
            start = None
    return spans


def _window_runs(win: torch.Tensor, entry_bytes: int, stage_off: int) -> tuple[list[int], list[int], list[int]]:
    """Runs between one plane's window of a host buffer, ``win`` (``[n, H, D]`` or ``[n, seg]``, rows dense), and
    its staging region at ``stage_off`` (``n`` entries of ``entry_bytes``, dense), as lists of ints (host address,
    staging offset, bytes): one run when the window is dense, else one per entry when each entry is, else one per
    row."""
    n = win.shape[0]
    if n == 0:
        return [], [], []
    item = win.element_size()
    st = [s * item for s in win.stride()]
    row = win.shape[-1] * item
    ptr = win.data_ptr()
    dense_entry = win.dim() == 2 or win.shape[1] == 1 or st[1] == row
    if dense_entry and (n == 1 or st[0] == entry_bytes):
        return [ptr], [stage_off], [n * entry_bytes]
    if dense_entry:
        return (
            [ptr + t * st[0] for t in range(n)],
            [stage_off + t * entry_bytes for t in range(n)],
            [entry_bytes] * n,
        )
    heads = win.shape[1]
    host = [ptr + t * st[0] + h * st[1] for t in range(n) for h in range(heads)]
    stage = [stage_off + t * entry_bytes + h * row for t in range(n) for h in range(heads)]
    return host, stage, [row] * (n * heads)


def _merge_runs(
    a: torch.Tensor, b: torch.Tensor, size: torch.Tensor, ls: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge consecutive runs that continue each other on both sides (``a`` and ``b`` are the two sides' starts) in
    every layer: only runs with the same host layer stride ``ls`` (then the host side moves alike in every layer)."""
    if a.numel() <= 1:
        return a.contiguous(), b.contiguous(), size.contiguous(), ls.contiguous()
    cont = (a[:-1] + size[:-1] == a[1:]) & (b[:-1] + size[:-1] == b[1:]) & (ls[:-1] == ls[1:])
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ~cont]).nonzero().flatten()
    seg = torch.zeros(a.numel(), dtype=torch.int64)
    seg[starts[1:]] = 1
    seg = seg.cumsum(0)
    total = torch.zeros(starts.numel(), dtype=torch.int64).index_add_(0, seg, size)
    return a[starts].contiguous(), b[starts].contiguous(), total, ls[starts].contiguous()
