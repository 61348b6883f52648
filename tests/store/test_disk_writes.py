"""DiskTier writes: atomic (a crash in the write or the rename leaves no file, a reader never sees a partial
one), put of an existing key (False, refreshes the mtime, keeps the bytes), per-key lookups, delete, clear and
usage, two stores sharing a path, a file evicted by another engine under a put, and concurrent puts (of one key
from two engines, of many keys)."""

import errno
import os
import threading
import time

import pytest
import torch

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store.disk import ChunkError, DiskTier
from tests.helpers import assert_same_bytes
from tests.store.disk_helpers import files_in, key_of, rand_chunk, set_mtime


# ------------------------------------------------------------------------------------------ atomic writes
@pytest.mark.parametrize(
    "exc", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()], ids=["EIO", "KeyboardInterrupt"]
)
def test_crash_in_write_leaves_no_file(store, monkeypatch, exc):
    key = key_of("crash")
    seen = {}
    real_write = disk_mod._write_all

    def write_half_then_crash(fd, bufs):
        seen["tmp"] = os.readlink(f"/proc/self/fd/{fd}")
        real_write(fd, bufs[:1])  # the header only: a partial file under the temporary name
        raise exc

    monkeypatch.setattr(disk_mod, "_write_all", write_half_then_crash)
    with pytest.raises(type(exc)):
        store.put(key, torch.ones(8))
    tmp = seen["tmp"]
    assert tmp != store.file_of(key)
    assert os.path.dirname(tmp) == os.path.dirname(store.file_of(key))  # same fs: the rename is atomic
    assert not os.path.exists(tmp)
    assert not store.contains(key)
    assert files_in(store.path) == []
    assert store.usage() == 0 and store.stats()["puts"] == 0
    monkeypatch.undo()
    assert store.put(key, torch.ones(8))  # a later put works
    assert_same_bytes(store.get(key), torch.ones(8))


@pytest.mark.parametrize("exc", [OSError("EXDEV"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_crash_in_rename_leaves_no_file(store, monkeypatch, exc):
    key = key_of("rename")
    calls = []

    def replace_crash(src, dst):
        calls.append((src, dst))
        assert os.path.getsize(src) > 0  # the complete file exists under the temporary name only
        assert not os.path.exists(dst)
        raise exc

    monkeypatch.setattr(disk_mod.os, "replace", replace_crash)
    with pytest.raises(type(exc)):
        store.put(key, torch.ones(8))
    monkeypatch.undo()
    assert calls and calls[0][1] == store.file_of(key)
    assert not os.path.exists(calls[0][0])
    assert files_in(store.path) == []


def test_reader_never_sees_a_partial_file(store):
    """While one thread writes large chunks, another polls: a present file must always verify."""
    keys = [key_of(f"big{i}") for i in range(6)]
    chunk = rand_chunk((1024, 1024), torch.uint8, 11)  # 1 MiB
    done = threading.Event()
    bad = []

    def reader():
        while not done.is_set():
            for k in keys:
                try:
                    store.get(k, chunk.shape, chunk.dtype)
                except ChunkError as e:
                    if "not on disk" not in str(e):
                        bad.append(str(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for k in keys:
            store.put(k, chunk)
    finally:
        done.set()
        t.join()
    assert bad == []
    assert all(store.contains(k) for k in keys)


# ------------------------------------------------------------------------------------------ put / lookup
def test_put_existing_returns_false_touches_mtime_and_keeps_bytes(store):
    key = key_of("dup")
    first, second = torch.zeros(6), torch.ones(6)
    assert store.put(key, first)
    old = time.time() - 1000
    set_mtime(store, key, old)
    assert store.put(key, second) is False
    assert os.path.getmtime(store.file_of(key)) > old + 900
    assert_same_bytes(store.get(key), first)
    assert store.stats()["puts"] == 1
    assert store.usage() == os.path.getsize(store.file_of(key))


@pytest.mark.parametrize("present", [[], [0], [1, 3], [0, 1, 2, 3, 4]], ids=str)
def test_contains_is_per_key(store, present):
    keys = [key_of(f"l{i}") for i in range(5)]
    for i in present:
        store.put(keys[i], torch.full((2,), i))
    assert [store.contains(k) for k in keys] == [i in present for i in range(5)]


def test_delete(store):
    key = key_of("del")
    store.put(key, torch.ones(4))
    assert store.delete(key) is True
    assert not store.contains(key) and store.usage() == 0
    assert store.delete(key) is False


def test_clear(store):
    for i in range(5):
        store.put(key_of(i), torch.ones(4))
    assert store.clear() == 5
    assert not any(store.contains(key_of(i)) for i in range(5))
    assert store.usage() == 0 and store.clear() == 0


def test_usage_is_the_sum_of_file_sizes(store):
    for i in range(4):
        store.put(key_of(i), torch.ones(i + 1, 8))
    assert store.usage() == sum(os.path.getsize(store.file_of(key_of(i))) for i in range(4))
    assert sorted(c.key for c in store.scan()) == sorted(key_of(i) for i in range(4))


# ------------------------------------------------------------------------------------------ two engines, threads
def test_two_stores_on_one_path_share_chunks(tmp_path):
    a, b = DiskTier.at(tmp_path, fingerprint="f"), DiskTier.at(tmp_path, fingerprint="f")
    chunk = rand_chunk((4, 4), torch.bfloat16, 9)
    assert a.put(key_of(1), chunk)
    assert b.contains(key_of(1))
    assert_same_bytes(b.get(key_of(1)), chunk)
    assert b.put(key_of(1), chunk) is False


def test_put_when_another_engine_evicts_the_existing_file(store, monkeypatch):
    """The file is there at the presence check and gone at the touch: the chunk must be written again."""
    key = key_of("race")
    store.put(key, torch.zeros(4))
    real_utime = os.utime

    def evicted_first(path, *args, **kw):
        os.unlink(path)
        return real_utime(path, *args, **kw)

    monkeypatch.setattr(disk_mod.os, "utime", evicted_first)
    assert store.put(key, torch.ones(4)) is True
    monkeypatch.undo()
    assert_same_bytes(store.get(key), torch.ones(4))


@pytest.mark.parametrize("threads", [2, 8])
def test_concurrent_puts_of_one_key(tmp_path, threads):
    stores = [DiskTier.at(tmp_path, fingerprint="f") for _ in range(2)]  # two engines, several threads
    chunk = rand_chunk((64, 64), torch.float16, 4)
    key = key_of("same")
    barrier = threading.Barrier(threads)
    results, errors = [], []

    def worker(i):
        barrier.wait()
        try:
            results.append(stores[i % 2].put(key, chunk))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and any(results)
    assert files_in(tmp_path) == [os.path.relpath(stores[0].file_of(key), tmp_path)]  # no tmp left over
    for s in stores:
        assert_same_bytes(s.get(key, chunk.shape, chunk.dtype), chunk)


def test_concurrent_puts_and_gets_of_many_keys(store):
    chunks = {key_of(i): rand_chunk((8, 8), torch.float32, i) for i in range(32)}
    items = list(chunks.items())
    errors = []

    def worker(part):
        try:
            for k, c in part:
                store.put(k, c)
                assert_same_bytes(store.get(k), c)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert store.stats()["puts"] == 32 and store.stats()["gets"] == 32
    assert all(store.contains(k) for k in chunks)
