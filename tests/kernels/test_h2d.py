"""Host <-> device paths of impl "cuda": DMA straight into the blocks or staged (a DMA to a device buffer and the
copy kernel inside HBM), by a threshold measured on the device; the UVA copy kernel when asked for.

On CPU: the rule that draws the threshold from timings (made-up ones here), the environment override, the CPU
threshold. On a GPU: every path bit-exact against the reference for every layout, both directions, pinned host
and device memory, padding slots; the paths giving the same bytes; the calibration; which path a call takes.
(The staged and DMA paths' CPU twins, the same run lists and reshape views, are tests/kernels/test_staged.py.)
"""

import itertools
import math

import pytest
import torch

from kvx import _ext
from kvx.kernels import check, ops
from kvx.kernels import dma as h2d
from kvx.kernels.layout import LAYOUTS
from kvx.kernels.plan import Copies
from kvx.kernels.streams import torch_stream
from kvx.testing import make_layout, random_fill_
from tests.helpers import assert_all_same_bytes, assert_same_bytes, case_seed

from .conftest import impl_or_skip, two_layouts

KiB = 1024
SIZES = [4 * KiB << k for k in range(9)]  # 4 KiB .. 1 MiB, as the calibration sweeps


# ------------------------------------------------------------------------------------------ the rule (CPU)
def _times(per_run_ms, gbs, sizes=SIZES, runs=64):
    """Time per copy of `runs` runs: a fixed cost per run plus bytes at a bandwidth."""
    return [runs * (per_run_ms + b / (gbs * 1e6)) for b in sizes]


def test_rule_picks_the_crossover():
    # kernel: no per-run cost, 20 GB/s; DMA: 4 us per run, 50 GB/s -> equal at b = 4e-3 / (1/20e6 - 1/50e6)
    kernel, dma = _times(0.0, 20), _times(0.004, 50)
    crossover = 0.004 / (1 / 20e6 - 1 / 50e6)  # 133 kB
    expected = min(b for b in SIZES if b >= crossover)
    assert h2d.choose_dma_min_bytes(SIZES, kernel, dma) == expected == 256 * KiB


def test_rule_never_dma_when_the_kernel_always_wins():
    assert h2d.choose_dma_min_bytes(SIZES, _times(0.0, 60), _times(0.004, 50)) == h2d.DMA_NEVER


def test_rule_dma_from_the_smallest_size_when_dma_always_wins():
    assert h2d.choose_dma_min_bytes(SIZES, _times(0.01, 20), _times(0.0, 50)) == SIZES[0]


def test_rule_tie_goes_to_dma():
    assert h2d.choose_dma_min_bytes([4096, 8192], [1.0, 2.0], [1.5, 2.0]) == 8192


def test_rule_ignores_a_dma_win_below_a_kernel_win():
    """Noise near the crossover: a size where the kernel wins moves the threshold above it."""
    kernel = [1.0, 1.0, 1.0, 1.0]
    dma = [0.9, 1.1, 0.9, 0.8]
    assert h2d.choose_dma_min_bytes([4096, 8192, 16384, 32768], kernel, dma) == 16384


@pytest.mark.parametrize(
    "args,match",
    [
        (([], [], []), "run_bytes: expected at least one run size"),
        (([4096, 8192], [1.0], [1.0, 1.0]), "staged_ms, dma_ms: expected one time per run size"),
        (([8192, 4096], [1.0, 1.0], [1.0, 1.0]), "run_bytes: expected strictly increasing positive ints"),
        (([0, 4096], [1.0, 1.0], [1.0, 1.0]), "run_bytes: expected strictly increasing positive ints"),
        (([4096.0], [1.0], [1.0]), "run_bytes: expected strictly increasing positive ints"),
        (([4096], [0.0], [1.0]), "staged_ms: expected positive finite times"),
        (([4096], [1.0], [math.nan]), "dma_ms: expected positive finite times"),
    ],
)
def test_rule_rejects_bad_timings(args, match):
    with pytest.raises(ValueError, match=match):
        h2d.choose_dma_min_bytes(*args)


