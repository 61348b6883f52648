"""Facts both sides of the connector derive identically from vLLM's configs.

The scheduler and the workers never exchange geometry: each computes the same chunk format,
fingerprint, key namespace and CPU slot count from ``VllmConfig`` + ``KVCacheConfig``.

**Several KV cache groups (vLLM's hybrid KV cache manager, HMA).** A model whose layers need different
block tables (full attention next to sliding-window attention) has one group per table. vLLM lays the
groups over the same memory: layer ``i`` of every group aliases the same tensor, and a block id is owned by
one group at a time. kvx keeps one chunk per ``chunk_size`` tokens and one key chain, as for a single
group: a chunk holds, for those tokens, the blocks of group 0, then those of group 1, ... (each group's
blocks of every physical layer), so the chunk tensor has ``num_groups`` times a single group's blocks.
A chunk is saved only when every block of every group is present (a sliding-window group's table holds
vLLM's null block for blocks that left the window: such a chunk is not saved), so any prefix of stored
chunks can be served to every group and a hit never exceeds what every group can serve. A load skips the
blocks vLLM left null (outside the window). Loads of such models are always asynchronous: with several
groups vLLM accepts load failures only per request (``failed_recving``), and only for async loads.

**Recurrent state (Mamba / linear-attention groups, vLLM's ``mamba_cache_mode="align"``).** vLLM keeps a
hybrid model's recurrent state (conv + SSM / GDN state of each such layer) in blocks of its own group: in align
mode, the block at position ``p`` of a state group's table holds the state after exactly ``(p + 1) *
block_size`` tokens, where a step ended there (other positions are vLLM's null block). Such a group's pages
are the attention groups' page size and alias the same tensors (layer ``i`` of every group), so kvx copies
them as raw pages, like attention pages. A hybrid model's chunk is then two objects under two keys: the
attention chunk (the attention groups' blocks of its tokens, as above) and, when vLLM kept the state at the
chunk's end, its *state object* (:func:`~kvx.keys.state_key`: one block per state group, per physical layer).
A hit needs the attention chunks of its whole prefix and the state object of its last chunk: it is rounded
down to the last chunk whose state is stored, never a partial load (:mod:`.scheduler`). Chunk size and vLLM's
block size must agree (states exist only at block ends). Chunks are raw pages ("pages" format).

Groups kvx cannot hold (Mamba groups outside align mode, chunked-local attention, attention groups with
different head shapes) make the connector passive (:func:`hma_unsupported_reason`): no hits, no saves.
Keys of single-group engines do not change (the namespace and fingerprint gain a field only with
several groups).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from ..keys import namespace_digest
from .config import ConfigError, KVXConfig
from .parts import RECORD_VERSION, Share

DEFAULT_CHUNK_TOKENS = 256  # chunk_size left unset: the smallest multiple of the engine's block size at least this


class UnsupportedModelError(ValueError):
    """The engine's KV cache is something kvx does not handle (e.g. several KV cache groups)."""


@dataclass(frozen=True)
class EngineGeometry:
    block_size: int  # tokens per vLLM block
    num_layers: int  # attention layers in the KV cache group
    num_kv_heads: int  # per rank
    head_size: int
    dtype: torch.dtype
    use_mla: bool
    opaque: bool  # vLLM CPU backend: ISA-packed pages
    isa: str  # the CPU attention ISA path ("" elsewhere)
    page_bytes: int  # one block of one layer
    num_groups: int = 1  # KV cache groups; a chunk holds every attention group's blocks (see the module docstring)
    group_kinds: tuple[str, ...] = ()  # several groups: per group "full", "sliding<window>" or "state"
    state_desc: str = ""  # recurrent-state groups: what their pages hold (shapes, dtypes, backend)
    total_kv_heads: int = 0  # the model's KV heads, every rank's (MLA: 1); 0: num_kv_heads (one rank)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def planes(self) -> int:
        return 1 if self.use_mla else 2

    @functools.cached_property
    def state_groups(self) -> tuple[int, ...]:
        """The recurrent-state (Mamba / linear-attention) groups, by index."""
        return tuple(g for g, k in enumerate(self.group_kinds) if k == STATE)

    @functools.cached_property
    def attn_groups(self) -> tuple[int, ...]:
        """The attention groups, by index (every group of an engine without recurrent state). Cached: a chunk's
        shape asks it (:func:`object_rows`)."""
        return tuple(g for g in range(self.num_groups) if g not in self.state_groups)

    @property
    def hybrid(self) -> bool:
        return bool(self.state_groups)


