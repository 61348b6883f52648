"""``kvx.kernels.plan.Copies`` on path ``kernel``: copies checked once, planned by layer range and run range by
range, bit-exact against the reference running each op alone over every layer."""

import re

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.layout import KVLayout, Op
from kvx.kernels.plan import Copies
from kvx.testing import make_kv_caches, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip

IMPLS = ["reference", "cpu", "triton", "cuda_sim"]  # cuda_sim's GPU twin: test_gpu_batch_by_layer_ranges
DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.uint8]
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "flash", "flashinfer", "mla"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


def _caches(name, dtype, seed, device="cpu", layers=3, blocks=12, block_size=16):
    geom = dict(
        num_layers=layers,
        num_blocks=blocks,
        block_size=block_size,
        num_heads=1 if name == "mla" else 2,
        head_size=40 if name == "mla" else 5,
    )
    a = make_kv_caches(name, **geom, dtype=dtype, device=device, generator=torch.Generator().manual_seed(seed))
    b = make_kv_caches(name, **geom, dtype=dtype, device=device, generator=torch.Generator().manual_seed(seed))
    return KVLayout.from_tensors(a, name), KVLayout.from_tensors(b, name)


def _copies(lay, g, device, pinned=False):
    """(op, ids, buffer) of a step's worth of copies: chunks of several sizes, a strided chunk cut from a
    pool, padding slots, raw pages; the scatters write distinct blocks, the last block by slots."""
    bs = lay.block_size

    def buf(shape, dtype):
        t = random_fill_(torch.empty(shape, dtype=dtype), g)
        return t.pin_memory() if pinned else t.to(device)

    pool = buf((2, lay.num_planes, lay.num_layers, 3 * bs, lay.num_heads, lay.head_size), lay.dtype)
    out = [
        ("blocks", [4, 0], buf(lay.canonical_shape(2 * bs), lay.dtype)),
        ("blocks", [7, 2, 9], pool[1].transpose(0, 1)),  # strided: a pool slot
        ("blocks", [5], buf(lay.canonical_shape(bs), lay.dtype)),
        ("slots", [11 * bs + 3, -1, 11 * bs, 10 * bs + bs - 1, -1], buf(lay.canonical_shape(5), lay.dtype)),
    ]
    if lay.page is not None:
        out.append(("pages", [1, 8], buf(lay.page_shape(2), torch.uint8)))
    return out


def _ranges(num_layers):
    return [(0, num_layers)] if num_layers == 1 else [(0, 1), (1, num_layers)]


def _batch_of(lay, impl=None):
    return Copies(lay, impl=impl, path="kernel")


def _run_by_ranges(batch, ranges):
    """Plan ``batch`` by ``ranges`` and run them one after another, as a layer-wise pipeline issues them."""
    plan = batch.plan(ranges)
    for r in range(len(ranges)):
        lo, hi = plan.range_legs(r)
        plan.run(None, None, lo, hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_batch_by_layer_ranges_matches_each_op_alone(impl, name, dtype):
    impl_or_skip(impl)
    seed = case_seed("batch", impl, name, str(dtype))
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, dtype, seed)
    copies = _copies(lay, g, "cpu")
    # gathers: into buffers filled with noise, so a row the batch misses shows
    outs = [buf.clone() for _, _, buf in copies]
    expected = [buf.clone() for _, _, buf in copies]
    batch = _batch_of(lay, impl)
    for (kind, ids, _), out in zip(copies, outs):
        batch.add(f"gather_{kind}", ids, out)
    _run_by_ranges(batch, _ranges(lay.num_layers))
    for (kind, ids, _), exp in zip(copies, expected):
        getattr(ops, f"gather_{kind}")(ref, ids, exp, impl="reference")
    for out, exp in zip(outs, expected):
        assert_same_bytes(out, exp)
    # scatters (pages and whole blocks of different kinds land on distinct blocks)
    _check_scatters(lay, ref, copies, impl)