def test_env_overrides_the_measurement(monkeypatch):
    """KVX_H2D_DMA_MIN_BYTES replaces the calibration (so nothing touches a device here)."""
    monkeypatch.setenv(h2d.H2D_ENV, "65536")
    assert h2d.h2d_dma_min_bytes("cuda:0", "scatter") == 65536
    assert h2d.h2d_dma_min_bytes("cuda:0", "gather") == 65536
    monkeypatch.setenv(h2d.H2D_ENV, " 0 ")
    assert h2d.h2d_dma_min_bytes("cuda:0", "gather") == 0


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "64KiB", "0x100"])
def test_env_must_be_a_non_negative_integer(monkeypatch, value):
    monkeypatch.setenv(h2d.H2D_ENV, value)
    with pytest.raises(
        ValueError,
        match=rf"KVX_H2D_DMA_MIN_BYTES: expected a non-negative integer .* got "
        rf"'{value}'",
    ):
        h2d.h2d_dma_min_bytes("cuda:0", "scatter")


def test_threshold_arguments_are_checked(monkeypatch):
    monkeypatch.setenv(h2d.H2D_ENV, "4096")
    with pytest.raises(ValueError, match="direction: expected 'gather' .* or 'scatter' .* got 'up'"):
        h2d.h2d_dma_min_bytes("cuda:0", "up")
    with pytest.raises(ValueError, match="device: expected a CUDA device, got cpu"):
        h2d.h2d_dma_min_bytes("cpu", "gather")
    with pytest.raises(ValueError, match="device: expected a CUDA device, got cpu"):
        h2d.calibrate_h2d("cpu")


def test_the_ops_reexport_the_rule():
    assert ops.calibrate_h2d is h2d.calibrate_h2d and ops.DMA_NEVER == h2d.DMA_NEVER and ops.PATHS is check.PATHS
    assert ops.dma_threshold is h2d.dma_threshold


def test_each_plan_takes_the_path_the_rule_says(monkeypatch):
    """Path ``auto`` (the default for a CUDA cache's host buffers; asked for here on a CPU cache, whose twin runs the
    same plans): pages of non-adjacent blocks are runs of exactly one page, so DMA straight into them from a threshold
    of one page, staged above it; an explicit path wins over the rule."""
    lay = make_layout(
        "LBNHC", num_layers=2, num_blocks=12, block_size=16, num_heads=2, head_size=8, dtype=torch.bfloat16
    )
    out = torch.empty(lay.page_shape(3), dtype=torch.uint8)

    def taken(path="auto"):
        copies = Copies(lay, path=path)
        copies.add("gather_pages", [1, 5, 9], out)
        return copies.plan(capacity=1 << 20).path_name

    monkeypatch.setenv(h2d.H2D_ENV, str(lay.page_bytes))
    assert taken() == "dma"
    monkeypatch.setenv(h2d.H2D_ENV, str(lay.page_bytes + 1))
    assert taken() == "staged"
    assert taken("dma") == "dma" and taken("kernel") == "kernel"
    monkeypatch.setenv(h2d.H2D_ENV, "0")
    assert taken() == "dma" and taken("staged") == "staged"
    monkeypatch.setenv(h2d.H2D_ENV, str(h2d.DMA_NEVER))
    assert taken() == "staged"
    assert Copies(lay).resolved_path() == "kernel"  # a CPU cache's default: its copy kernel


def test_cpu_caches_use_a_fixed_threshold(monkeypatch):
    """No PCIe to measure on a CPU cache (the deferred queue's CUDA code path): CPU_DMA_MIN_BYTES, or the
    variable."""
    monkeypatch.delenv(h2d.H2D_ENV, raising=False)
    assert h2d.dma_threshold("cpu", "scatter", 16) == h2d.CPU_DMA_MIN_BYTES == 64 * KiB
    monkeypatch.setenv(h2d.H2D_ENV, "0")
    assert h2d.dma_threshold("cpu", "gather", 128) == 0


# ------------------------------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
BLOCK_SIZES = [16, 32, 128]
TOKEN_LAYOUTS = [name for name in LAYOUTS if name != "cpu"]
# (path, contiguous side): the kernel on device memory is test_copy.py's
ROUTES = [
    pytest.param("staged", True, id="staged-pinned"),
    pytest.param("dma", True, id="dma-pinned"),
    pytest.param("dma", False, id="dma-hbm"),
    pytest.param("kernel", True, id="kernel-pinned"),
]


def _cases():
    for name, dtype, bs in itertools.product(TOKEN_LAYOUTS, DTYPES, BLOCK_SIZES):
        for hs in [576, 5] if name == "mla" else [64, 5]:
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")
    # float8 (vLLM's fp8_inc caches) on every layout and head size, one block size per layout in turn: the
    # copy moves bytes, so it is the 1-byte uint8 case above at the other block sizes
    for i, (name, dtype) in enumerate(itertools.product(TOKEN_LAYOUTS, FP8_DTYPES)):
        bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        for hs in [576, 5] if name == "mla" else [64, 5]:
            yield pytest.param(name, dtype, bs, hs, id=f"{name}-{str(dtype)[6:]}-bs{bs}-hs{hs}")