def _cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention packs pages for. As vLLM picks it: from the model's dtype and the KV cache
    dtype string (an fp8 cache is stored as uint8, but packed for the model dtype's kernel).

    Raw pages are only meaningful to an engine that packs them the same way, so the ISA is part of their
    fingerprint: if vLLM cannot tell it, kvx refuses to start rather than put a made-up value there (one
    engine would store chunks under it that another, which could tell, never finds, or worse)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except Exception as e:  # noqa: BLE001 - whatever the cause, the fingerprint cannot be made
        raise UnsupportedModelError(
            f"kv_cache_config: kvx could not determine the CPU attention ISA vLLM packs KV pages for (dtype "
            f"{dtype}, block size {block_size}, head size {head_size}, kv cache dtype {kv_cache_dtype!r}): "
            f"vllm.v1.attention.backends.cpu_attn._get_attn_isa failed with {type(e).__name__}: {e}"
        ) from e
    if not isinstance(isa, str) or not isa:
        raise UnsupportedModelError(
            f"kv_cache_config: expected vLLM's CPU attention ISA as a non-empty name, got {isa!r}"
        )
    return isa


NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block: the first block id), e.g. outside a window
STATE = "state"  # the kind of a recurrent-state group (MambaSpec in align mode)


def group_kind(spec) -> str | None:
    """ "full", "sliding<window>", "state" (Mamba / linear attention in vLLM's align mode), or None for a spec
    kvx cannot hold in a multi-group chunk."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if type(spec) is FullAttentionSpec and getattr(spec, "sliding_window", None) is None:
        return "full"
    if type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
        return f"sliding{int(spec.sliding_window)}"
    if isinstance(spec, MambaSpec) and getattr(spec, "mamba_cache_mode", "none") == "align":
        return STATE
    return None


def _state_reason(spec) -> str | None:
    """Why kvx cannot hold this MambaSpec group's state (None: it can)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (
            f"a Mamba / linear-attention group in mamba_cache_mode {mode!r}: kvx stores recurrent state only in "
            "vLLM's 'align' mode (enable prefix caching; --mamba-cache-mode align)"
        )
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        return "a Mamba / linear-attention group with speculative state blocks (speculative decoding)"
    return None


def state_description(specs) -> str:
    """What a recurrent-state page holds (every state group's shapes, dtypes and backend): part of the chunk
    fingerprint, so a state is never loaded into a model whose state differs (conv width, heads, dtype)."""
    parts = []
    for spec in specs:
        mt = getattr(spec, "mamba_type", "")
        parts.append(
            f"{getattr(mt, 'name', mt)}:{[list(map(int, sh)) for sh in spec.shapes]}:{[str(d) for d in spec.dtypes]}"
        )
    return ";".join(parts)


