"""The capacity of one disk tier (:class:`Budget`): the count of its directory's bytes, the reservations of
its puts, LRU eviction, and the eviction that relieves a full disk.

A put reserves its file's size before writing: if this engine's count of the directory plus the reservation
would exceed the capacity, it first deletes the least recently used chunk files (mtime; a read touches it)
down to ``low_watermark * capacity`` (the new chunk included). So one engine never exceeds the capacity,
however many writer threads it runs. Other engines on the path are seen when the directory is counted again
(at most ``rescan_s`` apart, and at every eviction; :class:`~.tier.DiskTier` gives the bound with several
engines); they may delete files at any time (a file already gone counts as freed).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StoreFullError
from .directory import ChunkInfo, Survey

# On ENOSPC/EDQUOT: evict this fraction of the store's chunk bytes (LRU), at least the chunk being
# written. The store cannot know how much room the rest of the file system needs; 10% makes room for
# many chunks (a 100 GiB store frees 10 GiB: 2560 chunks of 4 MiB), so a full disk costs one scan per
# 10% of the store rather than one per chunk, and keeps 90% of the cached chunks.
FULL_EVICT_FRACTION = 0.1
_WAIT_S = 0.05  # a put waiting for its own engine's in-flight writes re-checks at least this often


@dataclass(eq=False)
class Reservation:
    """The bytes of one put, counted against the capacity from before its write until :meth:`Budget.end`."""

    size: int
    final: str  # the chunk file it writes
    # whether its bytes were counted before the write (there was a capacity): decided once, as the capacity
    # may be set while it writes
    counted: bool


class Budget:
    """The capacity accounting of one disk tier: what its directory holds, at the last count plus this
    tier's writes since; reservations; LRU eviction.

    Args:
        path: the store directory (for errors).
        capacity: bytes the directory may hold (chunk and temporary files); None: unbounded (puts then
            reserve nothing, but the count is kept). May be set at any time: each reservation reads it once.
        low_watermark: an eviction deletes down to this fraction of the capacity.
        rescan_s: a reservation counts the directory again when the last count is older than this.
        clock: monotonic seconds (for ``rescan_s``).
        scan: one pass over the directory (:func:`kvx.store.disk.directory.survey`; the tier's removes and
            logs stale temporary files).
        removed: ``removed(chunks, evicted)``: chunk files this budget deleted (``evicted``: to make room;
            else :meth:`clear`). Called with the lock released; it must not call the budget.

    State. One lock (the condition ``_cond``'s) guards every field below, and is never held across I/O.
    A count (a directory scan) or an eviction (a scan and unlinks) takes *the turn* (``_busy``) and
    releases the lock for its I/O: one count, eviction or reservation decision at a time, while puts
    keep ending, registering temporary files and deletes keep settling (they only take the lock).

    - ``_used``: bytes under the path at the last count, plus this tier's reservations and writes since,
      minus its deletes.
    - ``_reserved``: bytes of this tier's puts being written (inside ``_used``).
    - ``_mine``: their temporary files (counted as reservations, not as files).
    - ``_ended``: during a count, ``(final path, or None if the write failed, size)`` of each reservation
      that ended meanwhile; None otherwise.
    - ``_counted_at``: ``clock()`` at the last count.
    - ``_relief``: evictions for a full disk so far (a put that fails after one retries instead).
    - ``_busy``: a thread holds the turn.

    Threads: the tier's writer threads (the connector's ``io_threads`` per tier; idle priority, normal for a
    ``kv_producer``): :meth:`reserve`, :meth:`track` / :meth:`untrack`, :meth:`end`, :meth:`relieve`; any
    thread deleting a chunk (:meth:`freed`); the thread opening the tier, and callers of :meth:`evict`,
    :meth:`clear`, :meth:`recount` (the CLI, tests).
    """

    def __init__(
        self,
        path: str,
        capacity: int | None,
        low_watermark: float,
        rescan_s: float,
        clock: Callable[[], float],
        scan: Callable[[], Survey],
        removed: Callable[[list[ChunkInfo], bool], None],
    ):
        self.path = path
        self.capacity = capacity
        self.low_watermark = low_watermark
        self.rescan_s = rescan_s
        self._clock = clock
        self._scan = scan
        self._removed = removed
        self._cond = threading.Condition(threading.Lock())
        self._used = 0
        self._reserved = 0
        self._mine: set[str] = set()
        self._ended: list[tuple[str | None, int]] | None = None
        self._counted_at = -math.inf
        self._relief = 0
        self._busy = False

    # ---------------------------------------------------------------- the turn (lock held)
    def _take_turn(self) -> None:
        while self._busy:
            self._cond.wait()
        self._busy = True

    def _give_turn(self) -> None:
        self._busy = False
        self._cond.notify_all()

    # ---------------------------------------------------------------- reading
    @property
    def used(self) -> int:
        """Bytes counted now (the last count plus this tier's writes since)."""
        with self._cond:
            return self._used

    @property
    def relief(self) -> int:
        """Evictions for a full disk so far: read before a write, passed to :meth:`relieve` if it fails."""
        return self._relief

    # ---------------------------------------------------------------- puts
    def reserve(self, key: str, size: int, final: str) -> Reservation:
        """Count ``size`` bytes (chunk ``key``'s file ``final``) against the capacity before they are written,
        evicting first if they would not fit; wait for this tier's own writes in flight when only they fill
        the budget. Without a capacity nothing is counted before the write. Raises :class:`StoreFullError`
        when they cannot fit (nothing reserved)."""
        cap = self.capacity
        if cap is None:
            return Reservation(size, final, counted=False)
        if size > cap:
            raise StoreFullError(f"chunk {key}: a file of {size} bytes cannot fit in capacity_bytes={cap}")
        with self._cond:
            self._take_turn()
            try:
                while True:
                    if self._clock() - self._counted_at >= self.rescan_s:
                        self._count_and_set()
                    if self._used + size <= cap:
                        break
                    _, inflight = self._evict(max(int(cap * self.low_watermark) - size, 0))
                    if self._used + size <= cap:
                        break
                    if not inflight:
                        # what is left is other writers' files in flight, or files that cannot be deleted
                        raise StoreFullError(
                            f"chunk {key}: no room under {self.path} ({self._used} of {cap} bytes used by "
                            f"files this store cannot evict, {size} needed)"
                        )
                    if self._reserved:  # this tier's own writes fill the budget: wait for one to end
                        self._give_turn()
                        self._cond.wait(_WAIT_S)
                        self._take_turn()
                    # then count again: the files they wrote can be evicted now
                self._used += size
                self._reserved += size
            finally:
                self._give_turn()
        return Reservation(size, final, counted=True)

    def track(self, r: Reservation, tmp: str) -> None:
        """``r``'s temporary file, before it exists: counted as its reservation, not as a file."""
        if r.counted:
            with self._cond:
                self._mine.add(tmp)

    def untrack(self, r: Reservation, tmp: str) -> None:
        """``r``'s temporary file was renamed into place or removed."""
        if r.counted:
            with self._cond:
                self._mine.discard(tmp)

    def end(self, r: Reservation, written: bool) -> None:
        """``r``'s write is over: its bytes are now a file (``written``), or returned."""
        with self._cond:
            if r.counted:
                self._reserved -= r.size
                if self._ended is not None:
                    self._ended.append((r.final if written else None, r.size))
                if not written:
                    self._used -= r.size
                self._cond.notify_all()  # a reservation waiting for this tier's writes
            elif written:
                self._used += r.size

    def freed(self, size: int) -> None:
        """This tier deleted a file of ``size`` bytes."""
        with self._cond:
            self._used = max(0, self._used - size)

    # ---------------------------------------------------------------- counting and evicting (lock held)
    def _count(self) -> tuple[Survey, int, int]:
        """With the turn: survey the directory (the lock released meanwhile) and count it. Returns (survey,
        bytes, of which this tier's writes in flight): chunk files, other writers' temporary files, and
        this tier's reservations.

        No reservation starts during the scan (the turn), but puts end. One that ends with its file renamed
        into place before the scan reaches its directory would count twice (file and reservation), and one
        that fails would count for nothing on disk; both are taken out after the scan. Counting the
        reservations after the scan instead would miss a put whose temporary file the scan saw half-written
        and which ended before the count: an under-count that overshot the capacity by up to a chunk per
        writer thread (test_concurrent_puts_never_exceed_the_capacity)."""
        reserved, mine = self._reserved, set(self._mine)
        self._ended = []
        self._cond.release()
        try:
            sv = self._scan()
        finally:
            self._cond.acquire()
            mine |= self._mine  # a reserved put that created its temporary file during the scan
            ended, self._ended = self._ended, None
        seen = {c.path for c in sv.chunks}
        reserved -= sum(size for final, size in ended if final is None or final in seen)
        return sv, sv.chunk_bytes + sum(t.bytes for t in sv.temps if t.path not in mine) + reserved, reserved

    def _set(self, used: int) -> None:
        self._used = used
        self._counted_at = self._clock()

    def _count_and_set(self) -> None:
        self._set(self._count()[1])

    def _unlink_lru(self, chunks: list[ChunkInfo], done: Callable[[int], bool], evicted: bool) -> tuple[int, int]:
        """With the turn: delete chunk files, least recently used first, until ``done(bytes freed)`` (the lock
        released meanwhile). Returns (files deleted, bytes freed); a file another engine deleted first
        counts as freed, not as deleted."""
        self._cond.release()
        try:
            gone, freed = [], 0
            for c in sorted(chunks, key=lambda c: c.mtime):
                if done(freed):
                    break
                try:
                    os.unlink(c.path)
                    gone.append(c)
                except FileNotFoundError:
                    pass  # another engine evicted it first
                except OSError:
                    continue  # cannot be deleted (read-only): still there
                freed += c.bytes
            if gone:
                self._removed(gone, evicted)
        finally:
            self._cond.acquire()
        return len(gone), freed

    def _evict(self, target: int) -> tuple[int, int]:
        """With the turn: delete least recently used files until the count is <= ``target``. Returns (files
        deleted, bytes of this tier's writes that were in flight during the scan)."""
        sv, used, inflight = self._count()
        removed, freed = self._unlink_lru(sv.chunks, lambda freed: used - freed <= target, True)
        self._set(used - freed)
        return removed, inflight

    # ---------------------------------------------------------------- whole-directory operations
    def recount(self) -> None:
        """Count the directory now (what every engine on the path has written)."""
        with self._cond:
            self._take_turn()
            try:
                self._count_and_set()
            finally:
                self._give_turn()

    def evict(self) -> int:
        """Delete least recently used files until the count is <= low_watermark * capacity. Returns the count
        of files deleted (0 when unbounded)."""
        cap = self.capacity
        if cap is None:
            return 0
        with self._cond:
            self._take_turn()
            try:
                return self._evict(int(cap * self.low_watermark))[0]
            finally:
                self._give_turn()

    def relieve(self, relief: int, size: int) -> tuple[int, int] | None:
        """The disk is full: delete the least recently used files (``FULL_EVICT_FRACTION`` of the chunk bytes,
        at least ``size``) unless another put did so since ``relief`` (:attr:`relief`) was read (then None:
        only retry). Returns (files deleted, bytes freed)."""
        with self._cond:
            self._take_turn()  # after an eviction in progress: its room is made when this returns
            try:
                if self._relief != relief:
                    return None
                self._relief += 1
                sv, used, _ = self._count()
                goal = max(int(sv.chunk_bytes * FULL_EVICT_FRACTION), size)
                removed, freed = self._unlink_lru(sv.chunks, lambda freed: freed >= goal, True)
                self._set(used - freed)
                return removed, freed
            finally:
                self._give_turn()

    def clear(self) -> int:
        """Delete every chunk file. Returns their count."""
        with self._cond:
            self._take_turn()
            try:
                sv, used, _ = self._count()
                n, freed = self._unlink_lru(sv.chunks, lambda freed: False, False)
                self._set(used - freed)
                return n
            finally:
                self._give_turn()
