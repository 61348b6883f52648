"""What the scheduler knows about one request, and the small named types that travel between the scheduler's
policies. Scheduler thread only (no locking): every object here is made, read and changed there.

A :class:`RequestTracker` is made at a request's first lookup (:func:`tracker_of`) and dropped when it finishes.
It holds the request's chunk keys (extended lazily over the prompt and, with ``save_decode``, the output: the
keys of the chunks the lookup reads and the save planner writes), its per-request controls, the lookup's plan
(:class:`LoadPlan`, kept from ``get_num_new_matched_tokens`` for ``update_state_after_alloc``), the save planner's
cursor (:class:`SaveCursor`), a P/D consumer's wait for its producer (:class:`PDWait`), and its fallback block
tables (:func:`tables_of`).

Seams: :mod:`.lookup` (the hit filters) reads and narrows a :class:`~.lookup.Lookup` of a tracker and keeps
:class:`PDWait`; :mod:`.load_plan` turns a :class:`LoadPlan` into the step's :class:`~.metadata.LoadSpec`;
:mod:`.save_plan` advances :class:`SaveCursor`; :class:`~.scheduler.KVXScheduler` owns the trackers
(``trackers``) and rewinds cursors on the workers' results.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..keys import MMItem, chunk_keys, request_root
from .params import RequestControls, controls_of


class Phase(enum.Enum):
    NEW = "new"
    LOADING = "loading"  # async load in flight
    RUNNING = "running"
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class StateRef:
    """A hybrid model's state object: its key, and the tier holding it."""

    key: str
    tier: str


@dataclass
class LoadPlan:
    """Result of the last lookup (kept so update_state_after_alloc loads exactly what was reported)."""

    num_computed: int
    hit_tokens: int
    tiers: list[str]  # per chunk: "cpu" or the name of the tier serving it
    keys: list[str]  # per chunk (the last may be a partial chunk's key)
    chunk_tokens: list[int]
    state: StateRef | None = None  # hybrid models: the last chunk's state object
    is_async: bool = False  # reported as an async load (load_async, or chunks still coming)
    coming: frozenset[str] = frozenset()  # chunks of the hit in "cpu" not there yet (a pull): the workers wait


@dataclass
class SaveCursor:
    """How far the save planner (:class:`~.save_plan.SavePlanner`) got with a request's chunks."""

    saved_chunks: int = 0  # full chunks handled by the save planner
    state_chunks: int = 0  # hybrid models: the full chunks up to the last one whose state object was planned
    partial_done: bool = False  # its trailing partial chunk handled
    not_admitted: int | None = None  # admit_after > 1: its first full chunk admission skipped (not stored)


@dataclass
class PDWait:
    """A P/D consumer's wait for its producer's chunks (:class:`~.lookup.WaitForProducer`)."""

    since: float | None = None  # when it began waiting
    settled: bool = False  # done waiting (all there, timed out, or not ours)


