"""The save planner: which of a request's chunks this step's metadata saves, and where. Scheduler thread only
(no locking): :class:`SavePlanner` is called from ``build_connector_meta`` (:class:`~.scheduler.KVXScheduler`),
once per scheduled request of a producer that saves it.

Every chunk a step completes is planned (prompt only unless ``save_decode``; minus ``skip_last_n_tokens``; the
trailing partial chunk only with ``save_partial_chunks``) as a :class:`ChunkSpan` of the request's block tables,
to every tier that lacks it (:meth:`~.ledger.ChunkLedger.plan_save`); a hybrid model's chunk also saves the
recurrent state at its end, where vLLM kept it, as its state object. A save whose KV depends on blocks whose
loads are not verified yet carries them (:mod:`.validity`): a chunk computed against a failed load is never
stored, and its request's planning stops there until vLLM recomputed it.

Seams: the request's progress is its tracker's :class:`~.tracker.SaveCursor`, advanced here and rewound by the
scheduler on the workers' results (an aborted CPU write, a failed load). The plans go into the step's
:class:`~.metadata.KVXMetadata` (``saves``); the transfers are the ledger's. Counters go to the scheduler's
``stats`` (one Counter, shared, never replaced).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..keys import state_key
from ..log import get_logger
from ..store import SlotIndex
from .admission import Admission
from .common import NULL_BLOCK, EngineGeometry
from .config import KVXConfig
from .events import KVEvents
from .ledger import ChunkLedger
from .metadata import KVXMetadata
from .tracker import RequestTracker, tables_of
from .validity import BlockValidity

log = get_logger(__name__)


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk to save: table positions [b0, b1) of every attention group, holding ``tokens`` tokens."""

    chunk: int | None  # the request's chunk-th chunk; None: its trailing partial chunk
    key: str
    b0: int
    b1: int
    tokens: int