def hma_unsupported_reason(kv_cache_config) -> str | None:
    """Why kvx cannot serve an engine with several KV cache groups (None: it can, or one group)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        return None
    specs = [g.kv_cache_spec for g in groups]
    from vllm.v1.kv_cache_interface import MambaSpec

    for g, spec in zip(groups, specs):
        if isinstance(spec, MambaSpec) and _state_reason(spec) is not None:
            return _state_reason(spec)
        if group_kind(spec) is None:
            return (
                f"KV cache group of {type(spec).__name__} ({len(g.layer_names)} layers): kvx stores full and "
                "sliding-window attention KV and align-mode Mamba / linear-attention state only"
            )
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            return "a KV cache group that vLLM marks host-resident or not transferable"
    attn = [s for s in specs if group_kind(s) != STATE]
    if not attn:
        return "no attention KV cache group (a model of recurrent layers only)"
    shape = {(int(s.block_size), int(s.num_kv_heads), int(s.head_size), s.dtype, int(s.page_size_bytes)) for s in attn}
    if len(shape) != 1:
        return f"KV cache groups with different block/head shapes {sorted(map(str, shape))}"
    (block, *_, page) = next(iter(shape))
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if any(group_kind(s) == STATE for s in specs) and hash_block not in (None, block):
        # vLLM then keeps (prefill checkpoint) states at sub-block positions: a block would not hold the state at
        # its end
        return (
            f"a Mamba / linear-attention group with prefix hashes of {hash_block} tokens inside {block}-token blocks "
            "(prefix_match_unit): kvx stores recurrent state at block ends only"
        )
    for s in specs:
        if group_kind(s) == STATE and (int(s.block_size), int(s.page_size_bytes)) != (block, page):
            return (
                f"a Mamba / linear-attention group of {int(s.block_size)}-token blocks and "
                f"{int(s.page_size_bytes)}-byte pages next to attention blocks of {block} tokens and {page} bytes "
                "(expected equal: vLLM aligns them)"
            )
    return None


def engine_geometry(vllm_config, kv_cache_config) -> EngineGeometry:
    """Geometry of the engine's KV cache (one group, or several attention groups of one shape: see
    :func:`hma_unsupported_reason`, checked first)."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedModelError("kv_cache_config: no KV cache group")
    reason = hma_unsupported_reason(kv_cache_config)
    if reason is not None:
        raise UnsupportedModelError(f"kv_cache_config: {reason}")
    spec = next(g.kv_cache_spec for g in groups if group_kind(g.kv_cache_spec) != STATE)
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False)) or type(spec).__name__.startswith("MLA")
    if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
        raise UnsupportedModelError(f"kv_cache_config: unsupported KV cache spec {type(spec).__name__}")
    from vllm.platforms import current_platform

    opaque = bool(current_platform.is_cpu())
    block_size = int(spec.block_size)
    isa = (
        _cpu_attention_isa(
            vllm_config.model_config.dtype, block_size, int(spec.head_size), str(vllm_config.cache_config.cache_dtype)
        )
        if opaque
        else ""
    )
    kinds = tuple(group_kind(g.kv_cache_spec) for g in groups) if len(groups) > 1 else ()
    state_specs = [g.kv_cache_spec for g in groups if group_kind(g.kv_cache_spec) == STATE]
    # several groups alias layer i of each group onto the same tensor: the physical layers are the largest group's
    return EngineGeometry(
        block_size=block_size,
        num_layers=max(len(g.layer_names) for g in groups),
        num_kv_heads=1 if use_mla else int(spec.num_kv_heads),
        total_kv_heads=1 if use_mla else _total_kv_heads(vllm_config, int(spec.num_kv_heads)),
        head_size=int(spec.head_size),
        dtype=spec.dtype,
        use_mla=use_mla,
        opaque=opaque,
        isa=isa,
        page_bytes=int(spec.page_size_bytes),
        num_groups=len(groups),
        group_kinds=kinds,
        state_desc=state_description(state_specs),
    )


def _total_kv_heads(vllm_config, per_rank: int) -> int:
    """The model's KV heads (every TP rank's), as vLLM counts them; ``per_rank`` where the config cannot say."""
    total = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    return int(total()) if callable(total) else per_rank


def chunk_format(config: KVXConfig, geom: EngineGeometry) -> str:
    """ "canonical" ([L, P, T, H, D], layout independent) or "pages" (raw pages, same engine kind only)."""
    if config.format == "canonical" and geom.hybrid:
        raise UnsupportedModelError(
            "format: 'canonical' cannot hold recurrent (Mamba / linear-attention) state, which kvx copies as raw "
            "pages; use 'auto' or 'pages'"
        )
    if config.format == "canonical" and geom.opaque:
        raise UnsupportedModelError(
            "format: 'canonical' is impossible on vLLM's CPU backend, whose pages are "
            "ISA-packed opaque bytes; use 'auto' or 'pages'"
        )
    if config.format == "auto":
        return "pages" if geom.opaque or geom.hybrid else "canonical"
    return config.format


