"""The pool file's directory (:mod:`.protocol`'s layout): the hash table of READY chunks that engines read without
asking the daemon (:class:`Directory`), and the daemon's writer of it (:class:`DirectoryWriter`)."""

from __future__ import annotations

import struct

import numpy as np

from .protocol import (
    DIR_ENTRY,
    FREE,
    KEY_HALVES,
    LOW32,
    PENDING,
    READY,
    PoolGeometry,
    dir_home,
    dir_seed,
    dir_shift,
    home_of,
    homes_of,
)

_ZERO_KEY = bytes(16)


class DirectoryWriter:
    """The daemon's writes to the directory in ``table`` (the pool file's mapped header, table and directory):
    insert a READY chunk, remove one. Linear probing from the key's home; removal shifts later entries back (no
    tombstones). The daemon's loop thread only."""

    def __init__(self, table, geom: PoolGeometry, seed: tuple[int, int]):
        self.table, self.geom, self.seed = table, geom, seed

    def _at(self, i: int) -> tuple[bytes, int]:
        return DIR_ENTRY.unpack_from(self.table, self.geom.dir_offset + DIR_ENTRY.size * i)

    def _put(self, i: int, key: bytes, slot1: int) -> None:
        """Entry ``i`` := (``key``, ``slot1``): the key first, the slot last, so a reader that sees the slot sees
        the key (or, where a slot is being cleared, 0 first)."""
        off = self.geom.dir_offset + DIR_ENTRY.size * i
        if slot1 == 0:
            struct.pack_into("<I", self.table, off + 16, 0)
            self.table[off : off + 16] = key
        else:
            self.table[off : off + 16] = key
            struct.pack_into("<I", self.table, off + 16, slot1)

    def insert(self, key: bytes, slot: int) -> None:
        """Publish a READY chunk in the directory (linear probing: :mod:`.protocol`)."""
        mask = self.geom.dir_entries - 1
        i = dir_home(key, self.geom.dir_entries, self.seed)
        while self._at(i)[1]:
            i = (i + 1) & mask
        self._put(i, key, slot + 1)

    def remove(self, key: bytes) -> None:
        """Take a chunk out of the directory, shifting the entries after it back (no tombstones: a probe stops at
        the first empty entry)."""
        mask = self.geom.dir_entries - 1
        i = dir_home(key, self.geom.dir_entries, self.seed)
        while True:
            k, slot1 = self._at(i)
            if not slot1:
                return
            if k == key:
                break
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            k, slot1 = self._at(j)
            if not slot1:
                break
            home = dir_home(k, self.geom.dir_entries, self.seed)
            if (home - i - 1) & mask < (j - i) & mask:  # its home lies in (i, j]: it stays
                continue
            self._put(i, k, slot1)
            i = j
        self._put(i, _ZERO_KEY, 0)


