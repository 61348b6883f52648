"""Facts both sides of the connector derive identically from vLLM's configs.

The scheduler and the workers never exchange geometry: each computes the same chunk format,
fingerprint, key namespace and CPU slot count from ``VllmConfig`` + ``KVCacheConfig``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .config import KVXConfig
from .keys import namespace_digest


class UnsupportedModelError(ValueError):
    """The engine's KV cache is something kvx does not handle (e.g. several KV cache groups)."""


@dataclass(frozen=True)
class EngineGeometry:
    block_size: int          # tokens per vLLM block
    num_layers: int          # attention layers in the KV cache group
    num_kv_heads: int        # per rank
    head_size: int
    dtype: torch.dtype
    use_mla: bool
    opaque: bool             # vLLM CPU backend: ISA-packed pages
    isa: str                 # the CPU attention ISA path ("" elsewhere)
    page_bytes: int          # one block of one layer

    @property
    def planes(self) -> int:
        return 1 if self.use_mla else 2


def _cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # pragma: no cover - depends on the vLLM build
        return "unknown"


def engine_geometry(vllm_config, kv_cache_config) -> EngineGeometry:
    """Geometry of the engine's (single-group) KV cache."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModelError(
            f"kv_cache_config: kvx handles models with one KV cache group (full attention), got {len(groups)} "
            "groups; start vLLM with --disable-hybrid-kv-cache-manager or use a full-attention model")
    spec = groups[0].kv_cache_spec
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False)) or type(spec).__name__.startswith("MLA")
    if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
        raise UnsupportedModelError(f"kv_cache_config: unsupported KV cache spec {type(spec).__name__}")
    from vllm.platforms import current_platform

    opaque = bool(current_platform.is_cpu())
    block_size = int(spec.block_size)
    isa = _cpu_attention_isa(spec.dtype, block_size, int(spec.head_size)) if opaque else ""
    return EngineGeometry(block_size=block_size, num_layers=len(groups[0].layer_names),
                          num_kv_heads=1 if use_mla else int(spec.num_kv_heads), head_size=int(spec.head_size),
                          dtype=spec.dtype, use_mla=use_mla, opaque=opaque, isa=isa,
                          page_bytes=int(spec.page_size_bytes))


def chunk_format(config: KVXConfig, geom: EngineGeometry) -> str:
    """"canonical" ([L, P, T, H, D], layout independent) or "pages" (raw pages, same engine kind only)."""
    if config.format == "canonical" and geom.opaque:
        raise UnsupportedModelError("format: 'canonical' is impossible on vLLM's CPU backend, whose pages are "
                                    "ISA-packed opaque bytes; use 'auto' or 'pages'")
    if config.format == "auto":
        return "pages" if geom.opaque else "canonical"
    return config.format


def format_fingerprint(geom: EngineGeometry, fmt: str, layout_name: str = "") -> str:
    """What a chunk's bytes mean. Canonical chunks: planes, heads, head size, dtype. Raw pages also
    depend on the page layout, block size and (CPU backend) the attention ISA that packed them."""
    parts = [fmt, f"P{geom.planes}", f"H{geom.num_kv_heads}", f"D{geom.head_size}", str(geom.dtype)]
    if fmt == "pages":
        parts += [f"N{geom.block_size}", "cpu_attn" if geom.opaque else layout_name, geom.isa]
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


def shard_count(vllm_config, use_mla: bool) -> int:
    """Storage shards per chunk: one per (TP rank, PP rank); MLA caches are identical across TP ranks."""
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    return (1 if use_mla else tp) * pp


def worker_shard(vllm_config, use_mla: bool) -> tuple[int, int, bool]:
    """(shard index, shard count, writes) of this worker. ``writes`` is False for MLA ranks other than
    TP rank 0 (they hold the same bytes as rank 0)."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # not initialised (single process tests)
        tp_rank, pp_rank = 0, 0
    per_stage = 1 if use_mla else tp
    shard = (0 if use_mla else tp_rank) + pp_rank * per_stage
    return shard, shard_count(vllm_config, use_mla), not (use_mla and tp_rank != 0)


def namespace(vllm_config, geom: EngineGeometry, fingerprint: str) -> bytes:
    """The key namespace of this engine (see :mod:`kvx.connector.keys`)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return namespace_digest(model=str(mc.model), revision=str(getattr(mc, "revision", None)),
                            quantization=str(getattr(mc, "quantization", None)),
                            kv_cache_dtype=str(cc.cache_dtype), dtype=str(geom.dtype), format=fingerprint,
                            tp=1 if geom.use_mla else int(pc.tensor_parallel_size),
                            pp=int(pc.pipeline_parallel_size))


def chunk_bytes(config: KVXConfig, geom: EngineGeometry) -> int:
    """Upper bound of one chunk's bytes on one worker (whole pages of every layer)."""
    return geom.num_layers * geom.page_bytes * (config.chunk_size // geom.block_size)


def num_cpu_slots(config: KVXConfig, geom: EngineGeometry) -> int:
    """CPU tier slots; the same number on the scheduler and on every worker."""
    tier = config.cpu_tier
    if tier is None:
        return 0
    return tier.size // chunk_bytes(config, geom)
