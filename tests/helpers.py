"""Helpers shared by the tests of every package: bit-exact tensor comparison, polling with a deadline, a real
small file system (tmpfs), and a few more.

Import them as ``from tests.helpers import ...`` from any test directory: the suite runs from the repository
root with ``--import-mode=importlib`` (pyproject.toml), where ``tests`` is a namespace package. Fixtures live in
the ``conftest.py`` files; plain functions live here.
"""

from __future__ import annotations

import os
import subprocess
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")


# ------------------------------------------------------------------------------------------ bit-exact compare
def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in element order, one row per element: ``[numel, element_size]`` uint8 (any dtype,
    float8 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), flat.element_size())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bytes: bit-exact, so NaN payloads, -0.0 and float8
    compare as the bits they are (``torch.equal`` would call NaN != NaN and -0.0 == 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_raw(a), _raw(b))


def _element(t: torch.Tensor, i: int) -> str:
    """Element ``i`` (in row-major order) of ``t``: its value and its bits, e.g. ``1.0 (0x3f80)``."""
    x = t.detach().reshape(-1)[i].cpu()
    bits = int.from_bytes(bytes(_raw(x).reshape(-1).tolist()), "little")
    try:
        value = x.item()
    except (RuntimeError, TypeError):  # a dtype .item() cannot convert
        value = x.float().item()
    return f"{value!r} (0x{bits:0{2 * x.element_size()}x})"


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    """Assert :func:`same_bytes`. A failure names the first differing element (its index in ``a``'s shape), its
    value and bits in both, and how many elements differ: ``what differ at (1, 0, 3) (1 of 4096 elements):
    0.5 (0x3800) != nan (0x7e00)``."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    x, y = _raw(a), _raw(b)
    if torch.equal(x, y):
        return
    differ = (x != y).any(dim=1).nonzero().reshape(-1).cpu()
    first = int(differ[0])
    index, rest = [], first
    for n in reversed(a.shape):
        index.append(rest % n)
        rest //= n
    raise AssertionError(
        f"{what} differ at {tuple(reversed(index))} ({len(differ)} of {a.numel()} elements): "
        f"{_element(a, first)} != {_element(b, first)}"
    )


def assert_all_same_bytes(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor], what: str = "layer") -> None:
    """:func:`assert_same_bytes` of two equally long sequences of tensors, pairwise (the layers of two caches,
    e.g. ``KVLayout.layers``); a failure names the position: ``layer 2 differ at ...``."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} != {len(b)} {what}s"
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_bytes(x, y, f"{what} {i}")


def case_seed(*key) -> int:
    """A per-case seed that is the same in every process (unlike hash())."""
    return zlib.crc32(repr(key).encode())


# ------------------------------------------------------------------------------------------ polling
def wait_for(cond: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.01) -> T:
    """Call ``cond()`` until it returns something true, and return that: a wait on the condition itself, which a
    loaded machine only makes slower, never wrong (a fixed sleep would). ``interval`` seconds pass between
    calls (0: none; ``cond`` may then do the waiting, e.g. step an engine). Past ``timeout`` seconds raise an
    AssertionError naming ``what`` was waited for; a callable ``what`` is called then, for a message with the
    state at that time (``lambda: f"the tier to reconnect: {tier.stats()}"``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what() if callable(what) else what}")
        if interval:
            time.sleep(interval)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped. SIGSTOP is delivered asynchronously, and a thread in
    a system call (a writer preempted in the middle of its rename) stops only when the call returns: until then
    the process may still change things. Poll it: ``wait_for(lambda: stopped(pid), 10, f"{pid} to stop")``."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that has just exited
            pass
    return bool(states) and all(s in ("T", "t") for s in states)


# ------------------------------------------------------------------------------------------ file systems
def mount_tmpfs(path, size: str = "8m"):
    """Mount a fresh tmpfs of ``size`` at ``path`` (made if missing) and return ``path``: a real, small file system
    (a disk that really fills up, or that can be turned read-only with :func:`remount`). Needs root and the right
    to mount; skips the test with the reason otherwise. Undo with :func:`umount` (the ``tmpfs`` fixture of
    tests/conftest.py does)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    return path


def umount(path) -> None:
    """Unmount ``path``; if it is still busy, detach it now (the kernel frees it later)."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path, mode: str) -> None:
    """Remount a :func:`mount_tmpfs` file system ``"ro"`` or ``"rw"`` (a store whose file system turns
    read-only)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


def dir_bytes(path) -> int:
    """Bytes of the files under ``path`` now (a file removed while walking counts nothing)."""
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                pass
    return total


def flip_byte(path, from_end: int = 100) -> None:
    """Damage a file the way a bad disk or a stray write does: one byte ``from_end`` bytes before its end."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


# ------------------------------------------------------------------------------------------ stored chunks
# In a byte tier (disk, Redis) a chunk is a *record* under its chunk key, written once the chunk is stored whole,
# and *parts* under kvx.keys.part_key(chunk key, name): one per KV head of the model (per pipeline
# stage's layers), or one per TP rank for hybrid models (kvx.connector.parts). A file or value is told from the
# other by its header: the scheduler writes records with the metadata ``kind: record``.
def is_record(head: bytes) -> bool:
    """Whether a stored object whose first bytes are ``head`` (its codec header, sealed or not: the metadata is in
    the clear) is a chunk's record, not a part of one (False for anything else, such as the manifest of a Redis
    value split in pieces)."""
    from kvx.store import ChunkError, codec

    try:
        return codec.decode_header(head).meta.get("kind") == "record"
    except ChunkError:
        return False


def store_objects(path) -> tuple[list[str], list[str]]:
    """(records, parts): a disk store's chunk files (``.safetensors``), sorted. A file removed while it is read
    counts as neither."""
    records, parts = [], []
    for d, _, fs in os.walk(path):
        for f in fs:
            if not f.endswith(".safetensors"):
                continue
            p = os.path.join(d, f)
            try:
                with open(p, "rb") as fh:
                    head = fh.read(1 << 16)
            except FileNotFoundError:
                continue
            (records if is_record(head) else parts).append(p)
    return sorted(records), sorted(parts)


def stored_chunk_keys(llm, ids: list[int], chunk_size: int) -> list[tuple[str, list[str]]]:
    """Per full chunk of ``ids`` (no cache_salt), as an in-process engine ``llm`` (one worker, every KV head and
    layer) stores it in a byte tier: (the chunk key, which names its record; its parts' keys)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvx.keys import chunk_keys, part_key, request_root

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    names = get_kv_transfer_group().worker_side.share.part_names()
    return [(k, [part_key(k, n) for n in names]) for k in chunk_keys(request_root(sched.namespace), ids, chunk_size)]


# ------------------------------------------------------------------------------------------ benchmarks, Redis
def load_benchmark(monkeypatch, name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
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


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state; comm may hold spaces


def redis_server_pids() -> set[int]:
    """Pids of the redis-server processes this process started (its descendants): what another test process runs
    at the same time (a second pytest worker, another checkout's tests) is not this test's to count."""
    me, pids = os.getpid(), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() != "redis-server":
                        continue
                pid = int(d)
                while pid > 1 and pid != me:
                    pid = _parent(pid)
                if pid == me:
                    pids.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return pids
