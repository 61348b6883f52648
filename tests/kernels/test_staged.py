"""``kvx.kernels.plan``: the host <-> device data path, planned into legs (the compiled plan), bit-exact against the
reference running each op alone over every layer.

On CPU every path runs its CPU twin (the DMA plan run by memcpy, the reshape by a CPU impl, ``cuda_sim`` included:
the CUDA kernel's own source over the staging views), so these tests execute the very run lists and staging views
a GPU gets. Cases: every layout and dtype kvx copies (fp8 included), odd head sizes, a strided chunk cut from a
pool, padding slots, raw pages, a capacity that splits a layer's copies between ids and one that takes several
layers per leg; the run lists themselves (a whole chunk's layer is one run); the errors. GPU twins at the end.
"""

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.plan import Copies
from kvx.testing import random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip, two_layouts

IMPLS = ["cpu", "cuda_sim", "reference"]  # the reshape's implementation on CPU
DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.uint8]
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "flash", "flashinfer", "mla"]
PATHS = ["staged", "dma", "kernel", "auto"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


def _caches(name, dtype, seed, device="cpu", layers=3):
    """Two identical small caches (under test, reference): odd head sizes, 12 blocks of 16 tokens."""
    geom = dict(
        num_layers=layers,
        num_blocks=12,
        block_size=16,
        num_heads=1 if name == "mla" else 2,
        head_size=40 if name == "mla" else 5,
    )
    return two_layouts(name, geom, dtype, False, seed, device=device)


def _copies(lay, g, pinned=False):
    """(kind, ids, buffer) of a step's worth of copies: chunks of several sizes, a strided chunk cut from a pool,
    padding slots; the scatters write distinct blocks, the last block by slots. Raw pages go in their own batch
    (a worker's batch holds one format)."""
    bs = lay.block_size

    def buf(shape, dtype):
        t = random_fill_(torch.empty(shape, dtype=dtype), g)
        return t.pin_memory() if pinned else t

    pool = buf((2, lay.num_planes, lay.num_layers, 3 * bs, lay.num_heads, lay.head_size), lay.dtype)
    return [
        ("blocks", [4, 0], buf(lay.canonical_shape(2 * bs), lay.dtype)),
        ("blocks", [7, 2, 9], pool[1].transpose(0, 1)),  # strided: a pool slot
        ("blocks", [5], buf(lay.canonical_shape(bs), lay.dtype)),
        ("slots", [11 * bs + 3, -1, 11 * bs, 10 * bs + bs - 1, -1], buf(lay.canonical_shape(5), lay.dtype)),
    ]


def _pages(lay, g, pinned=False):
    t = random_fill_(torch.empty(lay.page_shape(3), dtype=torch.uint8), g)
    return [("pages", [1, 8, 3], t.pin_memory() if pinned else t)]


def _run(plan, staging):
    """Every leg's steps in the direction's order on one stream, as the engine orders them."""
    plan.run(staging if plan.staged else None)


def _check_gathers(lay, ref, copies, path, impl, ranges, capacity):
    outs = [buf.clone() for _, _, buf in copies]  # filled with noise: a row the batch misses shows
    expected = [buf.clone() for _, _, buf in copies]
    batch = Copies(lay, path=path, impl=impl)
    for (kind, ids, _), out in zip(copies, outs):
        batch.add(f"gather_{kind}", ids, out)
    plan = batch.plan(ranges, capacity)
    staging = torch.empty(capacity or 16, dtype=torch.uint8, device=lay.device)
    _run(plan, staging)
    for (kind, ids, _), exp in zip(copies, expected):
        getattr(ops, f"gather_{kind}")(ref, ids, exp, impl="reference")
    for out, exp in zip(outs, expected):
        assert_same_bytes(out, exp)
    return plan


def _check_scatters(lay, ref, copies, path, impl, ranges, capacity):
    batch = Copies(lay, path=path, impl=impl)
    for kind, ids, src in copies:
        batch.add(f"scatter_{kind}", ids, src)
    plan = batch.plan(ranges, capacity)
    staging = torch.empty(capacity or 16, dtype=torch.uint8, device=lay.device)
    _run(plan, staging)
    for kind, ids, src in copies:
        getattr(ops, f"scatter_{kind}")(ref, ids, src.to(ref.device), impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)
    return plan


def _ranges(num_layers):
    return [(0, 1), (1, num_layers)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_batch_matches_each_op_alone(impl, name, dtype, path):
    impl_or_skip(impl)
    seed = case_seed("staged", impl, name, str(dtype), path)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, dtype, seed)
    cap = 1 << 20
    _check_gathers(lay, ref, _copies(lay, g), path, impl, _ranges(lay.num_layers), cap)
    _check_scatters(lay, ref, _copies(lay, g), path, impl, _ranges(lay.num_layers), cap)
    if lay.page is not None:
        _check_gathers(lay, ref, _pages(lay, g), path, impl, _ranges(lay.num_layers), cap)
        _check_scatters(lay, ref, _pages(lay, g), path, impl, _ranges(lay.num_layers), cap)


@pytest.mark.parametrize("name", ["LBNHC", "flash", "mla"])
@pytest.mark.parametrize("impl", ["cpu", "cuda_sim"])
def test_a_small_capacity_splits_a_layer_between_ids(impl, name):
    """A staging buffer of one block of one layer: every block of every layer is a leg of its own (a slot
    copy's entries pack several to a leg)."""
    impl_or_skip(impl)
    seed = case_seed("split", impl, name)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, torch.bfloat16, seed)
    block = lay.num_planes * lay.block_size * lay.num_heads * lay.row_bytes
    copies = _copies(lay, g)
    legs = _check_gathers(lay, ref, copies, "staged", impl, None, block).legs()
    assert all(p.nbytes <= block and p.end - p.start == 1 for p in legs)
    n_blocks = sum(len(ids) for kind, ids, _ in copies if kind == "blocks")
    assert len(legs) >= lay.num_layers * n_blocks
    legs = _check_scatters(lay, ref, _copies(lay, g), "staged", impl, None, block + 7).legs()
    assert all(p.nbytes <= block + 7 for p in legs)


