"""DiskTier on a failing disk: a full disk (ENOSPC/EDQUOT, simulated, and a real 8 MiB tmpfs when root) evicts
10% and retries once, then backs off without touching the disk; read-only directories (EROFS, chmod, a read-only
mount); the store's directory deleted while serving; files deleted by another engine before or during a read."""

import errno
import os
import re
import shutil
import time

import pytest
import torch

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store import StoreError, StoreFullError
from kvx.store.disk import ChunkError, DiskTier
from tests.helpers import assert_same_bytes, mount_tmpfs, remount, umount
from tests.store.disk_helpers import files_in, key_of, one_file_bytes, rand_chunk, set_mtime

# ------------------------------------------------------------------------------------------ full disk
FULL_ERRNOS = [errno.ENOSPC, errno.EDQUOT]


BACKOFFS = [1, 2, 4, 8, 16, 32, 60, 60]  # seconds: doubling from 1, at most 60


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def fill(s: DiskTier, n: int, shape=(2, 8)) -> list[str]:
    """``n`` chunks, least recently used first (mtimes an hour apart, in the past)."""
    keys = [key_of(f"fill{i}") for i in range(n)]
    base = time.time() - (n + 1) * 3600
    for i, k in enumerate(keys):
        s.put(k, torch.zeros(shape, dtype=torch.float16))
        set_mtime(s, k, base + i * 3600)
    return keys


def temps_in(path) -> list[str]:
    return [f for f in files_in(path) if not f.endswith(".safetensors")]