CASES = list(_cases())


def _buf(shape, dtype, host, g):
    t = random_fill_(torch.empty(shape, dtype=dtype), g)
    return t.pin_memory() if host else t.cuda()


def _check_op(kind, lay, ref, gather_ids, scatter_ids, shape_of, dtype, host, path, g):
    gather, scatter = getattr(ops, f"gather_{kind}"), getattr(ops, f"scatter_{kind}")
    out = _buf(shape_of(len(gather_ids)), dtype, host, g)
    expected = out.cuda() if host else out.clone()
    gather(lay, gather_ids, out, impl="cuda", path=path)
    gather(ref, gather_ids, expected, impl="reference")
    torch.cuda.synchronize()
    assert_same_bytes(out.cuda(), expected)
    src = _buf(shape_of(len(scatter_ids)), dtype, host, g)
    scatter(lay, scatter_ids, src, impl="cuda", path=path)
    scatter(ref, scatter_ids, src.cuda(), impl="reference")
    torch.cuda.synchronize()
    assert_all_same_bytes(lay.layers, ref.layers)


def _need_cuda_impl():
    if "cuda" not in ops.available_impls("cuda"):
        pytest.fail(
            f"impl 'cuda' should run here but is unavailable ({ops.available_impls('cuda')}); "
            f"{_ext.ERROR or 'kvx._C built without CUDA'}",
            pytrace=False,
        )


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("path,host", ROUTES)
@pytest.mark.parametrize("name,dtype,block_size,head_size", CASES)
def test_cuda_path_matches_reference(path, host, name, dtype, block_size, head_size):
    _need_cuda_impl()
    seed = case_seed("h2d", name, str(dtype), block_size, head_size)
    g = torch.Generator().manual_seed(seed)
    B = 8
    geom = dict(
        num_layers=int(torch.randint(1, 4, (1,), generator=g)),
        num_blocks=B,
        block_size=block_size,
        num_heads=1 if name == "mla" else int(torch.randint(1, 4, (1,), generator=g)),
        head_size=head_size,
    )
    lay, ref = two_layouts(name, geom, dtype, bool(seed % 2), seed, device="cuda")
    ids = torch.tensor([5, 6, 2, 0])  # 5, 6 adjacent: a merged run
    gather_ids = torch.cat([ids, ids[:1]])  # a block read twice
    _check_op("blocks", lay, ref, gather_ids, ids, lambda n: lay.canonical_shape(n * block_size), dtype, host, path, g)
    run = torch.arange(3 * block_size, 3 * block_size + 8)  # consecutive slots: a merged run
    rest = torch.randperm(B * block_size, generator=g)
    rest = rest[(rest < run[0]) | (rest > run[-1])][:29]
    slots = torch.cat([rest[:4], run, rest[4:]])
    slots[::5] = -1  # padding
    _check_op("slots", lay, ref, slots, slots, lay.canonical_shape, dtype, host, path, g)
    if not lay.opaque and lay.page is not None:
        _check_op("pages", lay, ref, ids, ids, lay.page_shape, torch.uint8, host, path, g)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("path", ops.PATHS)
def test_cuda_path_with_strided_pinned_chunk(path):
    """The contiguous side as a strided view of a pinned pool (a slot of kvx's CPU tier)."""
    _need_cuda_impl()
    g = torch.Generator().manual_seed(11)
    lay, ref = two_layouts(
        "LBHNC",
        dict(num_layers=3, num_blocks=6, block_size=16, num_heads=2, head_size=16),
        torch.bfloat16,
        False,
        11,
        device="cuda",
    )
    pool = random_fill_(torch.empty(2, 2, 3, 48, 2, 16, dtype=torch.bfloat16), g).pin_memory()  # [slot, P, L, ...]
    out = pool[1].transpose(0, 1)
    before = pool[0].clone()
    ops.gather_blocks(lay, [3, 0, 5], out, impl="cuda", path=path)
    torch.cuda.synchronize()
    assert_same_bytes(out, ops.gather_blocks(ref, [3, 0, 5], impl="reference").cpu())
    assert_same_bytes(pool[0], before)
    ops.scatter_blocks(lay, [1, 2, 4], pool[0].transpose(0, 1), impl="cuda", path=path)
    ops.scatter_blocks(ref, [1, 2, 4], pool[0].transpose(0, 1).cuda(), impl="reference")
    torch.cuda.synchronize()
    assert_all_same_bytes(lay.layers, ref.layers)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stream", ["default", "side"])
