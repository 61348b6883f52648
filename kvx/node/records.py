"""The records of ``kvx node``'s index (:class:`~.index.NodeState`): a namespace, a slot in use, a client's part.
The daemon's loop thread only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..store.alloc import Chunk


@dataclass(eq=False)
class Namespace:
    """One engine namespace: its chunks, recency, counters and quota. Loop thread only."""

    name: str
    model: str = ""
    chunk_size: int | None = None
    chunk_bytes: int = 0  # bytes of one chunk (the engines' slot_bytes): what a pull moves per chunk
    quota: int | None = None  # bytes, or None: no quota
    # an engine of it seals its byte tiers (or a peer said so): its chunks cross between nodes only encrypted (tcp),
    # or not at all (NIXL); set for good
    sealed: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)  # in the index: PENDING and READY
    lru: OrderedDict[Entry, None] = field(default_factory=OrderedDict)  # READY, no admin pin; LRU first
    chunks: int = 0  # READY in the index
    pending: int = 0  # PENDING in the index
    admin_pinned: int = 0  # READY with an admin pin
    clients: int = 0  # engine connections
    hits: int = 0
    misses: int = 0
    pulled: int = 0  # chunks pulled from peers into this pool
    pushed: int = 0  # chunks peers pushed into this pool (P/D)
    served: int = 0  # chunks leased to peers that read them
    evictions: int = 0  # chunks evicted to make room (LRU or quota); an operator's ``evict`` is not counted


@dataclass(eq=False, kw_only=True)
class Entry(Chunk):
    """A chunk of a namespace in the pool (its run of slots, pins and doom: :class:`kvx.store.alloc.Chunk`; a pin is
    a connection's lease). Loop thread only."""

    ns: Namespace
    state: int  # PENDING or READY
    owner: int | None  # the connection that allocated it, while PENDING
    admin: int = 0  # admin pins (``pin_prefix``): out of the LRU while any


@dataclass(eq=False)
class Client:
    """One connection's part of the index: what it allocated and has not committed, and the leases it holds.
    Loop thread only."""

    cid: int
    pid: int
    role: str | None = None  # None until hello; "engine", "puller" (an engine's pulls), "control", or "peer"
    pulling: int = 0  # a puller's pulls in flight (their replies are deferred), at most protocol.MAX_PULLS
    committed: int = 0  # a pull's client: its chunks made READY as they arrived (NodeState.pull_commit)
    peer: str | None = None  # a peer's connection: the peer node's id (what its data connection may write)
    ns: Namespace | None = None  # engines only
    pending: dict[str, Entry] = field(default_factory=dict)
    leases: dict[str, list[Entry]] = field(default_factory=dict)  # one element per lease, oldest first
