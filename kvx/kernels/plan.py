"""The one door into a copy: check -> plan -> execute.

Every copy kvx makes between a paged KV cache and contiguous buffers goes through here: the one-off ops of
:mod:`kvx.kernels.ops` (a set of one copy) and the worker's copies of a step (every chunk of a load, or of a save).

1. **Check** (:class:`Copies`): each copy is checked as it is added (:mod:`kvx.kernels.check`: ids, buffer, device,
   implementation; a scatter's blocks distinct across the set), all in one direction.
2. **Plan** (:meth:`Copies.plan`): the compiled :class:`Plan` (``kvx._C.CopyPlan``, ``csrc/plan/copy_plan.h``) cuts
   the copies into *legs* by layer range and staging capacity and computes, once, everything running a leg needs:
   its DMA runs (the staging side as offsets from whichever buffer the ring hands out) and its kernel launches (the
   CUDA launch decided). The ids are uploaded to the device once, by the first launch. A leg is the unit an executor
   runs and the issue path orders: its DMA and its launches ("part" in kvx means something else: a worker's share
   of a chunk in the stores, :mod:`kvx.connector.parts`).
3. **Execute**: a leg's steps are single calls into compiled code. A one-off copy runs every leg in order
   (:meth:`Plan.run`: now on the CPU, on the caller's stream on CUDA); an engine issues them on its queues with the
   ordering rules (``kvx._C.issue_load`` / ``issue_save`` / ``fence_range``, :mod:`kvx.engine`), one call per layer.

Paths (``path``, :data:`kvx.kernels.check.PATHS`): ``"kernel"`` (the copy kernel between the buffers and the
blocks: the CPU kernel on a CPU cache; on CUDA, device memory or pinned host memory read over PCIe, capped at
:data:`kvx.kernels.dma.H2D_MAX_CTAS` thread blocks), ``"dma"`` (runs of contiguous bytes straight between the buffers
and the blocks, on the copy engines), ``"staged"`` (one DMA between the buffers and a staging buffer on the cache's
device, then one kernel launch per op group between it and the blocks, inside the device), ``"auto"`` (``"dma"`` when
every copy's runs average at least the measured threshold, :func:`kvx.kernels.dma.dma_threshold`, else
``"staged"``). ``None``: ``"kernel"`` on a CPU cache and for device-resident buffers, ``"auto"`` for a CUDA cache's
host buffers. On a CPU cache every path runs its CPU twin (memcpy for the DMA, a CPU implementation for the
reshape): the deferred copy queue runs the CUDA code path so, and CI executes these very run lists and launches.

Implementations of the reshape (``impl``): ``cpu``, ``cuda`` and ``cuda_sim`` (the CUDA kernel's own source
emulated on the CPU, every access checked) run in compiled code; ``reference`` (pure torch) and ``triton`` run
from the launches' geometry here (tests and fallbacks: an engine's compiled path takes ``cpu`` or ``cuda``).

Ownership: a :class:`Copies` and its :class:`Plan` belong to the thread that builds them; a plan keeps its copies'
ids and buffers alive. Executors (:meth:`Plan.dma`, :meth:`Plan.reshape`) may run on a copy queue's thread.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .._ext import C as _C
from .._ext import require as _require
from . import check, dma
from .check import PATHS
from .layout import KVLayout, Op, byte_span, copy_geometry

CUDA_SIM_SM_COUNT = 132  # SMs of the device impl "cuda_sim" emulates (an H100 SXM), and a null engine plans for
ONE_OFF_STAGING_BYTES = 16 << 20  # a one-off staged copy without a staging buffer takes at most this much device memory
_PATH_CODE = {"kernel": 0, "dma": 1, "staged": 2, "auto": 3}
_PATH_NAME = ("kernel", "dma", "staged")
_IMPL_CODE = {"cpu": 0, "cuda": 1, "cuda_sim": 2, "reference": 3, "triton": 3}
_KIND = ("blocks", "slots", "pages")  # op groups, in their staging order


def _group(op: Op) -> int:
    return 2 if op.pages else 1 if op.slots else 0


@dataclasses.dataclass(slots=True)
class Copy:
    """One checked copy: ``op`` over ``n`` ids (int64 on the host: :func:`kvx.kernels.check.as_ids`) between the
    cache and ``buf`` (every layer)."""

    op: Op
    ids: object  # an int64 CPU tensor or array.array, alive while the plan is built
    n: int
    buf: torch.Tensor
    args: list  # kvx._C.CopyPlan.add's arguments, computed when it was checked


class LegInfo(NamedTuple):
    start: int  # layers [start, end)
    end: int
    range: int  # the layer range it belongs to
    nbytes: int  # bytes it moves: the staging it needs (path staged)
    layer_bytes: int  # staging bytes per layer


class ScatterClaims:
    """The blocks and slots the scatters of one set write: a plan runs its copies in no defined order, so no two
    of its scatters may write one byte. Owned by its set (one thread)."""

    def __init__(self, layout: KVLayout):
        self.block_size = layout.block_size
        self._blocks: set[int] = set()  # written by the scatters so far: whole blocks,
        self._slots: set[int] = set()  # single slots,
        self._slot_blocks: set[int] = set()  # and the blocks those slots are in

    def claim(self, op: Op, ids: list[int]) -> None:
        """Record a scatter's ids; ValueError naming them if an earlier scatter of the set writes them."""
        if op.slots:
            slots = [s for s in ids if s >= 0]
            blocks = {s // self.block_size for s in slots}
            clash = self._slots.intersection(slots) or blocks & self._blocks
            if not clash:
                self._slots.update(slots)
                self._slot_blocks |= blocks
                return
        else:
            blocks = set(ids)
            clash = blocks & (self._blocks | self._slot_blocks)
            if not clash:
                self._blocks |= blocks
                return
        raise ValueError(
            f"{op.id_name}: expected blocks and slots no earlier scatter of this batch writes (copies "
            f"of a batch run in no defined order), got {sorted(clash)[:8]} again"
        )


class Copies:
    """Copies of one direction between one paged cache and contiguous buffers, each checked as it is added, then
    planned into a :class:`Plan` (see the module docstring).

    ``add(op, ids, buf)`` takes the arguments of the op of that name (:mod:`kvx.kernels.ops`: ``"gather_blocks"``,
    ... or an :class:`~kvx.kernels.layout.Op`) with ``buf`` holding every layer of ``layout`` (a gather's ``buf`` may be
    None: allocated), and checks them as the op does (same errors). ``sm_count``: plan the CUDA launches for a device
    of that many SMs (a null engine's plans on a CPU cache; 0: the cache's device's, on CUDA)."""

    __slots__ = ("layout", "path", "max_ctas", "sm_count", "impl", "_cuda", "copies", "_gather", "_split", "_host")
    __slots__ += ("_claims",)

    def __init__(
        self,
        layout: KVLayout,
        *,
        path: str | None = None,
        impl: str | None = None,
        max_ctas: int = 0,
        sm_count: int = 0,
    ):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a kvx.kernels.layout.KVLayout, got {type(layout).__name__}")
        if path is not None and path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
        if not isinstance(max_ctas, int) or isinstance(max_ctas, bool) or max_ctas < 0:
            raise ValueError(f"max_ctas: expected an int >= 0 (0 = no cap), got {max_ctas!r}")
        self.layout, self.path, self.max_ctas, self.sm_count = layout, path, max_ctas, sm_count
        self.impl = check.pick_impl(impl, layout)
        self._cuda = layout.device.type == "cuda"
        self.copies: list[Copy] = []
        self._gather: bool | None = None
        self._split: bool | None = None  # raw pages: split by head, or whole (one kind per set)
        self._host: bool | None = None  # the buffers are host memory (a CUDA cache's: pinned)
        self._claims: ScatterClaims | None = None  # made at the first scatter

    def __len__(self) -> int:
        return len(self.copies)

    @property
    def gather(self) -> bool:
        """The set copies paged -> contiguous (a save); False: contiguous -> paged (a load)."""
        return bool(self._gather)

    @property
    def nbytes(self) -> int:
        """Bytes the whole set moves (every layer)."""
        return sum(c.buf.numel() * c.buf.element_size() for c in self.copies)

    def min_staging_bytes(self) -> int:
        """The smallest staging buffer a leg can use: one id of one layer."""
        lay = self.layout
        out = 0
        for c in self.copies:
            if c.op.pages:
                per = lay.page.page_bytes
            elif c.op.slots:
                per = lay.num_planes * lay.num_heads * lay.row_bytes
            else:
                per = lay.page_bytes
            out = max(out, per)
        return out

    def add(self, op: str | Op, ids, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Check and add one copy; returns its buffer (a gather's, allocated when ``buf`` is None)."""
        lay = self.layout
        if type(op) is not Op:
            try:
                op = Op(op)
            except ValueError:
                raise ValueError(f"op: expected one of {tuple(o.value for o in Op)}, got {op!r}") from None
        if lay.opaque and not op.pages:
            raise ValueError(
                f"layout: {lay.name!r} pages are packed by the attention backend (opaque bytes); only "
                "whole pages can be copied (gather_pages/scatter_pages), not tokens or canonical chunks"
            )
        if op.pages and lay.page is None:
            lay.page_shape(0)  # raises the explanatory error
        ids, small = check.as_ids(op.id_name, ids)
        check.check_ids(op.id_name, ids, small, op, lay)
        n = len(small) if small is not None else ids.numel()
        if buf is None:
            if not op.gather:
                raise TypeError("src: expected a tensor to scatter, got None")
            shape, dtype, _ = check.buffer_shape(op, lay, n)
            buf = torch.empty(shape, dtype=dtype, device=lay.device)
        bdev = check.check_buffer("out" if op.gather else "src", buf, op, lay, n)
        if self._gather is not None and op.gather != self._gather:
            raise ValueError(
                f"op: expected {'gathers' if self._gather else 'scatters'} only (one direction per batch), "
                f"got {op.value}"
            )
        host = bdev.type == "cpu"
        if self._cuda:
            self._check_path(op, buf, host)
        split = op.pages and buf.dim() == 5
        if op.pages:
            if self._split is not None and split != self._split:
                # one staged region per op: a set's raw pages are all split by head or none (a worker's are)
                raise ValueError(
                    "op: raw-page buffers split by head ([L, S, n, H, run]) and whole ([L, S, n, segment_bytes]) in "
                    "one batch; add each kind to a batch of its own"
                )
            self._split = split
        if not n:
            return buf
        if not op.gather:
            if self._claims is None:
                self._claims = ScatterClaims(lay)
            self._claims.claim(op, small if small is not None else ids.tolist())
        self._gather = op.gather
        self._host = host if self._host is None else self._host and host
        self.copies.append(Copy(op, ids, n, buf, self._spec(op, ids, n, buf, split, host)))
        return buf

    def _spec(self, op: Op, ids, n: int, buf: torch.Tensor, split: bool, host: bool) -> list:
        """The arguments of ``kvx._C.CopyPlan.add`` for one checked copy (its contiguous side's address last but
        one: a CUDA cache's host buffer is read through its device alias on path kernel)."""
        lay = self.layout
        item = buf.element_size()
        st = buf.stride()
        if op.pages:
            row = lay.page_head_bytes if split else lay.page.segment_bytes
            head = st[3] * item if split else row
        else:
            row, head = lay.row_bytes, st[3] * item
        head_major = split or not op.pages
        head_major = head_major and buf.dim() == 5 and lay.num_heads > 1 and st[2] == buf.shape[4] and st[4] == 1
        lo, hi = byte_span(buf) if self.impl == "cuda_sim" else (0, 0)
        return [
            lay.c_paged(op, split),
            st[0] * item,
            st[1] * item,
            st[2] * item,
            head,
            row,
            op.c_mode,
            op.c_direction,
            check.ids_address(ids),
            n,
            buf.data_ptr(),
            lo,
            hi,
            1 if (op.slots or op.pages) else lay.block_size,
            _group(op),
            head_major,
            host,
        ]

    def _check_path(self, op: Op, buf: torch.Tensor, host: bool) -> None:
        lay, path, impl = self.layout, self.path, self.impl
        if lay.device.type == "cpu":
            return  # every path runs its CPU twin
        arg = "out" if op.gather else "src"
        if path in ("dma", "staged", "auto") and impl not in ("cuda", "triton"):
            raise ValueError(
                f"path: {path!r} crosses between host memory and the device by DMA, which the CUDA impls 'cuda' and "
                f"'triton' drive; this copy runs impl {impl!r}: pass path=None"
            )
        if path in ("staged", "auto") and not host:
            raise ValueError(
                f"path: {path!r} stages a host buffer on the device; {arg} is already on {buf.device}: pass "
                "path=None (or 'dma')"
            )

    def resolved_path(self) -> str:
        """The path asked for, or the default for this cache and these buffers (see the module docstring)."""
        if self.path is not None:
            return self.path
        cuda_host = self.layout.device.type == "cuda" and self.impl == "cuda" and bool(self._host)
        return "auto" if cuda_host else "kernel"

    def plan(self, ranges=None, capacity: int | None = None) -> Plan:
        """The compiled plan: for each layer range of ``ranges`` (default: all layers at once), as many legs as
        ``capacity`` (bytes of one staging buffer; path staged) requires: whole ranges when a range's copies fit,
        else fewer layers, else the copies of one layer split by ids (never less than one id of one layer: ValueError
        naming ``capacity``)."""
        lay = self.layout
        path = self.path if self.path is not None else self.resolved_path()
        copies = self.copies
        if ranges is None:
            ranges = [(0, lay.num_layers)]
        else:
            ranges = list(ranges)
            for r in ranges:
                a, b = r
                if not (type(a) is int and type(b) is int and 0 <= a < b <= lay.num_layers):
                    raise ValueError(
                        f"ranges: expected (start, end) with 0 <= start < end <= {lay.num_layers}, got {(a, b)}"
                    )
        dma_min = 0
        if path == "auto" and copies:
            pieces = copies[0].n if len(copies) == 1 else sum(c.n for c in copies)
            dma_min = dma.dma_threshold(lay.device, "gather" if self._gather else "scatter", pieces)
        elif path == "staged" and copies and capacity is None:
            raise ValueError("capacity: expected the staging buffer's bytes for path 'staged', got None")
        max_ctas, sm, uva = self.max_ctas, self.sm_count, False
        if self._cuda and self.impl == "cuda":
            sm = sm or _device_sm_count(lay.device)
            uva = path == "kernel" and bool(self._host)
            if uva:  # PCIe saturates with a few SMs; more would only take them from the model
                max_ctas = min(max_ctas, dma.H2D_MAX_CTAS) if max_ctas else dma.H2D_MAX_CTAS
        p = Plan(self, max_ctas)
        for c in copies:
            if uva:  # the kernel reads the host buffer through its device alias
                args = list(c.args)
                args[10] = _require().cuda_host_device_pointer(args[10])
                p.add(*args)
            else:
                p.add(*c.args)
        p.build(_PATH_CODE[path], ranges, capacity or 0, dma_min, sm, max_ctas)
        if self._cuda and self.impl == "cuda" and p.num_ids:
            # the id table, once, from pinned memory (a copy from pageable memory may wait on the host), by torch on the
            # current stream, which records both buffers' use: the plan's first leg follows this stream (a one-off
            # op runs on it; an engine's first leg waits for a marker taken on it after this), and the plan holds the
            # device table until it is dropped, once its jobs have run
            with torch.cuda.device(lay.device):
                p.dev_ids = torch.from_numpy(p.ids(0, p.num_ids)).pin_memory().to(lay.device, non_blocking=True)
            p.set_device_ids(p.dev_ids.data_ptr())
        return p

    def run(self, staging: torch.Tensor | None = None, queues=None) -> None:
        """Plan the set as one layer range and run it now (a one-off copy: :meth:`Plan.run`). ``staging``: path
        staged's buffer on the cache's device; without one, a staged copy takes at most
        :data:`ONE_OFF_STAGING_BYTES` of device memory for the call (the legs are cut to fit). ``queues``: issue it
        on these (``kvx._C.Queues``: one queue, in order) instead (the host-time benchmark's null queues)."""
        if not self.copies:
            return
        lay = self.layout
        if staging is not None:
            if self.path not in (None, "staged", "auto"):
                raise ValueError(f"staging: only path 'staged' (or None) uses a staging buffer, got path {self.path!r}")
            check.check_staging(staging, lay.device)
            capacity = staging.numel()
            if capacity < lay.most_id_bytes:  # smaller than a block of one layer may be: ask what this set needs
                least = self.min_staging_bytes()
                if capacity < least:
                    raise ValueError(
                        f"staging: expected at least {least} bytes (one block of one layer of this copy), got "
                        f"{capacity}"
                    )
        else:
            capacity = max(min(self.nbytes, ONE_OFF_STAGING_BYTES), self.min_staging_bytes())
        plan = self.plan(capacity=capacity)
        if plan.staged and staging is None:
            staging = torch.empty(max(capacity, 16), dtype=torch.uint8, device=lay.device)
        if queues is not None:
            _C.issue_in_order(queues, plan, staging.data_ptr() if staging is not None else 0)
            return
        plan.run(staging)


_SM_COUNTS: dict[torch.device, int] = {}


def _device_sm_count(device: torch.device) -> int:
    n = _SM_COUNTS.get(device)
    if n is None:
        n = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


class Plan(_C.CopyPlan if _C is not None else object):
    """A compiled plan of a :class:`Copies` (see the module docstring): ``kvx._C.CopyPlan`` with the checked copies
    it reads and writes kept alive, and the Python implementations' executors."""

    def __init__(self, copies: Copies, max_ctas: int = 0):
        lay = copies.layout
        ptrs, dev, bounds = lay.plan_tables()
        super().__init__(ptrs, lay.num_layers, dev, bounds, _IMPL_CODE[copies.impl])
        self.layout = lay
        self.impl_name = copies.impl
        self.max_ctas = max_ctas
        self.copies = list(copies.copies)  # their ids and buffers stay alive while the plan is

    @property
    def path_name(self) -> str:
        return _PATH_NAME[self.path]

    @property
    def staged(self) -> bool:
        """Its legs need a staging buffer."""
        return self.path == 2

    def legs(self) -> list[LegInfo]:
        return [LegInfo(*self.leg(k)) for k in range(self.num_legs)]

    # ------------------------------------------------------------------ running
    def run(
        self, staging: torch.Tensor | None = None, stream: int | None = None, lo: int = 0, hi: int | None = None
    ) -> None:
        """Legs ``[lo, hi)`` (default: all) in order, each DMA and reshape in the direction's order (a load: DMA then
        reshape; a save: the reverse): on the CPU now, on CUDA on ``stream`` (a handle; default the current stream),
        where the stream orders the staging buffer's reuse. (A CUDA plan's id table was uploaded on the stream current
        when it was planned: another ``stream`` must be ordered after that one by the caller.)"""
        hi = self.num_legs if hi is None else hi
        if lo >= hi:
            return
        lay = self.layout
        if self.staged:
            check.check_staging(staging, lay.device, max(self.leg(k)[3] for k in range(lo, hi)))
        addr = staging.data_ptr() if staging is not None else 0
        if self.impl_name in ("cpu", "cuda_sim"):
            _C.run_host(self, addr, lo, hi, 0, CUDA_SIM_SM_COUNT, self.max_ctas)
        elif self.impl_name == "cuda":
            with torch.cuda.device(lay.device):
                if stream is None:
                    stream = torch.cuda.current_stream(lay.device).cuda_stream
                _C.issue_in_order(_C.StreamQueues(stream), self, addr, lo, hi)
        else:
            for k in range(lo, hi):
                if self.gather:
                    self.reshape(k, staging, stream)
                    self.dma(k, staging, stream)
                else:
                    self.dma(k, staging, stream)
                    self.reshape(k, staging, stream)

    def dma(self, leg: int, staging: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Leg ``leg``'s DMA: between the buffers and ``staging`` (path staged) or the blocks (dma). Nothing on path
        kernel. CUDA: issued on ``stream`` (a handle; default the current stream)."""
        if self.path == 0:
            return
        self._check_staging(leg, staging)
        addr = staging.data_ptr() if staging is not None else 0
        if self.layout.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(self.layout.device).cuda_stream
            self.dma_cuda(leg, addr, stream)
        else:
            self.dma_host(leg, addr)

    def reshape(self, leg: int, staging: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Leg ``leg``'s launches: between ``staging`` and the blocks (path staged), or the buffers and the blocks
        (kernel). Nothing on path dma."""
        if self.path == 1:
            return
        self._check_staging(leg, staging)
        addr = staging.data_ptr() if staging is not None else 0
        if self.impl_name in ("cpu", "cuda_sim"):
            self.reshape_host(leg, addr, 0, CUDA_SIM_SM_COUNT, self.max_ctas)
        elif self.impl_name == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(self.layout.device).cuda_stream
            self.reshape_cuda(leg, addr, stream)
        else:
            self._reshape_python(leg, staging, stream)

    def _check_staging(self, leg: int, staging: torch.Tensor | None) -> None:
        if self.staged:
            check.check_staging(staging, self.layout.device, self.leg(leg)[3])

    def _reshape_python(self, leg: int, staging: torch.Tensor | None, stream: int | None) -> None:
        """The reference or Triton implementation, from each launch's geometry."""
        from . import reference

        lay = self.layout
        cuda = lay.device.type == "cuda"
        for launch in self.launches(leg):
            a = launch["first_layer"]
            b = a + launch["num_layers"]
            sub = lay.layer_range(a, b)
            if launch["copy"] >= 0:
                c = self.copies[launch["copy"]]
                op, ids, buf = c.op, check.ids_tensor(c.ids), c.buf.narrow(0, a, b - a)
            else:
                op = Op(f"{'gather' if self.gather else 'scatter'}_{_KIND[launch['group']]}")
                ids = torch.from_numpy(self.ids(launch["ids_at"], launch["num_ids"]).copy())
                buf = _region_view(staging, launch, op, lay, self._split_pages())
            if self.impl_name == "reference":
                getattr(reference, op.value)(sub, ids, buf)
                continue
            from ..triton_kernels import copy as tk

            geo = copy_geometry(op, sub, buf, ids.numel())
            if cuda:
                from .streams import torch_stream

                with torch.cuda.stream(torch_stream(stream, lay.device)):
                    ids_dev = ids.pin_memory().to(lay.device, non_blocking=True)
                    tk.copy_rows(geo, sub.layer_ptrs(), ids_dev, buf, op.c_direction, anchor=sub.plane_views(0)[0])
            else:
                tk.copy_rows(geo, sub.layer_ptrs(), ids, buf, op.c_direction, anchor=sub.plane_views(0)[0])

    def _split_pages(self) -> bool:
        return any(c.op.pages and c.buf.dim() == 5 for c in self.copies)


def _region_view(staging: torch.Tensor, launch: dict, op: Op, lay: KVLayout, split: bool) -> torch.Tensor:
    """A staged launch's region of ``staging`` as the op's contiguous side for its layers (strided)."""
    layers, entries = launch["num_layers"], launch["entries"]
    strides = (launch["layer_stride"], launch["plane_stride"], launch["token_stride"], launch["head_stride"])
    row = launch["row_bytes"]
    if op.pages:
        segments = lay.page.segments
        if split:
            shape = (layers, segments, entries, lay.num_heads, row)
            return staging.as_strided(shape, (*strides, 1), launch["contig"])
        return staging.as_strided((layers, segments, entries, row), (*strides[:3], 1), launch["contig"])
    item = lay.itemsize
    shape = (layers, lay.num_planes, entries, lay.num_heads, lay.head_size)
    usable = staging.numel() // item * item
    return (
        staging[:usable].view(lay.dtype).as_strided(shape, (*(s // item for s in strides), 1), launch["contig"] // item)
    )
