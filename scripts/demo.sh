#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `kvx demo` - a 4096-token prompt on a local random
# Llama in vLLM (CPU), cold, then warm in a fresh engine from kvx's store. Extra args go to kvx demo.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/kvx demo "$@"