@pytest.mark.parametrize("capacity", [None, 1000], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("err", FULL_ERRNOS, ids=errno.errorcode.get)
def test_full_disk_evicts_least_recently_used_and_retries_once(tmp_path, monkeypatch, err, capacity):
    """A full disk is not the store's capacity: eviction there never ran, and every later put failed."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=capacity and capacity * size)
    keys = fill(s, 20)
    real = disk_mod._write_all
    calls = []

    def full_once(fd, bufs):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(err, os.strerror(err))
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", full_once)
    assert s.put(key_of("new"), torch.ones(2, 8, dtype=torch.float16)) is True
    assert len(calls) == 2
    # 10% of the bytes of 20 equal chunks: the 2 least recently used
    assert {c.key for c in s.scan()} == set(keys[2:]) | {key_of("new")}
    assert s.stats()["evicted"] == 2 and s.stats()["full"] == 0
    assert temps_in(s.path) == []


def test_full_disk_backs_off_then_recovers(tmp_path, monkeypatch):
    clock = FakeClock()
    path = tmp_path / "kv"
    s = DiskTier.at(path, clock=clock)
    fill(s, 30)
    real = disk_mod._write_all
    disk = {"full": True, "writes": 0}

    def write(fd, bufs):
        disk["writes"] += 1
        if disk["full"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, bufs)

    touched = []
    for name in ("open", "stat", "utime", "scandir", "mkdir"):  # every way put reaches the store's files
        real_fn = getattr(os, name)

        def spy(p, *args, _real=real_fn, **kwargs):
            if str(p).startswith(str(path)):
                touched.append(p)
            return _real(p, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    monkeypatch.setattr(disk_mod, "_write_all", write)
    chunk = torch.ones(2, 8, dtype=torch.float16)
    with pytest.raises(StoreFullError, match=r"no space left on device .* back-off \(1 s\)") as e:
        s.put(key_of("first"), chunk)
    assert isinstance(e.value, StoreError) and isinstance(e.value.__cause__, OSError)
    assert disk["writes"] == 2 and s.stats()["evicted"] == 3  # one eviction (10%), one retry
    assert temps_in(path) == []
    for backoff, following in zip(BACKOFFS, BACKOFFS[1:]):
        failed_at = clock.t
        clock.t = failed_at + backoff - 0.01  # still backing off: no disk access at all
        touched.clear()
        writes = disk["writes"]
        with pytest.raises(StoreFullError, match=rf"back-off \({backoff} s, 0.0 s left\)"):
            s.put(key_of(f"fast{backoff}"), chunk)
        assert disk["writes"] == writes and touched == []
        clock.t = failed_at + backoff  # over: try again, fail, back off longer
        with pytest.raises(StoreFullError, match=rf"back-off \({following} s\)"):
            s.put(key_of(f"again{backoff}"), chunk)
        assert disk["writes"] == writes + 2
    disk["full"] = False
    clock.t += 60
    assert s.put(key_of("recovered"), chunk) is True  # a success resets the back-off
    disk["full"] = True
    with pytest.raises(StoreFullError, match=r"back-off \(1 s\)"):
        s.put(key_of("full again"), chunk)
    assert temps_in(path) == []


def test_writers_hitting_a_full_disk_together_evict_once(tmp_path, monkeypatch):
    """Two puts fail on the full disk at once: the second retries in the room the first one made
    instead of evicting another 10%."""
    s = DiskTier.at(tmp_path / "kv")
    keys = fill(s, 20)
    real = disk_mod._write_all
    n = {"writes": 0}

    def write(fd, bufs):
        n["writes"] += 1
        if n["writes"] == 1:  # put A's write fails; put B started meanwhile fails, evicts, retries
            assert s.put(key_of("b"), torch.ones(2, 8, dtype=torch.float16))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if n["writes"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", write)
    assert s.put(key_of("a"), torch.ones(2, 8, dtype=torch.float16))
    assert n["writes"] == 4 and s.stats()["evicted"] == 2
    assert {c.key for c in s.scan()} == set(keys[2:]) | {key_of("a"), key_of("b")}


def test_full_tmpfs_is_relieved_by_eviction_and_backs_off_when_nothing_is_left(tmpfs):
    disk = tmpfs("8m")  # 8 MiB: a disk that really fills up
    clock = FakeClock()
    s = DiskTier.at(disk / "kv", clock=clock)
    chunk = rand_chunk((1 << 20,), torch.uint8, 1)  # 1 MiB: 7 fit in 8 MiB with their headers
    base = time.time() - 3600
    for i in range(20):
        assert s.put(key_of(i), chunk) is True
        set_mtime(s, key_of(i), base + i)
    kept = sorted(c.key for c in s.scan())
    assert 5 <= len(kept) <= 7 and kept == sorted(key_of(i) for i in range(20 - len(kept), 20))  # the newest
    assert s.stats()["evicted"] >= 20 - 7 and s.stats()["full"] == 0
    assert temps_in(s.path) == []
    # Now something the store cannot evict takes the whole disk: puts fail, leave nothing, back off.
    s.clear()
    fd = os.open(disk / "other", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError) as full:
        while True:
            os.write(fd, b"\0" * 65536)
    os.close(fd)
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(StoreFullError, match=r"back-off \(1 s\)"):
        s.put(key_of("x"), chunk)
    assert temps_in(s.path) == []
    with pytest.raises(StoreFullError, match=r"0.5 s left"):
        clock.t += 0.5
        s.put(key_of("x"), chunk)
    os.unlink(disk / "other")
    clock.t += 0.5
    assert s.put(key_of("x"), chunk) is True
    assert_same_bytes(s.get(key_of("x")), chunk)


# ------------------------------------------------------------------------------------------ read-only, vanishing files
@pytest.fixture(params=["EROFS", "chmod", "read-only mount"])
def read_only_store(request, tmp_path, monkeypatch):
    """A store holding one chunk (key_of("old")) on a directory that refuses writes."""
    how = request.param
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    path = tmp_path / "kv"
    if how == "read-only mount":
        mount_tmpfs(path, "1m")
    s = DiskTier.at(path, capacity_bytes=1 << 20)
    s.put(key_of("old"), torch.ones(4))
    if how == "EROFS":
        real_open = os.open

        def read_only(p, *args, **kwargs):
            if str(p).startswith(str(path)) and len(args) and args[0] & os.O_CREAT:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), p)
            return real_open(p, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    elif how == "chmod":
        (path / key_of("new")[:2]).mkdir(exist_ok=True)
        for d in (*path.iterdir(), path):
            d.chmod(0o555)
    else:
        remount(path, "ro")
    try:
        yield s
    finally:
        if how == "chmod":
            for d in path.iterdir():
                d.chmod(0o755)
            path.chmod(0o755)
        elif how == "read-only mount":
            umount(path)


def test_put_to_a_read_only_directory_fails_clearly_and_leaves_nothing(read_only_store):
    s = read_only_store
    before = files_in(s.path)
    key = key_of("new")
    with pytest.raises(OSError, match=rf"disk store {re.escape(s.path)}: cannot write chunk {key}") as e:
        s.put(key, torch.ones(4))
    assert e.value.errno in (errno.EROFS, errno.EACCES) and e.value.filename == s.file_of(key)
    assert not isinstance(e.value, StoreFullError)
    assert files_in(s.path) == before and s.stats()["puts"] == 1
    assert_same_bytes(s.get(key_of("old")), torch.ones(4))  # reads still work
    assert s.usage() == os.path.getsize(s.file_of(key_of("old")))
    assert s.evict() == 0


def test_store_directory_deleted_while_serving(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size)
    chunk = torch.zeros(2, 8, dtype=torch.float16)
    for i in range(3):
        s.put(key_of(i), chunk)
    shutil.rmtree(s.path)
    assert not s.contains(key_of(0))
    with pytest.raises(ChunkError, match="not on disk"):
        s.get(key_of(0))
    assert list(s.scan()) == [] and s.temp_files() == [] and s.usage() == 0
    assert s.evict() == 0 and s.clear() == 0 and s.delete(key_of(0)) is False
    assert s.stats()["errors"] == 0
    assert s.put(key_of(0), chunk) is True  # recreates the directory
    assert_same_bytes(s.get(key_of(0)), chunk)
    for i in range(1, 5):  # and the count starts from what is there
        s.put(key_of(i), chunk)
    assert s.usage() <= 3 * size


def test_file_deleted_between_contains_and_get_is_a_miss(store, monkeypatch):
    key = key_of("gone")
    store.put(key, torch.ones(4))
    assert store.contains(key)
    real = open

    def evicted_first(path, *args, **kwargs):
        os.unlink(path)  # another engine evicts it just now
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_mod, "open", evicted_first, raising=False)
    with pytest.raises(ChunkError, match="not on disk"):
        store.get(key)
    assert store.stats()["errors"] == 0


def test_file_deleted_while_being_read_is_still_served(store, monkeypatch):
    """Once open, the bytes stay readable (the open file holds them) and verify."""
    key = key_of("reading")
    chunk = rand_chunk((16, 16), torch.bfloat16, 3)
    store.put(key, chunk)
    real = open

    def open_then_evicted(path, *args, **kwargs):
        f = real(path, *args, **kwargs)
        os.unlink(path)  # another engine evicts it once it is open
        return f

    monkeypatch.setattr(disk_mod, "open", open_then_evicted, raising=False)
    assert_same_bytes(store.get(key, chunk.shape, chunk.dtype), chunk)
    assert not store.contains(key) and store.stats()["errors"] == 0
