"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size="8m", name="tmpfs") -> path``: a real, small file system mounted for the test (a disk
    that really fills up, or that can be remounted read-only with :func:`remount`). Needs root and the
    right to mount; skips with the reason otherwise. Unmounted at teardown."""
    mounted = []

    def make(size: str = "8m", name: str = "tmpfs"):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / name
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in reversed(mounted):
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def remount(path, mode: str) -> None:
    """Remount a :func:`tmpfs` ``"ro"`` or ``"rw"`` (a store whose file system turns read-only)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


@pytest.fixture(autouse=True)
def _kvx_logger_back_to_root():
    """An engine started by a test puts the ``kvx`` logger under vLLM's (kvx.log.attach_to_vllm), whose
    handlers do not propagate: put it back, so a later test's ``caplog`` sees kvx's records."""
    import logging

    kvx = logging.getLogger("kvx")
    parent, propagate = kvx.parent, kvx.propagate
    yield
    kvx.parent, kvx.propagate = parent, propagate


def flip_byte(path, from_end: int = 100) -> None:
    """Damage a file the way a bad disk or a stray write does: one byte ``from_end`` bytes before its end."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def load_benchmark(monkeypatch, name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)     # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def need_redis() -> None:
    """Skip without redis-server / redis-cli on a developer's machine; in CI (CI=true), where
    scripts/setup.sh installs them, their absence is a broken setup and fails."""
    from kvx.testing.redis_server import redis_cli_binary, redis_server_binary

    try:
        redis_server_binary()
        redis_cli_binary()
    except RuntimeError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {e}")
        pytest.skip(str(e))


def redis_server_pids() -> set[int]:
    """Pids of the redis-server processes of this user."""
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() == "redis-server" and os.stat(f"/proc/{d}").st_uid == os.getuid():
                        pids.add(int(d))
            except OSError:
                pass
    return pids
