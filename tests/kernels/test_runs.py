"""The copy as runs of contiguous bytes (kv_layout.h plan_runs / for_each_run, through kvx._C.plan_runs): what
the CUDA DMA path issues, one DMA per run (copy_dma() calls the same plan_runs()).

Executed here with a plain memmove per run on CPU caches, the runs must give the reference's bytes for every
layout, op, dtype, block size and head size the kernel tests cover; they must be maximal (no run continues
the previous one on both sides), never write a byte twice, and move exactly the payload.
"""

import ctypes
import itertools

import pytest
import torch

from kvx._ext import C as _ext_C
from kvx.kernels import ops
from kvx.kernels.layout import LAYOUTS, KVLayout, Op, c_descs, copy_geometry
from kvx.testing import make_layout, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import two_layouts

_C = _ext_C  # None without the extension: then conftest.py fails every test, with the import error

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
BLOCK_SIZES = [16, 32, 128]
HEAD_SIZES = [64, 5]  # an odd head size: rows of 5 elements, nothing 16-byte aligned
MLA_HEAD_SIZES = [576, 5]
TOKEN_LAYOUTS = [name for name in LAYOUTS if name != "cpu"]  # the CPU backend's pages are opaque
_GATHER, _SCATTER = 0, 1


def _plan_runs(kind, direction, lay, ids, buf, min_run_bytes=0):
    """(dst, src, bytes) int64 tensors, or None when the runs average fewer than ``min_run_bytes``."""
    ids = torch.as_tensor(ids, dtype=torch.int64).contiguous()
    plan = copy_geometry(Op("gather_" + kind), lay, buf, ids.numel())
    runs = _C.plan_runs(
        lay.layer_ptrs().data_ptr(),
        plan.num_layers,
        ids.data_ptr(),
        plan.num_ids,
        buf.data_ptr(),
        *c_descs(plan),
        plan.row_bytes,
        plan.mode,
        direction,
        min_run_bytes,
    )
    return None if runs is None else tuple(torch.from_numpy(a) for a in runs)


def _execute(runs):
    for d, s, n in zip(*(r.tolist() for r in runs)):
        ctypes.memmove(d, s, n)


def _payload(kind, lay, ids):
    ids = torch.as_tensor(ids)
    if kind == "pages":
        return lay.num_layers * lay.page.page_bytes * ids.numel()
    tokens = ids.numel() * lay.block_size if kind == "blocks" else int((ids >= 0).sum())
    return lay.num_layers * lay.num_planes * tokens * lay.num_heads * lay.row_bytes


def _check_shape_of_runs(runs, payload):
    dst, src, nbytes = runs
    assert int(nbytes.sum()) == payload
    assert bool((nbytes > 0).all())
    # maximal: no run continues the previous one on both sides
    cont = (dst[1:] == dst[:-1] + nbytes[:-1]) & (src[1:] == src[:-1] + nbytes[:-1])
    assert not bool(cont.any()), f"runs {cont.nonzero().flatten().tolist()} could merge with the next"
    # disjoint destinations: the DMA batch may run its copies in any order
    order = torch.argsort(dst)
    d, n = dst[order], nbytes[order]
    assert bool((d[1:] >= d[:-1] + n[:-1]).all()), "two runs write the same bytes"


def _geometry(layout, block_size, head_size, seed):
    g = torch.Generator().manual_seed(seed)
    heads = 1 if layout == "mla" else int(torch.randint(1, 4, (1,), generator=g))
    return dict(
        num_layers=int(torch.randint(1, 4, (1,), generator=g)),
        num_blocks=int(torch.randint(5, 9, (1,), generator=g)),
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
    ), g


