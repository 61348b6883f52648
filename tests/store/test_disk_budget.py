"""The disk tier's capacity (kvx.store.disk.budget.Budget) alone, on a real directory and without a DiskTier:
concurrent reservations never let the directory exceed the capacity, the count stays exact when puts end
during a count (the lock is free while the directory is scanned), a put waits for its own writes in flight,
one eviction per full-disk episode, LRU order, and an unbounded budget."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from kvx.store.disk.budget import FULL_EVICT_FRACTION, Budget
from kvx.store.disk.directory import _LIVE_TMP, chunk_file, survey, temp_name
from kvx.store.errors import StoreFullError
from tests.helpers import dir_bytes, wait_for

CHUNK = 4096  # bytes of every chunk file here
# (writer threads, capacity in chunks, low watermark): 8 threads into 2 chunks wait for each other
LOADS = [(1, 3, 0.9), (4, 3, 1.0), (8, 5, 0.6), (8, 2, 0.9)]


def key_of(i) -> str:
    return f"{i:032x}"


class Store:
    """A store directory written as DiskTier writes it (reserve, temporary file, rename, end), with a Budget
    on it. ``lock`` is taken by every rename and unlink, so a measurement never sees a file under two names."""

    def __init__(self, path, capacity, low_watermark=0.9, rescan_s=5.0):
        self.path = str(path)
        os.makedirs(self.path, exist_ok=True)
        self.lock = threading.RLock()
        self.removed: list[tuple[list[str], bool]] = []
        self.scans = 0
        self.hold_scan: threading.Event | None = None  # set: the next scans wait for it after surveying
        self.in_scan = threading.Event()
        self.budget = Budget(self.path, capacity, low_watermark, rescan_s, time.monotonic, self.scan, self.on_removed)
        self.budget.recount()

    def scan(self):
        self.scans += 1
        sv = survey(self.path, remove_stale=True)
        if self.hold_scan is not None:
            self.in_scan.set()
            assert self.hold_scan.wait(10)
        return sv

    def on_removed(self, chunks, evicted):
        self.removed.append(([c.key for c in chunks], evicted))

    def put(self, key, size=CHUNK, written=None, ended=None, fail=False):
        """One put; ``written(tmp)``: called with its temporary file complete; ``ended()``: after the rename
        (or the failure), before the reservation ends."""
        final = chunk_file(self.path, key)
        r = self.budget.reserve(key, size, final)
        tmp = temp_name(final)
        _LIVE_TMP.add(tmp)
        self.budget.track(r, tmp)
        ok = False
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(b"\0" * size)
            if written is not None:
                written(tmp)
            if fail:
                raise OSError("write failed")
            with self.lock:
                os.replace(tmp, final)
            ok = True
        except OSError:
            pass
        finally:
            if not ok:
                os.unlink(tmp)
            _LIVE_TMP.discard(tmp)
            self.budget.untrack(r, tmp)
            if ended is not None:
                ended()
            self.budget.end(r, ok)
        return ok

    def bytes(self) -> int:
        with self.lock:
            return dir_bytes(self.path)


def aged(store: Store, n: int) -> list[str]:
    """``n`` chunks written, least recently used first (mtimes an hour apart)."""
    keys = [key_of(1000 + i) for i in range(n)]
    base = time.time() - (n + 1) * 3600
    for i, k in enumerate(keys):
        store.put(k)
        os.utime(chunk_file(store.path, k), (base + i * 3600, base + i * 3600))
    return keys


def run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a writer thread is stuck"


# ------------------------------------------------------------------------------------------ under concurrency
@pytest.mark.parametrize("threads, chunks, low_watermark", LOADS, ids=str)
def test_concurrent_reservations_never_exceed_the_capacity(tmp_path, monkeypatch, threads, chunks, low_watermark):
    s = Store(tmp_path, chunks * CHUNK, low_watermark, rescan_s=0.01)
    real_unlink = os.unlink

    def unlink(p, *args, **kwargs):
        with s.lock:
            return real_unlink(p, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    peak, errors = [0], []
    barrier = threading.Barrier(threads)

    def measure(_tmp):  # this put's file complete: the most the directory holds for it
        peak[0] = max(peak[0], s.bytes())

    def writer(t):
        barrier.wait()
        try:
            for j in range(12):
                assert s.put(key_of(t * 100 + j), written=measure)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run([threading.Thread(target=writer, args=(t,)) for t in range(threads)])
    assert errors == []
    assert peak[0] <= chunks * CHUNK, f"{peak[0]} bytes in a budget of {chunks * CHUNK}"
    evicted = sum(len(keys) for keys, ev in s.removed if ev)
    assert evicted == threads * 12 - len(survey(s.path).chunks) > 0  # it did evict, every file it deleted told
    assert s.budget.used == s.bytes()  # exact once every put ended
    s.budget.recount()
    assert s.budget.used == s.bytes()


@pytest.mark.parametrize("written", [True, False], ids=["renamed", "failed"])
def test_a_put_ending_during_a_count_is_counted_once(tmp_path, written):
    """A count takes the reservations, scans without the lock, and settles the puts that ended meanwhile: a
    file renamed into place before the scan saw it is not counted again as a reservation, and a failed
    write's reservation is not counted at all (without that: one chunk too many either way)."""
    s = Store(tmp_path, 100 * CHUNK)
    assert s.put(key_of(1))
    counter = threading.Thread(target=s.budget.recount)

    def count_now():  # the put's file is in place (or removed), its reservation not ended yet
        s.hold_scan = threading.Event()
        counter.start()
        assert s.in_scan.wait(10)
        # the put ends now, while the count waits in its scan: the budget's lock is free during a scan

    assert s.put(key_of(2), ended=count_now, fail=not written) is written
    s.hold_scan.set()
    counter.join(10)
    assert s.budget.used == s.bytes() == (2 if written else 1) * CHUNK


