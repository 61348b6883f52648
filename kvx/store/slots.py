"""The slot tier, declared: the first level of kvx's cache, chunks in preallocated slots of host memory.

Two tiers implement it: the CPU tier (:class:`kvx.store.CPUIndex` and :class:`kvx.store.CPUPool`, one engine's own
slots) and the node tier (:class:`kvx.node.client.NodeIndex` and :class:`kvx.node.client.NodePool`, the slots of
``kvx node``'s pool, shared by every engine on the host). The connector speaks only to these two classes.

Each has two sides, as vLLM's OffloadingConnector splits its CPU tier:

- :class:`SlotIndex`, in the scheduler process, scheduler thread only: which key lives in which slot and in what
  state. Life cycle of a slot::

      free --allocate(key)--> PENDING --commit(key)--> READY --evicted--> free
                                 \\--abort(key)--> free

  Only READY slots are hits; ``pin`` (a load) and ``hold`` (a write to a byte tier reads the slot) keep a slot from
  eviction until ``unpin``.
- :class:`SlotPool`, in each worker, worker thread only: the bytes of the slots, ``slot(i)`` a tensor view.

What differs between a tier of one engine and a shared one is declared, not probed: :attr:`SlotIndex.shared` (other
engines store into it), :attr:`SlotIndex.pool` (the pool file the workers map, named in each step's metadata) and
:meth:`SlotPool.check` (a slot's owner may change under a shared tier: its key and generation are checked around
each copy).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Sequence

import torch

from .errors import ChunkError
from .tier import Listener


class SlotState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


class SlotIndex(abc.ABC):
    """The scheduler side of a slot tier. Scheduler thread only."""

    #: other engines store into this tier too: a chunk present was (or is being) written by another engine
    shared: bool = False
    #: (pool file, epoch) the workers must map to reach the slots this index names; None: the workers' own pool
    pool: tuple[str, str] | None = None

    @abc.abstractmethod
    def subscribe(self, listener: Listener) -> None:
        """``listener("cpu", STORED | REMOVED, keys)`` when this engine's chunk becomes a hit or a hit leaves."""

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is READY now."""

    def __contains__(self, key: str) -> bool:
        return self.contains_many([key])[0]

    @abc.abstractmethod
    def state(self, key: str) -> SlotState | None:
        """READY, PENDING, or None (no slot holds ``key``)."""

    @abc.abstractmethod
    def allocate(self, key: str) -> int | None:
        """A PENDING slot for ``key`` (evicting an unpinned READY chunk when full); None if ``key`` is present or
        no slot can be had."""

    @abc.abstractmethod
    def commit(self, key: str) -> None:
        """Every worker wrote ``key``'s slot: READY from now on."""

    @abc.abstractmethod
    def abort(self, key: str) -> None:
        """The write of ``key`` failed or was dropped: free its slot (when its last pin goes). No-op if absent."""

    @abc.abstractmethod
    def pin(self, keys: Sequence[str]) -> list[int]:
        """Hold READY slots for a load; their slot numbers. A shared tier answers -1 for a chunk it no longer holds
        READY (the workers' checks then fail that load: recomputed); a tier of one engine's own raises
        ``RuntimeError`` (the scheduler looked it up in this step: a bug)."""

    @abc.abstractmethod
    def hold(self, key: str) -> int | None:
        """Keep ``key``'s slot (PENDING or READY) while it is read for a byte tier's write; its slot, or None where
        a shared tier no longer has it."""

    @abc.abstractmethod
    def unpin(self, keys: Iterable[str]) -> None:
        """Undo :meth:`pin` / :meth:`hold` (each key as often as it appears)."""

    def pulling(self, missing: Sequence[str]) -> bool:
        """Whether the chunks of ``missing`` (a lookup's keys from its first miss on, in order) are on their way into
        this tier from elsewhere (a peer node's pool): the lookup is put off and asked again at the next step. A
        tier may start fetching them here. A tier that fetches nothing: False."""
        return False

    def coming(self, missing: Sequence[str]) -> int:
        """How many leading keys of ``missing`` (a lookup's keys from its first miss on) are on their way into slots
        of this tier now (a pull from a peer node into PENDING slots): a hit the engine loads asynchronously, its
        workers copying each chunk once its slot turns READY. A tier that fetches nothing: 0."""
        return 0

    def push(self, keys: Sequence[str], to: str) -> bool:
        """Send ``keys`` (a P/D producer's chunks, in order) to the node at ``to`` (``HOST:PORT``) as each becomes
        READY here, without waiting; False where this tier cannot (the consumer then waits for a shared tier)."""
        return False

    def clear(self) -> bool:
        """Drop every unpinned READY chunk (vLLM's ``reset_cache``); False if something stayed. A shared tier's
        chunks are every engine's: it keeps them and answers True."""
        return True

    def close(self) -> None:  # noqa: B027 (optional: a tier with nothing to release)
        """Release what the index holds (connections, leases)."""


class SlotPool(abc.ABC):
    """The worker side of a slot tier: the slots' bytes. Worker thread only."""

    #: page-locked (DMA and UVA copies reach it from a GPU)
    pinned: bool = False

    #: slots reachable now (0 while a shared pool is not mapped)
    num_slots: int
    #: bytes of one chunk in a slot (this worker's share)
    slot_bytes: int

    @abc.abstractmethod
    def slot(self, i: int) -> torch.Tensor:
        """A view of slot ``i`` (writes go to the pool); ``ValueError`` naming ``slot`` if there is none."""

    def attach(self, pool: tuple[str, str] | None, background: bool = True) -> None:  # noqa: B027
        """Map the pool a step's metadata names (:attr:`SlotIndex.pool`); a pool of the worker's own has none."""

    def check(self, slot: int, key: str, reading: bool, generation: int | None = None) -> int | None:
        """A shared pool: the generation of ``slot`` if it holds ``key`` (READY when ``reading``, else PENDING) and,
        given ``generation``, still that one, else :class:`kvx.store.ChunkError`. A pool of one engine's own
        slots cannot change under it: None."""
        return None

    def wait_ready(self, slot: int, key: str, deadline: float) -> int:
        """A shared pool: wait until ``slot``, which holds ``key`` PENDING (a pull from a peer is filling it), holds
        it READY; its generation. :class:`kvx.store.ChunkError` if it turns anything else, or is still PENDING at
        ``deadline`` (``time.monotonic()``). Any thread (it reads the slot's table entry only). A pool of one
        engine's own slots has none coming."""
        raise ChunkError(f"slot {slot}: expected chunk {key} coming into a shared pool, got a pool of this engine's")

    def close(self) -> None:  # noqa: B027
        """Release the memory (or its registration with CUDA)."""