def _round_trip(kind, lay, ref, gather_ids, scatter_ids, shape_of, dtype, g):
    """Gather then scatter through the runs, against the reference on a twin cache."""
    gather_ref, scatter_ref = getattr(ops, f"gather_{kind}"), getattr(ops, f"scatter_{kind}")
    out = random_fill_(torch.empty(shape_of(len(gather_ids)), dtype=dtype), g)  # poisoned: padding rows keep it
    expected = out.clone()
    runs = _plan_runs(kind, _GATHER, lay, gather_ids, out)
    _check_shape_of_runs(runs, _payload(kind, lay, gather_ids))
    _execute(runs)
    gather_ref(ref, gather_ids, expected, impl="reference")
    assert_same_bytes(out, expected)

    src = random_fill_(torch.empty(shape_of(len(scatter_ids)), dtype=dtype), g)
    runs = _plan_runs(kind, _SCATTER, lay, scatter_ids, src)
    _check_shape_of_runs(runs, _payload(kind, lay, scatter_ids))
    _execute(runs)
    scatter_ref(ref, scatter_ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


def _cases():
    for name, dtype, bs in itertools.product(TOKEN_LAYOUTS, DTYPES, BLOCK_SIZES):
        for hs in MLA_HEAD_SIZES if name == "mla" else HEAD_SIZES:
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")
    # float8 (vLLM's fp8_inc caches) on every layout and head size, one block size per layout in turn: the
    # copy moves bytes, so it is the 1-byte uint8 case above at the other block sizes
    for i, (name, dtype) in enumerate(itertools.product(TOKEN_LAYOUTS, FP8_DTYPES)):
        bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        for hs in MLA_HEAD_SIZES if name == "mla" else HEAD_SIZES:
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")


CASES = list(_cases())


@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES)
def test_block_runs_match_reference(name, dtype, block_size, head_size):
    seed = case_seed("runs-blocks", name, str(dtype), block_size, head_size)
    geom, g = _geometry(name, block_size, head_size, seed)
    lay, ref = two_layouts(name, geom, dtype, bool(seed % 2), seed)
    B = geom["num_blocks"]
    b = int(torch.randint(0, B - 1, (1,), generator=g))  # b, b + 1: adjacent pages may merge
    others = [int(x) for x in torch.randperm(B, generator=g) if int(x) not in (b, b + 1)]
    ids = torch.tensor([b, b + 1] + others[: int(torch.randint(0, B - 1, (1,), generator=g))])
    gather_ids = torch.cat([ids, ids[:1]])  # reading a block twice is fine
    _round_trip("blocks", lay, ref, gather_ids, ids, lambda n: lay.canonical_shape(n * block_size), dtype, g)


@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES)
def test_slot_runs_match_reference(name, dtype, block_size, head_size):
    seed = case_seed("runs-slots", name, str(dtype), block_size, head_size)
    geom, g = _geometry(name, block_size, head_size, seed)
    lay, ref = two_layouts(name, geom, dtype, bool(seed % 2), seed)
    num_slots = geom["num_blocks"] * block_size
    start = int(torch.randint(0, num_slots - 8, (1,), generator=g))
    run = torch.arange(start, start + 8)  # consecutive slots: merge candidates
    rest = torch.randperm(num_slots, generator=g)
    rest = rest[(rest < start) | (rest >= start + 8)][: int(torch.randint(1, 30, (1,), generator=g))]
    slots = torch.cat([run, rest])
    slots[torch.rand(slots.shape, generator=g) < 0.25] = -1  # padding slots
    _round_trip("slots", lay, ref, slots, slots, lay.canonical_shape, dtype, g)


PAGE_CASES = [
    pytest.param(name, dtype, bs, id=f"{name}-{str(dtype)[6:]}-bs{bs}")
    for name, dtype, bs in itertools.product(LAYOUTS, [torch.bfloat16, torch.uint8], BLOCK_SIZES)
]


@pytest.mark.parametrize("name,dtype,block_size", PAGE_CASES)
def test_page_runs_match_reference(name, dtype, block_size):
    seed = case_seed("runs-pages", name, str(dtype), block_size)
    geom, g = _geometry(name, block_size, 576 if name == "mla" else 64, seed)
    lay, ref = two_layouts(name, geom, dtype, name == "flashinfer", seed)
    ids = torch.tensor([2, 3, 0])  # 2, 3 adjacent in most layouts
    _round_trip("pages", lay, ref, ids, ids, lay.page_shape, torch.uint8, g)