def test_a_large_capacity_takes_several_layers_per_leg():
    g = torch.Generator().manual_seed(5)
    lay, ref = _caches("LBNHC", torch.float16, 5, layers=5)
    copies = _copies(lay, g)
    per_layer = Copies(lay, path="staged")
    for kind, ids, buf in copies:
        per_layer.add(f"gather_{kind}", ids, buf)
    layer_bytes = per_layer.nbytes // lay.num_layers
    legs = _check_gathers(lay, ref, copies, "staged", "cpu", [(0, 5)], 2 * layer_bytes).legs()
    assert [(p.start, p.end) for p in legs] == [(0, 2), (2, 4), (4, 5)]


def test_a_whole_chunk_layer_is_one_run():
    """The DMA plan: a chunk's layer is one run (its planes adjacent on both sides); two chunks are two runs each
    per layer (the staging side holds each plane's tokens of both chunks together), and padding slots no run."""
    g = torch.Generator().manual_seed(1)
    lay, _ = _caches("LBNHC", torch.bfloat16, 1)
    chunk = random_fill_(torch.empty(lay.canonical_shape(32), dtype=lay.dtype), g)
    one = Copies(lay, path="staged")
    one.add("scatter_blocks", [3, 4], chunk)
    plan = one.plan([(i, i + 1) for i in range(lay.num_layers)], 1 << 20)
    assert plan.num_legs == lay.num_layers
    for layer in range(plan.num_legs):
        dsts, srcs, sizes = plan.runs(layer)
        assert sizes.tolist() == [chunk[0].nbytes] and dsts.tolist() == [0]
        assert srcs.tolist() == [chunk[layer].data_ptr()]
    two = Copies(lay, path="staged")
    other = random_fill_(torch.empty(lay.canonical_shape(16), dtype=lay.dtype), g)
    two.add("scatter_blocks", [3, 4], chunk)
    two.add("scatter_blocks", [7], other)
    plan = two.plan([(0, 1)], 1 << 20)
    assert plan.num_legs == 1
    sizes = plan.runs(0)[2].tolist()
    assert sizes == [chunk[0, 0].nbytes, chunk[0, 1].nbytes, other[0, 0].nbytes, other[0, 1].nbytes]
    slots = Copies(lay, path="staged")
    out = torch.empty(lay.canonical_shape(5), dtype=lay.dtype)
    slots.add("gather_slots", [3, -1, -1, 40, 41], out)
    plan = slots.plan([(0, 1)], 1 << 20)
    row = out[0, 0, 0].nbytes
    assert plan.runs(0)[2].tolist() == [row, row, 2 * row, 2 * row]  # slot 3, then 40-41, each plane; no padding


