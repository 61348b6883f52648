"""kvx.testing.vllm_server.VllmServer without vLLM: the command and environment it starts the server with."""

from __future__ import annotations

import stat

import pytest

from kvx.testing import vllm_server as S


def _env_dumping_python(tmp_path):
    """An executable standing in for the interpreter: prints its arguments and environment, then exits."""
    exe = tmp_path / "fake-python"
    exe.write_text('#!/bin/sh\necho "ARGS $*"\nenv\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def _run(tmp_path, monkeypatch, **kw):
    # what kvx.testing.harness sets for an offline engine in this process: must not reach a server
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("KVX_TEST_MARKER", "inherited")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    srv = S.VllmServer(
        "/models/m",
        ["--dtype", "float32"],
        python=_env_dumping_python(tmp_path),
        log_path=tmp_path / "serve.log",
        wait=False,
        **kw,
    )
    srv._proc.wait(timeout=30)
    srv.stop()
    lines = srv.log_text().splitlines()
    env = dict(ln.split("=", 1) for ln in lines if "=" in ln and not ln.startswith(("$", "ARGS")))
    args = next(ln for ln in lines if ln.startswith("ARGS")).split()[1:]
    return srv, env, args


def test_server_gets_vllm_serving_defaults_not_the_offline_ones(tmp_path, monkeypatch):
    srv, env, args = _run(tmp_path, monkeypatch)
    assert env["VLLM_LOGGING_LEVEL"] == "INFO"  # request / abort / "kvx: ... ready" lines
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # engine core in its own process
    assert env["KVX_TEST_MARKER"] == "inherited"
    assert "PYTHONSAFEPATH" not in env  # the working directory is dropped by the server itself
    assert args == [
        "-m",
        "kvx.testing.vllm_server",
        "serve",
        "/models/m",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(srv.port),
    ]


def test_explicit_env_wins(tmp_path, monkeypatch):
    _, env, _ = _run(tmp_path, monkeypatch, env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_server_drops_the_working_directory_python_m_put_first(monkeypatch, tmp_path):
    """`python -m kvx.testing.vllm_server` from the repository root: vLLM's probe for a `triton_kernels` package
    must not find the repository's folder of that name, so the server takes the working directory off sys.path
    before importing vLLM; other entries stay."""
    monkeypatch.chdir(tmp_path)
    for first in ("", str(tmp_path)):
        monkeypatch.setattr(S.sys, "path", [first, "/a", str(tmp_path / "b")])
        S._drop_working_directory()
        assert S.sys.path == ["/a", str(tmp_path / "b")]
    monkeypatch.setattr(S.sys, "path", ["/a", str(tmp_path)])  # not put first by -m: left alone
    S._drop_working_directory()
    assert S.sys.path == ["/a", str(tmp_path)]


def test_host_and_port_flags_are_refused():
    with pytest.raises(ValueError, match="--port"):
        S.VllmServer("/models/m", ["--port", "8000"], wait=False)
