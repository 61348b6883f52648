"""impl "cuda_sim": the CUDA copy kernel's own source run on CPU, and the launch decisions it shares with the real
launcher (csrc/cuda/launch_config.h, copy_kernel.cuh, copy_sim.cu).

The bit-exact tests of every layout, dtype and op run cuda_sim through test_copy.py / test_batch.py's IMPLS, the
launch decisions themselves test_launch_config.py. Here: the emulation running exactly the launcher's grid
(grid-stride passes, the tail of the last pass, long rows spread over CTAs, the 64-bit path forced on small copies);
the checker firing on what a GPU would fault on or corrupt (a wider vector than the alignment allows, a buffer one
byte short, a byte written twice), the UVA-like case. GPU twins at the end run the real kernel on the same shapes and
compare its launch with the function's.
"""

import math
import re

import pytest
import torch

from kvx._ext import C as _ext_C
from kvx.kernels import ops
from kvx.kernels.layout import LAYOUTS, KVLayout, Op, byte_span, c_descs, copy_geometry
from kvx.testing import make_kv_caches, make_layout, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip, two_layouts
from .test_launch_config import _config

_C = _ext_C  # None without the extension: then conftest.py fails every test, with the import error
_BLOCKS = 0
_GATHER, _SCATTER = 0, 1
THREADS = 256  # threads per CTA of copy_cuda.cu (kThreads)
CTAS_PER_SM = 4  # launch_config.h kCtasPerSm: the grid's fill cap per SM
INDEX32_LIMIT = 1 << 31  # launch_config.h kIndex32Limit
H100_SMS = 132
TOKEN_LAYOUTS = [name for name in LAYOUTS if name != "cpu"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


# ------------------------------------------------------------------------------ the emulation
def cuda_sim_args(geo, lay, ids, buf) -> tuple:
    """``(bounds, args)`` for one copy: ``args`` are the arguments of ``kvx._C.cuda_sim_copy`` up to ``contig_strides``;
    ``bounds`` is the int64 ``[L, 2]`` tensor of per-layer ``[lo, hi)`` they point to (hold it while the call runs; the
    checker's tests narrow a bound in it). The bounds are the views' extents: each layer tensor's byte span (an access
    into another layer of a shared allocation is out of bounds) and the contiguous side's span."""
    bounds = lay.layer_bounds().clone()
    lo, hi = byte_span(buf)
    return bounds, (
        lay.layer_ptrs().data_ptr(),
        bounds.data_ptr(),
        geo.num_layers,
        ids.data_ptr(),
        geo.num_ids,
        buf.data_ptr(),
        lo,
        hi,
        *c_descs(geo),
    )


def _sim(
    kind,
    direction,
    lay,
    ids,
    buf,
    *,
    sm_count=H100_SMS,
    max_ctas=0,
    force_width=0,
    short=None,
    index32_limit=INDEX32_LIMIT,
):
    """kvx._C.cuda_sim_copy with ops' arguments, one declared extent one byte `short` if asked ("contig" or a
    layer index)."""
    impl_or_skip("cuda_sim")
    ids = torch.as_tensor(ids, dtype=torch.int64).contiguous()
    plan = copy_geometry(Op("gather_" + kind), lay, buf, ids.numel())
    bounds, args = cuda_sim_args(plan, lay, ids, buf)
    args = list(args)
    if short == "contig":
        args[7] -= 1  # contig_hi
    elif short is not None:
        bounds[short, 1] -= 1  # the layer's hi, read through the bounds tensor's address
    return _C.cuda_sim_copy(
        *args, plan.row_bytes, plan.mode, direction, sm_count, max_ctas, force_width, index32_limit=index32_limit
    )


_CONFIG_FIELDS = (
    "width",
    "words",
    "segments",
    "tpr",
    "wpl",
    "groups",
    "items_per_cta",
    "total_items",
    "ctas",
    "total_rows",
    "index_bits",
    "id_tokens",
)


def _same_config(a, b):
    return [getattr(a, f) for f in _CONFIG_FIELDS] + [a.params.row_bytes, a.divisors] == [
        getattr(b, f) for f in _CONFIG_FIELDS
    ] + [b.params.row_bytes, b.divisors]


def _passes(c):
    """Grid-stride passes the busiest thread of launch `c` makes."""
    return math.ceil(c.total_items / (c.ctas * c.items_per_cta))


# (layout, head size, dtype, op kind, ids, sm_count, max_ctas, the grid-stride loop comes round)
GRIDS = [
    pytest.param("LBNHC", 64, torch.float16, "blocks", [3, 0, 5], H100_SMS, 0, False, id="lbnhc-one-pass"),
    pytest.param("LBNHC", 64, torch.float16, "blocks", [3, 0, 5], H100_SMS, 2, True, id="lbnhc-max_ctas2"),
    # 10-byte rows: one 2-byte word per item, 2 items per thread per pass; 8 CTAs take all 3600 in one pass
    pytest.param("LBHNC", 5, torch.bfloat16, "slots", list(range(1, 121, 2)), H100_SMS, 8, False, id="slots-h2d-cap"),
    pytest.param("flash", 64, torch.bfloat16, "blocks", [1, 2, 6], 1, 0, True, id="flash-merged-rows"),
    pytest.param("BLNHC", 64, torch.float16, "blocks", list(range(16)), 64, 0, True, id="fill-cap"),
    pytest.param("mla", 576, torch.uint8, "pages", [4, 2, 0, 7, 5, 1, 3], H100_SMS, 1, True, id="pages-one-cta"),
    # 160-byte rows of 2-byte words: one lane x 4 consecutive words per item
    pytest.param("flashinfer", 5, torch.float8_e4m3fn, "blocks", [7, 1, 3, 0, 5, 2], 1, 2, True, id="fp8-sm1-cap2"),
]


def _grid_geom(name, head_size):
    big = name == "BLNHC"  # 49152 rows of one 128-byte item each: past the fill cap of 64 SMs x 4 CTAs x 128 items
    return dict(
        num_layers=3,
        num_blocks=16 if big else 8,
        block_size=128 if big else 16,
        num_heads=1 if name == "mla" else 4 if big else 2,
        head_size=head_size,
    )


def _grid_shape(lay, kind, n):
    return lay.page_shape(n) if kind == "pages" else lay.canonical_shape(n * lay.block_size if kind == "blocks" else n)


@pytest.mark.parametrize("name,head_size,dtype,kind,ids,sm_count,max_ctas,loops", GRIDS)
def test_sim_runs_the_launchers_grid(name, head_size, dtype, kind, ids, sm_count, max_ctas, loops):
    """The emulation runs every thread of the grid kernel_launch_config() decides (the launcher's), each work
    item by tpr lanes, with the grid-stride loop coming round where items exceed ctas * items_per_cta; and
    copies the reference's bytes doing so."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-grid", name, kind, max_ctas, sm_count)
    g = torch.Generator().manual_seed(seed)
    lay, ref = two_layouts(name, _grid_geom(name, head_size), dtype, False, seed)
    n = len(ids)
    out = random_fill_(torch.empty(_grid_shape(lay, kind, n), dtype=torch.uint8 if kind == "pages" else dtype), g)
    expected = out.clone()
    want = _config(kind, lay, n, out, sm_count=sm_count, max_ctas=max_ctas)
    report = _sim(kind, _GATHER, lay, ids, out, sm_count=sm_count, max_ctas=max_ctas)
    assert _same_config(report.config, want), (report.config, want)
    assert report.threads == want.ctas * THREADS
    assert report.item_visits == want.total_items * want.tpr  # no padding here: every item, tpr lanes
    assert report.passes_per_thread == _passes(want)
    assert (report.passes_per_thread > 1) == loops == (want.total_items > want.ctas * want.items_per_cta)
    getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
    assert_same_bytes(out, expected)
    src = random_fill_(torch.empty_like(out), g)
    report = _sim(kind, _SCATTER, lay, ids, src, sm_count=sm_count, max_ctas=max_ctas)
    assert report.passes_per_thread == _passes(want)
    getattr(ops, f"scatter_{kind}")(ref, ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


def test_padding_slots_are_not_visited():
    impl_or_skip("cuda_sim")
    lay = make_layout(
        "LBNHC", num_layers=2, num_blocks=4, block_size=16, num_heads=2, head_size=64, dtype=torch.float16
    )
    slots = [5, -1, 17, -1, -1, 40]
    out = torch.zeros(lay.canonical_shape(len(slots)), dtype=torch.float16)
    report = _sim("slots", _GATHER, lay, slots, out)
    c = report.config
    assert c.total_rows == 2 * 2 * 6 * 2 and c.segments == 1  # the iteration space counts padding ...
    assert report.item_visits == 2 * 2 * 3 * 2 * c.tpr  # ... the lanes copy only the 3 real slots
    assert report.accesses == 2 * 2 * 3 * 2 * 2 * (128 // c.width)  # a load and a store per word


def test_sim_spreads_a_long_row_over_ctas():
    """A raw LBNHC page of 64 KiB is one row of 32 work items: 4 CTAs of 8 lane groups (32 lanes x 4 words,
    2 KiB) move it in one pass, where the old kernel gave it to one warp. The emulation runs exactly that."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-long-row")
    g = torch.Generator().manual_seed(seed)
    geom = dict(num_layers=1, num_blocks=3, block_size=16, num_heads=8, head_size=128)
    lay, ref = two_layouts("LBNHC", geom, torch.bfloat16, False, seed)
    out = random_fill_(torch.empty(lay.page_shape(1), dtype=torch.uint8), g)
    expected = out.clone()
    report = _sim("pages", _GATHER, lay, [2], out)
    c = report.config
    assert (c.params.row_bytes, c.total_rows, c.tpr, c.wpl, c.segments, c.ctas) == (65536, 1, 32, 4, 32, 4)
    assert (report.threads, report.item_visits, report.passes_per_thread) == (4 * THREADS, 32 * 32, 1)
    ops.gather_pages(ref, [2], expected, impl="reference")
    assert_same_bytes(out, expected)


