"""Scheduler side of the connector: lookups, load plans, save plans. Runs in vLLM's EngineCore
process, on the scheduler thread only (no locking).

Per request a :class:`RequestTracker` holds the chunk keys (extended lazily over the prompt and, with
``save_decode``, the output), how far saving has got, and the request's in-flight load. The CPU tier's
index lives here (:class:`kvx.store.CPUIndex`); the tiers after it (disk, Redis, any registered type)
are a :class:`kvx.store.stack.TierStack` of the tiers opened in this process for lookups, so several
engines sharing a store see each other's chunks. No tier type is named here. Every transfer in flight (CPU
slot writes, tier writes, loads) is a record of the :class:`~.ledger.ChunkLedger`; this module decides which
chunks a request loads and saves, the ledger how and what is in flight.

Life of a request:

1. ``get_num_new_matched_tokens`` (maybe several times; side-effect free): walk the chunk keys,
   each chunk available from the fastest tier that holds it (CPU READY, else the first tier holding
   its record: every part stored, :mod:`.parts`), stop at the first miss; report the hit beyond vLLM's local
   prefix hit. A full-prompt hit leaves only the last token to compute (sync loads must leave one); the block it
   lands in is loaded before the forward. ``None`` when a tier cannot answer without blocking on the
   network (vLLM asks again at its next step).
2. ``update_state_after_alloc`` with ``num_external_tokens > 0``: build the :class:`LoadSpec`
   (block ids per chunk; pin CPU slots; allocate CPU slots to promote hits from slower tiers into;
   once committed there, they are written through to the faster tiers that lack them).
3. ``build_connector_meta`` each step: emit new loads; plan saves of every chunk this step completes
   (prompt only unless ``save_decode``; minus ``skip_last_n_tokens``; trailing partial chunk only with
   ``save_partial_chunks``), to every tier that lacks it; note preempted requests. A save whose KV
   depends on blocks whose loads are not verified yet carries them (:mod:`.validity`): a chunk computed
   against a failed load is never stored.
4. ``update_connector_output``: the workers' results end the ledger's transfers (commit/abort CPU slots,
   release pins and holds); failed loads poison the saves that depend on them and rewind the requests' save
   cursors, so the chunks vLLM recomputes are stored again.
5. ``request_finished``: drop the tracker (blocks are freed at once: saves are fenced on the workers).

Several KV cache groups (:mod:`.common`): block tables are per group; a chunk's load and save cover every
attention group's blocks of its tokens; a chunk with a null block (outside a sliding window) is not saved, and
null blocks are not loaded; loads are asynchronous (a failure is then reported per request). A hybrid model's
recurrent-state groups: a chunk whose end vLLM kept the state at (a block of every state group's table) also
saves that state as its state object; a hit is the longest prefix of stored chunks, rounded down to the last
one whose state object is stored, and leaves at least the prompt's last token to compute (vLLM recomputes it
for its logits: the state must be the one before it).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..keys import MMItem, chunk_keys, request_root, state_key
from ..log import get_logger
from ..node.client import NodeIndex
from ..store import CPUIndex, SlotIndex, TierContext, tier_class
from ..store.stack import TierStack
from .admission import Admission
from .common import (
    _NULL_BLOCK,
    EngineGeometry,
    chunk_bytes,
    node_slot_bytes,
    num_cpu_slots,
    object_bytes,
    write_backlog,
)
from .config import KVXConfig
from .costs import HitCosts
from .events import CPU_PLACE, KVEvents
from .ledger import ChunkLedger, LoadChunk
from .metadata import ChunkLoad, KVXMetadata, KVXWorkerMetadata, LoadSpec
from .params import RequestControls, controls_of
from .parts import record_of
from .saves import io_thread
from .validity import BlockValidity

log = get_logger(__name__)


class Phase(enum.Enum):
    NEW = "new"
    LOADING = "loading"  # async load in flight
    RUNNING = "running"
    PREEMPTED = "preempted"


@dataclass
class LoadPlan:
    """Result of the last lookup (kept so update_state_after_alloc loads exactly what was reported)."""

    num_computed: int
    hit_tokens: int
    tiers: list[str]  # per chunk: "cpu" or the name of the tier serving it
    keys: list[str]  # per chunk (the last may be a partial chunk's key)
    chunk_tokens: list[int]
    state: tuple[str, str] | None = None  # hybrid models: (key, tier) of the last chunk's state object


@dataclass
class Lookup:
    """One lookup of a request's prefix, as the hit filters narrow it (scheduler thread, one call)."""

    t: RequestTracker
    num_computed: int  # vLLM's own prefix hit
    keys: list[str]  # the full chunks looked up
    tiers: list[str]  # the hit: per leading chunk, the fastest tier holding it
    stored: list[str | None] = field(default_factory=list)  # hybrid models: per chunk, the tier of its state object
    partial: tuple[str, int, str | None] | None = None  # the trailing partial chunk: (key, tokens, its tier)
    extra: tuple[str, int, str] | None = None  # the partial chunk, added to the hit
    state: tuple[str, str] | None = None  # hybrid models: (key, tier) of the hit's last state object


