#!/usr/bin/env bash
# ONE run on a bare GPU machine (torch cu130, triton, nvcc, pytest, pytest-xdist, compute-sanitizer; no vLLM, no
# network), at most ~8 minutes (KVX_GPU_BUDGET_S, default 465 s, bounds every step's timeout), from the project's
# root. Adapted from ../shared/gpu/device_run_reference.sh (441 s on an H100 on 2026-11-27).
#
#   setup     cp312 wheels from .whl/ into /tmp/site (benchmarks/fetch_gpu_wheels.sh fetched them), the extension
#             built in place for this device's arch (KVX_CUDA_ARCHS from nvidia-smi's compute_cap: 90 H100/H200,
#             100 B200).
#   phase 1   correctness, concurrently, each under its own timeout: tests/kernels -m gpu (xdist -n 8),
#             tests/worker -m gpu, compute-sanitizer memcheck on the copy kernels and on the worker pipeline.
#   phase 2   timings, the GPU to itself, each under a timeout derived from the time left, most targets first:
#             gpu_staged_stress.py (~55 s: host copies checked bit-exact in a loop, by variant, idle and under load),
#             bench_copy --quick (table under idle and GEMM load, one layer's copies, both directions at once),
#             bench_copy --h2d-only --quick (per-layer batches of pages: auto vs dma and staged),
#             bench_pipeline --quick (kvx's default config: loads hidden, saves' slowdown, hooks' host time).
#   summary   benchmarks/gpu_targets.py judges every target from the CSVs (met / MISSED / NOT MEASURED, each with
#             its number and same-run baseline), also into benchmarks/results/gpu_targets_<device>.md.
#
# $OUT (default ./gpu-results) gets 8 files (the device tool returns <= 8 of <= 16 MiB): summary.md (read this
# first), gpu_targets_<device>.md, staged_stress_cuda.md, copy_cuda_quick.md, copy_h2d_cuda.md, pipeline_cuda.md,
# log.txt, results.tgz
# (every CSV and log: untar its results/ into benchmarks/results/ to commit the numbers).
#
# The device tool call (after `bash benchmarks/fetch_gpu_wheels.sh` here, which fills the ignored .whl/):
#   run(command="OUT=$OUT bash benchmarks/run_gpu.sh", carry=[".whl"], timeout_s=540)
# Time per phase, estimated from the 441 s run (not yet measured in this form): setup ~40 s (one arch on 16 cores),
# phase 1 <= 180 s (its worker tests alone took 96 s there), phase 2 ~150 s (copy ~70, h2d ~20, pipeline ~60),
# summary ~5 s; the timeouts keep the total under the budget whatever runs long.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
BUDGET=${KVX_GPU_BUDGET_S:-465}
PY=${PYTHON:-python3}
T0=$(date +%s)
R=$(mktemp -d /tmp/kvx-gpu-run.XXXXXX)  # logs, junit XML; archived at the end
RES=benchmarks/results
exec > >(tee -a "$OUT/log.txt") 2>&1
now() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(now))); }
step() { echo "=== [$(now)s] $*"; }
SUMMARY=()  # one line per step, for summary.md
note() { SUMMARY+=("$*"); echo "$*"; }
# the tail of a pytest or compute-sanitizer log: its counts
counts() { grep -aE "[0-9]+ (passed|failed|errors?|skipped|deselected)|ERROR SUMMARY|no tests ran" "$1" 2> /dev/null | tail -2 | tr '\n' ' '; }

# cap CAP RESERVE: a step's timeout: CAP seconds, or less to keep RESERVE seconds for what follows (0: no time)
cap() {
  local t=$(($(left) - $2))
  [ "$t" -gt "$1" ] && t=$1
  [ "$t" -lt 15 ] && t=0
  echo "$t"
}
# run_step NAME CAP RESERVE CMD...: CMD in the foreground under its timeout, output in $R/NAME.log
run_step() {
  local name=$1 t s rc
  t=$(cap "$2" "$3")
  shift 3
  if [ "$t" -eq 0 ]; then
    note "- $name: SKIPPED (no time left)"
    return
  fi
  step "$name (timeout ${t}s)"
  s=$(now)
  timeout -k 10 "$t" "$@" > "$R/$name.log" 2>&1
  rc=$?
  note "- $name: exit $rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)') in $(($(now) - s)) s (timeout $t s)"
  tail -n 4 "$R/$name.log"
}

step env
# SM_CAP, not CC: CC names the C compiler Triton builds its launcher with
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
SM_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
ARCH=${KVX_CUDA_ARCHS:-${SM_CAP:-90}}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max \
  --format=csv 2>&1
nvcc --version 2>&1 | tail -1
note "- device: ${GPU:-unknown}, compute capability ${SM_CAP:-unknown}, built for sm_$ARCH; kvx $(git rev-parse --short HEAD 2>/dev/null)"
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/wheels.log" 2>&1 || note "- WHEELS FAILED (see wheels.log)"
else
  note "- no .whl/: run benchmarks/fetch_gpu_wheels.sh and carry .whl (pydantic, crc32c, ... are missing here)"