def test_sim_last_pass_tail():
    """Two items per thread per pass (64-byte rows: 2 lanes x 2 words each), one CTA of 128 groups: 450 slots
    take two passes, the second with every group's first item and only groups 0..65's second one; padding
    slots among them are skipped. Every real item is copied once (a tail bound off by one would locate a
    slot past the id list, or copy an item twice: the checker's faults)."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-tail")
    g = torch.Generator().manual_seed(seed)
    geom = dict(num_layers=1, num_blocks=32, block_size=16, num_heads=1, head_size=32)
    lay, ref = two_layouts("mla", geom, torch.bfloat16, False, seed)
    slots = torch.randperm(32 * 16, generator=g)[:450]
    slots[::7] = -1
    out = random_fill_(torch.empty(lay.canonical_shape(450), dtype=torch.bfloat16), g)
    expected = out.clone()
    report = _sim("slots", _GATHER, lay, slots, out, max_ctas=1)
    c = report.config
    assert (c.tpr, c.wpl, c.items_per_cta, c.total_items, c.ctas) == (2, 2, 256, 450, 1)
    assert report.passes_per_thread == 2
    assert report.item_visits == int((slots >= 0).sum()) * c.tpr
    ops.gather_slots(ref, slots, expected, impl="reference")
    assert_same_bytes(out, expected)
    src = random_fill_(torch.empty_like(out), g)
    _sim("slots", _SCATTER, lay, slots, src, max_ctas=1)
    ops.scatter_slots(ref, slots, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


@pytest.mark.parametrize("offset", [1, 2, 4, 8], ids=lambda o: f"off{o}")
def test_narrow_words_in_wide_segments(offset):
    """A contiguous side `offset` bytes off alignment narrows the words to `offset` bytes; 4 KiB raw pages then
    still split into segments of 32 lanes x 4 words (a group's load covers >= 32 bytes)."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-narrow", offset)
    g = torch.Generator().manual_seed(seed)
    geom = dict(num_layers=2, num_blocks=4, block_size=16, num_heads=1, head_size=64)
    lay, ref = two_layouts("LBNHC", geom, torch.bfloat16, False, seed)
    ids = [3, 0, 2]
    shape = lay.page_shape(len(ids))
    backing = random_fill_(torch.empty(math.prod(shape) + offset, dtype=torch.uint8), g)
    out = backing[offset:].view(shape)
    expected = out.clone()
    report = _sim("pages", _GATHER, lay, ids, out)
    c = report.config
    words = 4096 // offset
    assert (c.params.row_bytes, c.width, c.tpr, c.wpl, c.segments) == (4096, offset, 32, 4, words // 128)
    ops.gather_pages(ref, ids, expected, impl="reference")
    assert_same_bytes(out, expected)
    src = random_fill_(torch.empty_like(backing), g)[offset:].view(shape)
    _sim("pages", _SCATTER, lay, ids, src)
    ops.scatter_pages(ref, ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


# The 64-bit index path runs only for copies of 2^31 items and more, which no CPU test can hold; the
# index32_limit knob moves the boundary so that small copies take it (test-only).
@pytest.mark.parametrize(
    "name,kind",
    [("LBNHC", "blocks"), ("LBHNC", "slots"), ("flashinfer", "blocks"), ("mla", "pages"), ("flash", "slots")],
)
def test_sim_64bit_index_path(name, kind):
    """The same copies through both index paths, bit-exact against the reference; the limit at the exact
    boundary (total_items + one grid's worth) still gives 32 bits, one below it 64."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-idx64", name, kind)
    g = torch.Generator().manual_seed(seed)
    geom = dict(num_layers=2, num_blocks=8, block_size=16, num_heads=1 if name == "mla" else 3, head_size=40)
    lay, ref = two_layouts(name, geom, torch.bfloat16, bool(seed % 2), seed)
    if kind == "slots":
        ids = torch.randperm(8 * 16, generator=g)[:37]
        ids[::5] = -1
    else:
        ids = torch.tensor([6, 2, 3, 0])
    n = len(ids)
    if kind == "pages":
        shape, dtype = lay.page_shape(n), torch.uint8
    else:
        shape, dtype = lay.canonical_shape(n * lay.block_size if kind == "blocks" else n), torch.bfloat16
    out = torch.empty(shape, dtype=dtype)
    c = _config(kind, lay, n, out, max_ctas=2)
    boundary = c.total_items + c.ctas * c.items_per_cta
    assert c.index_bits == 32
    assert _config(kind, lay, n, out, max_ctas=2, index32_limit=boundary).index_bits == 32
    assert _config(kind, lay, n, out, max_ctas=2, index32_limit=boundary - 1).index_bits == 64
    for limit in (boundary, boundary - 1, 1):
        out = random_fill_(torch.empty(shape, dtype=dtype), g)
        expected = out.clone()
        report = _sim(kind, _GATHER, lay, ids, out, max_ctas=2, index32_limit=limit)
        assert report.config.index_bits == (32 if limit == boundary else 64)
        getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
        assert_same_bytes(out, expected)
        src = random_fill_(torch.empty(shape, dtype=dtype), g)
        _sim(kind, _SCATTER, lay, ids, src, max_ctas=2, index32_limit=limit)
        getattr(ops, f"scatter_{kind}")(ref, ids, src, impl="reference")
        assert_all_same_bytes(lay.layers, ref.layers)


@pytest.mark.parametrize("max_ctas", [0, ops.H2D_MAX_CTAS], ids=["uncapped", "h2d-cap"])
@pytest.mark.parametrize("name", TOKEN_LAYOUTS)
def test_uva_like_contiguous_side(name, max_ctas):
    """As the kernel sees pinned host memory over UVA: the contiguous side in an allocation of its own,
    checked against its own extent, with the host <-> device CTA cap (every layout, blocks, padded slots,
    pages). Twin on a GPU: test_gpu_uva_kernel below (and test_h2d.py's kernel-pinned route)."""
    impl_or_skip("cuda_sim")
    seed = case_seed("sim-uva", name, max_ctas)
    g = torch.Generator().manual_seed(seed)
    geom = dict(
        num_layers=2,
        num_blocks=8,
        block_size=16,
        num_heads=1 if name == "mla" else 3,
        head_size=40 if name == "mla" else 24,
    )
    lay, ref = two_layouts(name, geom, torch.bfloat16, bool(seed % 2), seed)
    _check_three_ops(lay, ref, "cuda_sim", g, max_ctas=max_ctas)


def _check_three_ops(lay, ref, impl, g, *, max_ctas=0, host=False, path=None):
    """Blocks, padded slots and (where the layout has them) pages, both directions, through `impl` against
    the reference; the contiguous side fresh allocations (pinned host memory when `host`)."""
    dev = lay.device
    kw = dict(impl=impl, max_ctas=max_ctas, **({"path": path} if path else {}))

    def buf(shape, dtype):
        t = random_fill_(torch.empty(shape, dtype=dtype), g)
        return t.pin_memory() if host else t.to(dev)

    n = lay.num_blocks * lay.block_size
    slots = torch.randperm(n, generator=g)[:37]
    slots[::4] = -1
    cases = [
        ("blocks", torch.tensor([6, 2, 3, 0]), lambda k: lay.canonical_shape(k * lay.block_size), lay.dtype),
        ("slots", slots, lay.canonical_shape, lay.dtype),
    ]
    if lay.page is not None:
        cases.append(("pages", torch.tensor([5, 1]), lay.page_shape, torch.uint8))
    for kind, ids, shape_of, dtype in cases:
        out = buf(shape_of(len(ids)), dtype)
        expected = out.to(dev, copy=True)
        getattr(ops, f"gather_{kind}")(lay, ids, out, **kw)
        getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert_same_bytes(out.to(dev), expected)
        src = buf(shape_of(len(ids)), dtype)
        getattr(ops, f"scatter_{kind}")(lay, ids, src, **kw)
        getattr(ops, f"scatter_{kind}")(ref, ids, src.to(dev), impl="reference")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert_all_same_bytes(lay.layers, ref.layers)


# Row lengths in words of 16 bytes (16 * k) and of 1 byte (odd k): every segment shape (32, 16, 8, 4, 2 lanes x
# 4 or 2 words, and one-word items), segment counts from 1 to 66, and in the tail of the last pass every
# residue of the items modulo a pass. A bound off by one in the segment or tail arithmetic shows only for some
# of them, which the layouts' natural row lengths hit by chance.
SWEEP_ROW_BYTES = [16 * k for k in range(1, 133)] + list(range(1, 133, 2))


def _sweep_row_lengths(impl, device):
    g = torch.Generator().manual_seed(case_seed("sweep", impl))
    slots = [5, 0, 7, 2]  # 4 of 8 tokens: neighbours on both sides, both ends of the chunk
    for row_bytes in SWEEP_ROW_BYTES:
        geom = dict(num_layers=1, num_blocks=2, block_size=4, num_heads=1, head_size=row_bytes)
        seed = case_seed("sweep", row_bytes)
        a = make_kv_caches(
            "mla", **geom, dtype=torch.uint8, device=device, generator=torch.Generator().manual_seed(seed)
        )
        b = make_kv_caches(
            "mla", **geom, dtype=torch.uint8, device=device, generator=torch.Generator().manual_seed(seed)
        )
        lay, ref = KVLayout.from_tensors(a, "mla"), KVLayout.from_tensors(b, "mla")
        out = random_fill_(torch.empty(lay.canonical_shape(4), dtype=torch.uint8), g).to(device)
        expected = out.clone()
        ops.gather_slots(lay, slots, out, impl=impl)
        ops.gather_slots(ref, slots, expected, impl="reference")
        src = random_fill_(torch.empty_like(out, device="cpu"), g).to(device)
        ops.scatter_slots(lay, slots, src, impl=impl)
        ops.scatter_slots(ref, slots, src, impl="reference")
        if device == "cuda":
            torch.cuda.synchronize()
        assert_same_bytes(out, expected)
        assert_all_same_bytes(lay.layers, ref.layers)


def test_every_row_length_and_segment_shape():
    impl_or_skip("cuda_sim")
    _sweep_row_lengths("cuda_sim", "cpu")


# ------------------------------------------------------------------------------ the checker fires
ODD = dict(num_layers=1, num_blocks=4, block_size=16, num_heads=2, head_size=5, dtype=torch.float16)


@pytest.mark.parametrize("direction", [_GATHER, _SCATTER], ids=["gather", "scatter"])
def test_vector_wider_than_the_alignment_is_misaligned(direction):
    """LBNHC with 10-byte rows: copy_width() picks 2 bytes. One step wider (4) is what a too-wide width
    would launch: the first thread to reach an address 2 bytes off a multiple of 4 is named, with its item.

    A row of 2 words of 4 bytes is one item of one lane, one per thread in order: thread 0 copies row 0
    (block 0, token 0, head 0), aligned on both sides; thread 1 row 1, head 1 of token 0, whose chunk row sits
    10 bytes into the chunk."""
    impl_or_skip("cuda_sim")
    lay = make_layout("LBNHC", **ODD)
    buf = random_fill_(torch.empty(lay.canonical_shape(16), dtype=torch.float16))
    before = buf.clone()
    chosen = _config("blocks", lay, 1, buf).width
    assert chosen == 2
    op = "store" if direction == _GATHER else "load"
    addr = buf.data_ptr() + 10
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * 2
    with pytest.raises(
        _C.CudaSimFault,
        match=re.escape(
            f"cuda_sim: misaligned: 4-byte {op} at {addr:#x} by CTA 0 "
            f"thread 1 (lane 0 of group 1), item 1 (row 1 segment 0 of 1; entry 0, row 1 of 32): "
            f"address % 4 = 2; the "
            f"contiguous side is [{lo:#x}, {hi:#x})"
        ),
    ):
        _sim("blocks", direction, lay, [0], buf, force_width=2 * chosen)
    if direction == _GATHER:  # stopped before the faulting store: row 1 keeps its poison
        assert_same_bytes(buf[0, 0, 0, 1], before[0, 0, 0, 1])


def _last_vector_thread(c, row):
    """(cta, thread, item) of the lane that moves the last vector of `row` under launch `c`: the last lane of
    the row's last segment (its last word), wherever the grid-stride passes put that item."""
    item = row * c.segments + c.segments - 1
    within_pass = item % (c.ctas * c.items_per_cta)
    cta, slot = divmod(within_pass, c.items_per_cta)
    group = slot % c.groups  # slot // groups is the item's place k among the thread's items of the pass
    return cta, group * c.tpr + c.tpr - 1, item


@pytest.mark.parametrize("short", ["contig", "last-layer"])
@pytest.mark.parametrize("direction", [_GATHER, _SCATTER], ids=["gather", "scatter"])
def test_buffer_one_byte_short_is_out_of_bounds(direction, short):
    """Declare one buffer one byte shorter than it is: the one access reaching its last byte (the last vector
    of the last row: every block of a legacy-flash cache in order, where each block-plane is one row) is
    out of bounds, named with the thread that makes it, its row and the declared bounds."""
    impl_or_skip("cuda_sim")
    lay = make_layout("flash", num_layers=2, num_blocks=3, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
    ids = [0, 1, 2]
    buf = random_fill_(torch.empty(lay.canonical_shape(3 * 16), dtype=torch.float16))
    c = _config("blocks", lay, 3, buf, max_ctas=1)
    last = c.total_rows - 1
    cta, thread, item = _last_vector_thread(c, last)
    if short == "contig":
        lo, hi, name = buf.data_ptr(), buf.data_ptr() + buf.numel() * 2, "the contiguous side"
        layer = None
    else:
        t = lay.layers[-1]
        lo, hi, name = t.data_ptr(), t.data_ptr() + t.numel() * 2, "paged layer 1"
        layer = 1
    side_is_dst = (short == "contig") == (direction == _GATHER)
    op = "store" if side_is_dst else "load"
    addr = hi - c.width
    msg = (
        f"cuda_sim: out of bounds: {c.width}-byte {op} at {addr:#x} by CTA {cta} thread {thread} (lane "
        f"{thread % c.tpr} of group {thread // c.tpr}), item {item} (row {last} segment {c.segments - 1} of "
        f"{c.segments}; entry {last}, row 0 of 1): bytes [{addr:#x}, {hi:#x}) are not all in {name} "
        f"[{lo:#x}, {hi - 1:#x})"
    )
    with pytest.raises(_C.CudaSimFault, match=re.escape(msg)):
        _sim("blocks", direction, lay, ids, buf, max_ctas=1, short="contig" if layer is None else layer)


def test_byte_written_twice_is_a_race():
    """Two rows of one launch writing the same bytes (a scatter to one block twice, which ops refuses) race
    on a GPU: the second writer is named."""
    impl_or_skip("cuda_sim")
    lay = make_layout("flash", num_layers=1, num_blocks=3, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
    src = random_fill_(torch.empty(lay.canonical_shape(2 * 16), dtype=torch.float16))
    c = _config("blocks", lay, 2, src)
    with pytest.raises(
        _C.CudaSimFault,
        match=rf"cuda_sim: written twice: {c.width}-byte store at 0x[0-9a-f]+ by "
        rf"CTA 0 thread {c.tpr} \(lane 0 of group 1\), item 1 \(row 1 .*was already "
        r"written in this launch by CTA 0 thread 0 \(lane 0 of group 0\): "
        r"a race on a GPU",
    ):
        _sim("blocks", _SCATTER, lay, [2, 2], src)


def test_sim_checks_its_arguments():
    impl_or_skip("cuda_sim")
    lay = make_layout("flash", num_layers=1, num_blocks=3, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
    buf = torch.empty(lay.canonical_shape(16), dtype=torch.float16)
    with pytest.raises(
        ValueError, match=re.escape("force_width: expected 0 (copy_width()'s) or 1, 2, 4, 8, 16, got 3")
    ):
        _sim("blocks", _GATHER, lay, [0], buf, force_width=3)
    with pytest.raises(ValueError, match="sm_count: expected >= 1, got 0"):
        _sim("blocks", _GATHER, lay, [0], buf, sm_count=0)
    with pytest.raises(ValueError, match="direction: expected 0 .gather. or 1 .scatter., got 2"):
        _sim("blocks", 2, lay, [0], buf)
    with pytest.raises(ValueError, match=re.escape("index32_limit: expected 1 .. 2^31, got 0")):
        _sim("blocks", _GATHER, lay, [0], buf, index32_limit=0)


def test_cuda_sim_is_listed_with_the_cuda_build():
    """cuda_sim is the CUDA kernel's source: it exists exactly when kvx._C was built with nvcc."""
    assert bool(getattr(_C, "has_cuda_sim", False)) == bool(getattr(_C, "has_cuda", False))
    assert ("cuda_sim" in ops.available_impls("cpu")) == bool(_C.has_cuda_sim)
    assert "cuda_sim" not in ops.available_impls("meta")


# ------------------------------------------------------------------------------ GPU twins
def _device_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name,head_size,dtype,kind,ids,sm_count,max_ctas,loops", GRIDS)
def test_gpu_launch_matches_the_function_and_the_sim(name, head_size, dtype, kind, ids, sm_count, max_ctas, loops):
    """The real launcher's grid (returned by kvx._C.cuda_copy) is kernel_launch_config() on this device's SM
    count, and the emulation's on a CPU twin of the same geometry and SM count; the bytes are the
    reference's. (sm_count of the CPU case is the emulated device's; here it is the real one.)"""
    impl_or_skip("cuda", "cuda")
    seed = case_seed("gpu-grid", name, kind, max_ctas)
    g = torch.Generator().manual_seed(seed)
    geom = _grid_geom(name, head_size)
    a = make_kv_caches(name, **geom, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(seed))
    b = make_kv_caches(name, **geom, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(seed))
    lay, ref = KVLayout.from_tensors(a, name), KVLayout.from_tensors(b, name)
    n = len(ids)
    shape = _grid_shape(lay, kind, n)
    out = random_fill_(torch.empty(shape, dtype=torch.uint8 if kind == "pages" else dtype), g).cuda()
    expected = out.clone()
    ids_dev = torch.tensor(ids, dtype=torch.int64).cuda()
    plan = copy_geometry(Op("gather_" + kind), lay, out, n)
    used = _C.cuda_copy(
        lay.layer_ptrs().data_ptr(),
        lay.layer_ptrs(lay.device).data_ptr(),
        plan.num_layers,
        ids_dev.data_ptr(),
        plan.num_ids,
        out.data_ptr(),
        *c_descs(plan),
        plan.row_bytes,
        plan.mode,
        _GATHER,
        torch.cuda.current_stream().cuda_stream,
        max_ctas,
    )
    sms = _device_sms()
    assert _same_config(used, _config(kind, lay, n, out, sm_count=sms, max_ctas=max_ctas))
    assert used.ctas == min(
        math.ceil(used.total_items / used.items_per_cta), CTAS_PER_SM * sms, max_ctas or used.total_items
    )
    getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
    torch.cuda.synchronize()
    assert_same_bytes(out, expected)
    if "cuda_sim" in ops.available_impls("cpu"):
        twin = KVLayout.from_tensors(make_kv_caches(name, **geom, dtype=dtype), name)
        cpu_out = torch.empty(shape, dtype=out.dtype)
        report = _sim(kind, _GATHER, twin, ids, cpu_out, sm_count=sms, max_ctas=max_ctas)
        assert _same_config(report.config, used), (report.config, used)


@needs_cuda
@pytest.mark.gpu
def test_gpu_every_row_length_and_segment_shape():
    """Twin of test_every_row_length_and_segment_shape: the real kernel."""
    impl_or_skip("cuda", "cuda")
    _sweep_row_lengths("cuda", "cuda")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [0, ops.H2D_MAX_CTAS], ids=["uncapped", "h2d-cap"])
@pytest.mark.parametrize("name", TOKEN_LAYOUTS)
def test_gpu_uva_kernel(name, max_ctas):
    """Twin of test_uva_like_contiguous_side: the real kernel over pinned host memory (path="kernel")."""
    impl_or_skip("cuda", "cuda")
    seed = case_seed("sim-uva", name, max_ctas)
    g = torch.Generator().manual_seed(seed)
    geom = dict(
        num_layers=2,
        num_blocks=8,
        block_size=16,
        num_heads=1 if name == "mla" else 3,
        head_size=40 if name == "mla" else 24,
    )
    padded = bool(seed % 2)
    a = make_kv_caches(
        name, **geom, dtype=torch.bfloat16, device="cuda", padded=padded, generator=torch.Generator().manual_seed(seed)
    )
    b = make_kv_caches(
        name, **geom, dtype=torch.bfloat16, device="cuda", padded=padded, generator=torch.Generator().manual_seed(seed)
    )
    lay, ref = KVLayout.from_tensors(a, name), KVLayout.from_tensors(b, name)
    _check_three_ops(lay, ref, "cuda", g, max_ctas=max_ctas, host=True, path="kernel")
