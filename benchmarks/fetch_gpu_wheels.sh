#!/usr/bin/env bash
# Download, into .whl/ at the project's root, the cp312 manylinux x86_64 wheels of what kvx imports and the GPU
# machine lacks (it has torch 2.11+cu130, triton, numpy, pytest...; no network, no pydantic, crc32c,
# cryptography, redis). benchmarks/run_gpu.sh installs them there with `pip install --no-index --no-deps`.
# Pinned to the versions this project's CI venv runs (pydantic pins pydantic-core exactly; typing_extensions
# >= 4.16 for that pydantic: the GPU machine's own one is too old). Run on a machine with network:
#   bash benchmarks/fetch_gpu_wheels.sh        (about 10 MB; .whl/ is then carried to the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing_extensions==4.16.0
  crc32c==2.9.post0
  cryptography==50.0.2
  cffi==2.1.1
  pycparser==3.12
  redis==8.1.0
  hiredis==3.5.0
)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$w"
done
ls -la .whl
n=$(ls .whl/*.whl | wc -l)
[ "$n" -ge "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels in .whl, found $n" >&2; exit 1; }