def _head_major(shape, dtype, g):
    """A canonical buffer of ``shape`` laid out head-major: ``[H, L, P, T, D]`` in memory (a connector worker's
    buffers when it holds several KV heads, :attr:`kvx.connector.cache.RegisteredKV.head_major`)."""
    L, P, T, H, D = shape
    return random_fill_(torch.empty((H, L, P, T, D), dtype=dtype), g).movedim(0, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "flash", "flashinfer"])
@pytest.mark.parametrize("impl", IMPLS)
def test_head_major_buffers_stage_head_major(impl, name, dtype):
    """Head-major host buffers (whole chunks, a partial chunk cut from one, padding slots) are staged head-major,
    bit-exact in both directions, whole layers and a capacity that splits a layer between ids."""
    impl_or_skip(impl)
    seed = case_seed("staged-head-major", impl, name, str(dtype))
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, dtype, seed)
    bs = lay.block_size

    def copies():
        whole = _head_major(lay.canonical_shape(3 * bs), dtype, g)
        return [
            ("blocks", [4, 0], _head_major(lay.canonical_shape(2 * bs), dtype, g)),
            ("blocks", [7, 2], whole.narrow(2, 0, 2 * bs)),  # a partial chunk's view of a slot
            ("slots", [11 * bs + 3, -1, 11 * bs, 10 * bs + bs - 1, -1], _head_major(lay.canonical_shape(5), dtype, g)),
        ]

    for cap in (1 << 20, lay.num_planes * bs * lay.num_heads * lay.row_bytes):
        plan = _check_gathers(lay, ref, copies(), "staged", impl, _ranges(lay.num_layers), cap)
        assert all(launch["head_major"] for k in range(plan.num_legs) for launch in plan.launches(k))
        _check_scatters(lay, ref, copies(), "staged", impl, _ranges(lay.num_layers), cap)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "page-major"])
