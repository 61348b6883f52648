"""CPU tier: a preallocated pool of chunk slots (worker side) and its LRU index (scheduler side).

As in vLLM's OffloadingConnector, the scheduler process owns the index (which key lives in which slot,
recency, pins) and every worker owns the bytes of its own shard: the metadata of each step tells all
workers which slot to write or read, so tensor-parallel ranks stay consistent without talking.

Slot life cycle (scheduler side), kept by the slot tiers' one allocator (:mod:`.alloc`), a chunk one slot::

    free --allocate(key)--> PENDING --commit(key)--> READY --evict (LRU, pins == 0)--> free
                               \\--abort(key)--> free

Only READY slots are hits. ``pin`` holds a READY slot for an in-flight load, ``hold`` any slot whose
bytes are being written to another tier; neither is evicted until ``unpin``. A PENDING slot (being
written) is never evicted nor served.
"""

from __future__ import annotations

import math
import mmap
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..log import get_logger
from .alloc import Allocator, Chunk
from .slots import SlotIndex, SlotPool, SlotState
from .tier import REMOVED, STORED, Listener

log = get_logger(__name__)


@dataclass(eq=False, kw_only=True)
class _Entry(Chunk):
    """A chunk in the CPU tier (its slot, pins and doom: :class:`~.alloc.Chunk`). An aborted chunk still pinned stays
    in the index, doomed, until its last unpin frees it. Scheduler thread only."""

    state: SlotState


