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

Layout (every part on the scheduler thread only): :mod:`.tracker` (a request's :class:`~.tracker.RequestTracker`
and the named types the parts pass: :class:`~.tracker.LoadPlan`, :class:`~.tracker.SaveCursor`,
:class:`~.tracker.PDWait`); :mod:`.lookup` (step 1's hit filters, P/D waits among them, over a
:class:`~.lookup.Lookup`); :mod:`.load_plan` (step 2: :class:`~.load_plan.LoadPlanner`); :mod:`.save_plan` (step
3's saves: :class:`~.save_plan.SavePlanner`). This module owns the trackers, the tiers and the ledger, finds where
chunks are, and hands each part the state it reads or changes; the parts count into its ``stats``.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from ..keys import state_key
from ..log import get_logger
from ..node.client import NodeIndex
from ..store import CPUIndex, SlotIndex, TierContext, tier_class
from ..store.stack import TierStack
from .admission import Admission
from .common import (
    NULL_BLOCK,
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
from .ledger import ChunkLedger
from .load_plan import LoadPlanner
from .lookup import Lookup, Partial, WaitForProducer, hit_filters
from .metadata import KVXMetadata, KVXWorkerMetadata, LoadSpec
from .parts import record_of
from .save_plan import SavePlanner
from .threads import io_thread
from .tracker import LoadPlan, Phase, RequestTracker, state_tables, tables_of, tracker_of
from .validity import BlockValidity

log = get_logger(__name__)


def _first_level(config: KVXConfig, geom: EngineGeometry, namespace: bytes, model: str) -> SlotIndex | None:
    """The first level's index: the CPU tier's (:class:`kvx.store.CPUIndex`), a node's
    (:class:`kvx.node.client.NodeIndex`), or None (neither configured)."""
    n_slots = num_cpu_slots(config, geom)
    if config.cpu_tier is not None and n_slots < 1:
        raise ValueError(
            f"tiers: the cpu tier ({config.cpu_tier.size} bytes) cannot hold one chunk "
            f"of {config.chunk_size} tokens ({geom.num_layers} layers x {geom.page_bytes} "
            f"bytes per block); raise its size or lower chunk_size"
        )
    cpu: SlotIndex | None = CPUIndex(n_slots) if config.cpu_tier is not None else None
    if config.node_tier is not None:
        node = config.node_tier
        cpu = NodeIndex(
            node.socket,
            namespace,
            model,
            config.chunk_size,
            node_slot_bytes(config, geom),
            timeout=node.timeout,
            retry_s=node.retry_s,
            pull_wait_ms=node.pull_wait_ms,
            sealed=any(getattr(t, "encryption", None) is not None for t in config.byte_tiers),
        )
    return cpu


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
        self.cpu: SlotIndex | None = _first_level(config, geom, namespace, model)
        ctx = TierContext(fingerprint, role="scheduler", writes=producer, io_threads=config.io_threads)
        self.tiers = {t.type: tier_class(t.type).open(t, ctx) for t in config.byte_tiers}
        self.stack = TierStack(list(self.tiers.values()))
        # chunk records (:mod:`.parts`): written here once every worker stored its parts, off this thread
        self._layer_ranges: set[tuple[int, int]] = set()  # the workers' layer ranges, as they report them
        self._background = background_writes
        self._recorder: ThreadPoolExecutor | None = None  # made at the first record (engines of several workers)
        self.events = self._open_events(kv_events)
        self.trackers: dict[str, RequestTracker] = {}
        self._chunk_bytes = chunk_bytes(config, geom)
        self.ledger = self._open_ledger()
        self.admission = Admission(config.admit_after, config.admission_capacity) if config.admit_after > 1 else None
        self._new_loads: list[LoadSpec] = []
        self._pull_waiting = False  # a lookup was put off for a pull since the last step's metadata
        self.validity = BlockValidity(self.blocks_per_chunk)
        self._freed: list[int] = []  # blocks freed since the last step (for the workers)
        self._pending_reported = 0
        self.stats = Counter()  # emptied by take_stats, never replaced: the policies below count into it too
        self.costs = HitCosts(config.io_threads) if config.decline_slow_hits and self.stack else None
        self._open_policies()

    def _open_events(self, kv_events: bool) -> KVEvents:
        """vLLM's KV cache events of every kvx tier (sent only with ``kv_events``)."""
        tiers = self.tiers
        events = KVEvents(
            kv_events,
            self.geom.block_size,
            {"cpu": CPU_PLACE, **{n: (type(t).event_medium, type(t).event_locality) for n, t in tiers.items()}},
        )
        for source in ([self.cpu] if self.cpu is not None else []) + list(tiers.values()):
            source.subscribe(events.observe)
        return events

    def _open_ledger(self) -> ChunkLedger:
        config, geom, slot_bytes = self.config, self.geom, self._chunk_bytes
        if config.max_write_backlog < slot_bytes:
            log.warning(
                "kvx: max_write_backlog=%d is less than one chunk (%d bytes); using one chunk",
                config.max_write_backlog,
                slot_bytes,
            )
        return ChunkLedger(
            self.cpu,
            self.stack,
            self.num_workers,
            self.events,
            writes=self.producer,
            backlog=write_backlog(config, geom),
            object_bytes=lambda tokens, state: object_bytes(geom, tokens, state),
            slot_bytes=slot_bytes,
            commit=self._commit if self.tiers and self.producer else None,
        )

    def _open_policies(self) -> None:
        """The lookup's filters, the load and save planners: each handed the state it reads or changes."""
        config, stats = self.config, self.stats
        # the lookup's policies, in order (get_num_new_matched_tokens); each narrows the hit or puts the lookup off
        self.producer_wait = WaitForProducer(config, stats)
        self._hit_filters = hit_filters(
            config, self.costs, self._chunk_bytes, bool(self.state_groups), self.producer_wait, stats
        )
        self.load_planner = LoadPlanner(config, self.geom, self.cpu, self.ledger, self.validity, self.events, stats)
        self.save_planner = SavePlanner(
            config,
            self.geom,
            self.cpu,
            self.ledger,
            self.validity,
            self.admission,
            self.events,
            stats,
        )

    # ------------------------------------------------------------------ helpers
    def _tracker(self, request) -> RequestTracker:
        t = self.trackers.get(request.request_id)
        if t is None or t.request is not request:
            t, error = tracker_of(request, self.namespace, self.config.save_priority_limit)
            if error is not None:  # refused by the front end's check where it is installed
                log.error("kvx: request %s: %s; kvx neither loads nor saves it", request.request_id, error)
                self.stats["bad_request_params"] += 1
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

    def _locate(self, keys: list[str]) -> tuple[list[str | None], frozenset[str]] | None:
        """Per key, the fastest tier holding it ("cpu" or a tier's name; None: none), and the keys of those in "cpu"
        still on their way into it (a pull from a peer node: :meth:`kvx.store.SlotIndex.coming`). None: not known
        yet."""
        cached = self.cpu.contains_many(keys) if self.cpu is not None else [False] * len(keys)
        first_miss = next((i for i, hit in enumerate(cached) if not hit), len(keys))
        coming: frozenset[str] = frozenset()
        if self.cpu is not None and first_miss < len(keys):
            n = self.cpu.coming(keys[first_miss:])
            if n:
                coming = frozenset(keys[first_miss : first_miss + n])
                cached[first_miss : first_miss + n] = [True] * n
                self.stats["lookups_coming"] += 1
            elif self.cpu.pulling(keys[first_miss:]):
                self.stats["lookups_pulling"] += 1
                self._pull_waiting = True  # an idle step until the pull's slots are there: the workers pause a little
                return None
        found: list[str | None] = ["cpu" if hit else None for hit in cached]
        rest = [i for i, f in enumerate(found) if f is None]
        if rest and self.stack:
            more = self.stack.locate([keys[i] for i in rest])
            if more is None:
                return None
            for i, name in zip(rest, more):
                found[i] = name
        return found, coming

    # ------------------------------------------------------------------ step 1: lookup
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's block-aligned local hit) that kvx can load; None
        if a tier is still looking, or a P/D consumer waits for its producer's chunks (vLLM skips the request this
        step and asks again).

        The hit is the leading run of chunks some tier holds (:meth:`_look_up`), narrowed by each of
        :attr:`_hit_filters` in turn (each a small policy of :mod:`.lookup`: :class:`~.lookup.DeclineSlow`,
        :class:`~.lookup.RoundToState`, :class:`~.lookup.WaitForProducer`, :class:`~.lookup.AddPartial`), then
        reported (:meth:`_report`)."""
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
        got = self._locate(keys + ([pkey] if pkey else []) + skeys)
        if got is None:
            return None
        located, coming = got
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
            partial=Partial(pkey, rest, located[len(keys)]) if pkey else None,
            coming=coming,
        )

    def _report(self, lk: Lookup) -> tuple[int, bool]:
        """The tokens of the hit past vLLM's own (the plan kept for update_state_after_alloc)."""
        tiers, hit_keys = list(lk.tiers), lk.keys[: len(lk.tiers)]
        chunk_tokens = [self.chunk_size] * len(tiers)
        hit = len(tiers) * self.chunk_size
        if lk.extra is not None:
            tiers.append(lk.extra.tier)
            hit_keys = hit_keys + [lk.extra.key]
            chunk_tokens.append(lk.extra.tokens)
            hit += lk.extra.tokens
        if hit <= lk.num_computed:
            return 0, False
        num_tokens = lk.t.request.num_tokens
        # a hit still arriving (a pull) is loaded asynchronously: the request waits for it, not the step
        is_async = self.load_async or not lk.coming.isdisjoint(hit_keys)
        if not is_async and hit >= num_tokens:
            # A sync load must leave a token to compute: report all but the last one. The block holding
            # it is loaded whole before the forward (ChunkLoad.before_forward), which then writes the
            # last token's KV over the loaded copy; only that one token is recomputed, where vLLM's own
            # prefix cache recomputes the whole last block.
            hit = num_tokens - 1
            if hit <= lk.num_computed:
                return 0, False
        coming = lk.coming.intersection(hit_keys)
        lk.t.plan = LoadPlan(lk.num_computed, hit, tiers, hit_keys, chunk_tokens, lk.state, is_async, coming)
        if coming:
            self.stats["hits_coming"] += 1
        return hit - lk.num_computed, is_async

    def _sight(self, t: RequestTracker) -> None:
        """admit_after > 1: count the chunks request ``t``'s prompt covers as seen once more (once per request)."""
        t.sighted = True
        prompt = t.request.num_prompt_tokens
        keys = t.full_keys(prompt, self.chunk_size)
        rest = ((prompt - len(keys) * self.chunk_size) // self.geom.block_size) * self.geom.block_size
        if self.config.save_partial_chunks and rest and not self.state_groups:
            keys = keys + [t.partial_key(len(keys), rest, self.chunk_size)]
        self.admission.sight(keys)

    # ------------------------------------------------------------------ step 2: admission
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan the load of the hit vLLM allocated blocks for (:class:`~.load_plan.LoadPlanner`), as the last
        lookup reported it."""
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
        self._new_loads.append(self.load_planner.plan(t, plan, tables, num_external_tokens))
        t.phase = Phase.LOADING if plan.is_async else Phase.RUNNING
        t.plan = None
        self.stats["loads"] += 1

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
            pd_waiting=self.producer_wait.take_waiting(),
            pull_waiting=self._pull_waiting,
            preempted=sorted(getattr(so, "preempted_req_ids", None) or ()),
            finished=sorted(getattr(so, "finished_req_ids", None) or ()),
        )
        self._new_loads, self._pull_waiting = [], False
        if self.costs is not None:
            self.costs.step_begin(int(getattr(so, "total_num_scheduled_tokens", 0) or 0))
        freed, self._freed = self._freed, []
        for rid in meta.preempted:
            t = self.trackers.get(rid)
            if t is not None:
                t.phase = Phase.PREEMPTED
                freed += [b for ids in t.block_ids for b in ids if b != NULL_BLOCK]  # freed at once
        cached = so.scheduled_cached_reqs
        self._extend_tables(cached)
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
                    done = computed + so.num_scheduled_tokens.get(rid, 0)
                    num_spec = len(so.scheduled_spec_decode_tokens.get(rid, ()))
                    self.save_planner.plan(t, done, num_spec, block_state, meta)
            meta.saves += self.ledger.plan_write_through()
        meta.node = self.cpu.pool if self.cpu is not None else None  # the node's pool file these plans name slots of
        return meta

    def _extend_tables(self, cached) -> None:
        """Keep the fallback block tables current with the step's new blocks (vLLM < 0.32 has no
        KVConnectorBlockState)."""
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            t = self.trackers.get(rid)
            new = cached.new_block_ids[i] if cached.new_block_ids else None
            if t is not None and new is not None:
                old = t.block_ids if rid not in resumed and len(t.block_ids) == len(new) else [[] for _ in new]
                t.block_ids = [list(o) + list(n) for o, n in zip(old, new)]

    def _forward_writes(self, so, entries, block_state, from_first_token: bool = False) -> list[int]:
        """The blocks this step's forward writes KV into (the blocks of each request's scheduled tokens);
        ``from_first_token``: only those it writes from their first token (they hold verified KV after it)."""
        bs, out = self.geom.block_size, []
        for rid, start in entries:
            end = start + so.num_scheduled_tokens.get(rid, 0)
            first, last = (-(-start // bs) if from_first_token else start // bs), -(-end // bs)
            if end > start and first < last:
                for table in self._request_tables(rid, block_state):
                    out += [b for b in table[first:last] if b != NULL_BLOCK]
        return out

    def _request_tables(self, rid: str, block_state) -> list[list[int]]:
        t = self.trackers.get(rid)
        return tables_of(t, block_state) if t is not None else state_tables(rid, block_state)

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
                t.cursor.partial_done = False
            else:
                t.cursor.saved_chunks = min(t.cursor.saved_chunks, chunk)
            self.stats["saves_replanned"] += 1

    def _on_failed_loads(self, blocks: list[int]) -> None:
        """Workers could not load these blocks; vLLM recomputes them. Saves computed against them are
        poisoned, and every request affected saves its chunks again from the first failed one."""
        verdict = self.validity.failed(blocks)
        self.ledger.poison(verdict.poisoned)  # the slots they gather into are aborted when the workers report them
        for rid, chunk in verdict.rewind.items():
            t = self.trackers.get(rid)
            if t is not None:
                t.load_failed(chunk)
        self.stats["saves_poisoned"] += len(verdict.poisoned)

    # ------------------------------------------------------------------ step 5: end of a request
    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The blocks are freed at once: the workers learn them in the next step's metadata
        (``forward_blocks``) and fence the saves still reading them before any forward can write them.

        A ``kv_producer`` returns the chunks it is storing (``kvx_pd_chunks``, ``kvx_pd_key``) as the
        response's ``kv_transfer_params``: a consumer given them waits for those chunks to land."""
        t = self.trackers.pop(request.request_id, None)
        self._freed += [b for ids in block_ids or () for b in ids if b != NULL_BLOCK]
        push = t.controls.push_to if t is not None and self.cpu is not None else None
        if (
            t is not None
            and self.producer
            and not self.consumer
            and (self.stack or push)
            and t.saves
            and t.cursor.saved_chunks > 0
            and len(t.keys) >= t.cursor.saved_chunks
        ):
            cur = t.cursor
            # a hybrid model's consumer can load up to the last chunk whose state is stored
            n = min(cur.saved_chunks, cur.state_chunks) if self.state_groups else cur.saved_chunks
            if cur.not_admitted is not None:  # announce only the chunks it stores
                n = min(n, cur.not_admitted)
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
        stats = dict(self.stats)
        self.stats.clear()  # emptied, not replaced: the lookup's filters and the planners count into it
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