@dataclass
class RequestTracker:
    """What the scheduler knows about one request. Owned by :class:`KVXScheduler`."""

    req_id: str
    request: object  # vllm.v1.request.Request (live object, same process)
    root: bytes
    mm_items: tuple[MMItem, ...] = ()
    controls: RequestControls = RequestControls()  # the request's kvx_* kv_transfer_params
    saves: bool = True  # skip_save / save_priority_limit
    pd_since: float | None = None  # consumer: when it began waiting for its producer's chunks
    pd_settled: bool = False  # consumer: done waiting (all there, timed out, or not ours)
    local_hit: int | None = None  # vLLM's own prefix hit at the last lookup (None: not looked up)
    counted: bool = False  # hit/miss tokens counted (once per request)
    sighted: bool = False  # admit_after > 1: its prompt's chunks counted as seen (once per request)
    not_admitted: int | None = None  # admit_after > 1: its first full chunk admission skipped (not stored)
    keys: list[str] = field(default_factory=list)  # keys of full chunks hashed so far
    saved_chunks: int = 0  # full chunks handled by the save planner
    state_chunks: int = 0  # hybrid models: the full chunks up to the last one whose state object was planned
    partial_done: bool = False
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


def _mm_items(request) -> tuple[MMItem, ...]:
    items = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is not None and ident is not None:
            items.append(MMItem(str(ident), int(pos.offset), int(pos.length)))
    return tuple(items)


