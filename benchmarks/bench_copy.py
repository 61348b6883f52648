"""Copy-kernel benchmark (see kvx/testing/bench.py): `python benchmarks/bench_copy.py [--quick] [--device cuda]`.

CPU: the table (kvx's C++ copies against memcpy and torch indexing). CUDA: the table (on device, and cache <->
pinned host by every host path, idle and under a bf16 GEMM loop), one layer's copies of a step with their host
time, both directions at once, and the per-layer host <-> device sweep (`--h2d-only`: just that, into
results/copy_h2d_cuda.{csv,md}); `--sections` picks. benchmarks/gpu_targets.py judges the targets from the CSVs.
"""

import sys

from kvx.testing.bench import main

if __name__ == "__main__":
    sys.exit(main())
