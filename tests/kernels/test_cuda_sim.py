"""impl "cuda_sim": the CUDA copy kernel's own source run on CPU, and the launch decisions it shares with the
real launcher (csrc/cuda/launch_config.h, copy_kernel.cuh, copy_sim.cu).

The bit-exact tests of every layout, dtype and op run cuda_sim through test_copy.py / test_batch.py's IMPLS.
Here: the launch decisions themselves (anywhere: plain host arithmetic), the emulation running exactly that
grid (grid-stride loop, CTA caps), the checker firing on what a GPU would fault on or corrupt (a wider vector
than the alignment allows, a buffer one byte short, a byte written twice), the UVA-like case. GPU twins at
the end run the real kernel on the same shapes and compare its launch with the function's.
"""

import math
import re

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.layout import LAYOUTS, KVLayout, Op
from kvx.testing import make_kv_caches, make_layout, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip, two_layouts

_C = ops._C  # None without the extension: then conftest.py fails every test, with the import error
_BLOCKS = 0
_GATHER, _SCATTER = 0, 1
THREADS = 256  # threads per CTA of copy_cuda.cu (kThreads)
H100_SMS = 132
TOKEN_LAYOUTS = [name for name in LAYOUTS if name != "cpu"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


# ------------------------------------------------------------------------------ launch decisions (anywhere)
def _rows_config(row_bytes, rows, *, sm_count=H100_SMS, max_ctas=0, contig=1 << 24):
    """The launch for `rows` rows of `row_bytes` bytes: one layer, one plane, one row per block id."""
    paged = _C.PagedDesc(
        plane_stride=0,
        block_stride=row_bytes,
        token_stride=0,
        head_stride=0,
        num_blocks=rows,
        num_planes=1,
        block_size=1,
        num_heads=1,
    )
    dense = _C.ContigDesc(layer_stride=rows * row_bytes, plane_stride=0, token_stride=row_bytes, head_stride=row_bytes)
    return _C.cuda_launch_config(paged, dense, row_bytes, 1, rows, _BLOCKS, [1 << 20], contig, sm_count, max_ctas)


@pytest.mark.parametrize(
    "row_bytes,width,tpr",
    [
        (64, 16, 4),
        (128, 16, 8),
        (256, 16, 16),
        (512, 16, 32),
        (4096, 16, 32),  # 16-byte words: 4 .. 256 per row
        (72, 8, 16),  # 9 words of 8 bytes: the next power of two
        (10, 2, 8),
        (20, 4, 8),
        (1, 1, 4),
        (3, 1, 4),
    ],
)
def test_width_and_lanes_per_row(row_bytes, width, tpr):
    c = _rows_config(row_bytes, 1000)
    assert (c.width, c.tpr, c.groups) == (width, tpr, THREADS // tpr)
    assert c.params.row_bytes == row_bytes and c.total_rows == 1000


@pytest.mark.parametrize(
    "row_bytes,rows,sm_count,max_ctas,ctas",
    [
        (64, 1000, H100_SMS, 0, 16),  # 64 rows per CTA (tpr 4): ceil(1000 / 64)
        (512, 1000, H100_SMS, 0, 125),  # 8 rows per CTA (tpr 32)
        (512, 1, H100_SMS, 0, 1),
        (4096, 100_000, H100_SMS, 0, 528),  # fill cap: 4 CTAs per SM
        (4096, 100_000, 4, 0, 16),
        (4096, 100_000, H100_SMS, 8, 8),  # the caller's cap (H2D_MAX_CTAS)
        (512, 1000, H100_SMS, 1000, 125),  # a cap above the need changes nothing
        (512, 1000, 10, 30, 30),  # the smaller of both caps
    ],
)
def test_cta_count_and_caps(row_bytes, rows, sm_count, max_ctas, ctas):
    c = _rows_config(row_bytes, rows, sm_count=sm_count, max_ctas=max_ctas)
    assert c.ctas == ctas
    assert c.ctas == min(math.ceil(rows / c.groups), 4 * sm_count, max_ctas or rows)


def test_grid_stride_when_rows_exceed_the_grid():
    c = _rows_config(4096, 100_000)
    assert c.ctas * c.groups == 528 * 8 < c.total_rows  # each row group comes round ~24 times


def _one_row_descs():
    """A paged and a contiguous descriptor of 4 one-token blocks of one 64-byte row each."""
    paged = _C.PagedDesc(
        plane_stride=0,
        block_stride=64,
        token_stride=0,
        head_stride=0,
        num_blocks=4,
        num_planes=1,
        block_size=1,
        num_heads=1,
    )
    return paged, _C.ContigDesc(layer_stride=0, plane_stride=0, token_stride=64, head_stride=64)


def test_nothing_to_launch():
    paged, dense = _one_row_descs()
    assert _C.cuda_launch_config(paged, dense, 64, 1, 0, _BLOCKS, [1 << 20], 1 << 24, H100_SMS).ctas == 0
    assert _C.cuda_launch_config(paged, dense, 0, 1, 4, _BLOCKS, [1 << 20], 1 << 24, H100_SMS).ctas == 0


def test_launch_config_collapses_rows_and_reads_alignment():
    """legacy flash: a block-plane is one row; an address 8 bytes off narrows the vector to 8 bytes."""
    lay = make_layout("flash", num_layers=2, num_blocks=4, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
    buf = torch.empty(lay.canonical_shape(3 * 16), dtype=torch.float16)
    c = _config("blocks", lay, 3, buf)
    assert (c.params.row_bytes, c.total_rows, c.width, c.tpr) == (16 * 2 * 8 * 2, 2 * 2 * 3, 16, 32)
    assert _config("blocks", lay, 3, buf, contig=buf.data_ptr() + 8).width == 8


def test_launch_config_checks_its_arguments():
    with pytest.raises(ValueError, match="layer_ptrs: expected num_layers = 2 addresses, got 1"):
        _C.cuda_launch_config(
            *_one_row_descs(),
            64,
            2,
            4,
            _BLOCKS,
            [1 << 20],
            1 << 24,
            H100_SMS,
        )
    with pytest.raises(ValueError, match="sm_count: expected >= 1, got 0"):
        _rows_config(64, 10, sm_count=0)


# ------------------------------------------------------------------------------ the emulation
def _config(kind, lay, n, buf, *, sm_count=H100_SMS, max_ctas=0, contig=None):
    plan = ops._plan(Op("gather_" + kind), lay, buf, n)
    return _C.cuda_launch_config(
        *ops._c_descs(plan),
        plan.row_bytes,
        plan.num_layers,
        plan.num_ids,
        plan.mode,
        lay.layer_ptrs().tolist(),
        buf.data_ptr() if contig is None else contig,
        sm_count,
        max_ctas,
    )


def _sim(kind, direction, lay, ids, buf, *, sm_count=H100_SMS, max_ctas=0, force_width=0, short=None):
    """kvx._C.cuda_sim_copy with ops' arguments, one declared extent one byte `short` if asked ("contig" or a
    layer index)."""
    impl_or_skip("cuda_sim")
    ids = torch.as_tensor(ids, dtype=torch.int64).contiguous()
    plan = ops._plan(Op("gather_" + kind), lay, buf, ids.numel())
    bounds, args = ops._cuda_sim_args(plan, lay, ids, buf)
    args = list(args)
    if short == "contig":
        args[7] -= 1  # contig_hi
    elif short is not None:
        bounds[short, 1] -= 1  # the layer's hi, read through the bounds tensor's address
    return _C.cuda_sim_copy(*args, plan.row_bytes, plan.mode, direction, sm_count, max_ctas, force_width)


def _same_config(a, b):
    return (a.width, a.tpr, a.groups, a.ctas, a.total_rows, a.params.row_bytes) == (
        b.width,
        b.tpr,
        b.groups,
        b.ctas,
        b.total_rows,
        b.params.row_bytes,
    )


# (layout, head size, dtype, op kind, ids, sm_count, max_ctas, the grid-stride loop comes round)
GRIDS = [
    pytest.param("LBNHC", 64, torch.float16, "blocks", [3, 0, 5], H100_SMS, 0, False, id="lbnhc-one-pass"),
    pytest.param("LBNHC", 64, torch.float16, "blocks", [3, 0, 5], H100_SMS, 2, True, id="lbnhc-max_ctas2"),
    pytest.param("LBHNC", 5, torch.bfloat16, "slots", list(range(1, 121, 2)), H100_SMS, 8, True, id="slots-h2d-cap"),
    pytest.param("flash", 64, torch.bfloat16, "blocks", [1, 2, 6], 1, 0, False, id="flash-merged-rows"),
    pytest.param("BLNHC", 64, torch.float16, "blocks", list(range(16)), H100_SMS, 0, True, id="fill-cap"),
    pytest.param("mla", 576, torch.uint8, "pages", [4, 2, 0, 7, 5, 1, 3], H100_SMS, 1, True, id="pages-one-cta"),
    pytest.param("flashinfer", 5, torch.float8_e4m3fn, "blocks", [7, 1, 3, 0, 5, 2], 1, 0, True, id="fp8-sm1"),
]


def _grid_geom(name, head_size):
    big = name == "BLNHC"  # 49152 rows: past the fill cap of 528 CTAs x 32 rows
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
    """The emulation runs every thread of the grid kernel_launch_config() decides (the launcher's), each row
    by tpr lanes, with the grid-stride loop coming round where rows exceed ctas * groups; and copies the
    reference's bytes doing so."""
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
    assert report.row_visits == want.total_rows * want.tpr  # no padding here: every row, tpr lanes
    assert report.rows_per_thread == math.ceil(want.total_rows / (want.ctas * want.groups))
    assert (report.rows_per_thread > 1) == loops == (want.total_rows > want.ctas * want.groups)
    getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
    assert_same_bytes(out, expected)
    src = random_fill_(torch.empty_like(out), g)
    report = _sim(kind, _SCATTER, lay, ids, src, sm_count=sm_count, max_ctas=max_ctas)
    assert report.rows_per_thread == math.ceil(want.total_rows / (want.ctas * want.groups))
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
    assert c.total_rows == 2 * 2 * 6 * 2  # the iteration space counts padding ...
    assert report.row_visits == 2 * 2 * 3 * 2 * c.tpr  # ... the lanes copy only the 3 real slots
    assert report.accesses == 2 * 2 * 3 * 2 * 2 * (128 // c.width)  # a load and a store per word


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


# Row lengths in words of 16 bytes (16 * k) and of 1 byte (odd k): every lane count (tpr 4, 8, 16, 32) and,
# for tpr 32, every residue of words modulo the 4 x 32 words one pass of the unrolled loop moves, so each
# lane meets each way out of the loop (unrolled passes then tail, tail only, nothing). A bound off by one in
# either loop shows only for some of them (the unrolled loop's for words % 128 in [96, 128)), which the
# layouts' natural row lengths hit by chance.
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


def test_every_row_length_around_the_unrolled_loop():
    impl_or_skip("cuda_sim")
    _sweep_row_lengths("cuda_sim", "cpu")


# ------------------------------------------------------------------------------ the checker fires
ODD = dict(num_layers=1, num_blocks=4, block_size=16, num_heads=2, head_size=5, dtype=torch.float16)


@pytest.mark.parametrize("direction", [_GATHER, _SCATTER], ids=["gather", "scatter"])
def test_vector_wider_than_the_alignment_is_misaligned(direction):
    """LBNHC with 10-byte rows: copy_width() picks 2 bytes. One step wider (4) is what a too-wide width
    would launch: the first thread to reach an address 2 bytes off a multiple of 4 is named, with its row.

    Thread 0 (row group 0) copies row 0 (block 0, token 0, head 0): aligned on both sides. Thread 4 (4 lanes
    per row of 2 words) starts row 1, head 1 of token 0, whose chunk row sits 10 bytes into the chunk."""
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
            f"thread 4 (lane 0 of row group 1), row 1 (entry 0, row 1 of 32): "
            f"address % 4 = 2; the "
            f"contiguous side is [{lo:#x}, {hi:#x})"
        ),
    ):
        _sim("blocks", direction, lay, [0], buf, force_width=2 * chosen)
    if direction == _GATHER:  # stopped before the faulting store: row 1 keeps its poison
        assert_same_bytes(buf[0, 0, 0, 1], before[0, 0, 0, 1])


def _last_vector_thread(c, row):
    """(cta, thread) of the lane that moves the last vector of `row` under launch `c`."""
    words = c.params.row_bytes // c.width
    group = row // c.groups
    return group % c.ctas, (row % c.groups) * c.tpr + (words - 1) % c.tpr


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
    c = _config("blocks", lay, 3, buf, max_ctas=1)  # one CTA: every row group comes round
    last = c.total_rows - 1
    cta, thread = _last_vector_thread(c, last)
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
        f"{thread % c.tpr} of row group {thread // c.tpr}), row {last} (entry {last}, row 0 of 1): bytes "
        f"[{addr:#x}, {hi:#x}) are not all in {name} [{lo:#x}, {hi - 1:#x})"
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
        rf"CTA 0 thread {c.tpr} \(lane 0 of row group 1\), row 1 .*was already "
        r"written in this launch by CTA 0 thread 0 \(lane 0 of row group 0\): "
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
    plan = ops._plan(Op("gather_" + kind), lay, out, n)
    used = _C.cuda_copy(
        lay.layer_ptrs().data_ptr(),
        lay.layer_ptrs(lay.device).data_ptr(),
        plan.num_layers,
        ids_dev.data_ptr(),
        plan.num_ids,
        out.data_ptr(),
        *ops._c_descs(plan),
        plan.row_bytes,
        plan.mode,
        _GATHER,
        torch.cuda.current_stream().cuda_stream,
        max_ctas,
    )
    sms = _device_sms()
    assert _same_config(used, _config(kind, lay, n, out, sm_count=sms, max_ctas=max_ctas))
    assert used.ctas == min(math.ceil(used.total_rows / used.groups), 4 * sms, max_ctas or used.total_rows)
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
def test_gpu_every_row_length_around_the_unrolled_loop():
    """Twin of test_every_row_length_around_the_unrolled_loop: the real kernel."""
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