@dataclass
class RequestTracker:
    """What the scheduler knows about one request. Owned by :class:`~.scheduler.KVXScheduler`."""

    req_id: str
    request: object  # vllm.v1.request.Request (live object, same process)
    root: bytes
    mm_items: tuple[MMItem, ...] = ()
    controls: RequestControls = RequestControls()  # the request's kvx_* kv_transfer_params
    saves: bool = True  # skip_save / save_priority_limit
    pd_wait: PDWait = field(default_factory=PDWait)  # consumer: its wait for its producer's chunks
    local_hit: int | None = None  # vLLM's own prefix hit at the last lookup (None: not looked up)
    counted: bool = False  # hit/miss tokens counted (once per request)
    sighted: bool = False  # admit_after > 1: its prompt's chunks counted as seen (once per request)
    keys: list[str] = field(default_factory=list)  # keys of full chunks hashed so far
    cursor: SaveCursor = field(default_factory=SaveCursor)  # the save planner's progress
    phase: Phase = Phase.NEW
    plan: LoadPlan | None = None
    block_ids: list[list[int]] = field(default_factory=list)  # fallback tables, per group (no KVConnectorBlockState)
    # chunk key -> the tier this request loaded it from, or found it in at its lookup: that tier holds it, so its
    # save skips that tier (a remote tier is not asked on the scheduler's path: a warm 16-chunk prefill from Redis
    # gathered and sent every chunk back; so did a hit declined as slow). Forgotten from a failed load's chunk on:
    # the recomputed chunks are written again.
    loaded_from: dict[str, str] = field(default_factory=dict)

    def full_keys(self, num_tokens: int, chunk_size: int) -> list[str]:
        """Keys of the full chunks among the first ``num_tokens`` tokens (extends the chain lazily)."""
        want = num_tokens // chunk_size
        if want > len(self.keys):
            start = len(self.keys) * chunk_size
            prev = bytes.fromhex(self.keys[-1]) if self.keys else self.root
            toks = list(self.request.all_token_ids[start : want * chunk_size])
            mm = tuple(MMItem(m.hash, m.offset - start, m.length) for m in self.mm_items)
            self.keys += chunk_keys(prev, toks, chunk_size, mm_items=mm)
        return self.keys[:want]

    def partial_key(self, num_full: int, tokens: int, chunk_size: int) -> str:
        """Key of a trailing partial chunk of ``tokens`` tokens after ``num_full`` full chunks."""
        start = num_full * chunk_size
        prev = bytes.fromhex(self.keys[num_full - 1]) if num_full else self.root
        toks = list(self.request.all_token_ids[start : start + tokens])
        mm = tuple(MMItem(m.hash, m.offset - start, m.length) for m in self.mm_items)
        return chunk_keys(prev, toks, chunk_size, mm_items=mm, num_chunks=0, partial_tokens=tokens)[0]

    def load_failed(self, chunk: int) -> None:
        """A load its chunk ``chunk`` depends on failed: save its chunks again from there, to every tier too (from
        the failed chunk on, the tier's copy may be what failed: the recomputed ones are written)."""
        self.cursor.saved_chunks = min(self.cursor.saved_chunks, chunk)
        self.cursor.partial_done = False
        good = set(self.keys[:chunk])
        self.loaded_from = {k: v for k, v in self.loaded_from.items() if k in good}


def _mm_items(request) -> tuple[MMItem, ...]:
    items = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is not None and ident is not None:
            items.append(MMItem(str(ident), int(pos.offset), int(pos.length)))
    return tuple(items)


def tracker_of(request, namespace: bytes, save_priority_limit: int | None) -> tuple[RequestTracker, str | None]:
    """A new tracker of ``request`` in engine namespace ``namespace``, and the error in its ``kvx_*`` controls
    (None: none; with one, kvx neither loads nor saves it)."""
    controls, error = controls_of(request)
    lora = getattr(request, "lora_request", None)
    root = request_root(
        namespace,
        getattr(request, "cache_salt", None),
        getattr(lora, "lora_name", None) if lora is not None else None,
        controls.namespace,
    )
    limit = save_priority_limit
    saves = not controls.skip_save and (limit is None or int(getattr(request, "priority", 0)) <= limit)
    t = RequestTracker(request.request_id, request, root, _mm_items(request), controls=controls, saves=saves)
    return t, error


def state_tables(rid: str, block_state) -> list[list[int]]:
    """Request ``rid``'s block tables, per group, from vLLM's ``KVConnectorBlockState`` ([]: none there)."""
    ids = block_state.get_block_ids(rid) if block_state is not None else None
    return [list(g) for g in ids] if ids is not None and ids and ids[0] else []


def tables_of(t: RequestTracker, block_state) -> list[list[int]]:
    """Request ``t``'s block tables, per group: vLLM's, else the fallback tables the scheduler keeps."""
    return state_tables(t.req_id, block_state) or t.block_ids