class SavePlanner:
    """Plans the saves of the chunks each step completes (see the module docstring). Owned by
    :class:`~.scheduler.KVXScheduler`, which hands it the parts of its state it reads or changes."""

    def __init__(
        self,
        config: KVXConfig,
        geom: EngineGeometry,
        cpu: SlotIndex | None,
        ledger: ChunkLedger,
        validity: BlockValidity,
        admission: Admission | None,
        events: KVEvents,
        stats: Counter,
    ):
        self.config, self.geom = config, geom
        self.chunk_size = config.chunk_size
        self.blocks_per_chunk = config.chunk_size // geom.block_size
        self.cpu, self.ledger, self.validity, self.admission, self.events = cpu, ledger, validity, admission, events
        self.stats = stats

    def plan(self, t: RequestTracker, done: int, num_spec: int, block_state, meta: KVXMetadata) -> None:
        """Plan request ``t``'s chunks among its first ``done`` tokens (``num_spec`` of them speculative) that
        its cursor has not handled yet, into ``meta``."""
        req, cur = t.request, t.cursor
        prompt = req.num_prompt_tokens
        if self.config.save_decode:
            limit = min(done - num_spec, len(req.all_token_ids))
        else:
            limit = prompt
        limit = min(limit, prompt - self.config.skip_last_n_tokens) if self.config.skip_last_n_tokens else limit
        end = min(done, limit)
        nfull = max(end, 0) // self.chunk_size
        table = None
        if nfull > cur.saved_chunks:
            keys = t.full_keys(nfull * self.chunk_size, self.chunk_size)
            table = tables_of(t, block_state)
            for c in range(cur.saved_chunks, nfull):
                b0 = c * self.blocks_per_chunk
                span = ChunkSpan(c, keys[c], b0, b0 + self.blocks_per_chunk, self.chunk_size)
                if not self._plan_one(t, span, table, meta):
                    return  # depends on a failed load: saved from here once vLLM recomputed it
                cur.saved_chunks = c + 1
        if (
            self.config.save_partial_chunks
            and not cur.partial_done
            and done >= prompt
            and end > 0
            and limit < (nfull + 1) * self.chunk_size
            and cur.saved_chunks == nfull
        ):
            self._plan_partial(t, nfull, end, table, block_state, meta)

    def _plan_partial(self, t: RequestTracker, nfull: int, end: int, table, block_state, meta: KVXMetadata) -> None:
        """Plan request ``t``'s trailing partial chunk (the whole blocks of its first ``end`` tokens past its
        ``nfull`` full chunks), once."""
        rest = ((end - nfull * self.chunk_size) // self.geom.block_size) * self.geom.block_size
        if rest > 0:
            t.full_keys(nfull * self.chunk_size, self.chunk_size)
            table = table if table is not None else tables_of(t, block_state)
            b0 = nfull * self.blocks_per_chunk
            key = t.partial_key(nfull, rest, self.chunk_size)
            if not self._plan_one(t, ChunkSpan(None, key, b0, b0 + rest // self.geom.block_size, rest), table, meta):
                return
        t.cursor.partial_done = True

    def _savable_blocks(self, t: RequestTracker, span: ChunkSpan, tables: list[list[int]]) -> list[int] | None:
        """The blocks of every attention group that ``span`` saves (group after group); None: it cannot be saved
        (vLLM's tables do not cover it, or a sliding window released some of its blocks)."""
        b0, b1 = span.b0, span.b1
        attn = [tables[g] for g in self.geom.attn_groups] if len(tables) == self.geom.num_groups else []
        if not attn or any(len(tb[b0:b1]) * self.geom.block_size != span.tokens for tb in attn):
            log.warning(
                "kvx: request %s: %s blocks for a %d-token chunk; not saving it",
                t.req_id,
                [len(tb[b0:b1]) for tb in tables],
                span.tokens,
            )
            return None
        block_ids = [b for tb in attn for b in tb[b0:b1]]
        if NULL_BLOCK in block_ids:
            # a sliding-window group released blocks of this chunk (vLLM's null block): it cannot serve every
            # group, so it is not stored (a hit never reaches past it)
            if (self.cpu is not None and self.cpu.state(span.key) is None) or self.ledger.lacking(span.key):
                self.stats["saves_incomplete"] += 1
            return None
        return block_ids

    def _plan_one(self, t: RequestTracker, span: ChunkSpan, tables: list[list[int]], meta: KVXMetadata) -> bool:
        """Plan saving ``span`` of every attention group's table as its chunk to every tier lacking it, and a hybrid
        model's state at the chunk's end as its state object. Returns False (nothing planned) if its KV depends on
        a block whose load is known to have failed."""
        block_ids = self._savable_blocks(t, span, tables)
        if block_ids is None:
            return True
        chunk, key = span.chunk, span.key
        deps = {}
        for table in tables:  # a state depends on every block before it, of every group
            deps.update(self.validity.unverified(table, span.b1))
        if deps and self.validity.known_bad(deps):
            self.stats["saves_deferred"] += 1
            return False
        if self.admission is not None and not self.admission.admitted(key):
            self.stats["saves_skipped_admission"] += 1  # not seen often enough yet: neither it nor its state
            if chunk is not None:
                cur = t.cursor
                cur.not_admitted = chunk if cur.not_admitted is None else min(cur.not_admitted, chunk)
            return True
        if chunk is not None and self.geom.state_groups:
            self._plan_state(t, chunk, key, tables, span.b1, deps, meta)
        self.events.record(key, t.request, span.b0, span.b1 - span.b0)
        # A rank cannot know in time that a load failed on another rank (only the scheduler hears every worker):
        # with several workers (those the ledger hears), a save depending on loads is gathered into the CPU tier
        # only, and written through to the other tiers once committed.
        save = self.ledger.plan_save(
            t.req_id,
            chunk,
            key,
            block_ids,
            span.tokens,
            deps,
            skip_tier=t.loaded_from.get(key),
            gather_first=bool(deps) and self.ledger.num_workers > 1,
        )
        if save is None:
            return True
        if deps:
            self.validity.guard(t.req_id, key, deps)
        meta.saves.append(save)
        self.stats["saves"] += 1
        return True

    def _plan_state(self, t: RequestTracker, chunk: int, key: str, tables, b1: int, deps: dict, meta) -> None:
        """Plan saving the recurrent state at the end of chunk ``key`` (blocks [.., b1)) as its state object, if
        vLLM kept it: in align mode the block at position ``b1 - 1`` of each state group's table holds the state
        after exactly ``b1`` blocks' tokens where a step ended there, and is vLLM's null block elsewhere."""
        p = b1 - 1
        ids = [tables[g][p] if p < len(tables[g]) else NULL_BLOCK for g in self.geom.state_groups]
        if NULL_BLOCK in ids:
            return
        skey = state_key(key)
        t.cursor.state_chunks = max(t.cursor.state_chunks, chunk + 1)
        gather_first = bool(deps) and self.ledger.num_workers > 1
        save = self.ledger.plan_save(
            t.req_id, chunk, skey, ids, self.chunk_size, deps, t.loaded_from.get(skey), gather_first, state=True
        )
        if save is None:
            return
        if deps:
            self.validity.guard(t.req_id, skey, deps)
        meta.saves.append(save)
        self.stats["state_saves"] += 1