fi
export PYTHONPATH=$PWD:/tmp/site
run_step build 200 330 env KVX_CUDA=1 KVX_CUDA_ARCHS="$ARCH" "$PY" setup.py -q build_ext --inplace
"$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
"$PY" -c "
import kvx; from kvx._ext import require; C = require(); from kvx.kernels import ops
print('kvx from', kvx.__file__, '| has_cuda', C.has_cuda, '| impls', ops.available_impls('cuda'), '| paths', ops.PATHS)" \
  2>&1 | tee "$R/import.log" || true
grep -q "has_cuda True" "$R/import.log" || note "- EXTENSION NOT USABLE (see build.log, import.log)"

step "phase 1: correctness (concurrent)"
T1=$(cap 180 210)  # phase 2 and the summary keep >= 210 s
declare -A PID
start() {  # start NAME CMD...: in the background under timeout $T1 (timeout leads its own process group)
  local name=$1
  shift
  timeout -k 10 "$T1" "$@" > "$R/$name.log" 2>&1 &
  PID[$name]=$!
}
finish() {  # finish NAME: wait, then kill what is left of its process group (xdist workers, sanitizer children)
  local name=$1 rc
  wait "${PID[$name]}"
  rc=$?
  kill -9 -- "-${PID[$name]}" 2> /dev/null
  note "- $name: exit $rc$([ $rc -eq 124 ] && echo " (TIMED OUT at ${T1} s)") at $(now) s: $(counts "$R/$name.log")"
}
if [ "$T1" -gt 0 ]; then
  S1=$(now)
  start kernels_gpu "$PY" -m pytest tests/kernels -q -m gpu -p no:cacheprovider -n 8 --junitxml="$R/kernels_gpu.xml"
  start worker_gpu "$PY" -m pytest tests/worker -q -m gpu -p no:cacheprovider --junitxml="$R/worker_gpu.xml"
  # the copy kernels and the host <-> device paths (kernel, DMA, staged batches), one geometry each
  start sanitizer_memcheck_kernels compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest \
    tests/kernels/test_copy.py tests/kernels/test_h2d.py tests/kernels/test_staged.py -q -m gpu -p no:cacheprovider \
    -k "(cuda and bs16 and hs5 and bfloat16) or (gpu_batch and bfloat16 and LBNHC)"
  # the worker's staged loads and saves racing a slow forward / slow copies (a one-block budget splits every layer)
  start sanitizer_memcheck_worker compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest tests/worker \
    -q -m gpu -k "(bit_exact and LBNHC) or splits" -p no:cacheprovider
  # the same loop as in phase 2, here with the GPU shared by the jobs above (the conditions the lost bytes showed in)
  start staged_stress_shared "$PY" benchmarks/gpu_staged_stress.py --seconds 2 --out "$R/staged_stress_shared.md"
  for n in kernels_gpu worker_gpu sanitizer_memcheck_kernels sanitizer_memcheck_worker staged_stress_shared; do
    finish "$n"
  done
  step "phase 1 took $(($(now) - S1)) s"
else
  note "- phase 1: SKIPPED (no time left)"
fi
left_over=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2> /dev/null)
[ -n "$left_over" ] && note "- WARNING: GPU processes still running before the timings: $left_over"

step "phase 2: timings (GPU to itself)"
rm -f $RES/copy_cuda_quick* $RES/copy_h2d_cuda.* $RES/pipeline_cuda.* $RES/gpu_targets_*.md $RES/staged_stress_cuda.md
# the host paths checked bit-exact in a loop (the staged path lost bytes on an H100, 2026-11-27: a stream race)
run_step staged_stress 75 200 "$PY" benchmarks/gpu_staged_stress.py --seconds 2 --out $RES/staged_stress_cuda.md
run_step bench_copy 170 130 "$PY" benchmarks/bench_copy.py --device cuda --quick --sections table,layer,bidir \
  --out $RES/copy_cuda_quick
run_step bench_h2d 70 75 "$PY" benchmarks/bench_copy.py --device cuda --quick --h2d-only --out $RES/copy_cuda_quick
run_step bench_pipeline 200 12 "$PY" benchmarks/bench_pipeline.py --device cuda --quick

step "summary"
"$PY" benchmarks/gpu_targets.py --results $RES --gpu "${GPU:-unknown GPU}" > "$R/gpu_targets.log" 2>&1 ||
  note "- gpu_targets.py FAILED (see gpu_targets.log)"
TARGETS=$(ls $RES/gpu_targets_*.md 2> /dev/null | head -1)
{
  echo "# kvx GPU run: ${GPU:-unknown GPU}, $(date -u +%Y-%m-%dT%H:%MZ), $(now) s"
  echo
  printf '%s\n' "${SUMMARY[@]}"
  echo
  [ -n "$TARGETS" ] && sed 's/^# /## /' "$TARGETS"
} > "$OUT/summary.md"
cat "$OUT/summary.md"
for f in "$TARGETS" $RES/copy_cuda_quick.md $RES/copy_h2d_cuda.md $RES/pipeline_cuda.md $RES/staged_stress_cuda.md; do
  [ -f "$f" ] && cp "$f" "$OUT/"
done
mkdir -p "$R/results" && cp $RES/copy_cuda_quick* $RES/copy_h2d_cuda.* $RES/pipeline_cuda.* $RES/gpu_targets_*.md $RES/staged_stress_cuda.md \
  "$R/results/" 2> /dev/null
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
step "done in $(now) s"
ls -la "$OUT"
