"""DiskTier capacity: LRU eviction down to the low watermark (recency refreshed by gets and repeated puts,
files already on disk counted), engines sharing a path within its budget, evictions by one engine seen by
another, and capacity under concurrent writers measured on the directory itself (never over the capacity, not
even for a moment; a chunk larger than the capacity; puts waiting for writes in flight; a capacity set mid-put)."""

import os
import threading
import time

import pytest
import torch

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store import StoreFullError
from kvx.store.disk import ChunkError, DiskTier
from tests.helpers import dir_bytes
from tests.store.disk_helpers import files_in, key_of, one_file_bytes, rand_chunk, set_mtime

# ------------------------------------------------------------------------------------------ capacity / LRU
# mtimes are set explicitly (an hour apart, in the past) so the LRU order does not depend on the clock
MTIME_ORDERS = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]]


@pytest.mark.parametrize("order", MTIME_ORDERS, ids=str)
def test_eviction_removes_least_recently_used_down_to_low_watermark(tmp_path, order):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=5 * size, low_watermark=0.6)  # target: 3 files
    keys = [key_of(i) for i in range(5)]
    for k in keys:
        assert s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    assert s.stats()["evicted"] == 0  # at capacity, not over
    base = time.time() - 10 * 3600
    for rank, i in enumerate(order):  # order[0] is the oldest
        set_mtime(s, keys[i], base + rank * 3600)
    new = key_of("new")
    s.put(new, torch.zeros(2, 8, dtype=torch.float16))  # 6 files > 5: evict down to 3
    survivors = {keys[order[3]], keys[order[4]], new}
    assert {c.key for c in s.scan()} == survivors
    assert s.stats()["evicted"] == 3
    assert s.usage() == 3 * size


def test_get_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
    keys = [key_of(i) for i in range(3)]
    for k in keys:
        s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    base = time.time() - 3600
    for i, k in enumerate(keys):
        set_mtime(s, k, base + i)  # keys[0] oldest
    s.get(keys[0])  # now the most recent
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {keys[0], keys[2], key_of("new")}


def test_put_of_existing_key_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
    keys = [key_of(i) for i in range(3)]
    for i, k in enumerate(keys):
        s.put(k, torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, k, time.time() - 3600 + i)
    assert s.put(keys[0], torch.zeros(2, 8, dtype=torch.float16)) is False
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {keys[0], keys[2], key_of("new")}


def test_capacity_counts_files_already_on_disk(tmp_path):
    """A store opened on a full directory (a restart) evicts on its first put."""
    size = one_file_bytes(tmp_path)
    first = DiskTier.at(tmp_path / "kv")
    for i in range(4):
        first.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(first, key_of(i), time.time() - 3600 + i)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=4 * size + size // 2, low_watermark=0.5)
    assert s.usage() == 4 * size
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {key_of(3), key_of("new")}


def test_unbounded_store_never_evicts(tmp_path):
    s = DiskTier.at(tmp_path)
    for i in range(10):
        s.put(key_of(i), torch.zeros(64))
    assert s.evict() == 0 and all(s.contains(key_of(i)) for i in range(10))


def test_evict_with_nothing_to_do(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=10 * size)
    s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16))
    assert s.evict() == 0 and s.contains(key_of(0))


# ------------------------------------------------------------------------------------------ two engines
@pytest.mark.parametrize("rescan_s", [0, 3600])
def test_engines_sharing_a_path_keep_it_within_its_budget(tmp_path, rescan_s):
    """Each engine re-counts the directory (after rescan_s), so together they stay within the budget."""
    size = one_file_bytes(tmp_path)
    stores = [
        DiskTier.at(tmp_path / "kv", capacity_bytes=6 * size, low_watermark=1.0, rescan_s=rescan_s) for _ in range(3)
    ]
    peak = 0
    for i in range(30):
        stores[i % 3].put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        peak = max(peak, stores[0].usage())
    if rescan_s == 0:
        assert peak <= 6 * size
    else:  # counts go stale for an hour: each engine sees only its own writes
        assert peak > 6 * size


