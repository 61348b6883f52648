"""Every copy implementation, bit-exact against the pure-torch reference, for every layout."""

import itertools

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.layout import LAYOUTS, KVLayout
from kvx.testing import make_kv_caches, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip, two_layouts

# Module-level parameter lists (stacked with parametrize).
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# Every KV cache dtype vLLM allocates: the model dtypes, float8 (kv_cache_dtype "fp8_inc", and what a
# uint8 fp8 cache holds) and uint8 (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" are stored as uint8).
VLLM_DTYPES = [torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES, torch.uint8]
BLOCK_SIZES = [16, 32, 128]
HEAD_SIZES = [64, 5]  # an odd head size exercises the 1- and 2-byte copy widths
MLA_HEAD_SIZES = [576, 5]
TOKEN_LAYOUTS = [name for name in LAYOUTS if name != "cpu"]  # the CPU backend's pages are opaque
# compared with "reference"; "cuda_sim" is the CUDA kernel's own source emulated on CPU (its twin on a GPU is
# impl "cuda" in test_gpu_matches_reference below, on the same CASES)
IMPLS = ["cpu", "triton", "cuda_sim"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")
GPU_IMPLS = ["cuda", "triton"]


def _geometry(layout, block_size, head_size, seed):
    g = torch.Generator().manual_seed(seed)
    heads = 1 if layout == "mla" else int(torch.randint(1, 4, (1,), generator=g))
    num_blocks = int(torch.randint(5, 9, (1,), generator=g))
    return dict(
        num_layers=int(torch.randint(1, 4, (1,), generator=g)),
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
    ), g


def _cases(head_sizes_for):
    for name, dtype, bs in itertools.product(TOKEN_LAYOUTS, DTYPES, BLOCK_SIZES):
        for hs in head_sizes_for(name):
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")


CASES = list(_cases(lambda name: MLA_HEAD_SIZES if name == "mla" else HEAD_SIZES))


def _fp8_cases():
    """float8 on every layout and head size; one block size per layout, in turn (the kernels move bytes, so
    a float8 copy runs the 1-byte uint8 code, which CASES covers at every block size)."""
    for i, (name, dtype) in enumerate(itertools.product(TOKEN_LAYOUTS, FP8_DTYPES)):
        bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        for hs in MLA_HEAD_SIZES if name == "mla" else HEAD_SIZES:
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")


FP8_CASES = list(_fp8_cases())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES + FP8_CASES)
def test_blocks(impl, name, dtype, block_size, head_size):
    impl_or_skip(impl)
    seed = case_seed(name, str(dtype), block_size, head_size)
    geom, g = _geometry(name, block_size, head_size, seed)
    padded = bool(seed % 2)
    lay, ref = two_layouts(name, geom, dtype, padded, seed)
    n = int(torch.randint(1, geom["num_blocks"], (1,), generator=g))
    ids = torch.randperm(geom["num_blocks"], generator=g)[:n]
    # gather: duplicates are fine when reading; the output is poisoned first
    gids = torch.cat([ids, ids[:1]])
    shape = lay.canonical_shape(len(gids) * block_size)
    out = random_fill_(torch.empty(shape, dtype=dtype), g)
    expected = out.clone()
    ops.gather_blocks(lay, gids, out, impl=impl)
    ops.gather_blocks(ref, gids, expected, impl="reference")
    assert_same_bytes(out, expected)
    # scatter new data into distinct blocks; untouched blocks stay as they were
    src = random_fill_(torch.empty(lay.canonical_shape(n * block_size), dtype=dtype), g)
    ops.scatter_blocks(lay, ids, src, impl=impl)
    ops.scatter_blocks(ref, ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES + FP8_CASES)