def test_dma_staged_and_kernel_give_identical_bytes(stream):
    """A chunk of realistic size (LBNHC pages, legacy-flash blocks), both directions, on the legacy default
    stream (one cudaMemcpyAsync per run) and on a side stream (batched), by DMA, staged and the UVA kernel."""
    _need_cuda_impl()
    g = torch.Generator().manual_seed(3)
    s = torch.cuda.current_stream() if stream == "default" else torch.cuda.Stream()
    with torch.cuda.stream(s):
        for name, kind in (("LBNHC", "pages"), ("flash", "blocks"), ("LBNHC", "blocks")):
            geom = dict(num_layers=4, num_blocks=96, block_size=16, num_heads=8, head_size=128)
            a, b = two_layouts(name, geom, torch.bfloat16, False, 5, device="cuda")
            rest = torch.randperm(96, generator=g)
            ids = torch.cat([torch.arange(50, 58), rest[(rest < 50) | (rest >= 58)][:32]])  # 8 adjacent blocks
            shape = a.page_shape(40) if kind == "pages" else a.canonical_shape(40 * 16)
            dt = torch.uint8 if kind == "pages" else torch.bfloat16
            gather, scatter = getattr(ops, f"gather_{kind}"), getattr(ops, f"scatter_{kind}")
            x = random_fill_(torch.empty(shape, dtype=dt), g).pin_memory()
            y, z = x.clone().pin_memory(), x.clone().pin_memory()
            gather(a, ids, x, impl="cuda", path="dma")
            gather(a, ids, y, impl="cuda", path="kernel")
            gather(a, ids, z, impl="cuda", path="staged")
            s.synchronize()
            assert_same_bytes(x, y)
            assert_same_bytes(x, z)
            src = random_fill_(torch.empty(shape, dtype=dt), g).pin_memory()
            scatter(a, ids, src, impl="cuda", path="dma")
            scatter(b, ids, src, impl="cuda", path="kernel")
            s.synchronize()
            assert_all_same_bytes(a.layers, b.layers)
            scatter(b, ids, random_fill_(torch.empty(shape, dtype=dt), g).pin_memory(), impl="cuda", path="dma")
            scatter(b, ids, src, impl="cuda", path="staged")
            s.synchronize()
            assert_all_same_bytes(a.layers, b.layers)


def _small_gpu_caches(dtype, seed):
    """Two identical LBNHC caches on the GPU: 2 layers of 16 blocks of 16 tokens, 2 heads of 64."""
    geom = dict(num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_size=64)
    return two_layouts("LBNHC", geom, dtype, False, seed, device="cuda")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_staged_copies_on_the_default_stream_wait_for_their_own_steps(impl):
    """A staged copy issued on the legacy default stream (handle 0) keeps every step there: its ids' upload and its
    reshape do not go to a stream of torch's pool (``torch.cuda.ExternalStream(0)`` is one), which would run apart
    from the DMA and the kernel. Every pool stream is kept busy, so a step sent there would come too late: wrong
    bytes (on an H100 that race lost 5-7 cases per run of this file's staged tests). The op (impl cuda) and a
    batch of the reshape's impl, both directions."""
    _need_cuda_impl()
    impl_or_skip(impl, "cuda")
    assert torch.cuda.current_stream().cuda_stream == 0 and torch_stream(0).cuda_stream == 0
    lay, ref = _small_gpu_caches(torch.bfloat16, 4)
    g = torch.Generator().manual_seed(4)

    def busy_pool():
        for _ in range(64):  # twice round torch's pool of streams
            with torch.cuda.stream(torch.cuda.Stream()):
                torch.cuda._sleep(20_000_000)

    def staged(op, ids, buf):
        if impl == "cuda":
            getattr(ops, op)(lay, ids, buf, impl="cuda", path="staged")
            return None
        batch = Copies(lay, path="staged", impl=impl)
        batch.add(op, ids, buf)
        staging = torch.empty(batch.nbytes, dtype=torch.uint8, device="cuda")
        plan = batch.plan(capacity=staging.numel())
        plan.run(staging)
        return plan, staging  # held until the check

    busy_pool()
    out = random_fill_(torch.empty(lay.canonical_shape(48), dtype=lay.dtype), g).pin_memory()
    expected = out.cuda()
    held = staged("gather_blocks", [5, 1, 9], out)
    ops.gather_blocks(ref, [5, 1, 9], expected, impl="reference")
    torch.cuda.synchronize()
    assert_same_bytes(out.cuda(), expected)
    busy_pool()
    src = random_fill_(torch.empty(lay.canonical_shape(48), dtype=lay.dtype), g).pin_memory()
    held = staged("scatter_blocks", [2, 7, 11], src)
    ops.scatter_blocks(ref, [2, 7, 11], src.cuda(), impl="reference")
    torch.cuda.synchronize()
    del held
    assert_all_same_bytes(lay.layers, ref.layers)