class KVXScheduler:
    """The scheduler-side state machine of :class:`kvx.connector.KVXConnector`."""

    def __init__(
        self,
        config: KVXConfig,
        geom: EngineGeometry,
        namespace: bytes,
        fingerprint: str,
        num_workers: int,
        producer: bool,
        consumer: bool,
        kv_events: bool = False,
        split: bool = True,
        stages: int = 1,
        background_writes: bool = True,
        model: str = "",
    ):
        """``split``: chunks are stored by KV head (:func:`~.common.head_parts`); ``stages``: pipeline stages (a
        chunk's record lists one layer range per stage); ``background_writes``: records are written on idle cores
        only, as the workers' tier writes (a P/D producer passes False: its consumer waits for them); ``model``: the
        model's name, as a node's ``stats`` lists this engine's namespace."""
        self.config = config
        self.split, self.stages = split, stages
        self.geom = geom
        self.namespace = namespace
        self.num_workers = num_workers
        self.producer, self.consumer = producer, consumer
        self.chunk_size = config.chunk_size
        self.blocks_per_chunk = config.chunk_size // geom.block_size
        self.ngroups = geom.num_groups
        self.attn_groups, self.state_groups = geom.attn_groups, geom.state_groups
        # several groups: vLLM takes load failures only per request, and only of async loads
        self.load_async = config.load_async or self.ngroups > 1
        n_slots = num_cpu_slots(config, geom)
        if config.cpu_tier is not None and n_slots < 1:
            raise ValueError(
                f"tiers: the cpu tier ({config.cpu_tier.size} bytes) cannot hold one chunk "
                f"of {config.chunk_size} tokens ({geom.num_layers} layers x {geom.page_bytes} "
                f"bytes per block); raise its size or lower chunk_size"
            )
        self.cpu: SlotIndex | None = CPUIndex(n_slots) if config.cpu_tier is not None else None
        if config.node_tier is not None:
            node = config.node_tier
            self.cpu = NodeIndex(
                node.socket,
                namespace,
                model,
                config.chunk_size,
                node_slot_bytes(config, geom),
                timeout=node.timeout,
                retry_s=node.retry_s,
                pull_wait_ms=node.pull_wait_ms,
            )
        ctx = TierContext(fingerprint, role="scheduler", writes=producer, io_threads=config.io_threads)
        self.tiers = {t.type: tier_class(t.type).open(t, ctx) for t in config.byte_tiers}
        self.stack = TierStack(list(self.tiers.values()))
        # chunk records (:mod:`.parts`): written here once every worker stored its parts, off this thread
        self._layer_ranges: set[tuple[int, int]] = set()  # the workers' layer ranges, as they report them
        self._background = background_writes
        self._recorder: ThreadPoolExecutor | None = None  # made at the first record (engines of several workers)
        self.events = KVEvents(
            kv_events,
            geom.block_size,
            {"cpu": CPU_PLACE, **{n: (type(t).event_medium, type(t).event_locality) for n, t in self.tiers.items()}},
        )
        for source in ([self.cpu] if self.cpu is not None else []) + list(self.tiers.values()):
            source.subscribe(self.events.observe)
        self.trackers: dict[str, RequestTracker] = {}
        self._chunk_bytes = slot_bytes = chunk_bytes(config, geom)
        if config.max_write_backlog < slot_bytes:
            log.warning(
                "kvx: max_write_backlog=%d is less than one chunk (%d bytes); using one chunk",
                config.max_write_backlog,
                slot_bytes,
            )
        self.ledger = ChunkLedger(
            self.cpu,
            self.stack,
            num_workers,
            self.events,
            writes=producer,
            backlog=write_backlog(config, geom),
            object_bytes=lambda tokens, state: object_bytes(geom, tokens, state),
            slot_bytes=slot_bytes,
            commit=self._commit if self.tiers and producer else None,
        )
        self.admission = Admission(config.admit_after, config.admission_capacity) if config.admit_after > 1 else None
        self._new_loads: list[LoadSpec] = []
        self.validity = BlockValidity(self.blocks_per_chunk)
        self._freed: list[int] = []  # blocks freed since the last step (for the workers)
        self._pending_reported = 0
        self._pd_waiting = False  # a lookup this step waited for a producer's chunks (scheduler thread)
        self.stats = Counter()
        self.costs = HitCosts(config.io_threads) if config.decline_slow_hits and self.stack else None
        # the lookup's policies, in order (get_num_new_matched_tokens); each narrows the hit or puts the lookup off
        self._hit_filters = (
            ([self._decline_slow] if self.costs is not None else [])
            + ([self._round_to_state] if self.state_groups else [])
            + [self._wait_for_producer]
            + ([self._add_partial] if config.save_partial_chunks and not self.state_groups else [])
        )

    # ------------------------------------------------------------------ helpers
    def _tracker(self, request) -> RequestTracker:
        t = self.trackers.get(request.request_id)
        if t is None or t.request is not request:
            controls, error = controls_of(request)
            if error is not None:  # refused by the front end's check where it is installed
                log.error("kvx: request %s: %s; kvx neither loads nor saves it", request.request_id, error)
                self.stats["bad_request_params"] += 1
            lora = getattr(request, "lora_request", None)
            root = request_root(
                self.namespace,
                getattr(request, "cache_salt", None),
                getattr(lora, "lora_name", None) if lora is not None else None,
                controls.namespace,
            )
            limit = self.config.save_priority_limit
            saves = not controls.skip_save and (limit is None or int(getattr(request, "priority", 0)) <= limit)
            t = RequestTracker(request.request_id, request, root, _mm_items(request), controls=controls, saves=saves)
            self.trackers[request.request_id] = t
        return t

    def _commit(self, tier: str, key: str) -> Future | None:
        """Write chunk ``key``'s record to ``tier`` (every worker stored its parts there), on the recorder thread.
        None: an engine of one worker, which wrote it with its parts (:class:`~.parts.PartIO`)."""
        if self.num_workers == 1:
            return None
        if self._recorder is None:
            self._recorder = ThreadPoolExecutor(
                1, thread_name_prefix="kvx-record", initializer=io_thread, initargs=(self._background,)
            )
        if len(self._layer_ranges) != self.stages:  # every worker reports its range with its results: a defect
            fut: Future = Future()
            fut.set_exception(RuntimeError(f"expected {self.stages} stages' layer ranges, got {self._layer_ranges}"))
            return fut
        record = record_of(
            sorted(self._layer_ranges), self.geom.model_kv_heads if self.split else self.geom.num_kv_heads
        )
        return self._recorder.submit(self.tiers[tier].put, key, record.encode(), {"kind": "record"})

    def _locate(self, keys: list[str]) -> list[str | None] | None:
        """Per key, the fastest tier holding it ("cpu" or a tier's name; None: none). None: not known yet."""
        cached = self.cpu.contains_many(keys) if self.cpu is not None else [False] * len(keys)
        first_miss = next((i for i, hit in enumerate(cached) if not hit), len(keys))
        if self.cpu is not None and first_miss < len(keys) and self.cpu.pulling(keys[first_miss:]):
            self.stats["lookups_pulling"] += 1
            return None
        found: list[str | None] = ["cpu" if hit else None for hit in cached]
        rest = [i for i, f in enumerate(found) if f is None]
        if rest and self.stack:
            more = self.stack.locate([keys[i] for i in rest])
            if more is None:
                return None
            for i, name in zip(rest, more):
                found[i] = name
        return found

    # ------------------------------------------------------------------ step 1: lookup
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's block-aligned local hit) that kvx can load; None
        if a tier is still looking, or a P/D consumer waits for its producer's chunks (vLLM skips the request this
        step and asks again).

        The hit is the leading run of chunks some tier holds (:meth:`_look_up`), narrowed by each of
        :attr:`_hit_filters` in turn (each a small policy: :meth:`_decline_slow`, :meth:`_round_to_state`,
        :meth:`_wait_for_producer`, :meth:`_add_partial`), then reported (:meth:`_report`)."""
        t = self._tracker(request)
        t.plan = None
        if self.admission is not None and not t.sighted:
            self._sight(t)
        if not self.consumer or t.controls.skip_load:
            return 0, False
        t.local_hit = num_computed_tokens
        lk = self._look_up(t, num_computed_tokens)
        if lk is None or not all(f(lk) for f in self._hit_filters):
            self.stats["lookups_pending"] += 1
            return None, False
        self.stats["lookups"] += 1
        return self._report(lk)

    def _look_up(self, t: RequestTracker, num_computed: int) -> Lookup | None:
        """Where each chunk of the request's prompt is (None: a tier cannot answer yet); the hit so far: the leading
        run of chunks found. The tiers found holding a chunk are noted (its save skips them)."""
        num_tokens = t.request.num_tokens
        keys = t.full_keys(num_tokens, self.chunk_size)
        if self.state_groups:
            # the state must be the one before the last token, which vLLM computes (for its logits)
            keys = keys[: (num_tokens - 1) // self.chunk_size]
        rest = ((num_tokens - len(keys) * self.chunk_size) // self.geom.block_size) * self.geom.block_size
        partial = self.config.save_partial_chunks and rest and not self.state_groups
        pkey = t.partial_key(len(keys), rest, self.chunk_size) if partial else None
        skeys = [state_key(k) for k in keys] if self.state_groups else []
        located = self._locate(keys + ([pkey] if pkey else []) + skeys)
        if located is None:
            return None
        found, stored = located[: len(keys)], located[len(located) - len(skeys) :]  # chunks, state objects
        for key, tier in zip(keys + skeys, found + stored):
            if tier is not None and tier != "cpu":  # that tier holds it: a save of it (declined, or under vLLM's
                t.loaded_from.setdefault(key, tier)  # own hit) skips that tier, as after a load from it
        n = next((i for i, tier in enumerate(found) if tier is None), len(found))
        return Lookup(
            t,
            num_computed,
            keys,
            tiers=list(found[:n]),
            stored=stored,
            partial=(pkey, rest, located[len(keys)]) if pkey else None,
        )

    def _decline_slow(self, lk: Lookup) -> bool:
        """``decline_slow_hits``: stop the hit before a tier slower than recomputing its chunks."""
        if lk.tiers:
            n = self.costs.servable(lk.tiers, lk.num_computed // self.chunk_size, self.chunk_size, self._chunk_bytes)
            if n < len(lk.tiers):
                self.stats["hits_declined_slow"] += 1
                del lk.tiers[n:]
        return True

    def _round_to_state(self, lk: Lookup) -> bool:
        """A hybrid model's hit ends where a state object is stored: the longest prefix of chunks, rounded down to
        one whose state is."""
        n = next((j for j in range(len(lk.tiers), 0, -1) if lk.stored[j - 1] is not None), 0)
        if n < len(lk.tiers):
            self.stats["hits_rounded_to_state"] += 1
        del lk.tiers[n:]
        lk.state = (state_key(lk.keys[n - 1]), lk.stored[n - 1]) if n else None
        return True

    def _wait_for_producer(self, lk: Lookup) -> bool:
        """A P/D consumer's request: put the lookup off while its producer's chunks are still landing."""
        if lk.t.controls.pd and self._pd_wait(lk.t, lk.keys, len(lk.tiers)):
            self._pd_waiting = True
            return False
        return True

    def _add_partial(self, lk: Lookup) -> bool:
        """``save_partial_chunks``: a hit of every full chunk goes on with the trailing partial chunk, if stored."""
        if lk.partial is not None and len(lk.tiers) == len(lk.keys) and lk.partial[2] is not None:
            lk.extra = lk.partial
        return True

    def _report(self, lk: Lookup) -> tuple[int, bool]:
        """The tokens of the hit past vLLM's own (the plan kept for update_state_after_alloc)."""
        tiers, hit_keys = list(lk.tiers), lk.keys[: len(lk.tiers)]
        chunk_tokens = [self.chunk_size] * len(tiers)
        hit = len(tiers) * self.chunk_size
        if lk.extra is not None:
            pkey, rest, tier = lk.extra
            tiers.append(tier)
            hit_keys = hit_keys + [pkey]
            chunk_tokens.append(rest)
            hit += rest
        if hit <= lk.num_computed:
            return 0, False
        num_tokens = lk.t.request.num_tokens
        if not self.load_async and hit >= num_tokens:
            # A sync load must leave a token to compute: report all but the last one. The block holding
            # it is loaded whole before the forward (ChunkLoad.before_forward), which then writes the
            # last token's KV over the loaded copy; only that one token is recomputed, where vLLM's own
            # prefix cache recomputes the whole last block.
            hit = num_tokens - 1
            if hit <= lk.num_computed:
                return 0, False
        lk.t.plan = LoadPlan(lk.num_computed, hit, tiers, hit_keys, chunk_tokens, lk.state)
        return hit - lk.num_computed, self.load_async

    def _sight(self, t: RequestTracker) -> None:
        """admit_after > 1: count the chunks request ``t``'s prompt covers as seen once more (once per request)."""
        t.sighted = True
        prompt = t.request.num_prompt_tokens
        keys = t.full_keys(prompt, self.chunk_size)
        rest = ((prompt - len(keys) * self.chunk_size) // self.geom.block_size) * self.geom.block_size
        if self.config.save_partial_chunks and rest and not self.state_groups:
            keys = keys + [t.partial_key(len(keys), rest, self.chunk_size)]
        self.admission.sight(keys)

    def _pd_wait(self, t: RequestTracker, keys: list[str], hits: int) -> bool:
        """A consumer's request whose producer announced chunks (``kvx_pd_chunks``, ``kvx_pd_key``): True while
        some of them are not in a tier yet and ``pd_wait_ms`` has not passed since the first lookup (the
        producer's writes may still be landing); then it goes on with what is there."""
        n = t.controls.pd_chunks
        if n == 0 or hits >= n or t.pd_settled:
            return False
        if n > len(keys) or keys[n - 1] != t.controls.pd_key:
            # another prompt, model or engine namespace: those chunks can never be ours
            log.warning(
                "kvx: request %s: its producer's chunks (%d, last %s) are not this prompt's chunks in this "
                "engine's namespace; not waiting for them",
                t.req_id,
                n,
                t.controls.pd_key,
            )
            self.stats["pd_mismatches"] += 1
            t.pd_settled = True
            return False
        now = time.monotonic()
        if t.pd_since is None:
            t.pd_since = now
            self.stats["pd_waits"] += 1
        if (now - t.pd_since) * 1e3 < self.config.pd_wait_ms:
            return True
        log.warning(
            "kvx: request %s: %d of the %d chunks its producer announced arrived within pd_wait_ms=%d; "
            "computing the rest",
            t.req_id,
            hits,
            n,
            self.config.pd_wait_ms,
        )
        self.stats["pd_timeouts"] += 1
        t.pd_settled = True
        return False

    # ------------------------------------------------------------------ step 2: admission
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        t = self._tracker(request)
        tables = [list(g) for g in blocks.get_block_ids()] if blocks is not None else [[]] * self.ngroups
        if tables and tables[0]:
            t.block_ids = tables
        if t.local_hit is not None and not t.counted:
            # tokens past vLLM's own prefix hit that kvx did not serve (those it serves: hit_tokens_<tier>)
            t.counted = True
            self.stats["miss_tokens"] += max(0, request.num_prompt_tokens - t.local_hit - num_external_tokens)
        if t.phase is Phase.PREEMPTED:
            t.phase = Phase.NEW
        if num_external_tokens == 0:
            if t.phase is not Phase.LOADING:  # the second call of an async load changes nothing
                t.plan = None
                t.phase = Phase.RUNNING
            return
        plan = t.plan
        if plan is None:
            raise RuntimeError(
                f"request {request.request_id}: update_state_after_alloc with "
                f"{num_external_tokens} external tokens but no lookup plan"
            )
        bs = self.geom.block_size
        start, end = plan.num_computed, plan.num_computed + num_external_tokens
        first_blk, end_blk = start // bs, -(-end // bs)
        spans = []
        for c, (key, tier, ntok) in enumerate(zip(plan.keys, plan.tiers, plan.chunk_tokens)):
            cb0 = c * self.blocks_per_chunk
            lo, hi = max(cb0, first_blk), min(cb0 + ntok // bs, end_blk)
            if lo < hi:
                spans.append((key, tier, ntok, cb0, lo, hi))
        # a hit from a slower tier is promoted into the CPU tier (and, once there, written through to the faster
        # tiers lacking it, by a producer)
        states = self._state_load(request.request_id, plan, tables, end)
        promote = [
            tier != "cpu" and self.cpu is not None and self.config.promote and self.cpu.state(key) is None
            for key, tier, *_ in spans + states
        ]
        xfer, slots = self.ledger.plan_load(
            request.request_id,
            [LoadChunk(key, tier, ntok, p) for (key, tier, ntok, *_), p in zip(spans, promote)]
            + [
                LoadChunk(key, tier, self.chunk_size, p, state=True)
                for (key, tier, _), p in zip(states, promote[len(spans) :])
            ],
        )
        chunks: list[ChunkLoad] = []
        loaded: dict[int, int] = {}
        state_loads = []  # loaded after the chunks (the order the workers read them in)
        for (key, tier, ids), (slot, slot_xfer) in zip(states, slots[len(spans) :]):
            state_loads.append(ChunkLoad(key, tier, slot, ids, 0, self.chunk_size, slot_xfer=slot_xfer, state=True))
            loaded.update((b, len(plan.keys) - 1) for b in ids)
            t.loaded_from[key] = tier
        tables = [tables[g] for g in self.attn_groups]
        for (key, tier, ntok, cb0, lo, hi), (slot, slot_xfer), p in zip(spans, slots, promote):
            if p:
                self.events.record(key, request, cb0, ntok // bs)
            shared = end % bs != 0 and hi == end_blk  # the last block also gets this step's tokens
            ids, positions = self._load_blocks(tables, lo, hi, cb0, ntok // bs)
            chunks.append(
                ChunkLoad(
                    key,
                    tier,
                    slot,
                    ids,
                    lo - cb0,
                    ntok,
                    before_forward=shared,
                    shared_tokens=end % bs if shared else 0,
                    positions=positions,
                    span=hi - lo if positions is not None else 0,
                    slot_xfer=slot_xfer,
                )
            )
            loaded.update((b, cb0 // self.blocks_per_chunk) for b in ids)
            t.loaded_from[key] = tier
            self.stats[f"hit_tokens_{tier}"] += min(hi * bs, end) - max(lo * bs, start)
        self.validity.loading(request.request_id, loaded)
        self._new_loads.append(LoadSpec(request.request_id, chunks + state_loads, self.load_async, xfer))
        t.phase = Phase.LOADING if self.load_async else Phase.RUNNING
        t.plan = None
        self.stats["loads"] += 1

    def _state_load(self, rid: str, plan: LoadPlan, tables: list[list[int]], end: int) -> list[tuple[str, str, list]]:
        """The state object a hybrid model's load restores: [(key, tier, the state groups' blocks at the hit's
        end)], or [] (no state groups). vLLM allocates, for the external hit, a block at its end in every state
        group's table; the state is loaded there, before the request computes from it."""
        if plan.state is None:
            return []
        p = end // self.geom.block_size - 1
        if end != plan.hit_tokens or end % self.chunk_size:
            raise RuntimeError(
                f"request {rid}: vLLM allocated a load of {end - plan.num_computed} tokens from {plan.num_computed}, "
                f"expected the whole hit up to {plan.hit_tokens} (a chunk end: the stored state is the one there)"
            )
        ids = [tables[g][p] if p < len(tables[g]) else _NULL_BLOCK for g in self.state_groups]
        if _NULL_BLOCK in ids:
            raise RuntimeError(
                f"request {rid}: vLLM allocated no block for the recurrent state at token {end} "
                f"(state groups' blocks at position {p}: {ids})"
            )
        key, tier = plan.state
        return [(key, tier, ids)]

    def _load_blocks(self, tables: list[list[int]], lo: int, hi: int, cb0: int, n: int):
        """The blocks a load of table positions [lo, hi) writes (a chunk starting at position ``cb0``, ``n``
        blocks per group), and their positions in the chunk (None: one group, no null block: ``lo - cb0 + i``).
        vLLM's null blocks (a sliding-window group's blocks outside the window) are skipped."""
        if len(tables) == 1 and _NULL_BLOCK not in tables[0][lo:hi]:
            return tables[0][lo:hi], None
        ids, positions = [], []
        for g, table in enumerate(tables):
            for j in range(lo, hi):
                if j < len(table) and table[j] != _NULL_BLOCK:
                    ids.append(table[j])
                    positions.append(g * n + j - cb0)
        return ids, positions

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict | None:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        spec = next((s for s in reversed(self._new_loads) if s.req_id == request.request_id), None)
        if spec is None:
            return None
        bs = self.geom.block_size

        def source(tier: str) -> CacheHitSource:
            if tier == "cpu":
                return CacheHitSource.HOST
            try:
                return CacheHitSource(self.tiers[tier].hit_source)
            except ValueError:
                return CacheHitSource.EXTERNAL_UNSPECIFIED

        counts = Counter()
        for ch in spec.chunks:
            if ch.state:
                continue
            counts[source(ch.tier)] += (ch.span if ch.positions is not None else len(ch.block_ids)) * bs
        total = sum(counts.values())
        if total > num_external_tokens:  # the full-prompt hit leaves one token to compute
            counts[source(spec.chunks[-1].tier)] -= total - num_external_tokens
        return {k: v for k, v in counts.items() if v > 0}

    # ------------------------------------------------------------------ step 3: per-step metadata
    def build_connector_meta(self, so) -> KVXMetadata:
        self.ledger.end_commits()  # records written since the last step (vLLM reports no output on an idle step)
        meta = KVXMetadata(
            loads=self._new_loads,
            pd_waiting=self._pd_waiting,
            preempted=sorted(getattr(so, "preempted_req_ids", None) or ()),
            finished=sorted(getattr(so, "finished_req_ids", None) or ()),
        )
        self._new_loads = []
        self._pd_waiting = False
        if self.costs is not None:
            self.costs.step_begin(int(getattr(so, "total_num_scheduled_tokens", 0) or 0))
        freed, self._freed = self._freed, []
        for rid in meta.preempted:
            t = self.trackers.get(rid)
            if t is not None:
                t.phase = Phase.PREEMPTED
                freed += [b for ids in t.block_ids for b in ids if b != _NULL_BLOCK]  # freed at once
        # keep fallback block tables current (vLLM < 0.32 has no KVConnectorBlockState)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            t = self.trackers.get(rid)
            new = cached.new_block_ids[i] if cached.new_block_ids else None
            if t is not None and new is not None:
                old = t.block_ids if rid not in resumed and len(t.block_ids) == len(new) else [[] for _ in new]
                t.block_ids = [list(o) + list(n) for o, n in zip(old, new)]
        entries = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        entries += list(zip(cached.req_ids, cached.num_computed_tokens))
        block_state = getattr(so, "kv_connector_block_state", None)
        written = self._forward_writes(so, entries, block_state)
        meta.forward_blocks = sorted(set(written).union(freed))
        if self.validity:
            self.validity.computed(self._forward_writes(so, entries, block_state, from_first_token=True))
        if self.producer:
            for rid, computed in entries:
                t = self.trackers.get(rid)
                if t is not None and t.saves:
                    self._plan_saves(
                        t,
                        computed + so.num_scheduled_tokens.get(rid, 0),
                        len(so.scheduled_spec_decode_tokens.get(rid, ())),
                        block_state,
                        meta,
                    )
            meta.saves += self.ledger.plan_write_through()
        meta.node = self.cpu.pool if self.cpu is not None else None  # the node's pool file these plans name slots of
        return meta

    def _forward_writes(self, so, entries, block_state, from_first_token: bool = False) -> list[int]:
        """The blocks this step's forward writes KV into (the blocks of each request's scheduled tokens);
        ``from_first_token``: only those it writes from their first token (they hold verified KV after it)."""
        bs, out = self.geom.block_size, []
        for rid, start in entries:
            end = start + so.num_scheduled_tokens.get(rid, 0)
            first, last = (-(-start // bs) if from_first_token else start // bs), -(-end // bs)
            if end > start and first < last:
                for table in self._request_tables(rid, block_state):
                    out += [b for b in table[first:last] if b != _NULL_BLOCK]
        return out

    def _request_tables(self, rid: str, block_state) -> list[list[int]]:
        t = self.trackers.get(rid)
        return self._tables(t, block_state) if t is not None else self._state_tables(rid, block_state)

    def _plan_saves(self, t: RequestTracker, done: int, num_spec: int, block_state, meta: KVXMetadata) -> None:
        req = t.request
        prompt = req.num_prompt_tokens
        if self.config.save_decode:
            limit = min(done - num_spec, len(req.all_token_ids))
        else:
            limit = prompt
        limit = min(limit, prompt - self.config.skip_last_n_tokens) if self.config.skip_last_n_tokens else limit
        end = min(done, limit)
        nfull = max(end, 0) // self.chunk_size
        table = None
        if nfull > t.saved_chunks:
            keys = t.full_keys(nfull * self.chunk_size, self.chunk_size)
            table = self._tables(t, block_state)
            for c in range(t.saved_chunks, nfull):
                b0 = c * self.blocks_per_chunk
                if not self._plan_one(t, c, keys[c], table, b0, b0 + self.blocks_per_chunk, self.chunk_size, meta):
                    return  # depends on a failed load: saved from here once vLLM recomputed it
                t.saved_chunks = c + 1
        if (
            self.config.save_partial_chunks
            and not t.partial_done
            and done >= prompt
            and end > 0
            and limit < (nfull + 1) * self.chunk_size
            and t.saved_chunks == nfull
        ):
            rest = ((end - nfull * self.chunk_size) // self.geom.block_size) * self.geom.block_size
            if rest > 0:
                t.full_keys(nfull * self.chunk_size, self.chunk_size)
                table = table if table is not None else self._tables(t, block_state)
                b0 = nfull * self.blocks_per_chunk
                key = t.partial_key(nfull, rest, self.chunk_size)
                if not self._plan_one(t, None, key, table, b0, b0 + rest // self.geom.block_size, rest, meta):
                    return
            t.partial_done = True

    def _tables(self, t: RequestTracker, block_state) -> list[list[int]]:
        return self._state_tables(t.req_id, block_state) or t.block_ids

    @staticmethod
    def _state_tables(rid: str, block_state) -> list[list[int]]:
        ids = block_state.get_block_ids(rid) if block_state is not None else None
        return [list(g) for g in ids] if ids is not None and ids and ids[0] else []

    def _plan_one(
        self,
        t: RequestTracker,
        chunk: int | None,
        key: str,
        tables: list[list[int]],
        b0: int,
        b1: int,
        tokens: int,
        meta: KVXMetadata,
    ) -> bool:
        """Plan saving blocks [b0, b1) of every attention group's table as chunk ``key`` (the request's
        ``chunk``-th; None: its trailing partial chunk) to every tier lacking it, and a hybrid model's state at the
        chunk's end as its state object. Returns False (nothing planned) if its KV depends on a block whose load
        is known to have failed."""
        attn = [tables[g] for g in self.attn_groups] if len(tables) == self.ngroups else []
        if not attn or any(len(tb[b0:b1]) * self.geom.block_size != tokens for tb in attn):
            log.warning(
                "kvx: request %s: %s blocks for a %d-token chunk; not saving it",
                t.req_id,
                [len(tb[b0:b1]) for tb in tables],
                tokens,
            )
            return True
        block_ids = [b for tb in attn for b in tb[b0:b1]]
        if _NULL_BLOCK in block_ids:
            # a sliding-window group released blocks of this chunk (vLLM's null block): it cannot serve every
            # group, so it is not stored (a hit never reaches past it)
            if (self.cpu is not None and self.cpu.state(key) is None) or self.ledger.lacking(key):
                self.stats["saves_incomplete"] += 1
            return True
        deps = {}
        for table in tables:  # a state depends on every block before it, of every group
            deps.update(self.validity.unverified(table, b1))
        if deps and self.validity.known_bad(deps):
            self.stats["saves_deferred"] += 1
            return False
        if self.admission is not None and not self.admission.admitted(key):
            self.stats["saves_skipped_admission"] += 1  # not seen often enough yet: neither it nor its state
            if chunk is not None:
                t.not_admitted = chunk if t.not_admitted is None else min(t.not_admitted, chunk)
            return True
        if chunk is not None and self.state_groups:
            self._plan_state(t, chunk, key, tables, b1, deps, meta)
        self.events.record(key, t.request, b0, b1 - b0)
        # A rank cannot know in time that a load failed on another rank (only the scheduler hears every worker):
        # with several workers, a save depending on loads is gathered into the CPU tier only, and written through
        # to the other tiers once committed.
        save = self.ledger.plan_save(
            t.req_id,
            chunk,
            key,
            block_ids,
            tokens,
            deps,
            skip_tier=t.loaded_from.get(key),
            gather_first=bool(deps) and self.num_workers > 1,
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
        ids = [tables[g][p] if p < len(tables[g]) else _NULL_BLOCK for g in self.state_groups]
        if _NULL_BLOCK in ids:
            return
        skey = state_key(key)
        t.state_chunks = max(t.state_chunks, chunk + 1)
        gather_first = bool(deps) and self.num_workers > 1
        save = self.ledger.plan_save(
            t.req_id, chunk, skey, ids, self.chunk_size, deps, t.loaded_from.get(skey), gather_first, state=True
        )
        if save is None:
            return
        if deps:
            self.validity.guard(t.req_id, skey, deps)
        meta.saves.append(save)
        self.stats["state_saves"] += 1

    # ------------------------------------------------------------------ step 4: worker results
    def update_connector_output(self, output) -> None:
        self.ledger.end_commits()  # records written since the last step: those chunks are stored now
        if self.costs is not None:
            self.costs.step_end()
        wm = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVXWorkerMetadata):
            return
        if self.costs is not None:
            for tier, nbytes, seconds in wm.reads:
                self.costs.read(tier, nbytes, seconds)
        if wm.failed_blocks:
            self._on_failed_loads(wm.failed_blocks)
        self._layer_ranges.update(map(tuple, wm.layers))
        done = self.ledger.settle(wm.results)
        for tier, key in wm.removed:
            self.events.removed(tier, key)
        self.stats["cpu_store_failed"] += done.aborted
        self._rewind(done.rewind)
        for rid in done.loads_done:
            self.validity.load_done(rid)
            t = self.trackers.get(rid)
            if t is not None and t.phase is Phase.LOADING:
                t.phase = Phase.RUNNING
        self.validity.drop_verified_guards()

    def _rewind(self, waiting: list[tuple[str, int | None]]) -> None:
        """Plan again the chunks these requests counted as saved on a CPU write that was aborted."""
        for rid, chunk in waiting:
            t = self.trackers.get(rid)
            if t is None:
                continue
            if chunk is None:
                t.partial_done = False
            else:
                t.saved_chunks = min(t.saved_chunks, chunk)
            self.stats["saves_replanned"] += 1

    def _on_failed_loads(self, blocks: list[int]) -> None:
        """Workers could not load these blocks; vLLM recomputes them. Saves computed against them are
        poisoned, and every request affected saves its chunks again from the first failed one."""
        verdict = self.validity.failed(blocks)
        self.ledger.poison(verdict.poisoned)  # the slots they gather into are aborted when the workers report them
        for rid, chunk in verdict.rewind.items():
            t = self.trackers.get(rid)
            if t is not None:
                t.saved_chunks = min(t.saved_chunks, chunk)
                t.partial_done = False
                # from the failed chunk on, the tier's copy may be what failed: write the recomputed ones
                good = set(t.keys[:chunk])
                t.loaded_from = {k: v for k, v in t.loaded_from.items() if k in good}
        self.stats["saves_poisoned"] += len(verdict.poisoned)

    # ------------------------------------------------------------------ step 5: end of a request
    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The blocks are freed at once: the workers learn them in the next step's metadata
        (``forward_blocks``) and fence the saves still reading them before any forward can write them.

        A ``kv_producer`` returns the chunks it is storing (``kvx_pd_chunks``, ``kvx_pd_key``) as the
        response's ``kv_transfer_params``: a consumer given them waits for those chunks to land."""
        t = self.trackers.pop(request.request_id, None)
        self._freed += [b for ids in block_ids or () for b in ids if b != _NULL_BLOCK]
        push = t.controls.push_to if t is not None and self.cpu is not None else None
        if (
            t is not None
            and self.producer
            and not self.consumer
            and (self.stack or push)
            and t.saves
            and t.saved_chunks > 0
            and len(t.keys) >= t.saved_chunks
        ):
            # a hybrid model's consumer can load up to the last chunk whose state is stored
            n = min(t.saved_chunks, t.state_chunks) if self.state_groups else t.saved_chunks
            if t.not_admitted is not None:  # announce only the chunks it stores
                n = min(n, t.not_admitted)
            if n > 0 and push and not self.cpu.push(t.keys[:n], push):
                self.stats["pushes_refused"] += 1
                if not self.stack:  # nowhere the consumer could find them
                    return False, None
            if n > 0:
                return False, {"kvx_pd_chunks": n, "kvx_pd_key": t.keys[n - 1]}
        return False, None

    def take_stats(self) -> dict:
        """Counters since the last call, the tiers' stored/eviction counts, and the ``pending_writes`` gauge
        (tier writes and CPU slot writes in flight) whenever it changed. vLLM asks every step, after the step's
        output: the step's end for the prefill-throughput estimate too (``update_connector_output`` runs only on
        steps with workers' output)."""
        if self.costs is not None:
            self.costs.step_end()
        stats, self.stats = dict(self.stats), Counter()
        stats.update(self.events.take_counts())
        if self.ledger.dropped:
            for tier, n in self.ledger.dropped.items():
                stats[f"{tier}_dropped_backpressure"] = n
            stats["saves_dropped_backpressure"] = sum(self.ledger.dropped.values())
            self.ledger.dropped.clear()
        if self.ledger.slots_busy:
            stats["cpu_slots_busy"], self.ledger.slots_busy = self.ledger.slots_busy, 0
        pending = self.ledger.writes_in_flight()
        if pending != self._pending_reported:
            stats["pending_writes"] = self._pending_reported = pending
        return stats

    def take_events(self) -> list:
        return self.events.take()

    def has_pending_push_work(self) -> bool:
        # keep the engine stepping while a worker has something to report: the reports ride on steps; records
        # written since are ended here too (vLLM calls update_connector_output only with workers' output)
        self.ledger.end_commits()
        return not self.ledger.idle()

    def reset_cache(self) -> bool:
        if self.cpu is None or self.cpu.shared:
            return True  # a node's chunks are every engine's on the host (kvx node evict drops them)
        self.events.apply_observed()
        ok = self.cpu.clear()
        if ok and not self.stack:
            self.events.cleared()  # nothing is left in any kvx tier
        return ok

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.shutdown(wait=True)
        self.stack.close()