def test_a_put_waits_for_its_own_writes_in_flight(tmp_path):
    """Room for one chunk and a write in flight: the second put neither fails nor overshoots, it re-counts
    until the first one is on disk, then evicts it (least recently used)."""
    s = Store(tmp_path, CHUNK)
    writing, release, done = threading.Event(), threading.Event(), {}

    def hold(_tmp):
        writing.set()
        assert release.wait(10)

    first = threading.Thread(target=s.put, args=(key_of(1),), kwargs={"written": hold})
    first.start()
    assert writing.wait(10)
    second = threading.Thread(target=lambda: done.setdefault("ok", s.put(key_of(2))))
    scans = s.scans
    second.start()
    wait_for(lambda: s.scans >= scans + 3, 10, "the second put to re-count while it waits")
    assert "ok" not in done and s.bytes() == CHUNK  # no room while the first write is in flight
    release.set()
    first.join(10)
    second.join(10)
    assert done == {"ok": True}
    assert [c.key for c in survey(s.path).chunks] == [key_of(2)] and s.removed == [([key_of(1)], True)]
    assert s.budget.used == s.bytes() == CHUNK


def test_no_room_is_store_full(tmp_path):
    s = Store(tmp_path, 3 * CHUNK, rescan_s=0)  # every reservation counts: it sees the other writer's file
    with pytest.raises(StoreFullError, match=f"a file of {4 * CHUNK} bytes cannot fit in capacity_bytes={3 * CHUNK}"):
        s.budget.reserve(key_of(1), 4 * CHUNK, chunk_file(s.path, key_of(1)))
    # another host's write in flight fills the directory: nothing this budget may evict
    k = key_of(2)
    os.makedirs(os.path.dirname(chunk_file(s.path, k)))
    with open(os.path.join(os.path.dirname(chunk_file(s.path, k)), f".{k}.00000000.1.deadbeef.tmp"), "wb") as f:
        f.write(b"\0" * 3 * CHUNK)
    with pytest.raises(StoreFullError, match=rf"no room under {re.escape(s.path)} \({3 * CHUNK} of {3 * CHUNK} bytes"):
        s.put(key_of(3))
    assert s.budget.used == s.bytes() == 3 * CHUNK  # nothing reserved


# ------------------------------------------------------------------------------------------ eviction
def test_eviction_is_least_recently_used_down_to_the_low_watermark(tmp_path):
    s = Store(tmp_path, 10 * CHUNK, low_watermark=0.5)
    keys = aged(s, 10)
    s.removed.clear()
    assert s.budget.evict() == 5
    assert s.removed == [(keys[:5], True)]
    assert {c.key for c in survey(s.path).chunks} == set(keys[5:]) and s.budget.used == 5 * CHUNK
    assert s.put(key_of(1))  # fits: nothing evicted
    assert s.put(key_of(2)) and s.removed == [(keys[:5], True)]
    assert s.budget.clear() == 7
    cleared, evicted = s.removed[-1]
    assert not evicted and cleared[:5] == keys[5:] and set(cleared[5:]) == {key_of(1), key_of(2)}
    assert s.budget.used == s.bytes() == 0


def test_one_relief_per_full_disk_episode(tmp_path):
    """Writers failing on a full disk together evict once: the second waits for the first's eviction, then only
    retries (None)."""
    s = Store(tmp_path, None)
    keys = aged(s, 20)
    relief = s.budget.relief
    s.hold_scan = threading.Event()
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", s.budget.relieve(relief, CHUNK)))
    first.start()
    assert s.in_scan.wait(10)
    second = threading.Thread(target=lambda: got.setdefault("second", s.budget.relieve(relief, CHUNK)))
    second.start()
    assert s.budget.used == 20 * CHUNK  # the lock is free during the first one's scan
    assert "second" not in got  # it waits for the turn (the first eviction)
    s.hold_scan.set()
    first.join(10)
    second.join(10)
    n = int(20 * FULL_EVICT_FRACTION)
    assert got == {"first": (n, n * CHUNK), "second": None}
    assert {c.key for c in survey(s.path).chunks} == set(keys[n:]) and s.budget.used == (20 - n) * CHUNK
    assert s.budget.relieve(s.budget.relief, 3 * CHUNK) == (3, 3 * CHUNK)  # at least the chunk being written


# ------------------------------------------------------------------------------------------ unbounded
def test_unbounded_budget_counts_without_reserving(tmp_path):
    s = Store(tmp_path, None)
    scans = s.scans
    assert not s.budget.reserve(key_of(0), CHUNK, chunk_file(s.path, key_of(0))).counted
    assert s.budget.used == 0  # nothing reserved
    assert s.put(key_of(1))
    assert s.budget.used == CHUNK and s.scans == scans  # its file counted, without a count
    assert s.budget.evict() == 0
    s.budget.capacity = 2 * CHUNK  # set while the tier runs: the next puts reserve
    assert s.put(key_of(2)) and s.put(key_of(3))
    assert s.budget.used <= 2 * CHUNK and len(survey(s.path).chunks) <= 2
