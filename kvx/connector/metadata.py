"""What crosses between the scheduler side and the workers, once per step.

Scheduler -> workers: :class:`KVXMetadata` (loads to start, chunks to save, requests preempted).
Workers -> scheduler: :class:`KVXWorkerMetadata` (per-key completion counts, summed over workers by
vLLM's output aggregator; an event counts as complete once every worker reported it).
Both are plain dataclasses of ints, strings and lists: they pickle/msgpack across processes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # the worker side also runs without vLLM (tests/gpu drive it on a GPU machine without vLLM)
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            return self


@dataclass
class ChunkLoad:
    """Fill ``block_ids`` from chunk ``key``, starting at block ``first_block`` of the chunk.

    ``tier`` is where the bytes are ("cpu": pool slot ``slot``; else the name of the tier to read from).
    For a load from another tier, ``slot`` (if not None) is a CPU slot to read the chunk into (promotion). ``before_forward``: the last
    block also receives this step's first computed token, whose KV vLLM may write before
    ``wait_for_layer_load``. The worker copies only the chunk's ``shared_tokens`` tokens of that block
    (so the order against that write does not matter), or, with raw pages (which cannot be split by
    token), the whole chunk before the forward starts.
    """

    key: str
    tier: str
    slot: int | None
    block_ids: list[int]
    first_block: int
    tokens: int
    before_forward: bool = False
    shared_tokens: int = 0       # with before_forward: tokens of the last block the chunk provides
    # Several KV cache groups (or null blocks skipped): the chunk's block index of each of ``block_ids``
    # (group g's j-th block of a chunk of n blocks per group is g * n + j); None: first_block + i
    positions: list[int] | None = None
    span: int = 0                # with positions: blocks of each group this load covers (tokens = span * block)


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool


@dataclass
class ChunkSave:
    """Save the ``tokens`` tokens in ``block_ids`` as chunk ``key`` (several KV cache groups: every group's
    blocks of those tokens, group after group).

    ``slot``: CPU pool slot to gather into (None: no CPU copy). ``to_tiers``: also write the chunk to
    these tiers (by name). ``from_slot``: the bytes are already in this CPU slot (no gather; e.g.
    write-through of a chunk that was loaded from the CPU tier). ``deps``: blocks this chunk's KV depends on whose loads are
    not verified yet; a worker on which one of them failed drops the save (:mod:`.validity`).
    """

    req_id: str
    key: str
    block_ids: list[int]
    tokens: int
    slot: int | None
    to_tiers: list[str] = field(default_factory=list)
    from_slot: int | None = None
    deps: list[int] = field(default_factory=list)


@dataclass
class KVXMetadata(KVConnectorMetadata):
    """One step's instructions. ``forward_blocks``: the blocks this step's forward writes and the blocks
    freed since the last step (finished or preempted requests: the next forwards may write them); the
    worker fences every queued copy of them before the forward (``kvx.engine.BlockOrder``). ``finished``:
    requests finished since the last step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    forward_blocks: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted or self.finished or self.forward_blocks)


@dataclass
class KVXWorkerMetadata(KVConnectorWorkerMetadata):
    """Completion counts from workers (summed by :meth:`aggregate`).

    stored:    CPU slot written (save or promotion), per key
    unstored:  CPU slot write failed or skipped, per key
    tier_done: a tier's write of a chunk finished (written, or already present / failed), per
               :func:`tier_done_key` (tier, key)
    tier_written / tier_failed: of those, the writes that stored new bytes / that failed
    tier_removed: chunks removed from a tier on a worker (evicted, dropped), as tier_done keys
    loads_done: a request's load finished (successfully or not), per request id
    failed_blocks: blocks whose load failed on a worker (union over workers)
    """

    stored: dict[str, int] = field(default_factory=dict)
    unstored: dict[str, int] = field(default_factory=dict)
    tier_done: dict[str, int] = field(default_factory=dict)
    tier_written: dict[str, int] = field(default_factory=dict)
    tier_failed: dict[str, int] = field(default_factory=dict)
    tier_removed: list[str] = field(default_factory=list)
    loads_done: dict[str, int] = field(default_factory=dict)
    failed_blocks: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVXWorkerMetadata):
            return self
        out = KVXWorkerMetadata()
        for name in ("stored", "unstored", "tier_done", "tier_written", "tier_failed", "loads_done"):
            merged = Counter(getattr(self, name))
            merged.update(getattr(other, name))
            setattr(out, name, dict(merged))
        out.failed_blocks = sorted(set(self.failed_blocks) | set(other.failed_blocks))
        out.tier_removed = self.tier_removed + other.tier_removed
        return out

    def is_empty(self) -> bool:
        return not (self.stored or self.unstored or self.tier_done or self.tier_written or self.tier_failed
                    or self.tier_removed or self.loads_done or self.failed_blocks)


def tier_done_key(*args: str):
    """``tier_done_key(tier, key)`` -> the string key of :attr:`KVXWorkerMetadata.tier_done` (its dicts
    cross processes as msgpack: string keys only); ``tier_done_key(s)`` -> (tier, key)."""
    if len(args) == 2:
        return f"{args[0]}/{args[1]}"
    tier, _, key = args[0].rpartition("/")
    return tier, key