def test_eviction_by_one_engine_is_a_miss_for_the_other(tmp_path):
    size = one_file_bytes(tmp_path)
    a = DiskTier.at(tmp_path / "kv", capacity_bytes=2 * size, low_watermark=1.0)
    b = DiskTier.at(tmp_path / "kv")
    b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16))
    set_mtime(b, key_of("b"), time.time() - 3600)
    a.put(key_of("a1"), torch.zeros(2, 8, dtype=torch.float16))
    a.put(key_of("a2"), torch.zeros(2, 8, dtype=torch.float16))
    # a counts only its own writes (2 files: not over); its next eviction scans the whole directory
    assert a.evict() == 1
    assert a.contains(key_of("a1")) and a.contains(key_of("a2"))
    assert not b.contains(key_of("b"))
    with pytest.raises(ChunkError, match="not on disk"):
        b.get(key_of("b"))
    assert b.stats()["errors"] == 0
    assert b.delete(key_of("b")) is False
    assert b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16)) is True


def test_evict_tolerates_files_deleted_by_another_engine(tmp_path, monkeypatch):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=4 * size, low_watermark=0.5)
    for i in range(4):
        s.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, key_of(i), time.time() - 3600 + i)
    real_unlink = os.unlink

    def other_engine_was_faster(path, *args, **kw):
        real_unlink(path)  # another engine removes it between scan and unlink
        return real_unlink(path, *args, **kw)  # -> FileNotFoundError

    monkeypatch.setattr(disk_mod.os, "unlink", other_engine_was_faster)
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))  # 5 > 4: evict down to 2
    monkeypatch.undo()
    assert {c.key for c in s.scan()} == {key_of(3), key_of("new")}


# ------------------------------------------------------------------------------------------ capacity under load
class DirMeter:
    """The real bytes under a directory (chunk and temporary files), measured after every rename and by a
    sampling thread. Renames and unlinks take the meter's lock, so a measurement never sees a file under
    two names or half-way through an eviction; a temporary file being written counts with what it holds
    so far (never more than the bytes its put reserved)."""

    def __init__(self, path, monkeypatch):
        self.path, self.lock, self.peak, self.samples, self.at_peak = str(path), threading.RLock(), 0, 0, []
        real_replace, real_unlink = os.replace, os.unlink

        def replace(src, dst, *args, **kwargs):
            with self.lock:
                real_replace(src, dst, *args, **kwargs)
                self.measure()

        def unlink(p, *args, **kwargs):
            with self.lock:
                return real_unlink(p, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)

    def measure(self) -> int:
        with self.lock:
            total = dir_bytes(self.path)
            if total > self.peak:  # what was there, for the failure message
                self.peak, self.at_peak = total, files_in(self.path)
            self.samples += 1
            return total

    def sampling(self, done: threading.Event) -> threading.Thread:
        def run():
            while not done.is_set():
                self.measure()
                time.sleep(0.001)  # let the writers at the lock between samples

        t = threading.Thread(target=run)
        t.start()
        return t


