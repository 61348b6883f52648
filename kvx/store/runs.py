"""Free slots as runs (:class:`Runs`): runs of whole slots for chunks of any size, in one pool. The slot tiers'
allocator (:mod:`.alloc`) takes and gives its runs here; a CPU tier chunk is a run of one slot.

In ``kvx node``'s pool the ``n`` slots are its allocation unit (``--slot-size``, 64 KiB by default); a chunk of
``b`` bytes takes a run of ``ceil(b / unit)`` consecutive slots, addressed by its first (its table entry, its
directory entry, its byte offset ``data_offset + unit * first``). Runs come from a binary buddy allocator that hands
out exactly the run asked for: a run of ``u`` slots is cut from a free aligned block of ``2^k >= u`` slots and the
block's tail goes back as the aligned power-of-two blocks it is made of; a run freed goes back as its own aligned
blocks, each merged with its free buddy. So chunks of every model on the host share one pool with no size fixed up
front; the waste is the rounding of a chunk up to whole units, plus free blocks too small for a run (fragmentation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Held(Protocol):
    """A held run, as :meth:`Runs.holders` reads it."""

    units: int


def _blocks(start: int, end: int):
    """[start, end) as aligned power-of-two blocks: (offset, order) each, in order."""
    while start < end:
        k = (start & -start).bit_length() - 1 if start else (end - start).bit_length() - 1
        while start + (1 << k) > end:
            k -= 1
        yield start, k
        start += 1 << k


class Runs:
    """Free runs of ``n`` slots (see the module docstring). Its :class:`~.alloc.Allocator`'s thread only."""

    def __init__(self, n: int):
        self.n = n
        self._free: list[set[int]] = [set() for _ in range(max(1, n.bit_length()))]  # per order: free offsets
        self._order: dict[int, int] = {}  # a free block's offset -> its order
        self._mask = 0  # bit j set: a free block of order j exists
        self.free_units = 0
        self.max_units = 1 << (n.bit_length() - 1) if n else 0  # the largest run a pool of n slots can give
        self._give(0, n)

    def can(self, units: int) -> bool:
        """Whether a run of ``units`` slots is free now."""
        return self._mask >> (units - 1).bit_length() != 0

    def take(self, units: int) -> int | None:
        """The first slot of a free run of ``units`` slots now taken; None if none is free."""
        k = (units - 1).bit_length()
        m = self._mask >> k
        if not m:
            return None
        j = k + (m & -m).bit_length() - 1  # the smallest order with a free block that holds the run
        free = self._free[j]
        off = min(free) if len(free) < 64 else free.pop()  # low offsets first, cheaply
        free.discard(off)
        if not free:
            self._mask &= ~(1 << j)
        del self._order[off]
        self.free_units -= 1 << j
        self._give(off + units, off + (1 << j))  # the block's tail
        return off

    def give(self, first: int, units: int) -> None:
        """Free the run of ``units`` slots from ``first``."""
        self._give(first, first + units)

    def _give(self, start: int, end: int) -> None:
        for off, k in _blocks(start, end) if end - start > 1 else ((start, 0),) if end > start else ():
            self.free_units += 1 << k
            while k + 1 < len(self._free):  # merge with the free buddy, as far as it goes
                buddy = off ^ (1 << k)
                if self._order.get(buddy) != k:
                    break
                free = self._free[k]
                free.discard(buddy)
                if not free:
                    self._mask &= ~(1 << k)
                del self._order[buddy]
                off, k = min(off, buddy), k + 1
            self._free[k].add(off)
            self._mask |= 1 << k
            self._order[off] = k

    def holders(self, first: int, size: int, at: Mapping[int, Held]) -> list[Held] | None:
        """What holds the aligned block of ``size`` slots from ``first``, by ``at`` (a held run's first slot -> its
        holder): the runs in it, a run from before it into it included; None if a slot there is neither free nor
        held (a run not yet given back, as a quarantined one)."""
        held, s = [], first
        for k in range(size.bit_length(), self.n.bit_length() + 1):  # a run starts aligned to its own size
            start = first & ~((1 << k) - 1)
            if start < first and (h := at.get(start)) is not None and start + h.units > first:
                held.append(h)
                s = start + h.units
                break
        while s < first + size:
            if (h := at.get(s)) is not None:
                held.append(h)
                s += h.units
            elif (k := self._order.get(s)) is not None:
                s += 1 << k
            else:
                return None
        return held

    def largest(self) -> int:
        """Slots in the largest free block (the largest run :meth:`take` can give now)."""
        return 1 << (self._mask.bit_length() - 1) if self._mask else 0
