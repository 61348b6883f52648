"""The slot tiers' one allocator (:class:`Allocator`): a pool's slots and the life cycle of the chunks in them.

Both slot tiers use it: the CPU tier's index (:class:`kvx.store.cpu.CPUIndex`, one engine's slots, a chunk one slot)
and ``kvx node``'s (:class:`kvx.node.index.NodeState`, one pool per host, a chunk a run of slots of any length,
:mod:`.runs`). Each keeps its own key -> chunk map and its counters; the allocator keeps what the chunks share::

    free --reserve--> held (PENDING) --ready--> in the LRU (READY) --evict (LRU, no pin) / drop--> free
                        \\--drop--> free

- A pinned chunk (:meth:`pin`: a load reads it, or a write to another tier) is never evicted. A chunk dropped while
  pinned is *doomed*: out of its owner's index at once, its slot freed at its last :meth:`unpin`.
- A READY chunk can be *exempt* from eviction while it stays READY (the node's admin pins): out of the LRU.
- To make room for a run of ``u`` slots, the LRU chunk goes with the rest of its aligned block of ``u``'s size when
  all of that is free or evictable; an LRU chunk whose block cannot be freed (a pin, a PENDING chunk, a run reaching
  in) is passed over for the next one, so no chunk is evicted for nothing.
- Every time a slot changes hands its *generation* goes up: a reader or writer that kept the generation it was given
  sees its chunk unchanged (the node's engines and peers check it around each copy).
- A run freed with ``quarantine`` is reused only :attr:`quarantine_s` later (the node: a PENDING slot of a connection
  that closed, whose workers may still be writing it; a pull's slot that did not arrive). A chunk dropped with
  ``quarantine`` while pinned is quarantined at its last :meth:`unpin`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .runs import Runs


@dataclass(eq=False)
class Chunk:
    """A chunk in a slot tier, as the allocator sees it. The owner's index subclasses it with its own fields (its
    state, namespace, admin pins). Its owner's thread only."""

    key: str
    slot: int = -1  # the first slot of its run (-1 until reserved)
    units: int = 1  # slots in its run
    pins: int = 0
    doomed: bool = False
    quarantined: bool = False  # doomed with ``quarantine``: its run is quarantined when its last pin goes


