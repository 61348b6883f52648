"""Admission (``admit_after``): a chunk is stored only once the prompts of that many requests covered it.

A chunk's key is a hash chain over its prefix, so counting a key counts its whole prefix. Sightings are kept in
a bounded LRU (``admission_capacity`` keys; the least recently seen is forgotten, and starts again from zero).
Scheduler thread only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class Admission:
    """Sightings per chunk key: :meth:`sight` once per request, :meth:`admitted` when a save is planned."""

    def __init__(self, after: int, capacity: int):
        self.after = after
        self.capacity = capacity
        self._seen: OrderedDict[int, int] = OrderedDict()  # the key -> sightings (capped at ``after``)

    @staticmethod
    def _id(key: str) -> int:
        return int(key, 16)  # 128 bits as an int: smaller than the hex string

    def sight(self, keys: Iterable[str]) -> None:
        """One request's prompt covers these chunks."""
        seen = self._seen
        for key in keys:
            k = self._id(key)
            seen[k] = min(seen.pop(k, 0) + 1, self.after)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def admitted(self, key: str) -> bool:
        return self._seen.get(self._id(key), 0) >= self.after

    def __len__(self) -> int:
        return len(self._seen)
