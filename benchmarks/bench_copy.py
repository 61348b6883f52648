"""Copy-kernel benchmark (see kvx/bench.py): `python benchmarks/bench_copy.py [--quick] [--device cuda]`."""

import sys

from kvx.bench import main

if __name__ == "__main__":
    sys.exit(main())