@pytest.mark.parametrize("name", ["LBHNC", "BLHNC", "cpu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_raw_pages_split_by_head_on_every_path(impl, name, head_major, path):
    """Raw pages seen split by head, ``[L, S, n, H, run]`` (head-major in memory: a connector worker's buffers when it
    holds several KV heads of a head-major page layout), bit-exact on every path in both directions, whole layers
    and a capacity of one page of one layer; staged head-major when the buffers are."""
    impl_or_skip(impl)
    seed = case_seed("staged-pages-by-head", impl, name, head_major, path)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, torch.bfloat16, seed)

    def buf(n):
        L, S, _, H, run = shape = lay.page_heads_shape(n)
        if head_major:
            return random_fill_(torch.empty((H, L, S, n, run), dtype=torch.uint8), g).movedim(0, 3)
        return random_fill_(torch.empty(shape, dtype=torch.uint8), g)

    def copies():
        return [("pages", [1, 8, 3], buf(3)), ("pages", [5, 0], buf(4).narrow(2, 1, 2))]  # a chunk, a slot's part

    for cap in (1 << 20, lay.page.page_bytes):
        plan = _check_gathers(lay, ref, copies(), path, impl, _ranges(lay.num_layers), cap)
        if plan.path_name == "staged":
            launches = [launch for k in range(plan.num_legs) for launch in plan.launches(k)]
            assert all(launch["row_bytes"] == lay.page_head_bytes for launch in launches)  # split by head
            assert all(launch["head_major"] == head_major for launch in launches)
        _check_scatters(lay, ref, copies(), path, impl, _ranges(lay.num_layers), cap)


def test_a_head_major_chunk_layer_is_one_run_per_head():
    """A head-major chunk's layer crosses as one run per KV head (its planes adjacent on both sides), and a mix of
    head-major and token-major buffers in one op is staged token-major, still bit-exact."""
    g = torch.Generator().manual_seed(2)
    lay, ref = _caches("LBNHC", torch.bfloat16, 2)
    chunk = _head_major(lay.canonical_shape(32), lay.dtype, g)
    batch = Copies(lay, path="staged")
    batch.add("scatter_blocks", [3, 4], chunk)
    plan = batch.plan([(i, i + 1) for i in range(lay.num_layers)], 1 << 20)
    for layer in range(plan.num_legs):
        dsts, srcs, sizes = plan.runs(layer)
        head = chunk[layer, :, :, 0].nbytes  # [P, T, D]
        assert sizes.tolist() == [head] * lay.num_heads and dsts.tolist() == [h * head for h in range(lay.num_heads)]
        assert srcs.tolist() == [chunk[layer, 0, 0, h].data_ptr() for h in range(lay.num_heads)]
    mixed = [
        ("blocks", [3, 4], chunk),
        ("blocks", [7], random_fill_(torch.empty(lay.canonical_shape(16), dtype=lay.dtype), g)),
    ]
    plan = _check_scatters(lay, ref, mixed, "staged", "cpu", [(0, lay.num_layers)], 1 << 20)
    assert not any(launch["head_major"] for launch in plan.launches(0))


def test_auto_takes_dma_for_large_pieces_and_staged_for_rows(monkeypatch):
    """Path "auto" on a CPU cache: DMA straight into the blocks from CPU_DMA_MIN_BYTES (or the variable)."""
    from kvx.kernels import dma

    monkeypatch.delenv(dma.H2D_ENV, raising=False)
    g = torch.Generator().manual_seed(2)
    lay, _ = _caches("LBNHC", torch.bfloat16, 2)
    pages = Copies(lay, path="auto")
    pages.add("gather_pages", [1, 5], torch.empty(lay.page_shape(2), dtype=torch.uint8))
    rows = Copies(lay, path="auto")
    rows.add("gather_blocks", [1, 5], random_fill_(torch.empty(lay.canonical_shape(32), dtype=lay.dtype), g))
    cap = 1 << 20
    assert pages.plan(capacity=cap).path_name == rows.plan(capacity=cap).path_name == "staged"  # 640 B < 64 KiB
    monkeypatch.setenv(dma.H2D_ENV, str(lay.page.page_bytes))
    assert pages.plan(capacity=cap).path_name == "dma"


def test_bad_batches_are_refused():
    lay, _ = _caches("LBNHC", torch.bfloat16, 3)
    buf = torch.empty(lay.canonical_shape(16), dtype=lay.dtype)
    with pytest.raises(
        ValueError, match=r"path: expected one of \('kernel', 'dma', 'staged', 'auto'\) or None, got 'x'"
    ):
        Copies(lay, path="x")
    batch = Copies(lay, path="staged")
    batch.add("gather_blocks", [1], buf)
    with pytest.raises(ValueError, match="op: expected gathers only .one direction per batch., got scatter_blocks"):
        batch.add("scatter_blocks", [2], buf)
    with pytest.raises(ValueError, match="capacity: expected the staging buffer's bytes for path 'staged'"):
        batch.plan()
    with pytest.raises(ValueError, match=r"capacity: expected at least 640 bytes \(one block of one layer"):
        batch.plan(capacity=639)
    with pytest.raises(ValueError, match=r"ranges: expected \(start, end\) with 0 <= start < end <= 3, got \(2, 5\)"):
        batch.plan([(2, 5)], 1 << 20)
    plan = batch.plan(capacity=1 << 20)
    (leg,) = plan.legs()
    with pytest.raises(ValueError, match=f"staging: expected at least {leg.nbytes} bytes for this leg, got 64"):
        plan.dma(0, torch.empty(64, dtype=torch.uint8))
    scatter = Copies(lay)
    scatter.add("scatter_blocks", [1, 2], torch.empty(lay.canonical_shape(32), dtype=lay.dtype))
    with pytest.raises(ValueError, match=r"block_ids: expected blocks and slots no earlier scatter .* got \[2\]"):
        scatter.add("scatter_blocks", [2], buf)


# ------------------------------------------------------------------------------ GPU twins
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", LAYOUTS)
def test_gpu_batch_matches_each_op_alone(name, dtype, path):
    seed = case_seed("staged-gpu", name, str(dtype), path)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, dtype, seed, device="cuda")
    for cap in (1 << 20, lay.num_planes * lay.block_size * lay.num_heads * lay.row_bytes):
        outs = _copies(lay, g, pinned=True)
        expected = [buf.cuda() for _, _, buf in outs]
        batch = Copies(lay, path=path, impl="cuda")
        for kind, ids, out in outs:
            batch.add(f"gather_{kind}", ids, out)
        staging = torch.empty(cap, dtype=torch.uint8, device="cuda")
        _run(batch.plan(_ranges(lay.num_layers), cap), staging)
        for (kind, ids, _), exp in zip(outs, expected):
            getattr(ops, f"gather_{kind}")(ref, ids, exp, impl="reference")
        torch.cuda.synchronize()
        for (_, _, out), exp in zip(outs, expected):
            assert_same_bytes(out.cuda(), exp)
        srcs = _copies(lay, g, pinned=True)
        batch = Copies(lay, path=path, impl="cuda")
        for kind, ids, src in srcs:
            batch.add(f"scatter_{kind}", ids, src)
        _run(batch.plan(_ranges(lay.num_layers), cap), staging)
        for kind, ids, src in srcs:
            getattr(ops, f"scatter_{kind}")(ref, ids, src.cuda(), impl="reference")
        torch.cuda.synchronize()
        assert_all_same_bytes(lay.layers, ref.layers)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "page-major"])
