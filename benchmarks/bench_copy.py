"""Copy-kernel benchmark (see kvx/testing/bench.py): `python benchmarks/bench_copy.py [--quick] [--device cuda]`.

On CUDA it also runs the host <-> device sweep (UVA kernel vs DMA vs one cudaMemcpyAsync per page, piece
sizes 2 KiB .. 1 MiB, with the measured kernel-or-DMA threshold) into results/copy_h2d_cuda.{csv,md};
`--h2d-only` runs just that.
"""

import sys

from kvx.testing.bench import main

if __name__ == "__main__":
    sys.exit(main())
