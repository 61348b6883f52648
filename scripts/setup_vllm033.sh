#!/usr/bin/env bash
# Set up .venv-vllm033 for the vLLM 0.33 pass of scripts/test.sh: the CUDA wheel vllm==0.33.0 with the
# torch it pins (2.14.0+cu130: what GPU users run; it installs and imports on a machine without a GPU, and
# its scheduler side runs with VLLM_TARGET_DEVICE=cpu), the test dependencies and kvx (editable).
# Idempotent. ~9 GB (hard links into uv's cache); cold, without a uv cache, ~2 min on 2 cores: packages ~45 s,
# kvx's extension ~25-30 s (CPU and CUDA kernels), the import check ~30 s (the first import compiles
# vLLM's bytecode, which the tests then reuse). Warm (venv there) ~40 s.
#   KVX_PYTHON   python to build the venv from (default: python3.11, else python3)
# A separate script rather than a mode of setup.sh: this venv needs none of setup.sh's CPU-torch handling
# (the torch 2.13 CPU pin, the local CPU wheel, the torchvision/torchaudio/torchcodec excludes: next to
# vLLM's own CUDA torch they import) nor its redis-server install (setup.sh's, which runs first in CI).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm033
PY="${KVX_PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! command -v uv >/dev/null 2>&1; then
  echo "setup-vllm033: installing uv"
  "$PY" -m pip install --quiet uv
fi
UV="$(command -v uv || echo "$PY -m uv")"

[ -x "$VENV/bin/python" ] || $UV venv --quiet --python "$PY" "$VENV"

# vLLM pins torch (and the CUDA libraries); kvx's own dependencies come with `-e .` below.
# cuda-python>=13: flashinfer asks for any cuda-python and vLLM's stack for cuda-bindings 13. Left alone,
# uv takes cuda-bindings 13.5.0, which no cuda-python 13 release pins (13.4.4 pins 13.4.4), and falls back
# to cuda-python 12.6.2.post1, an old all-in-one wheel whose cuda/bindings files overwrite cuda-bindings
# 13's. Then `import cutlass` (flashinfer's b12x, imported by vllm.v1.attention.backends.cpu_attn among
# others) fails with "cuda.bindings.runtime has no attribute cudaLibrary_t". pip resolves cuda-python
# 13.4.4 with cuda-bindings 13.4.4, as this pin does.
# The tests need pytest; hiredis: the Redis tier parses replies as in .venv (a P/D test runs through a
# redis-server, which setup.sh installs).
PKGS=(vllm==0.33.0 "cuda-python>=13" pytest hiredis)
echo "setup-vllm033: installing ${PKGS[*]}"
start=$SECONDS
$UV pip install --quiet -p "$VENV/bin/python" "${PKGS[@]}"
echo "setup-vllm033: packages installed in $((SECONDS - start)) s"

# kvx is built again (~25 s) rather than reusing setup.sh's build: the extension is torch-free and an editable
# build puts it in the source tree (kvx/_C*.so, which .venv imports too), so the rebuild hands .venv the same
# module, and this script works on its own on a fresh machine.
start=$SECONDS
echo "setup-vllm033: building kvx (compiled extension)"
$UV pip install --quiet -p "$VENV/bin/python" -e .
echo "setup-vllm033: kvx built in $((SECONDS - start)) s"
# kvx imports vLLM's CPU attention module on the CPU platform (the ISA of raw pages): a broken CUDA package
# set fails here, named, rather than in every test
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import torch, vllm, vllm.v1.attention.backends.cpu_attn, kvx.connector
from kvx._ext import require
C = require()
print('setup-vllm033: kvx ready (CUDA kernels compiled: %s), vllm %s, torch %s'
      % (C.has_cuda, vllm.__version__, torch.__version__))" 2>&1 | grep -v '^W[0-9]'
