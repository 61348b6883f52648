"""Copy microbenchmarks under pytest-benchmark: a few representative cases of ``benchmarks/bench_copy.py``
(kvx/bench.py), each timed for kvx's CPU kernels next to its baselines in the same run:

  memcpy         glibc memcpy of the same bytes on the same threads (the roof)
  kvx-cpu        kvx's C++ copy (``impl="cpu"``)
  torch-index    torch indexing per layer and plane (``impl="reference"``, what ExampleConnector-style code does)

Cases: an LBNHC bf16 cache (8 KV heads x 128, 4 layers, 4096 tokens: 64 MiB moved per copy), block size 16
(vLLM GPU) and 128 (vLLM CPU), gather and scatter of blocks (a chunk in canonical form) and of slots.
Each group's table compares its three rows. ``extra_info`` of each row carries the bytes and GB/s.

    pytest benchmarks --benchmark-only --benchmark-json=benchmarks/results/copy_pytest_benchmark_cpu.json

No speed is asserted; a copy's result is checked once against torch indexing before it is timed.
"""

from __future__ import annotations

import pytest
import torch

from kvx import ops
from kvx.bench import Case, _setup

IMPLS = ("memcpy", "kvx-cpu", "torch-index")
CASES = [Case(op, "LBNHC", torch.bfloat16, bs, 4096, 4, 8, 128)
         for bs in (16, 128)
         for op in ("gather_blocks", "scatter_blocks", "gather_slots", "scatter_slots")]
_setups: dict[str, tuple] = {}


def setup(case: Case):
    """The case's cache, ids and buffer, shared by its three rows (only the current case is kept)."""
    if case.label not in _setups:
        _setups.clear()
        _setups[case.label] = _setup(case, "cpu", False, torch.Generator().manual_seed(0))
    return _setups[case.label]


@pytest.fixture(scope="module")
def ext():
    return pytest.importorskip("kvx._C", reason="kvx's compiled extension is not built")


@pytest.mark.parametrize("case, impl", [(c, i) for c in CASES for i in IMPLS],
                         ids=[f"{c.label.replace(' ', '-')}-{i}" for c in CASES for i in IMPLS])
def test_copy(benchmark, ext, case, impl):
    lay, ids, buf, nbytes = setup(case)
    op = getattr(ops, case.op)
    if impl == "memcpy":
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        b.fill_(2)
        fn = lambda: ext.cpu_memcpy(b.data_ptr(), a.data_ptr(), nbytes)          # noqa: E731
    else:
        name = "cpu" if impl == "kvx-cpu" else "reference"
        if case.op.startswith("gather") and name != "reference":
            # kvx gathers the bytes torch indexing gathers (random bytes: compare bits, NaNs included)
            want = torch.empty_like(buf)
            op(lay, ids, want, impl="reference")
            op(lay, ids, buf, impl=name)
            assert torch.equal(buf.view(torch.uint8), want.view(torch.uint8))
        fn = lambda: op(lay, ids, buf, impl=name)                                 # noqa: E731
    benchmark.group = case.label
    benchmark.extra_info.update(bytes=nbytes, impl=impl, op=case.op, block_size=case.block_size,
                                threads=ops.get_num_threads())
    benchmark.pedantic(fn, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.median / 1e9, 3)
