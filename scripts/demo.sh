#!/usr/bin/env bash
# Usage: ./scripts/demo.sh [--vllm-log] [kvx demo options]
#
# Set up (scripts/setup.sh) and run the main job: `kvx demo` - a 4096-token prompt on a local random
# Llama in vLLM (CPU), cold, then warm in a fresh engine from kvx's store. It prints kvx's lines and
# any errors; --vllm-log shows vLLM's log (its warnings; VLLM_LOGGING_LEVEL=INFO for more), other
# packages' warnings and progress bars too. Other options go to kvx demo (`.venv/bin/kvx demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  case "$arg" in
    -h | --help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0 ;;
    --vllm-log) vllm_log=1 ;;
  esac
done
if [[ -z "${vllm_log:-}" ]]; then
  # torch reads it when it loads, before kvx demo can set it: its C++ warnings (a NUMA binding notice)
  export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
fi
./scripts/setup.sh
exec .venv/bin/kvx demo "$@"