# page layouts whose pages hold each KV head's bytes as one run (head-major): their raw pages can be cut by head
_HEAD_MAJOR_PAGES = ("cpu", "LBHNC", "BLHNC", "mla")


def head_parts(geom: EngineGeometry, fmt: str, layout_name: str = "") -> bool:
    """Whether this engine's chunks are stored as one part per KV head (:mod:`.parts`), so that engines of every
    TP size share them: canonical chunks and head-major raw pages, MLA's single latent "head", not a hybrid model's
    recurrent state (one part per rank, and the TP size stays in the namespace)."""
    if geom.hybrid:
        return False
    return geom.use_mla or fmt == "canonical" or layout_name in _HEAD_MAJOR_PAGES


def format_fingerprint(geom: EngineGeometry, fmt: str, layout_name: str = "") -> str:
    """What a chunk's bytes mean. Canonical chunks: planes, heads, head size, dtype. Raw pages also
    depend on the page layout, block size and (CPU backend) the attention ISA that packed them. Heads: the model's
    (every rank's) when chunks are stored by head (:func:`head_parts`), else a rank's."""
    heads = geom.model_kv_heads if head_parts(geom, fmt, layout_name) else geom.num_kv_heads
    parts = [fmt, f"P{geom.planes}", f"H{heads}", f"D{geom.head_size}", str(geom.dtype)]
    if fmt == "pages":
        parts += [f"N{geom.block_size}", "cpu_attn" if geom.opaque else layout_name, geom.isa]
    if geom.num_groups > 1:  # every group's blocks, in group order (single-group fingerprints unchanged)
        parts += ["groups=" + ",".join(geom.group_kinds)]
    if geom.hybrid:  # what a state page holds (single-group and attention-only fingerprints unchanged)
        parts += ["state=" + geom.state_desc]
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


def worker_share(vllm_config, geom: EngineGeometry, split: bool, layer_names) -> Share:
    """This worker's sub-rectangle of every chunk (:class:`~.parts.Share`): its TP rank's KV heads of the model's,
    and its KV layers' decoder indices (from vLLM's layer names, ``layer_names`` in the cache's physical order)."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tp_group

        rank = get_tp_group().rank_in_group
    except Exception:  # not initialised (single process tests)
        rank = 0
    from vllm.model_executor.models.utils import extract_layer_index

    idx = [extract_layer_index(n) for n in layer_names]
    layers = (min(idx), max(idx) + 1)
    contiguous = idx == list(range(layers[0], layers[1]))
    total = geom.model_kv_heads
    if geom.use_mla:
        return Share((0, 1), 1, layers, contiguous, writer=rank == 0)
    if not split:
        return Share((0, geom.num_kv_heads), geom.num_kv_heads, layers, contiguous, split=False, rank=rank, ranks=tp)
    if tp > total:  # each head on tp / total ranks: the first of them writes it
        per = tp // total
        return Share((rank // per, rank // per + 1), total, layers, contiguous, writer=rank % per == 0)
    n = geom.num_kv_heads
    return Share((rank * n, (rank + 1) * n), total, layers, contiguous)


def namespace(vllm_config, geom: EngineGeometry, fingerprint: str, split: bool = True) -> bytes:
    """The key namespace of this engine (see :mod:`kvx.keys`). The parallel sizes are not in it when
    chunks are stored by KV head (``split``, :func:`head_parts`): engines of every TP and PP size share chunks; a
    hybrid model's keeps the TP size (its state cannot be cut by head). ``parts``: the storage version (chunks
    stored before parts existed are under other keys: never looked up, recomputed)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    # several groups: the group structure is named (the fingerprint holds it too); one group: as it always was
    more = {"kv_groups": list(geom.group_kinds)} if geom.num_groups > 1 else {}
    return namespace_digest(
        model=str(mc.model),
        revision=str(getattr(mc, "revision", None)),
        quantization=str(getattr(mc, "quantization", None)),
        kv_cache_dtype=str(cc.cache_dtype),
        dtype=str(geom.dtype),
        format=fingerprint,
        parts=RECORD_VERSION,
        **({} if split else {"tp": int(pc.tensor_parallel_size)}),
        **more,
    )