class Allocator:
    """One pool of ``num_slots`` slots and its chunks (see the module docstring). The owner's thread only: the
    scheduler thread for :class:`~.cpu.CPUIndex`, the node's loop thread for :class:`~kvx.node.index.NodeState`.

    Args:
        num_slots: slots in the pool (0: none yet).
        on_evict: ``on_evict(chunk)`` when the allocator evicts an LRU chunk to make room: the owner takes it out of
            its index (it must not call :meth:`drop`: the allocator does).
        on_free: ``on_free(chunk)`` when a chunk's slot is free again (its generation already bumped): the node
            writes its table entry.
        quarantine_s: how long a run dropped with ``quarantine`` stays unused.
    """

    def __init__(
        self,
        num_slots: int,
        on_evict: Callable[[Chunk], None],
        on_free: Callable[[Chunk], None] | None = None,
        quarantine_s: float = 0.0,
    ):
        self.runs = Runs(num_slots)
        self.at: dict[int, Chunk] = {}  # a held run's first slot -> its chunk (PENDING, READY or doomed)
        self.lru: OrderedDict[Chunk, None] = OrderedDict()  # READY, not exempt; least recently used first
        self.generation = [0] * num_slots
        self.quarantine_s = quarantine_s
        self.quarantine: deque[tuple[float, int, int]] = deque()  # (reusable at, first, units), oldest first
        self._on_evict = on_evict
        self._on_free = on_free

    @property
    def max_units(self) -> int:
        """The longest run the pool can give."""
        return self.runs.max_units

    # ------------------------------------------------------------------------------------------ life cycle
    def reserve(self, chunk: Chunk, units: int = 1) -> bool:
        """Give ``chunk`` a run of ``units`` slots (PENDING), evicting LRU chunks if none is free; False (nothing
        evicted in vain) if no such run can be freed."""
        if not self.make_room(units):
            return False
        chunk.slot, chunk.units = self.runs.take(units), units
        self.at[chunk.slot] = chunk
        self.generation[chunk.slot] += 1
        return True

    def make_room(self, units: int) -> bool:
        """Free a run of ``units`` slots if none is: ends the quarantines that are over, then evicts LRU chunks a
        block at a time. False if no run of that length can be had."""
        if self.quarantine:
            now = time.monotonic()
            while self.quarantine and self.quarantine[0][0] <= now:
                _, first, n = self.quarantine.popleft()
                self.runs.give(first, n)
        while not self.runs.can(units):
            for c in self.lru:
                if not c.pins and (block := self._freeable(c, units)):
                    break
            else:
                return False
            for c in block:
                self.evict(c)
        return True

    def ready(self, chunk: Chunk) -> None:
        """``chunk`` is READY: a hit from now on, the most recently used."""
        self.lru[chunk] = None

    def touch(self, chunk: Chunk) -> None:
        """``chunk`` was used: the most recently used (an exempt one stays out of the LRU)."""
        if chunk in self.lru:
            self.lru.move_to_end(chunk)

    def exempt(self, chunk: Chunk, yes: bool = True) -> None:
        """Keep READY ``chunk`` from eviction until ``exempt(chunk, False)`` (then the most recently used)."""
        if yes:
            self.lru.pop(chunk, None)
        else:
            self.lru[chunk] = None

    def pin(self, chunk: Chunk) -> None:
        """Keep ``chunk`` (PENDING or READY) from eviction, and its slot from reuse, until :meth:`unpin`."""
        chunk.pins += 1

    def unpin(self, chunk: Chunk) -> bool:
        """Undo one :meth:`pin`; True if that freed a doomed chunk's slot."""
        chunk.pins -= 1
        if chunk.doomed and not chunk.pins:
            self._free(chunk, chunk.quarantined)
            return True
        return False

    def evict(self, chunk: Chunk) -> None:
        """Take ``chunk`` out of its owner's index (``on_evict``) and :meth:`drop` it."""
        self._on_evict(chunk)
        self.drop(chunk)

    def drop(self, chunk: Chunk, quarantine: bool = False) -> None:
        """``chunk`` left its owner's index: free its slot now, or at its last unpin if pinned (doomed)."""
        self.lru.pop(chunk, None)
        if chunk.pins:
            chunk.doomed = True
            chunk.quarantined = chunk.quarantined or quarantine  # a late transfer may land until its last unpin
        else:
            self._free(chunk, quarantine)

    def _free(self, chunk: Chunk, quarantine: bool = False) -> None:
        del self.at[chunk.slot]
        self.generation[chunk.slot] += 1  # a reader or writer of the old chunk sees it changed
        if self._on_free is not None:
            self._on_free(chunk)
        if quarantine and self.quarantine_s > 0:
            self.quarantine.append((time.monotonic() + self.quarantine_s, chunk.slot, chunk.units))
        else:
            self.runs.give(chunk.slot, chunk.units)

    # ------------------------------------------------------------------------------------------ eviction
    @staticmethod
    def evictable(lru: OrderedDict[Chunk, None]) -> Iterator[Chunk]:
        """The chunks of ``lru`` (the allocator's, or an owner's part of it) with no pin, least recently used first."""
        return (c for c in lru if not c.pins)

    def _freeable(self, victim: Chunk, units: int) -> list[Chunk] | None:
        """The chunks to evict, ``victim`` (an evictable chunk) first, so that a run of ``units`` slots is free: the
        chunks in the victim's aligned block of that run's size (the block a buddy allocator can hand out), if
        every slot of it is free or held by an evictable chunk; else None."""
        size = 1 << (units - 1).bit_length()
        if victim.units >= size:
            return [victim]  # its run, freed, is an aligned block of at least ``size`` slots
        block = self.runs.holders(victim.slot & ~(size - 1), size, self.at)
        if block is None or not all(c in self.lru and not c.pins for c in block):
            return None
        block.remove(victim)
        return [victim, *block]

    # ------------------------------------------------------------------------------------------ figures
    @property
    def free_units(self) -> int:
        return self.runs.free_units

    def largest(self) -> int:
        """Slots in the largest free run now."""
        return self.runs.largest()
