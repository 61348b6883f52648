#!/usr/bin/env bash
# One go on a GPU machine: build kvx with the CUDA kernels, run the GPU tests (CUDA and compiled
# Triton kernels, every layout, HBM and pinned host, the host <-> device DMA path and its calibration), a
# compute-sanitizer memcheck/racecheck pass over the copy kernels and the DMA path, then the copy
# benchmark; prints the result tables at the end (copy_cuda.md, and copy_h2d_cuda.md: UVA kernel vs DMA
# vs one cudaMemcpyAsync per page over piece sizes, with the measured threshold).
# The kernel's CPU emulation (impl "cuda_sim", tests/kernels/test_cuda_sim.py) runs here next to its GPU
# twins: the real launcher's grid checked against kernel_launch_config() and the emulation on this device's
# SM count, the grid-stride / CTA-cap / UVA shapes on the real kernel, and those under compute-sanitizer
# (the device-side counterpart of the emulation's alignment, bounds and double-write checks).
# Needs torch (CUDA build), triton, nvcc, pytest; no vLLM and no network.
#   PYTHON=python3 benchmarks/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
KVX_CUDA=1 KVX_CUDA_ARCHS="${KVX_CUDA_ARCHS:-90}" "$PY" -m pip install --no-build-isolation --no-deps -e . -q || exit 1
"$PY" -c "from kvx._ext import require; C = require(); assert C.has_cuda and C.cuda_device_count() > 0, 'CUDA kernels not usable'"
"$PY" -m pytest tests/kernels -q -m gpu -p no:cacheprovider; rc_tests=$?
# cuda_sim (CPU) and its GPU twins in one run: the emulated launch decisions next to the device's own
"$PY" -m pytest tests/kernels/test_cuda_sim.py -q -p no:cacheprovider || rc_tests=1
# the connector's worker racing a slow fake forward through finish / reuse / preempt / load steps
"$PY" -m pytest tests/worker -q -m gpu -p no:cacheprovider || rc_tests=1
if command -v compute-sanitizer >/dev/null 2>&1; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" -m pytest tests/kernels/test_copy.py \
      tests/kernels/test_h2d.py -q -m gpu -k "cuda and bs16 and hs5 and bfloat16" -p no:cacheprovider \
      > "/tmp/kvx-sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool (kernels): exit $? (log /tmp/kvx-sanitizer-$tool.log)"
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" -m pytest tests/kernels/test_cuda_sim.py -q -m gpu \
      -p no:cacheprovider > "/tmp/kvx-sanitizer-$tool-grids.log" 2>&1
    echo "compute-sanitizer $tool (grid-stride, CTA caps, UVA): exit $? (log /tmp/kvx-sanitizer-$tool-grids.log)"
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" -m pytest tests/worker -q -m gpu -k bit_exact \
      -p no:cacheprovider > "/tmp/kvx-sanitizer-$tool-pipeline.log" 2>&1
    echo "compute-sanitizer $tool (worker pipeline): exit $? (log /tmp/kvx-sanitizer-$tool-pipeline.log)"
  done
fi
"$PY" benchmarks/bench_copy.py --device cuda
cat benchmarks/results/copy_cuda.md
cat benchmarks/results/copy_h2d_cuda.md
# the worker's layer-wise loads and saves against a synthetic forward (hidden copy time, forward slowdown)
"$PY" benchmarks/bench_pipeline.py --device cuda
cat benchmarks/results/pipeline_cuda.md
exit $rc_tests