def test_slots(impl, name, dtype, block_size, head_size):
    impl_or_skip(impl)
    seed = case_seed("slots", name, str(dtype), block_size, head_size)
    geom, g = _geometry(name, block_size, head_size, seed)
    lay, ref = two_layouts(name, geom, dtype, bool(seed % 2), seed)
    num_slots = geom["num_blocks"] * block_size
    n = int(torch.randint(1, 40, (1,), generator=g))
    slots = torch.randperm(num_slots, generator=g)[: 2 * n]
    slots[torch.rand(slots.shape, generator=g) < 0.25] = -1  # padding slots
    slots = slots[::2]  # a non-contiguous ids tensor
    out = random_fill_(torch.empty(lay.canonical_shape(len(slots)), dtype=dtype), g)
    expected = out.clone()
    ops.gather_slots(lay, slots, out, impl=impl)
    ops.gather_slots(ref, slots, expected, impl="reference")
    assert_same_bytes(out, expected)  # padding rows keep the poison
    src = random_fill_(torch.empty_like(out), g)
    ops.scatter_slots(lay, slots, src, impl=impl)
    ops.scatter_slots(ref, slots, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


PAGE_CASES = [
    pytest.param(name, dtype, bs, id=f"{name}-{str(dtype)[6:]}-bs{bs}")
    for name, dtype, bs in itertools.product(LAYOUTS, [torch.bfloat16, torch.uint8], BLOCK_SIZES)
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,dtype,block_size", PAGE_CASES)
def test_pages(impl, name, dtype, block_size):
    impl_or_skip(impl)
    seed = case_seed("pages", name, str(dtype), block_size)
    geom, g = _geometry(name, block_size, 576 if name == "mla" else 64, seed)
    # padding inside rows breaks the page into many runs; padding between blocks (flashinfer) does not
    lay, ref = two_layouts(name, geom, dtype, name == "flashinfer", seed)
    ids = torch.randperm(geom["num_blocks"], generator=g)[:3]
    out = random_fill_(torch.empty(lay.page_shape(3), dtype=torch.uint8), g)
    expected = out.clone()
    ops.gather_pages(lay, ids, out, impl=impl)
    ops.gather_pages(ref, ids, expected, impl="reference")
    assert_same_bytes(out, expected)
    src = random_fill_(torch.empty_like(out), g)
    ops.scatter_pages(lay, ids, src, impl=impl)
    ops.scatter_pages(ref, ids, src, impl="reference")
    assert_all_same_bytes(lay.layers, ref.layers)


HEAD_MAJOR_PAGES = ["LBHNC", "BLHNC", "cpu"]  # layouts whose page segments hold each head's bytes as one run


def test_which_layouts_pages_split_by_head():
    for name in LAYOUTS:
        geom = dict(num_layers=1, num_blocks=3, block_size=16, num_heads=1 if name == "mla" else 3, head_size=8)
        lay = KVLayout.from_tensors(make_kv_caches(name, **geom, dtype=torch.bfloat16), name)
        run = lay.page_head_bytes
        assert (run is not None) == (name in HEAD_MAJOR_PAGES), (name, run)
        if run is not None:
            assert run * 3 == lay.page.segment_bytes and lay.page_heads_shape(2) == (1, 1, 2, 3, run)
        else:
            with pytest.raises(ValueError, match="cannot be split by head"):
                lay.page_heads_shape(2)


PAGES_BY_HEAD = [
    pytest.param(name, dtype, bs, id=f"{name}-{str(dtype)[6:]}-bs{bs}")
    for name, dtype, bs in itertools.product(HEAD_MAJOR_PAGES, [torch.bfloat16, torch.float8_e4m3fn], [16, 128])
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("name,dtype,block_size", PAGES_BY_HEAD)
def test_pages_split_by_head(impl, head_major, name, dtype, block_size):
    """A raw-page chunk seen as ``[L, S, n, H, run]``: the same bytes as ``[L, S, n, segment_bytes]``, each head's
    runs wherever its buffer puts them (head-major: ``[H, L, S, n, run]`` in memory, one run per head)."""
    impl_or_skip(impl)
    _pages_by_head_case(impl, head_major, name, dtype, block_size, "cpu")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("name,dtype,block_size", PAGES_BY_HEAD)
def test_gpu_pages_split_by_head(impl, head_major, name, dtype, block_size):
    """The same on a CUDA cache, the host side in pinned memory (the kernel reads and writes it over UVA)."""
    impl_or_skip(impl, "cuda")
    _pages_by_head_case(impl, head_major, name, dtype, block_size, "cuda")


def _pages_by_head_case(impl, head_major, name, dtype, block_size, device):
    seed = case_seed("pages-heads", name, str(dtype), block_size, head_major)
    g = torch.Generator().manual_seed(seed)
    geom = dict(
        num_layers=3, num_blocks=7, block_size=block_size, num_heads=int(torch.randint(2, 5, (1,), generator=g))
    )
    geom["head_size"] = 64 if name != "cpu" else 32
    lay, ref = two_layouts(name, geom, dtype, False, seed, device=device)
    ids = torch.randperm(geom["num_blocks"], generator=g)[:5]
    shape = lay.page_heads_shape(5)
    pin = device == "cuda"

    def host() -> torch.Tensor:  # pinned on a CUDA cache (torch.empty_like does not keep pinning)
        if head_major:
            return torch.empty((shape[3], *shape[:3], shape[4]), dtype=torch.uint8, pin_memory=pin).movedim(0, 3)
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin)

    out = random_fill_(host(), g)
    ops.gather_pages(lay, ids, out, impl=impl)
    if device == "cuda":
        torch.cuda.synchronize()
    expected = ops.gather_pages(ref, ids, impl="reference").cpu()  # [L, S, n, segment_bytes]
    assert_same_bytes(out.contiguous().flatten(-2), expected)
    src = random_fill_(host(), g)  # same strides as out
    ops.scatter_pages(lay, ids, src, impl=impl)
    ops.scatter_pages(ref, ids, src.contiguous().flatten(-2).to(device), impl="reference")
    if device == "cuda":
        torch.cuda.synchronize()
    assert_all_same_bytes(lay.layers, ref.layers)
    back = ops.gather_pages(ref, ids, host(), impl="reference")  # the reference's own 5-D path
    assert_same_bytes(back.contiguous(), src.contiguous())


def clobber(lay, ids):
    for l in range(lay.num_layers):
        for plane in lay.plane_views(l):
            plane[ids] = 0


@pytest.mark.parametrize("impl", ["reference"] + IMPLS)
@pytest.mark.parametrize("name", TOKEN_LAYOUTS)
def test_round_trip_restores_touched_blocks_only(impl, name):
    impl_or_skip(impl)
    _round_trip_case(impl, name)


def _round_trip_case(impl, name, device="cpu"):
    g = torch.Generator().manual_seed(7)
    lay = KVLayout.from_tensors(
        make_kv_caches(
            name,
            num_layers=2,
            num_blocks=9,
            block_size=16,
            num_heads=1 if name == "mla" else 2,
            head_size=24,
            dtype=torch.bfloat16,
            device=device,
            generator=g,
        ),
        name,
    )
    before = [t.clone() for t in lay.layers]
    ids = [6, 1, 4]
    chunk = ops.gather_blocks(lay, ids, impl=impl)
    clobber(lay, ids)
    ops.scatter_blocks(lay, ids, chunk, impl=impl)
    assert_all_same_bytes(lay.layers, before)
    pages = ops.gather_pages(lay, ids, impl=impl)
    clobber(lay, ids)
    ops.scatter_pages(lay, ids, pages, impl=impl)
    assert_all_same_bytes(lay.layers, before)


@pytest.mark.parametrize("impl", ["reference"] + IMPLS)
def test_canonical_chunk_moves_between_layouts_and_block_sizes(impl):
    """A chunk gathered from one layout and block size scatters into another and reads back the same."""
    impl_or_skip(impl)
    _chunk_between_layouts_case(impl)


def _chunk_between_layouts_case(impl, device="cpu"):
    g = torch.Generator().manual_seed(3)
    src = KVLayout.from_tensors(
        make_kv_caches(
            "LBNHC",
            num_layers=2,
            num_blocks=4,
            block_size=32,
            num_heads=2,
            head_size=8,
            dtype=torch.float16,
            device=device,
            generator=g,
        ),
        "LBNHC",
    )
    dst = KVLayout.from_tensors(
        make_kv_caches(
            "flash",
            num_layers=2,
            num_blocks=9,
            block_size=16,
            num_heads=2,
            head_size=8,
            dtype=torch.float16,
            device=device,
            generator=g,
        ),
        "flash",
    )
    chunk = ops.gather_blocks(src, [2, 0], impl=impl)  # 64 tokens
    ops.scatter_blocks(dst, [5, 1, 8, 3], chunk, impl=impl)  # 4 blocks of 16
    assert_same_bytes(ops.gather_blocks(dst, [5, 1, 8, 3], impl=impl), chunk)
    # token (b, t) of the source equals the token it landed on
    k_src, k_dst = src.plane_views(1)[0], dst.plane_views(1)[0]
    for b, t in [(2, 0), (2, 31), (0, 5)]:
        tok = (0 if b == 2 else 32) + t
        db, dt = [5, 1, 8, 3][tok // 16], tok % 16
        assert_same_bytes(k_src[b, t], k_dst[db, dt])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("impl", ["reference"] + IMPLS)
def test_strided_contiguous_side(impl, dtype):
    """The contiguous side may be a strided view (e.g. a slot of a larger pool, layers permuted)."""
    impl_or_skip(impl)
    _strided_contiguous_side_case(impl, dtype)


def _strided_contiguous_side_case(impl, dtype, device="cpu"):
    g = torch.Generator().manual_seed(11)
    lay = KVLayout.from_tensors(
        make_kv_caches(
            "LBHNC",
            num_layers=3,
            num_blocks=6,
            block_size=16,
            num_heads=2,
            head_size=16,
            dtype=dtype,
            device=device,
            generator=g,
        ),
        "LBHNC",
    )
    pool = random_fill_(torch.empty(2, 2, 3, 48, 2, 16, dtype=dtype), g).to(device)  # [slot, P, L, T, H, D]
    out = pool[1].transpose(0, 1)  # [L, P, T, H, D], strided
    ops.gather_blocks(lay, [3, 0, 5], out, impl=impl)
    assert_same_bytes(out, ops.gather_blocks(lay, [3, 0, 5], impl="reference"))  # vs a contiguous chunk
    before = pool[0].clone()
    ops.gather_blocks(lay, [1, 2, 4], out, impl=impl)
    assert_same_bytes(pool[0], before)


def test_reference_matches_hand_indexing():
    """The oracle itself, against explicit loops over the vLLM 0.32 LBNHC and legacy flash layouts."""
    g = torch.Generator().manual_seed(5)
    for name in ("LBNHC", "flash", "mla"):
        H = 1 if name == "mla" else 3
        caches = make_kv_caches(
            name, num_layers=2, num_blocks=4, block_size=16, num_heads=H, head_size=4, dtype=torch.float32, generator=g
        )
        lay = KVLayout.from_tensors(caches, name)
        ids = [3, 1]
        out = ops.gather_blocks(lay, ids, impl="reference")
        for l, t in enumerate(caches):
            for i, b in enumerate(ids):
                for tok in range(16):
                    for h in range(H):
                        if name == "LBNHC":  # view [B, H, N, 2D], K = first D of the content
                            k, v = t[b, h, tok, :4], t[b, h, tok, 4:]
                        elif name == "flash":  # [2, B, N, H, D]
                            k, v = t[0, b, tok, h], t[1, b, tok, h]
                        else:  # [B, N, C]
                            k, v = t[b, tok], None
                        assert_same_bytes(out[l, 0, i * 16 + tok, h], k)
                        if v is not None:
                            assert_same_bytes(out[l, 1, i * 16 + tok, h], v)


def _hand_row(t, name, b, tok, h, p):
    """Row ``[D]`` of plane ``p``, block ``b``, token ``tok``, head ``h`` in one layer's cache tensor ``t`` as
    make_kv_caches builds it, by plain indexing (no KVLayout)."""
    if name in ("LBNHC", "LBHNC", "BLNHC", "BLHNC"):  # [B, H, N, 2D]: K is the first D of the content
        d = t.shape[-1] // 2
        return t[b, h, tok, p * d : (p + 1) * d]
    if name == "flash":  # [2, B, N, H, D]
        return t[p, b, tok, h]
    if name == "flashinfer":  # [B, 2, N, H, D]
        return t[b, p, tok, h]
    assert name == "mla" and p == 0 and h == 0  # [B, N, D]
    return t[b, tok]


def _bytes(row):
    return row.view(torch.uint8)


@pytest.mark.parametrize("dtype", VLLM_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", ["LBHNC", "BLNHC", "flash", "flashinfer", "mla"])
def test_reference_every_vllm_dtype_by_hand(name, dtype):
    """The oracle itself on every KV dtype vLLM uses (float8 included: torch has no CPU index_copy for it),
    blocks and slots, both directions, against per-row byte comparisons on padded (non-contiguous) caches."""
    g = torch.Generator().manual_seed(case_seed("by-hand", name, str(dtype)))
    N, B, H = 16, 4, 1 if name == "mla" else 2
    caches = make_kv_caches(
        name, num_layers=2, num_blocks=B, block_size=N, num_heads=H, head_size=6, dtype=dtype, padded=True, generator=g
    )
    lay = KVLayout.from_tensors(caches, name)
    P = lay.num_planes
    rows = [(l, p, h) for l in range(2) for p in range(P) for h in range(H)]

    out = ops.gather_blocks(lay, [3, 1, 3], impl="reference")
    for (l, p, h), (i, b), tok in itertools.product(rows, enumerate([3, 1, 3]), range(N)):
        assert_same_bytes(out[l, p, i * N + tok, h], _hand_row(caches[l], name, b, tok, h, p))

    slots = [5, -1, 17, 63, -1, 0, 40]
    out = random_fill_(torch.empty(lay.canonical_shape(len(slots)), dtype=dtype), g)
    poison = out.clone()
    ops.gather_slots(lay, slots, out, impl="reference")
    for (l, p, h), (i, s) in itertools.product(rows, enumerate(slots)):
        want = poison[l, p, i, h] if s < 0 else _hand_row(caches[l], name, s // N, s % N, h, p)
        assert_same_bytes(out[l, p, i, h], want)

    def expect_writes(writes):
        """The caches after ``writes`` [(layer, plane, head, block, token, row)], written by hand on copies."""
        expected = [t.clone() for t in caches]
        for l, p, h, b, tok, row in writes:
            _bytes(_hand_row(expected[l], name, b, tok, h, p)).copy_(_bytes(row))
        return expected

    src = random_fill_(torch.empty(lay.canonical_shape(len(slots)), dtype=dtype), g)
    expected = expect_writes(
        [
            (l, p, h, s // N, s % N, src[l, p, i, h])
            for (l, p, h), (i, s) in itertools.product(rows, enumerate(slots))
            if s >= 0
        ]
    )
    ops.scatter_slots(lay, slots, src, impl="reference")  # padding slots write nothing
    assert_all_same_bytes(caches, expected)

    src = random_fill_(torch.empty(lay.canonical_shape(2 * N), dtype=dtype), g)
    expected = expect_writes(
        [
            (l, p, h, b, tok, src[l, p, i * N + tok, h])
            for (l, p, h), (i, b), tok in itertools.product(rows, enumerate([2, 0]), range(N))
        ]
    )
    ops.scatter_blocks(lay, [2, 0], src, impl="reference")
    assert_all_same_bytes(caches, expected)


def test_cpu_large_copies_and_thread_counts():
    """Copies above the streaming-store threshold (16 MiB) and any thread count give the reference bytes."""
    impl_or_skip("cpu")
    g = torch.Generator().manual_seed(1)
    lay = KVLayout.from_tensors(
        make_kv_caches(
            "LBNHC",
            num_layers=4,
            num_blocks=96,
            block_size=16,
            num_heads=8,
            head_size=128,
            dtype=torch.bfloat16,
            generator=g,
        ),
        "LBNHC",
    )
    ref = KVLayout.from_tensors([t.clone() for t in lay.layers], "LBNHC")
    ids = torch.randperm(96, generator=g)[:80]  # 4 x 80 x 16 KiB x 2 planes = 21 MB
    expected = ops.gather_blocks(lay, ids, impl="reference")
    default_threads = ops.get_num_threads()
    try:
        for threads in (1, 2, 3):
            ops.set_num_threads(threads)
            assert_same_bytes(ops.gather_blocks(lay, ids, impl="cpu"), expected)
        src = random_fill_(torch.empty_like(expected), g)
        ops.scatter_blocks(lay, ids, src, impl="cpu")
        ops.scatter_blocks(ref, ids, src, impl="reference")
        assert_all_same_bytes(lay.layers, ref.layers)
        pages = ops.gather_pages(lay, ids, impl="cpu")
        assert_same_bytes(pages, ops.gather_pages(ref, ids, impl="reference"))
    finally:
        ops.set_num_threads(default_threads)


# ------------------------------------------------------------------------------------------ GPU


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("host", [False, True], ids=["hbm", "pinned"])
@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES + FP8_CASES)
def test_gpu_matches_reference(impl, host, name, dtype, block_size, head_size):
    impl_or_skip(impl, "cuda")
    seed = case_seed("gpu", name, str(dtype), block_size, head_size)
    geom, g = _geometry(name, block_size, head_size, seed)
    a = make_kv_caches(name, **geom, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(seed))
    b = make_kv_caches(name, **geom, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(seed))
    lay, ref = KVLayout.from_tensors(a, name), KVLayout.from_tensors(b, name)
    ids = torch.randperm(geom["num_blocks"], generator=g)[:3]

    def buf(shape, dt):
        t = random_fill_(torch.empty(shape, dtype=dt), g)
        return t.pin_memory() if host else t.cuda()

    for kind, n in (("blocks", 3 * block_size), ("slots", 37), ("pages", 3)):
        if kind == "pages":
            shape, dt = lay.page_shape(3), torch.uint8
        else:
            shape, dt = lay.canonical_shape(n), dtype
        idx = ids if kind != "slots" else torch.randperm(geom["num_blocks"] * block_size, generator=g)[:37]
        if kind == "slots":
            idx[::5] = -1
        gather, scatter = getattr(ops, f"gather_{kind}"), getattr(ops, f"scatter_{kind}")
        out = buf(shape, dt)
        expected = out.clone() if not host else out.cuda()
        gather(lay, idx, out, impl=impl)
        gather(ref, idx, expected, impl="reference")
        torch.cuda.synchronize()
        assert_same_bytes(out.cuda(), expected)
        src = buf(shape, dt)
        scatter(lay, idx, src, impl=impl)
        scatter(ref, idx, src.cuda(), impl="reference")
        torch.cuda.synchronize()
        assert_all_same_bytes(lay.layers, ref.layers)


# GPU twins of the CPU-only cases above (cuda_sim runs them on CPU; these run the real kernel)
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", TOKEN_LAYOUTS)
def test_gpu_round_trip_restores_touched_blocks_only(name):
    impl_or_skip("cuda", "cuda")
    _round_trip_case("cuda", name, "cuda")


@needs_cuda
@pytest.mark.gpu
def test_gpu_canonical_chunk_moves_between_layouts_and_block_sizes():
    impl_or_skip("cuda", "cuda")
    _chunk_between_layouts_case("cuda", "cuda")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=lambda d: str(d)[6:])
def test_gpu_strided_contiguous_side(dtype):
    impl_or_skip("cuda", "cuda")
    _strided_contiguous_side_case("cuda", dtype, "cuda")
