"""The load planner: a request's reported hit (:class:`~.tracker.LoadPlan`) turned into the step's
:class:`~.metadata.LoadSpec` once vLLM allocated its blocks. Scheduler thread only (no locking):
:class:`LoadPlanner` is called from ``update_state_after_alloc`` (:class:`~.scheduler.KVXScheduler`).

Each chunk of the hit that vLLM's allocation covers is a :class:`LoadSpan` of table positions: the blocks past
vLLM's own prefix hit, every attention group's (vLLM's null blocks, outside a sliding window, are skipped); a
block that also gets this step's first computed token is loaded before the forward. A hybrid model's hit also
restores the state object at its end (:class:`StateLoad`: one block per state group). A hit from a slower tier
is promoted into the CPU tier (``promote``: once committed there, written through to the faster tiers lacking
it, by a producer). The ledger pins and allocates the slots (:meth:`~.ledger.ChunkLedger.plan_load`); the blocks
loaded are noted as loading (:mod:`.validity`), and the tiers read in the tracker's ``loaded_from`` (their saves
skip them). Counters (``hit_tokens_<tier>``) go to the scheduler's ``stats`` (one Counter, shared, never
replaced).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..store import SlotIndex
from .common import NULL_BLOCK, EngineGeometry
from .config import KVXConfig
from .events import KVEvents
from .ledger import ChunkLedger, LoadChunk
from .metadata import ChunkLoad, LoadSpec
from .tracker import LoadPlan, RequestTracker
from .validity import BlockValidity


@dataclass(frozen=True)
class LoadSpan:
    """One chunk of a load: table positions [lo, hi) of chunk ``key`` (``tokens`` tokens from tier ``tier``),
    which starts at table position ``cb0``."""

    key: str
    tier: str
    tokens: int
    cb0: int
    lo: int
    hi: int


@dataclass(frozen=True)
class StateLoad:
    """A hybrid model's state object loaded: its key, the tier read, and the state groups' blocks it fills."""

    key: str
    tier: str
    block_ids: list[int]


class LoadPlanner:
    """Plans a request's load (see the module docstring). Owned by :class:`~.scheduler.KVXScheduler`, which hands
    it the parts of its state it reads or changes."""

    def __init__(
        self,
        config: KVXConfig,
        geom: EngineGeometry,
        cpu: SlotIndex | None,
        ledger: ChunkLedger,
        validity: BlockValidity,
        events: KVEvents,
        stats: Counter,
    ):
        self.config, self.geom, self.cpu, self.ledger = config, geom, cpu, ledger
        self.validity, self.events, self.stats = validity, events, stats
        self.chunk_size = config.chunk_size
        self.blocks_per_chunk = config.chunk_size // geom.block_size

    def plan(self, t: RequestTracker, plan: LoadPlan, tables: list[list[int]], num_external_tokens: int) -> LoadSpec:
        """Request ``t``'s load of the ``num_external_tokens`` tokens vLLM allocated past its own hit, as
        ``plan`` reported them, into block ``tables`` (per group)."""
        rid = t.req_id
        start, end = plan.num_computed, plan.num_computed + num_external_tokens
        spans = self._spans(plan, start, end)
        states = self._state_load(rid, plan, tables, end)
        promote = [self._promotes(s.key, s.tier) for s in [*spans, *states]]
        xfer, slots = self.ledger.plan_load(
            rid,
            [LoadChunk(s.key, s.tier, s.tokens, p) for s, p in zip(spans, promote)]
            + [LoadChunk(s.key, s.tier, self.chunk_size, p, state=True) for s, p in zip(states, promote[len(spans) :])],
        )
        loaded: dict[int, int] = {}  # block -> the chunk it is loaded from (validity)
        state_loads = []  # loaded after the chunks (the order the workers read them in)
        for s, (slot, slot_xfer) in zip(states, slots[len(spans) :]):
            load = ChunkLoad(
                s.key,
                s.tier,
                slot,
                s.block_ids,
                0,
                self.chunk_size,
                slot_xfer=slot_xfer,
                state=True,
                coming=s.key in plan.coming,
            )
            state_loads.append(load)
            loaded.update((b, len(plan.keys) - 1) for b in s.block_ids)
            t.loaded_from[s.key] = s.tier
        attn = [tables[g] for g in self.geom.attn_groups]
        chunks = [
            self._chunk_load(t, s, slot, slot_xfer, p, attn, start, end, loaded, s.key in plan.coming)
            for s, (slot, slot_xfer), p in zip(spans, slots, promote)
        ]
        self.validity.loading(rid, loaded)
        return LoadSpec(rid, chunks + state_loads, plan.is_async, xfer)

    def _promotes(self, key: str, tier: str) -> bool:
        """A hit from a slower tier is read into a CPU slot too (if the CPU tier lacks it)."""
        return tier != "cpu" and self.cpu is not None and self.config.promote and self.cpu.state(key) is None

    def _spans(self, plan: LoadPlan, start: int, end: int) -> list[LoadSpan]:
        """The chunks of ``plan`` with blocks among tokens [start, end) (their table positions)."""
        bs = self.geom.block_size
        first_blk, end_blk = start // bs, -(-end // bs)
        spans = []
        for c, (key, tier, ntok) in enumerate(zip(plan.keys, plan.tiers, plan.chunk_tokens)):
            cb0 = c * self.blocks_per_chunk
            lo, hi = max(cb0, first_blk), min(cb0 + ntok // bs, end_blk)
            if lo < hi:
                spans.append(LoadSpan(key, tier, ntok, cb0, lo, hi))
        return spans

    def _chunk_load(
        self,
        t: RequestTracker,
        s: LoadSpan,
        slot: int | None,
        slot_xfer: int | None,
        promote: bool,
        tables: list[list[int]],
        start: int,
        end: int,
        loaded: dict[int, int],
        coming: bool = False,
    ) -> ChunkLoad:
        """The load of span ``s`` into the attention groups' ``tables`` (its blocks noted in ``loaded``)."""
        bs = self.geom.block_size
        end_blk = -(-end // bs)
        if promote:
            self.events.record(s.key, t.request, s.cb0, s.tokens // bs)
        shared = end % bs != 0 and s.hi == end_blk  # the last block also gets this step's tokens
        ids, positions = self._load_blocks(tables, s.lo, s.hi, s.cb0, s.tokens // bs)
        load = ChunkLoad(
            s.key,
            s.tier,
            slot,
            ids,
            s.lo - s.cb0,
            s.tokens,
            before_forward=shared,
            shared_tokens=end % bs if shared else 0,
            positions=positions,
            span=s.hi - s.lo if positions is not None else 0,
            slot_xfer=slot_xfer,
            coming=coming,
        )
        loaded.update((b, s.cb0 // self.blocks_per_chunk) for b in ids)
        t.loaded_from[s.key] = s.tier
        self.stats[f"hit_tokens_{s.tier}"] += min(s.hi * bs, end) - max(s.lo * bs, start)
        return load

    def _state_load(self, rid: str, plan: LoadPlan, tables: list[list[int]], end: int) -> list[StateLoad]:
        """The state object a hybrid model's load restores: [its :class:`StateLoad` at the hit's end], or [] (no
        state groups). vLLM allocates, for the external hit, a block at its end in every state group's table; the
        state is loaded there, before the request computes from it."""
        if plan.state is None:
            return []
        p = end // self.geom.block_size - 1
        if end != plan.hit_tokens or end % self.chunk_size:
            raise RuntimeError(
                f"request {rid}: vLLM allocated a load of {end - plan.num_computed} tokens from {plan.num_computed}, "
                f"expected the whole hit up to {plan.hit_tokens} (a chunk end: the stored state is the one there)"
            )
        ids = [tables[g][p] if p < len(tables[g]) else NULL_BLOCK for g in self.geom.state_groups]
        if NULL_BLOCK in ids:
            raise RuntimeError(
                f"request {rid}: vLLM allocated no block for the recurrent state at token {end} "
                f"(state groups' blocks at position {p}: {ids})"
            )
        return [StateLoad(plan.state.key, plan.state.tier, ids)]

    @staticmethod
    def _load_blocks(tables: list[list[int]], lo: int, hi: int, cb0: int, n: int):
        """The blocks a load of table positions [lo, hi) writes (a chunk starting at position ``cb0``, ``n``
        blocks per group), and their positions in the chunk (None: one group, no null block: ``lo - cb0 + i``).
        vLLM's null blocks (a sliding-window group's blocks outside the window) are skipped."""
        if len(tables) == 1 and NULL_BLOCK not in tables[0][lo:hi]:
            return tables[0][lo:hi], None
        ids, positions = [], []
        for g, table in enumerate(tables):
            for j in range(lo, hi):
                if j < len(table) and table[j] != NULL_BLOCK:
                    ids.append(table[j])
                    positions.append(g * n + j - cb0)
        return ids, positions