def test_strided_contiguous_side():
    """A strided chunk (one slot of a larger pool, layers and planes permuted) as either side."""
    g = torch.Generator().manual_seed(11)
    lay, ref = two_layouts(
        "flash", dict(num_layers=3, num_blocks=6, block_size=16, num_heads=2, head_size=16), torch.bfloat16, False, 11
    )
    pool = random_fill_(torch.empty(2, 2, 3, 48, 2, 16, dtype=torch.bfloat16), g)  # [slot, P, L, T, H, D]
    out = pool[1].transpose(0, 1)  # [L, P, T, H, D], strided
    before = pool[0].clone()
    runs = _plan_runs("blocks", _GATHER, lay, [3, 4, 1], out)
    _check_shape_of_runs(runs, _payload("blocks", lay, [3, 4, 1]))
    assert len(runs[0]) == 3 * 2 * 2  # blocks 3-4 merge in each (layer, plane); block 1 alone
    _execute(runs)
    assert_same_bytes(out, ops.gather_blocks(ref, [3, 4, 1], impl="reference"))
    assert_same_bytes(pool[0], before)
    src = random_fill_(torch.empty(3, 2, 2, 48, 2, 16, dtype=torch.bfloat16), g)[:, 1]  # [L, P, T, H, D], strided
    _execute(_plan_runs("blocks", _SCATTER, lay, [5, 0, 2], src))
    ops.scatter_blocks(ref, [5, 0, 2], src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


# ------------------------------------------------------------------------------ merging: expected counts
FLASH = dict(num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
FLASH_PAGE = 16 * 2 * 8 * 2  # one block of one plane: N * H * D * 2 bytes, contiguous in [2, B, N, H, D]


def test_whole_cache_is_one_run():
    """Every block in order, legacy flash [L][2, B, N, H, D] in one allocation, into a dense chunk: the
    cache and the chunk are the same bytes in the same order, so the copy is a single run."""
    base = torch.empty(2, 2, 8, 16, 2, 8, dtype=torch.float16)  # one allocation for both layers
    lay = KVLayout.from_tensors([random_fill_(base[l]) for l in range(2)], "flash")
    ids = list(range(8))
    out = torch.empty(lay.canonical_shape(8 * 16), dtype=torch.float16)
    dst, src, nbytes = _plan_runs("blocks", _GATHER, lay, ids, out)
    assert (len(dst), int(nbytes[0]), int(src[0]), int(dst[0])) == (
        1,
        base.numel() * 2,
        base.data_ptr(),
        out.data_ptr(),
    )
    dst, src, nbytes = _plan_runs("blocks", _SCATTER, lay, ids, out)
    assert (len(dst), int(nbytes[0]), int(dst[0]), int(src[0])) == (
        1,
        base.numel() * 2,
        base.data_ptr(),
        out.data_ptr(),
    )


def test_consecutive_blocks_merge_per_plane():
    lay = make_layout("flash", **FLASH)
    out = torch.empty(lay.canonical_shape(4 * 16), dtype=torch.float16)
    dst, src, nbytes = _plan_runs("blocks", _GATHER, lay, [1, 2, 3, 5], out)
    # per (layer, plane): blocks 1-3 as one run, block 5 alone
    assert nbytes.tolist() == [3 * FLASH_PAGE, FLASH_PAGE] * 4
    k0 = lay.plane_views(0)[0]
    assert int(src[0]) == k0[1].data_ptr() and int(dst[0]) == out.data_ptr()
    assert int(src[1]) == k0[5].data_ptr() and int(dst[1]) == out[0, 0, 48].data_ptr()


def test_raw_pages_of_consecutive_blocks_merge():
    """vLLM >= 0.32 LBNHC: a block of a layer is one page; pages of consecutive blocks are adjacent."""
    lay = make_layout("LBNHC", **FLASH)
    out = torch.empty(lay.page_shape(4), dtype=torch.uint8)
    dst, src, nbytes = _plan_runs("pages", _GATHER, lay, [4, 5, 6, 0], out)
    assert nbytes.tolist() == [3 * lay.page_bytes, lay.page_bytes] * 2


def test_packed_kv_rows_stay_separate():
    """LBNHC canonical copies: each head's K (or V) row sits between V (K) rows in the page, so no two rows
    are adjacent on the paged side: one run per row."""
    lay = make_layout("LBNHC", **FLASH)
    out = torch.empty(lay.canonical_shape(2 * 16), dtype=torch.float16)
    _, _, nbytes = _plan_runs("blocks", _GATHER, lay, [2, 3], out)
    assert nbytes.tolist() == [8 * 2] * (2 * 2 * 2 * 16 * 2)  # L * P * n * N * H rows of D * 2 bytes


def test_consecutive_slots_merge_and_padding_breaks_the_run():
    lay = make_layout("flash", **FLASH)
    slots = [33, 34, 35, -1, 36, 37, 90]
    out = torch.empty(lay.canonical_shape(len(slots)), dtype=torch.float16)
    token = 2 * 8 * 2  # H * D * 2 bytes: heads merge into one row
    _, _, nbytes = _plan_runs("slots", _GATHER, lay, slots, out)
    assert nbytes.tolist() == [3 * token, 2 * token, token] * 4
    _, _, nbytes = _plan_runs("slots", _SCATTER, lay, slots, out)
    assert nbytes.tolist() == [3 * token, 2 * token, token] * 4


def test_min_run_bytes_declines_copies_with_small_runs():
    """The DMA side of the rule: runs only when they average at least min_run_bytes."""
    lay = make_layout("flash", **FLASH)
    out = torch.empty(lay.canonical_shape(4 * 16), dtype=torch.float16)
    payload = _payload("blocks", lay, [1, 2, 3, 5])
    mean = payload // 8  # 8 runs, see above
    assert _plan_runs("blocks", _GATHER, lay, [1, 2, 3, 5], out, min_run_bytes=mean) is not None
    assert _plan_runs("blocks", _GATHER, lay, [1, 2, 3, 5], out, min_run_bytes=mean + 1) is None
    assert _plan_runs("blocks", _GATHER, lay, [1, 2, 3, 5], out, min_run_bytes=ops.DMA_NEVER) is None
    assert len(_plan_runs("blocks", _GATHER, lay, [1, 2, 3, 5], out, min_run_bytes=0)[0]) == 8


@pytest.mark.parametrize("kind", ["blocks", "slots"])
@pytest.mark.parametrize("name", TOKEN_LAYOUTS)
def test_runs_at_the_cutoff_are_executed_whole(name, kind):
    """The max_runs cutoff of plan_runs() (kv_layout.h), which copy_dma() issues from: with min_run_bytes at
    the runs' mean the copy fits and gets every run (the list without a cutoff), which executed give the
    reference's bytes, padding slots included; one byte more, or more than the payload, and nothing is
    returned (the prefix emitted before the cutoff is discarded, the kernel takes the copy)."""
    seed = case_seed("runs-cutoff", name, kind)
    geom, g = _geometry(name, 16, 5 if kind == "slots" else 64, seed)
    lay, ref = two_layouts(name, geom, torch.float16, bool(seed % 2), seed)
    if kind == "slots":
        ids = torch.randperm(geom["num_blocks"] * 16, generator=g)[:23]
        ids[::3] = -1  # padding slots
        shape_of = lay.canonical_shape
    else:
        ids = torch.tensor([4, 1, 2, 3])  # 1-3 adjacent: merged where the layout allows

        def shape_of(n):
            return lay.canonical_shape(n * 16)

    for direction in (_GATHER, _SCATTER):
        buf = random_fill_(torch.empty(shape_of(len(ids)), dtype=torch.float16), g)
        expected = buf.clone()
        full = _plan_runs(kind, direction, lay, ids, buf)
        payload = _payload(kind, lay, ids)
        mean = payload // len(full[0])
        at = _plan_runs(kind, direction, lay, ids, buf, min_run_bytes=mean)
        assert at is not None and all(torch.equal(a, b) for a, b in zip(at, full))
        assert _plan_runs(kind, direction, lay, ids, buf, min_run_bytes=mean + 1) is None
        assert _plan_runs(kind, direction, lay, ids, buf, min_run_bytes=payload + 1) is None  # max_runs = 0
        _check_shape_of_runs(at, payload)
        _execute(at)
        op = f"{'gather' if direction == _GATHER else 'scatter'}_{kind}"
        getattr(ops, op)(ref, ids, expected if direction == _GATHER else buf, impl="reference")
        if direction == _GATHER:
            assert_same_bytes(buf, expected)  # padding rows keep their poison
        assert_all_same_bytes(lay.layers, ref.layers)


def test_plan_runs_checks_direction():
    lay = make_layout("flash", **FLASH)
    out = torch.empty(lay.canonical_shape(16), dtype=torch.float16)
    with pytest.raises(ValueError, match="direction: expected 0 .gather. or 1 .scatter., got 2"):
        _plan_runs("blocks", 2, lay, [0], out)