@pytest.mark.parametrize("name", ["LBHNC", "BLHNC"])
def test_gpu_raw_pages_split_by_head_on_every_path(name, head_major, path):
    """Raw pages split by head between a CUDA cache and pinned buffers, on every path, bit-exact both ways."""
    seed = case_seed("staged-gpu-pages-by-head", name, head_major, path)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, torch.bfloat16, seed, device="cuda")
    ids = [1, 8, 3]
    L, S, n, H, run = lay.page_heads_shape(len(ids))

    def pinned():
        if head_major:
            t = torch.empty((H, L, S, n, run), dtype=torch.uint8, pin_memory=True).movedim(0, 3)
        else:
            t = torch.empty((L, S, n, H, run), dtype=torch.uint8, pin_memory=True)
        return random_fill_(t, g)

    for cap in (1 << 20, lay.page.page_bytes):
        staging = torch.empty(cap, dtype=torch.uint8, device="cuda")
        out = pinned()
        batch = Copies(lay, path=path, impl="cuda")
        batch.add("gather_pages", ids, out)
        _run(batch.plan(_ranges(lay.num_layers), cap), staging)
        torch.cuda.synchronize()
        assert_same_bytes(out.contiguous().flatten(-2).cuda(), ops.gather_pages(ref, ids, impl="reference"))
        src = pinned()
        batch = Copies(lay, path=path, impl="cuda")
        batch.add("scatter_pages", ids, src)
        _run(batch.plan(_ranges(lay.num_layers), cap), staging)
        ops.scatter_pages(ref, ids, src.contiguous().flatten(-2).cuda(), impl="reference")
        torch.cuda.synchronize()
        assert_all_same_bytes(lay.layers, ref.layers)