@needs_cuda
@pytest.mark.gpu
def test_calibration_is_sane(monkeypatch):
    _need_cuda_impl()
    monkeypatch.delenv(h2d.H2D_ENV, raising=False)
    cal = h2d.calibrate_h2d()
    assert cal.device == torch.device("cuda", torch.cuda.current_device())
    assert cal.pieces == h2d.CAL_PIECES == (16, 128)
    assert list(cal.run_bytes[0]) == [4 * KiB << k for k in range(8)]  # 16 pieces: 4 KiB .. 512 KiB
    assert list(cal.run_bytes[1]) == [4 * KiB << k for k in range(6)]  # 128 pieces: up to 16 MiB a copy
    for d in (0, 1):
        for k in range(len(cal.pieces)):
            sizes = list(cal.run_bytes[k])
            for ts in (cal.staged_ms[d][k], cal.dma_ms[d][k]):
                assert len(ts) == len(sizes) and all(math.isfinite(t) and 0 < t < 1000 for t in ts)
            assert cal.dma_min_bytes[d][k] in set(sizes) | {h2d.DMA_NEVER}
            assert cal.dma_min_bytes[d][k] == h2d.choose_dma_min_bytes(sizes, cal.staged_ms[d][k], cal.dma_ms[d][k])
    assert h2d.calibrate_h2d() is cal  # measured once per device
    assert h2d.h2d_dma_min_bytes(None, "gather", 16) == cal.dma_min_bytes[0][0]
    assert h2d.h2d_dma_min_bytes(cal.device, "scatter", 128) == cal.dma_min_bytes[1][1]
    assert h2d.h2d_dma_min_bytes(cal.device, "scatter", 100) == cal.dma_min_bytes[1][1]  # the nearest batch size
    again = h2d.calibrate_h2d(force=True)
    assert again is not cal and h2d.calibrate_h2d() is again


@needs_cuda
@pytest.mark.gpu
def test_each_call_takes_the_path_the_rule_says(monkeypatch):
    """On a CUDA cache: pages of non-adjacent blocks are runs of exactly one page, so DMA straight into them from a
    threshold of one page, staged above it (the kernel on the device, uncapped); the UVA kernel (at most 8 CTAs) only
    when asked for; device memory on the contiguous side: the kernel, uncapped, unless DMA is asked for."""
    _need_cuda_impl()
    lay, _ = _small_gpu_caches(torch.float16, 1)
    out = torch.empty(lay.page_shape(3), dtype=torch.uint8).pin_memory()

    def taken(buf=out, **kw):
        max_ctas = kw.pop("max_ctas", 0)
        copies = Copies(lay, impl="cuda", max_ctas=max_ctas, **kw)
        copies.add("gather_pages", [1, 5, 9], buf)
        plan = copies.plan(capacity=1 << 20)
        ctas = [launch["ctas"] for launch in plan.launches(0)]
        return plan.path_name, max(ctas) if ctas else None

    monkeypatch.setenv(h2d.H2D_ENV, str(lay.page_bytes))
    assert taken() == ("dma", None)
    monkeypatch.setenv(h2d.H2D_ENV, str(lay.page_bytes + 1))
    assert taken()[0] == "staged"
    assert taken(path="kernel")[0] == "kernel" and taken(path="kernel")[1] <= ops.H2D_MAX_CTAS
    assert taken(path="kernel", max_ctas=3)[1] <= 3
    assert taken(path="dma") == ("dma", None)
    monkeypatch.setenv(h2d.H2D_ENV, "0")
    assert taken() == ("dma", None)
    assert taken(path="staged")[0] == "staged"
    hbm = torch.empty(lay.page_shape(3), dtype=torch.uint8, device="cuda")
    assert taken(hbm)[0] == "kernel"