class CPUIndex(SlotIndex):
    """The CPU tier's :class:`~.slots.SlotIndex`: an LRU index of ``num_slots`` chunk slots of this engine's own.
    Scheduler thread only (no locking)."""

    def __init__(self, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self._entries: dict[str, _Entry] = {}
        self._slots = Allocator(num_slots, self._evicted)  # slots, recency and pins; its chunks are _Entries
        self.stats = {"allocated": 0, "evicted": 0, "committed": 0, "aborted": 0}
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """As :meth:`kvx.store.Tier.subscribe`: ``listener("cpu", STORED | REMOVED, keys)`` when a chunk
        is committed (becomes a hit) or a committed chunk leaves the pool."""
        self._listeners.append(listener)

    def _emit(self, event: str, keys: list[str]) -> None:
        for fn in self._listeners:
            fn("cpu", event, keys)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self for k in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:  # no list: the scheduler asks this per chunk
        e = self._entries.get(key)
        return e is not None and e.state is SlotState.READY

    def state(self, key: str) -> SlotState | None:
        e = self._entries.get(key)
        return e.state if e else None

    def allocate(self, key: str) -> int | None:
        """Reserve a slot for ``key`` (PENDING), evicting the least recently used unpinned READY chunk
        if the pool is full. Returns None if ``key`` is already present or every slot is busy."""
        if key in self._entries:
            return None
        e = _Entry(key, state=SlotState.PENDING)
        if not self._slots.reserve(e):
            return None
        self._entries[key] = e
        self.stats["allocated"] += 1
        return e.slot

    def _evicted(self, e: _Entry) -> None:
        """The allocator evicts ``e`` (LRU, READY, unpinned) to make room."""
        del self._entries[e.key]
        self.stats["evicted"] += 1
        self._emit(REMOVED, [e.key])

    def commit(self, key: str) -> None:
        """The slot's bytes are written on every worker: serve it from now on."""
        e = self._entries.get(key)
        if e is None or e.state is not SlotState.PENDING or e.doomed:
            raise RuntimeError(
                f"commit({key}): expected a PENDING slot, got "
                f"{('aborted' if e.doomed else e.state) if e else 'no entry'}"
            )
        e.state = SlotState.READY
        self._slots.ready(e)
        self.stats["committed"] += 1
        self._emit(STORED, [key])

    def abort(self, key: str) -> None:
        """The write failed or was dropped: free the slot."""
        e = self._entries.get(key)
        if e is None or e.doomed:
            return  # nothing to free, or already aborted (freed by the last unpin)
        self.stats["aborted"] += 1
        if e.state is SlotState.READY:
            self._emit(REMOVED, [key])
        e.state = SlotState.PENDING
        if not e.pins:
            del self._entries[key]
        self._slots.drop(e)  # still read by a load or a write elsewhere: doomed, freed by the last unpin

    def pin(self, keys: Sequence[str]) -> list[int]:
        """Hold READY slots for a load; returns their slot numbers."""
        keys = list(keys)
        for k in keys:  # all or nothing: check every key before pinning (or reordering) any
            e = self._entries.get(k)
            if e is None or e.state is not SlotState.READY:
                raise RuntimeError(f"pin({k}): expected a READY slot, got {e.state if e else 'no entry'}")
        slots = []
        for k in keys:
            e = self._entries[k]
            self._slots.pin(e)
            self._slots.touch(e)
            slots.append(e.slot)
        return slots

    def hold(self, key: str) -> int:
        """Keep an entry (PENDING or READY) from eviction while its bytes are read for another tier's
        write; returns its slot. Undo with :meth:`unpin`."""
        e = self._entries.get(key)
        if e is None:
            raise RuntimeError(f"hold({key}): no such entry")
        self._slots.pin(e)
        return e.slot

    def unpin(self, keys: Iterable[str]) -> None:
        """Undo :meth:`pin` / :meth:`hold`. All or nothing: if one key is not pinned (as often as it
        appears in ``keys``), nothing is unpinned."""
        keys = list(keys)
        count: dict[str, int] = {}
        for k in keys:
            count[k] = count.get(k, 0) + 1
            e = self._entries.get(k)
            if e is None or e.pins < count[k]:
                raise RuntimeError(f"unpin({k}): the slot is not pinned")
        for k in keys:
            if self._slots.unpin(self._entries[k]):  # the last pin of an aborted chunk: its slot is free
                del self._entries[k]

    def pending(self) -> int:
        """Slots being written (PENDING, not aborted): their workers have not all reported yet."""
        return sum(1 for e in self._entries.values() if e.state is SlotState.PENDING and not e.doomed)

    def pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    def clear(self) -> bool:
        """Drop every unpinned, READY entry (reset_cache). Returns False if something stayed."""
        gone = [e for e in self._entries.values() if e.state is SlotState.READY and e.pins == 0]
        for e in gone:
            del self._entries[e.key]
            self._slots.drop(e)
        if gone:
            self._emit(REMOVED, [e.key for e in gone])
        return not self._entries


class CPUPool(SlotPool):
    """The bytes of the CPU tier on one worker: ``num_slots`` chunks of ``slot_shape`` in one allocation.

    Args:
        num_slots: number of chunk slots.
        slot_shape, dtype: one chunk as it lies in memory (canonical ``[L, P, T, H, D]``, or ``[H, L, P, T, D]`` for
            a worker whose host buffers are head-major, or raw pages ``[L, S, n, bytes]``).
        pin: page-lock the pool for DMA/UVA copies to a GPU (registered with ``cudaHostRegister`` so a
            large pool is not rounded up to a power of two by torch's pinned allocator).
        populate: commit every page now (unpinned pools; page-locking commits them anyway), on the kvx
            thread pool, at start-up. Otherwise each page's first write faults: filling a fresh 8 MiB slot
            takes 2048 faults, each slower in a busy vLLM process, on the critical path of a disk hit
            promoted into the slot.
    """

    def __init__(
        self, num_slots: int, slot_shape: Sequence[int], dtype: torch.dtype, pin: bool = False, populate: bool = True
    ):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
        try:
            if any(isinstance(s, bool) for s in slot_shape):
                raise TypeError
            shape = tuple(operator.index(s) for s in slot_shape)  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError(f"slot_shape: expected a sequence of positive ints, got {slot_shape!r}") from None
        if any(s < 1 for s in shape):
            raise ValueError(f"slot_shape: expected a sequence of positive ints, got {slot_shape!r}")
        self.num_slots = num_slots
        self.slot_shape = shape
        self.dtype = dtype
        nbytes = num_slots * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # anonymous mmap: page-aligned, so whole pages can be committed (and registered with CUDA)
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.data = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(num_slots, *shape)
        self.pinned = False
        if pin:
            self._pin()  # page-locking commits every page
        elif populate:
            self._populate()

    def _populate(self) -> None:
        try:
            from .._ext import load

            _C = load()  # ImportError when kvx._C is not built
        except ImportError:  # the pure-Python fallback: pages are committed on first write
            return
        err = _C.cpu_populate_write(self.data.data_ptr(), self.data.numel() * self.data.element_size())
        if err:  # EINVAL: kernel < 5.14
            log.info("kvx: CPU pool pages not committed ahead (madvise errno %d); first writes fault", err)

    def _pin(self):
        nbytes = self.data.numel() * self.data.element_size()
        # portable (1) | mapped (2): every context may DMA from it, and kernels read/write it through UVA
        err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 3)
        if int(err) != 0:
            self.data = self.data.pin_memory()  # fall back to torch's pinned allocator
        else:
            self._registered = True
        self.pinned = True

    def slot(self, i: int) -> torch.Tensor:
        """View of slot ``i``: ``slot_shape`` (writes go to the pool)."""
        try:
            if isinstance(i, bool):
                raise TypeError
            i = operator.index(i)  # a float or bool would index/add a dim instead of failing
        except TypeError:
            raise ValueError(f"slot: expected an int in [0, {self.num_slots}), got {i!r}") from None
        if not 0 <= i < self.num_slots:
            raise ValueError(f"slot: expected 0 <= slot < {self.num_slots}, got {i}")
        return self.data[i]

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot_shape) * self.data.element_size()

    def close(self):
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self._registered = False