class Directory:
    """The directory and slot table of a mapped pool file, read by an engine (see the module docstring): which of
    a list of keys are READY, without asking the daemon. Vectorised (numpy): 256 keys in tens of microseconds."""

    _DIR = np.dtype([("a", "<u8"), ("b", "<u8"), ("slot", "<u4"), ("pad", "V12")])
    _TABLE = np.dtype([("a", "<u8"), ("b", "<u8"), ("gen", "<u8"), ("state", "<u4"), ("pad", "V4")])

    def __init__(self, buf, geom: PoolGeometry, epoch: bytes):
        self.geom = geom
        self.mask = geom.dir_entries - 1
        self.seed, self.shift = dir_seed(epoch), dir_shift(geom.dir_entries)
        self.dir = np.frombuffer(buf, dtype=self._DIR, count=geom.dir_entries, offset=geom.dir_offset)
        self.table = np.frombuffer(buf, dtype=self._TABLE, count=geom.num_slots, offset=geom.table_offset)
        self._dir64 = np.frombuffer(buf, dtype="<u8", count=geom.dir_entries * 4, offset=geom.dir_offset).reshape(-1, 4)
        self._table64 = np.frombuffer(buf, dtype="<u8", count=geom.num_slots * 4, offset=geom.table_offset)
        self._table64 = self._table64.reshape(-1, 4)
        self._mask64 = np.uint64(self.mask)

    def ready(self, keys_hex: str) -> list[bool]:
        """Per key (``keys_hex``: 32-hex keys end to end), whether the pool holds it READY now."""
        return [s >= 0 for s in self.slots(keys_hex)]

    def state(self, key_hex: str) -> int:
        """READY, PENDING or FREE: what the directory and the slot table say of one key now, in microseconds (no
        numpy call on the way to a READY answer). A daemon writing meanwhile may make the answer stale at once;
        nothing reads a slot on this answer alone (the workers check the slot's entry around their copies)."""
        a, b = KEY_HALVES.unpack(bytes.fromhex(key_hex))
        pos = home_of(a, b, self.seed, self.shift)
        for _ in range(self.mask + 1):
            e = self.dir[pos]
            slot = int(e["slot"])
            if slot == 0:
                break
            if int(e["a"]) == a and int(e["b"]) == b:
                t = self.table[slot - 1]
                if int(t["state"]) == READY and int(t["a"]) == a and int(t["b"]) == b:
                    return READY
                break
            pos = (pos + 1) & self.mask
        t = self.table
        pending = (t["state"] == PENDING) & (t["a"] == np.uint64(a)) & (t["b"] == np.uint64(b))
        return PENDING if pending.any() else FREE

    def pending(self, keys_hex: str) -> list[int]:
        """Per key (``keys_hex``: 32-hex keys end to end), the slot the table holds it PENDING in now (being written:
        an engine's save, a pull from a peer), else -1. A scan of the PENDING entries (few), not a probe."""
        want = np.frombuffer(bytes.fromhex(keys_hex), dtype="<u8").reshape(-1, 2)
        t = self._table64
        cand = np.flatnonzero((t[:, 3] & LOW32) == PENDING)
        out = [-1] * len(want)
        if len(cand):
            rows = t[cand]
            for i, (a, b) in enumerate(want):
                hit = np.flatnonzero((rows[:, 0] == a) & (rows[:, 1] == b))
                if len(hit):
                    out[i] = int(cand[hit[0]])
        return out

    def slots(self, keys_hex: str) -> list[int]:
        """Per key (``keys_hex``: 32-hex keys end to end), its slot if the pool holds it READY now, else -1. On the
        entries as rows of four uint64 (one gather per probe round), not the structured arrays' fields: a lookup
        of 256 keys is most of an engine's lookup time, and this way is faster (``benchmarks/bench_node.py``)."""
        want = np.frombuffer(bytes.fromhex(keys_hex), dtype="<u8").reshape(-1, 2)
        n = len(want)
        slot_of = np.full(n, -1, dtype=np.int64)
        todo, wa, wb = np.arange(n), want[:, 0], want[:, 1]
        pos = homes_of(wa, wb, self.seed, self.shift)
        for _ in range(self.mask + 1):
            e = self._dir64[pos]
            slot = (e[:, 2] & LOW32).astype(np.int64)  # slot + 1; 0: an empty entry, where a probe ends
            found = (e[:, 0] == wa) & (e[:, 1] == wb) & (slot != 0)
            slot_of[todo[found]] = slot[found] - 1
            go = ~found & (slot != 0)
            if not go.any():
                break
            todo, wa, wb, pos = todo[go], wa[go], wb[go], (pos[go] + np.uint64(1)) & self._mask64
        hit = np.flatnonzero(slot_of >= 0)
        t = self._table64[slot_of[hit]]  # the slot's entry: READY, and still this key
        ok = ((t[:, 3] & LOW32) == READY) & (t[:, 0] == want[hit, 0]) & (t[:, 1] == want[hit, 1])
        out = np.full(n, -1, dtype=np.int64)
        out[hit[ok]] = slot_of[hit[ok]]
        return out.tolist()