def _check_scatters(lay, ref, copies, impl):
    """Every scatter of ``copies`` in one batch of ``impl``, run by layer ranges, against each op alone on
    the reference's copy of the cache."""
    batch = _batch_of(lay, impl)
    for kind, ids, src in copies:
        batch.add(f"scatter_{kind}", ids, src)
    _run_by_ranges(batch, _ranges(lay.num_layers))
    for kind, ids, src in copies:
        getattr(ops, f"scatter_{kind}")(ref, ids, src.to(ref.device), impl="reference")
    if lay.device.type == "cuda":
        torch.cuda.synchronize()
    assert_all_same_bytes(lay.layers, ref.layers)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_layout_pages_batch(impl):
    """vLLM's CPU backend (opaque pages): the worker's per-layer page loads."""
    impl_or_skip(impl)
    g = torch.Generator().manual_seed(9)
    lay, ref = _caches("cpu", torch.bfloat16, 9, layers=4)
    srcs = [
        (ids, random_fill_(torch.empty(lay.page_shape(len(ids)), dtype=torch.uint8), g))
        for ids in ([3, 1], [0], [11, 6, 7])
    ]
    batch = _batch_of(lay, impl)
    for ids, src in srcs:
        batch.add("scatter_pages", ids, src)
    _run_by_ranges(batch, [(layer, layer + 1) for layer in range(lay.num_layers)])
    for ids, src in srcs:
        ops.scatter_pages(ref, ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


def test_an_op_is_named_once():
    """An op's one encoding is :class:`Op`: its value names the op's function (and the oracle's), ``add`` takes it or
    that name, and the extension's integers are derived from it."""
    assert [op.value for op in Op] == [
        "gather_blocks",
        "scatter_blocks",
        "gather_slots",
        "scatter_slots",
        "gather_pages",
        "scatter_pages",
    ]
    assert all(callable(getattr(ops, op.value)) for op in Op)
    assert [(op.c_mode, op.c_direction) for op in Op] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert [op.id_name for op in Op if op.slots] == ["slot_ids", "slot_ids"]
    g = torch.Generator().manual_seed(5)
    lay, ref = _caches("LBNHC", torch.float16, 5)
    src = random_fill_(torch.empty(lay.canonical_shape(2 * lay.block_size), dtype=lay.dtype), g)
    batch = _batch_of(lay, "reference")
    batch.add(Op.SCATTER_BLOCKS, [4, 2], src)
    batch.add("scatter_blocks", [5], src[:, :, : lay.block_size])
    assert len(batch) == 2
    batch.plan().run()
    ops.scatter_blocks(ref, [4, 2], src, impl="reference")
    ops.scatter_blocks(ref, [5], src[:, :, : lay.block_size], impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)
    out = _batch_of(lay, "reference")
    got = out.add("gather_blocks", [4, 2])  # a gather's buffer, allocated
    out.plan().run()
    assert_same_bytes(got, src)
    with pytest.raises(ValueError, match=r"op: expected scatters only \(one direction per batch\), got gather_blocks"):
        batch.add("gather_blocks", [4], torch.empty_like(src[:, :, : lay.block_size]))


def test_run_touches_only_its_layers():
    g = torch.Generator().manual_seed(4)
    lay, _ = _caches("LBNHC", torch.float16, 4)
    before = [t.clone() for t in lay.layers]
    src = random_fill_(torch.empty(lay.canonical_shape(2 * lay.block_size), dtype=lay.dtype), g)
    batch = _batch_of(lay)
    batch.add("scatter_blocks", [3, 6], src)
    batch.plan([(1, 2)]).run()
    assert_same_bytes(lay.layers[0], before[0])
    assert_same_bytes(lay.layers[2], before[2])
    assert_same_bytes(ops.gather_blocks(lay, [3, 6])[1], src[1])


def test_layer_range_is_one_object_per_range():
    lay, _ = _caches("flash", torch.bfloat16, 1, layers=4)
    sub = lay.layer_range(1, 3)
    assert sub is lay.layer_range(1, 3) and lay.layer_range(0, 4) is lay
    assert sub.num_layers == 2 and sub.layers == lay.layers[1:3] and sub.layer_names == lay.layer_names[1:3]
    with pytest.raises(ValueError, match=r"start, end: expected 0 <= start < end <= 4, got 2, 2"):
        lay.layer_range(2, 2)


# ------------------------------------------------------------------------------------------ bad input
def _batch():
    lay, _ = _caches("LBNHC", torch.bfloat16, 2)
    return lay, _batch_of(lay)


def test_bad_op_name():
    _, batch = _batch()
    with pytest.raises(ValueError, match=r"op: expected one of \('gather_blocks'.*got 'scatter'"):
        batch.add("scatter", [0], torch.empty(0))


def test_bad_layout():
    with pytest.raises(TypeError, match="layout: expected a kvx.kernels.layout.KVLayout, got Tensor"):
        Copies(torch.empty(1))


def test_missing_buffer():
    _, batch = _batch()
    with pytest.raises(TypeError, match="src: expected a tensor to scatter, got None"):
        batch.add("scatter_blocks", [0], None)


def test_add_checks_as_the_op_does():
    lay, batch = _batch()
    with pytest.raises(ValueError, match=r"block_ids: expected block ids in \[0, 12\), got max 12"):
        batch.add("scatter_blocks", [12], torch.empty(lay.canonical_shape(16), dtype=lay.dtype))
    with pytest.raises(ValueError, match=r"src: expected shape"):
        batch.add("scatter_blocks", [1], torch.empty(lay.canonical_shape(8), dtype=lay.dtype))
    assert len(batch) == 0


@pytest.mark.parametrize(
    "first,second,clash",
    [
        (("scatter_blocks", [2, 5]), ("scatter_blocks", [7, 5]), "[5]"),
        (("scatter_blocks", [2]), ("scatter_slots", [2 * 16 + 3]), "[2]"),
        (("scatter_slots", [4 * 16 + 1]), ("scatter_blocks", [4]), "[4]"),
        (("scatter_slots", [4 * 16 + 1, -1]), ("scatter_slots", [-1, 4 * 16 + 1]), "[65]"),
    ],
    ids=["blocks", "slot-in-block", "block-of-slot", "slots"],
)
def test_scatters_of_a_batch_must_not_overlap(first, second, clash):
    lay, batch = _batch()

    def src(op, ids):
        n = len(ids) * lay.block_size if op == "scatter_blocks" else len(ids)
        return torch.zeros(lay.canonical_shape(n), dtype=lay.dtype)

    batch.add(first[0], first[1], src(*first))
    with pytest.raises(
        ValueError,
        match=rf"expected blocks and slots no earlier scatter of this batch writes.*"
        rf"got {re.escape(clash)} again",
    ):
        batch.add(second[0], second[1], src(*second))
    batch.add("scatter_slots", [4 * 16 + 2], src("scatter_slots", [0]))  # another slot of a slot's block: fine


def test_gathers_may_overlap():
    lay, batch = _batch()
    out = [torch.empty(lay.canonical_shape(16), dtype=lay.dtype) for _ in range(2)]
    batch.add("gather_blocks", [3], out[0])
    batch.add("gather_blocks", [3], out[1])
    batch.plan().run()
    assert_same_bytes(out[0], out[1])


@pytest.mark.parametrize("start,end", [(-1, 1), (2, 1), (0, 4), (1, 1), (0.0, 1)])
def test_bad_layer_range(start, end):
    lay, batch = _batch()
    batch.add("gather_blocks", [3])
    with pytest.raises(
        ValueError, match=rf"ranges: expected \(start, end\) with 0 <= start < end <= 3, got \({start}, {end}\)"
    ):
        batch.plan([(start, end)])


# ------------------------------------------------------------------------------------------ GPU
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("pinned", [False, True], ids=["hbm", "pinned"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_gpu_batch_by_layer_ranges(impl, pinned, name):
    impl_or_skip(impl, "cuda")
    seed = case_seed("gpu-batch", impl, name, pinned)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, torch.bfloat16, seed, device="cuda")
    _check_scatters(lay, ref, _copies(lay, g, "cuda", pinned=pinned), impl)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("pinned", [False, True], ids=["hbm", "pinned"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_gpu_batch_gathers_by_layer_ranges(impl, pinned, name):
    """The gather half of test_batch_by_layer_ranges_matches_each_op_alone on a GPU (its twin for cuda_sim)."""
    impl_or_skip(impl, "cuda")
    seed = case_seed("gpu-batch-gather", impl, name, pinned)
    g = torch.Generator().manual_seed(seed)
    lay, ref = _caches(name, torch.bfloat16, seed, device="cuda")
    copies = _copies(lay, g, "cuda", pinned=pinned)
    outs = [buf.clone().pin_memory() if pinned else buf.clone() for _, _, buf in copies]
    expected = [buf.to("cuda", copy=True) for _, _, buf in copies]
    batch = _batch_of(lay, impl)
    for (kind, ids, _), out in zip(copies, outs):
        batch.add(f"gather_{kind}", ids, out)
    _run_by_ranges(batch, _ranges(lay.num_layers))
    for (kind, ids, _), exp in zip(copies, expected):
        getattr(ops, f"gather_{kind}")(ref, ids, exp, impl="reference")
    torch.cuda.synchronize()
    for out, exp in zip(outs, expected):
        assert_same_bytes(out.to("cuda"), exp)
