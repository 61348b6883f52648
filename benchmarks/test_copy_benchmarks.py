"""Copy microbenchmarks under pytest-benchmark: a few representative cases of ``benchmarks/bench_copy.py``
(kvx/testing/bench.py), each timed for kvx's CPU kernels next to its baselines in the same run:

  memcpy         glibc memcpy of the same bytes on the same threads (the roof)
  kvx-cpu        kvx's C++ copy (``impl="cpu"``)
  torch-index    torch indexing per layer and plane (``impl="reference"``, what ExampleConnector-style code does)

Cases: an LBNHC bf16 cache (8 KV heads x 128, 4 layers, 4096 tokens: 64 MiB moved per copy), block size 16
(vLLM GPU) and 128 (vLLM CPU), gather and scatter of blocks (a chunk in canonical form) and of slots.
Each group's table compares its three rows. ``extra_info`` of each row carries the bytes and GB/s.
One more group times a layer-wise load (16 chunks into 8 layers, one layer at a time) issued as one op per
chunk and layer against one compiled plan run per layer (see ``test_layerwise_load``).

    pytest benchmarks --benchmark-only --benchmark-json=benchmarks/results/copy_pytest_benchmark_cpu.json

No speed is asserted; a copy's result is checked once against torch indexing before it is timed.
"""

from __future__ import annotations

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.plan import Copies
from kvx.testing.bench import Case, _setup

IMPLS = ("memcpy", "kvx-cpu", "torch-index")
CASES = [
    Case(op, "LBNHC", torch.bfloat16, bs, 4096, 4, 8, 128)
    for bs in (16, 128)
    for op in ("gather_blocks", "scatter_blocks", "gather_slots", "scatter_slots")
]
_setups: dict[str, tuple] = {}


def setup(case: Case):
    """The case's cache, ids and buffer, shared by its three rows (only the current case is kept)."""
    if case.label not in _setups:
        _setups.clear()
        _setups[case.label] = _setup(case, "cpu", False, torch.Generator().manual_seed(0))
    return _setups[case.label]


@pytest.fixture(scope="module")
def ext():
    from kvx._ext import C

    if C is None:
        pytest.skip("kvx's compiled extension is not built")
    return C


@pytest.mark.parametrize(
    "case, impl",
    [(c, i) for c in CASES for i in IMPLS],
    ids=[f"{c.label.replace(' ', '-')}-{i}" for c in CASES for i in IMPLS],
)
def test_copy(benchmark, ext, case, impl):
    lay, ids, buf, nbytes = setup(case)
    op = getattr(ops, case.op)
    if impl == "memcpy":
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        b.fill_(2)
        fn = lambda: ext.cpu_memcpy(b.data_ptr(), a.data_ptr(), nbytes)  # noqa: E731
    else:
        name = "cpu" if impl == "kvx-cpu" else "reference"
        if case.op.startswith("gather") and name != "reference":
            # kvx gathers the bytes torch indexing gathers (random bytes: compare bits, NaNs included)
            want = torch.empty_like(buf)
            op(lay, ids, want, impl="reference")
            op(lay, ids, buf, impl=name)
            assert torch.equal(buf.view(torch.uint8), want.view(torch.uint8))
        fn = lambda: op(lay, ids, buf, impl=name)  # noqa: E731
    benchmark.group = case.label
    benchmark.extra_info.update(
        bytes=nbytes, impl=impl, op=case.op, block_size=case.block_size, threads=ops.get_num_threads()
    )
    benchmark.pedantic(fn, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.median / 1e9, 3)


# A warm load as the layer-wise pipeline issues it (CUDA, and the deferred CPU queue): 16 chunks of 256
# tokens from CPU-pool slots into an 8-layer cache, one layer at a time, every layer. Rows:
#   ops-per-chunk-and-layer  one scatter op per chunk and layer (128 ops: each checks its arguments)
#   batch-per-layer          one plan of the 16 chunks, run layer by layer (8 runs)
#   ops-per-chunk            one all-layers op per chunk (16 ops: the thread queue's single layer group)
#   memcpy                   the same bytes, one memcpy
LAYERWISE = dict(layers=8, chunks=16, tokens=256, block_size=16, heads=8, head_size=64)
LAYERWISE_ROWS = ("ops-per-chunk-and-layer", "batch-per-layer", "ops-per-chunk", "memcpy")


@pytest.fixture(scope="module")
def layerwise_setup():
    from kvx.kernels.layout import KVLayout
    from kvx.testing import make_kv_caches, random_fill_

    p = LAYERWISE
    g = torch.Generator().manual_seed(0)
    blocks_per_chunk = p["tokens"] // p["block_size"]
    caches = make_kv_caches(
        "LBNHC",
        num_layers=p["layers"],
        num_blocks=p["chunks"] * blocks_per_chunk + 7,
        block_size=p["block_size"],
        num_heads=p["heads"],
        head_size=p["head_size"],
        dtype=torch.bfloat16,
        generator=g,
    )
    lay = KVLayout.from_tensors(caches, "LBNHC")
    pool = random_fill_(torch.empty(p["chunks"], *lay.canonical_shape(p["tokens"]), dtype=torch.bfloat16), g)
    order = torch.randperm(lay.num_blocks, generator=g).tolist()
    ids = [order[c * blocks_per_chunk : (c + 1) * blocks_per_chunk] for c in range(p["chunks"])]
    return lay, pool, ids


@pytest.mark.parametrize("row", LAYERWISE_ROWS)
def test_layerwise_load(benchmark, ext, layerwise_setup, row):
    lay, pool, ids = layerwise_setup
    subs = [lay.layer_range(i, i + 1) for i in range(lay.num_layers)]
    nbytes = pool.numel() * pool.element_size()
    if row == "memcpy":
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.fill_(1)
        fn = lambda: ext.cpu_memcpy(dst.data_ptr(), pool.data_ptr(), nbytes)  # noqa: E731
    elif row == "ops-per-chunk-and-layer":

        def fn():
            for i, sub in enumerate(subs):
                for c, blocks in enumerate(ids):
                    ops.scatter_blocks(sub, blocks, pool[c, i : i + 1])
    elif row == "ops-per-chunk":

        def fn():
            for c, blocks in enumerate(ids):
                ops.scatter_blocks(lay, blocks, pool[c])
    else:

        def fn():
            batch = Copies(lay)
            for c, blocks in enumerate(ids):
                batch.add("scatter_blocks", blocks, pool[c])
            plan = batch.plan([(i, i + 1) for i in range(lay.num_layers)])
            for i in range(lay.num_layers):
                plan.run(None, None, *plan.range_legs(i))

    if row != "memcpy":  # every row lands the same bytes
        fn()
        for c, blocks in enumerate(ids):
            assert torch.equal(ops.gather_blocks(lay, blocks).view(torch.uint8), pool[c].view(torch.uint8))
    benchmark.group = "layer-wise load: 16 chunks x 8 layers, LBNHC bf16 bs16"
    benchmark.extra_info.update(bytes=nbytes, row=row, threads=ops.get_num_threads())
    benchmark.pedantic(fn, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.median / 1e9, 3)