def resolve_chunk_size(config: KVXConfig, geom: EngineGeometry) -> tuple[KVXConfig, bool]:
    """``config`` with the chunk size this engine uses, and whether kvx chose it: a ``chunk_size`` the user set must
    be a multiple of vLLM's block size (for a hybrid model, equal to it: its recurrent state exists only at block
    ends, :mod:`.common`), else :class:`~.config.ConfigError` naming both; left unset, it follows the engine: the
    block size for a hybrid model, else the smallest multiple of the block size of at least
    :data:`DEFAULT_CHUNK_TOKENS` tokens (vLLM picks the block size itself for hybrids: 384 for some). Every process
    of an engine derives the same value from the same geometry."""
    block = geom.block_size
    if "chunk_size" not in config.model_fields_set:
        chunk = block if geom.hybrid else -(-DEFAULT_CHUNK_TOKENS // block) * block
        return config.model_copy(update={"chunk_size": chunk}), True
    if config.chunk_size % block:
        raise ConfigError(f"chunk_size: expected a multiple of vLLM's block size {block}, got {config.chunk_size}")
    if geom.hybrid and config.chunk_size != block:
        raise ConfigError(
            f"chunk_size: this hybrid model keeps its recurrent state only at multiples of vLLM's block size "
            f"(mamba_cache_mode 'align'), so chunks must end there: expected chunk_size {block}, got "
            f"{config.chunk_size}"
        )
    return config, False


def object_rows(geom: EngineGeometry, tokens: int, state: bool = False) -> int:
    """vLLM blocks per layer in one stored object: a chunk of ``tokens`` tokens (whole blocks of every attention
    group), or with ``state`` a state object (one block per recurrent-state group)."""
    return len(geom.state_groups) if state else len(geom.attn_groups) * -(-tokens // geom.block_size)


def object_bytes(geom: EngineGeometry, tokens: int, state: bool = False) -> int:
    """One stored object's bytes on one worker (whole pages of every layer)."""
    return object_rows(geom, tokens, state) * geom.num_layers * geom.page_bytes


def chunk_bytes(config: KVXConfig, geom: EngineGeometry) -> int:
    """Upper bound of one stored object's bytes on one worker, a chunk or a state object: a CPU slot's size."""
    return max(object_bytes(geom, config.chunk_size), object_bytes(geom, config.chunk_size, state=True))


def node_slot_bytes(config: KVXConfig, geom: EngineGeometry) -> int:
    """The bytes one chunk (or state object) takes in a node's slot: every rank's KV heads (:func:`chunk_bytes` is
    one rank's; MLA's latent cache is the same on every rank)."""
    return chunk_bytes(config, geom) * geom.model_kv_heads // geom.num_kv_heads


def node_reason(config: KVXConfig, geom: EngineGeometry, split: bool, tp: int, pp: int) -> str | None:
    """Why this engine cannot use a node tier (None: it can): a node stores each chunk once per host, whole, with
    every rank's heads in one slot, so each rank's share must be a range of heads (or the whole chunk)."""
    if config.node_tier is None:
        return None
    if pp > 1:
        return f"tiers: the node tier serves engines of one pipeline stage, got pipeline_parallel_size={pp}"
    if tp > 1 and not split and not geom.use_mla:
        return (
            f"tiers: the node tier stores chunks cut by KV head; this engine's chunks (tensor_parallel_size={tp}) "
            f"cannot be cut by head (a hybrid model's state, or raw pages with tokens outside heads): use the cpu tier"
        )
    return None


def write_backlog(config: KVXConfig, geom: EngineGeometry) -> int:
    """``max_write_backlog``, at least one chunk (a CPU slot's bytes: a buffered save counts one whole)."""
    return max(config.max_write_backlog, chunk_bytes(config, geom))


def num_cpu_slots(config: KVXConfig, geom: EngineGeometry) -> int:
    """CPU tier slots; the same number on the scheduler and on every worker."""
    tier = config.cpu_tier
    if tier is None:
        return 0
    return tier.size // chunk_bytes(config, geom)