def put_from_threads(stores, threads: int, per_thread: int, shape, meter: DirMeter) -> list:
    """``threads`` writer threads per store, each putting ``per_thread`` distinct chunks at once."""
    jobs = [(s, f"{i}-{t}") for i, s in enumerate(stores) for t in range(threads)]
    barrier = threading.Barrier(len(jobs))
    results, errors = [], []

    def worker(s, tag):
        barrier.wait()
        try:
            for j in range(per_thread):
                results.append(s.put(key_of(f"{tag}-{j}"), rand_chunk(shape, torch.float16, j)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    done = threading.Event()
    sampler = meter.sampling(done)
    ts = [threading.Thread(target=worker, args=job) for job in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.set()
    sampler.join()
    assert errors == []
    return results


LOAD_SHAPE = (64, 256)  # 32 KiB chunks: a write takes long enough for the threads to overlap


# (writer threads, capacity in chunks, low watermark): 8 threads into 2 chunks wait for each other
LOADS = [(1, 3, 0.9), (4, 3, 1.0), (8, 5, 0.6), (8, 2, 0.9)]


@pytest.mark.parametrize("threads, chunks, low_watermark", LOADS, ids=str)
def test_concurrent_puts_never_exceed_the_capacity(tmp_path, monkeypatch, threads, chunks, low_watermark):
    """Each put reserves its bytes and evicts before writing: the directory never holds more than the
    capacity, not even for a moment (the old store counted after the write and evicted afterwards:
    one chunk over per writer thread)."""
    size = one_file_bytes(tmp_path, LOAD_SHAPE)
    path = tmp_path / "kv"
    s = DiskTier.at(path, capacity_bytes=chunks * size, low_watermark=low_watermark)
    meter = DirMeter(path, monkeypatch)
    results = put_from_threads([s], threads, 10, LOAD_SHAPE, meter)
    assert results == [True] * threads * 10
    assert meter.peak <= chunks * size, f"{meter.peak} bytes of {chunks * size}: {meter.at_peak}"
    assert meter.peak >= (chunks - 1) * size and s.stats()["evicted"] > 0  # the test did reach the limit
    assert s.usage() <= chunks * size


def test_engines_sharing_a_path_overshoot_at_most_the_others_writes_in_flight(tmp_path, monkeypatch):
    """With rescan_s=0 every put re-counts the directory: N engines with T writer threads each stay within
    capacity + (N-1) x (T+1) chunks (what the others have in flight or reserve during one count)."""
    n, threads, chunks = 2, 3, 4
    size = one_file_bytes(tmp_path, LOAD_SHAPE)
    path = tmp_path / "kv"
    stores = [DiskTier.at(path, capacity_bytes=chunks * size, low_watermark=0.9, rescan_s=0) for _ in range(n)]
    meter = DirMeter(path, monkeypatch)
    put_from_threads(stores, threads, 8, LOAD_SHAPE, meter)
    assert meter.peak <= chunks * size + (n - 1) * (threads + 1) * size
    assert sum(s.stats()["evicted"] for s in stores) > 0


def test_chunk_larger_than_the_capacity_is_refused(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=size - 1)
    with pytest.raises(StoreFullError, match=f"a file of {size} bytes cannot fit in capacity_bytes={size - 1}"):
        s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16))
    assert files_in(s.path) == [] and s.stats()["full"] == 1


def test_put_waits_for_its_own_writes_in_flight_when_they_fill_the_capacity(tmp_path, monkeypatch):
    """Capacity for one chunk, two puts at once: the second waits until the first is on disk, then
    evicts it (LRU) rather than fail or overshoot."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=size)
    real = disk_mod._write_all
    writing, release = threading.Event(), threading.Event()
    second = {}

    def slow_first_write(fd, bufs):
        if not writing.is_set():
            writing.set()
            release.wait(10)
        real(fd, bufs)

    def put_second():
        second["result"] = s.put(key_of(2), torch.ones(2, 8, dtype=torch.float16))

    monkeypatch.setattr(disk_mod, "_write_all", slow_first_write)
    first = threading.Thread(target=lambda: s.put(key_of(1), torch.zeros(2, 8, dtype=torch.float16)))
    first.start()
    assert writing.wait(10)
    t = threading.Thread(target=put_second)
    t.start()
    t.join(0.2)
    assert t.is_alive() and "result" not in second  # no room while the first write is in flight
    release.set()
    first.join()
    t.join()
    assert second["result"] is True
    assert [c.key for c in s.scan()] == [key_of(2)] and s.stats()["evicted"] == 1


def test_capacity_set_while_a_put_writes_keeps_the_count_exact(tmp_path, monkeypatch):
    """A put that began without a capacity (reserving nothing) and ends after ``capacity_bytes`` was set
    must not settle as a reservation: the store once counted it as a negative reservation from then on,
    one chunk under the truth, and held capacity + 1 chunks (tests/faults/test_soak.py sets the capacity
    while the engine writes)."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv")
    real = disk_mod._write_all
    writing, release = threading.Event(), threading.Event()

    def slow_first_write(fd, bufs):
        if not writing.is_set():
            writing.set()
            release.wait(10)
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", slow_first_write)
    first = threading.Thread(target=lambda: s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16)))
    first.start()
    assert writing.wait(10)
    s.capacity_bytes = 3 * size
    release.set()
    first.join()
    for i in range(1, 8):
        assert s.put(key_of(i), torch.full((2, 8), i, dtype=torch.float16))
    assert len(files_in(s.path)) <= 3 and s.usage() <= 3 * size
    assert s.usage() == sum(os.path.getsize(os.path.join(s.path, f)) for f in files_in(s.path))
