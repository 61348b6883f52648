"""What crosses between the scheduler side and the workers, once per step.

Scheduler -> workers: :class:`KVXMetadata` (loads to start, chunks to save, requests preempted); every
transfer in it carries the id of its record in the scheduler's :class:`~.ledger.ChunkLedger`.
Workers -> scheduler: :class:`KVXWorkerMetadata`: one outcome per transfer id and worker (merged over workers
by vLLM's output aggregator; the ledger ends a transfer once every worker reported it).
Both are plain dataclasses of ints, strings and lists: they pickle across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # the worker side also runs without vLLM (tests/worker drive it on a GPU machine without vLLM)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            return self


# What one worker reports for one transfer (:attr:`KVXWorkerMetadata.results`)
OK = "ok"  # done: the CPU slot written, the tier stored new bytes, the load finished
NOOP = "noop"  # nothing done: the save was dropped (backpressure, a failed load) or this engine does not write
HELD = "held"  # a tier write: this worker's parts are in the tier, all there already (or it writes none: a replica)
FAILED = "failed"  # the copy, read or write failed


@dataclass
class ChunkLoad:
    """Fill ``block_ids`` from chunk ``key``, starting at block ``first_block`` of the chunk.

    ``tier`` is where the bytes are ("cpu": pool slot ``slot``; else the name of the tier to read from).
    For a load from another tier, ``slot`` (if not None) is a CPU slot to read the chunk into (promotion,
    transfer ``slot_xfer``). ``before_forward``: the last block also receives this step's first computed
    token, whose KV vLLM may write before ``wait_for_layer_load``. The worker copies only the chunk's
    ``shared_tokens`` tokens of that block (so the order against that write does not matter), or, with raw
    pages (which cannot be split by token), the whole chunk before the forward starts. ``state``: the object is
    a state object (a hybrid model's recurrent state at the end of a chunk of ``tokens`` tokens: one block per
    state group, ``block_ids`` in group order; see :mod:`.common`).
    """

    key: str
    tier: str
    slot: int | None
    block_ids: list[int]
    first_block: int
    tokens: int
    before_forward: bool = False
    shared_tokens: int = 0  # with before_forward: tokens of the last block the chunk provides
    # Several KV cache groups (or null blocks skipped): the chunk's block index of each of ``block_ids``
    # (group g's j-th block of a chunk of n blocks per group is g * n + j); None: first_block + i
    positions: list[int] | None = None
    span: int = 0  # with positions: blocks of each group this load covers (tokens = span * block)
    slot_xfer: int | None = None  # with a slot, for a load from another tier: the transfer writing that slot
    state: bool = False
    # a node's slot a pull from a peer is still filling (PENDING): the worker copies it once it turns READY, and
    # fails the chunk if it turns anything else or takes longer than the pull's wait (an async load's only)
    coming: bool = False


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool
    xfer: int = -1  # the load's transfer (reported when every copy of it has run)


@dataclass
class ChunkSave:
    """Save the ``tokens`` tokens in ``block_ids`` as chunk ``key`` (several KV cache groups: every group's
    blocks of those tokens, group after group).

    ``slot``: CPU pool slot to gather into (None: no CPU copy), written by transfer ``slot_xfer``.
    ``to_tiers``: also write the chunk to these tiers ({tier name: the write's transfer id}). ``from_slot``: the
    bytes are already in this CPU slot (no gather; a write-through of a committed chunk, or of one that was loaded
    from the CPU tier). ``deps``: blocks this chunk's KV depends on whose loads are not verified yet; a worker on
    which one of them failed drops the save (:mod:`.validity`). ``state``: a state object (see :class:`ChunkLoad`).
    """

    req_id: str
    key: str
    block_ids: list[int]
    tokens: int
    slot: int | None
    to_tiers: dict[str, int] = field(default_factory=dict)
    from_slot: int | None = None
    deps: list[int] = field(default_factory=list)
    slot_xfer: int | None = None
    state: bool = False


@dataclass
class KVXMetadata(KVConnectorMetadata):
    """One step's instructions. ``forward_blocks``: the blocks this step's forward writes and the blocks
    freed since the last step (finished or preempted requests: the next forwards may write them); the
    worker fences every queued copy of them before the forward (``kvx.engine.BlockOrder``). ``finished``:
    requests finished since the last step. ``pd_waiting``: a request waits for the chunks its producer announced
    (its lookup this step was put off): a worker's idle step may pause a little (:data:`.worker.PD_IDLE_PAUSE_S`).
    ``pull_waiting``: a lookup was put off until its node has a pull's slots (:data:`.worker.PULL_IDLE_PAUSE_S`)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    forward_blocks: list[int] = field(default_factory=list)
    pd_waiting: bool = False
    pull_waiting: bool = False  # a lookup was put off while its node pulls its chunks (a shorter pause: PULL_IDLE_...)
    node: tuple[str, str] | None = None  # the node tier's pool file and epoch (kvx.node.client.NodePool.attach)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted or self.finished or self.forward_blocks)


@dataclass
class KVXWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers report to the scheduler (merged by :meth:`aggregate`).

    results: transfer id -> each reporting worker's outcome (:data:`OK`, :data:`HELD`, :data:`NOOP`, :data:`FAILED`)
    failed_blocks: blocks whose load failed on a worker (union over workers)
    removed: (tier, chunk key) of chunks removed from a byte tier on a worker (evicted, dropped)
    reads: one record per chunk read from a byte tier: (tier, bytes, seconds), for the scheduler's estimate of
    each tier's read speed (:class:`~.scheduler.HitCosts`)
    layers: the reporting workers' layer ranges (sent with every report; not a result on its own)
    """

    results: dict[int, list[str]] = field(default_factory=dict)
    failed_blocks: list[int] = field(default_factory=list)
    removed: list[tuple[str, str]] = field(default_factory=list)
    reads: list[tuple[str, int, float]] = field(default_factory=list)
    # the layer ranges (decoder indices) of the reporting workers' parts (:mod:`.parts`): a chunk's record lists them
    layers: list[tuple[int, int]] = field(default_factory=list)

    def report(self, xfer: int, outcome: str) -> None:
        self.results.setdefault(xfer, []).append(outcome)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVXWorkerMetadata):
            return self
        results = {x: list(o) for x, o in self.results.items()}
        for x, o in other.results.items():
            results.setdefault(x, []).extend(o)
        return KVXWorkerMetadata(
            results,
            sorted(set(self.failed_blocks) | set(other.failed_blocks)),
            self.removed + other.removed,
            self.reads + other.reads,
            sorted(set(self.layers) | set(other.layers)),
        )

    def is_empty(self) -> bool:
        return not (self.results or self.failed_blocks or self.removed or self.reads)
