"""Connector configuration, read from vLLM's ``kv_connector_extra_config`` and validated.

Example::

    {"chunk_size": 256,
     "tiers": [{"type": "cpu", "size": "4GiB"},
               {"type": "disk", "path": "/mnt/kv", "size": "100GiB"}],
     "save_decode": false, "skip_last_n_tokens": 0}

Unknown keys and bad values raise :class:`ConfigError` naming the key, what was expected and what
was given.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ..store import StrictConfig, TierConfig, parse_size, parse_tier_config, tier_class


class ConfigError(ValueError):
    """Invalid ``kv_connector_extra_config``."""


class CPUTierConfig(TierConfig):
    """A pool of chunk slots in (pinned, on CUDA) host memory: the first level of the stack, and the
    buffer every other tier reads into and writes from (:mod:`kvx.store.cpu`)."""

    type: Literal["cpu"]
    size: int = Field(description="bytes, e.g. '4GiB'")

    _size = field_validator("size", mode="before")(parse_size)


class NodeTierConfig(TierConfig):
    """The host's ``kvx node`` pool in the CPU tier's place: one pool per host in shared memory, shared by every
    engine on it and outliving them (:mod:`kvx.node`). Workers copy straight between the KV cache and the pool's
    slots; the scheduler asks the node, over its control socket, which chunks it holds."""

    type: Literal["node"]
    socket: str = Field(description="the node's control socket (kvx node --socket PATH)")
    timeout: float = Field(
        default=2.0, gt=0, le=60, description="seconds a request to the node may take before it counts as down"
    )
    retry_s: float = Field(
        default=1.0, gt=0, le=600, description="seconds between attempts to reach a node that is down"
    )
    pull_wait_ms: int = Field(
        default=500,
        ge=0,
        le=60_000,
        description="a node in a cluster (kvx node --peers): how long a request whose chunks the node pulls from a "
        "peer may wait for them (the node cuts a pull its peer's rate cannot move in time); 0: no pulls",
    )


_FIRST_TIERS = {"cpu": CPUTierConfig, "node": NodeTierConfig}  # the first level: slots the workers copy into


def _tier_model(kind: str) -> type[TierConfig]:
    return _FIRST_TIERS[kind] if kind in _FIRST_TIERS else tier_class(kind).config_model


def _parse_tier(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") in _FIRST_TIERS:
        return _FIRST_TIERS[raw["type"]].model_validate(raw)
    return parse_tier_config(raw) if isinstance(raw, dict) else raw


class KVXConfig(StrictConfig):
    """Validated ``kv_connector_extra_config`` of :class:`kvx.connector.KVXConnector`."""

    chunk_size: int = Field(
        default=256,
        gt=0,
        description="tokens per chunk; a multiple of vLLM's block size (a hybrid model's: equal to it); unset: the "
        "smallest multiple of the engine's block size of at least 256 (kvx.connector.common.resolve_chunk_size)",
    )
    tiers: list[TierConfig] = Field(
        default_factory=lambda: [CPUTierConfig(type="cpu", size=4 * 2**30)],
        min_length=1,
        description="fastest first: cpu, then any registered tier type (kvx.store.tier_types()) or 'module:Class'",
    )
    save_decode: bool = Field(default=False, description="also save chunks completed during decode")
    save_partial_chunks: bool = Field(
        default=False,
        description="save a request's trailing partial chunk "
        "(rounded down to whole blocks) when it finishes its prompt",
    )
    skip_last_n_tokens: int = Field(default=0, ge=0, description="never save the last n prompt tokens")
    load_async: bool = Field(
        default=False,
        description="report hits as async loads (the request waits for "
        "the load off the critical path) instead of sync layer-wise loads",
    )
    promote: bool = Field(default=True, description="copy hits from slower tiers into the CPU tier")
    format: Literal["auto", "canonical", "pages"] = Field(
        default="auto",
        description="chunk format: canonical [L,P,T,H,D] (layout independent) or raw pages; "
        "auto = canonical unless the backend's pages are opaque",
    )
    kv_layout: str | None = Field(default=None, description="preferred vLLM KV layout (e.g. 'LBNHC')")
    layerwise: bool = Field(
        default=True,
        description="CUDA: fence each layer's load in wait_for_layer_load "
        "(loads overlap the forward; vLLM then uses piecewise CUDA graphs); false: fence "
        "all loads before the forward",
    )
    save_layerwise: bool = Field(
        default=True,
        description="queue each layer group's save gathers as soon as "
        "the forward wrote it (save_kv_layer), so the copies overlap the rest of the "
        "forward; false: all layers at once in wait_for_save",
    )
    save_priority_limit: int | None = Field(
        default=None,
        description="save only requests whose vLLM priority "
        "is at most this (lower is more important); null: every request",
    )
    pd_wait_ms: int = Field(
        default=3000,
        ge=0,
        le=600_000,
        description="kv_consumer: how long a request waits for "
        "the chunks its producer announced (kvx_pd_chunks) to reach a shared tier before it "
        "computes without them",
    )
    io_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="each worker's threads reading the byte tiers (disk, Redis, any registered type: one pool for "
        "all, normal priority), and as many writing per byte tier (idle priority, but normal with kv_role "
        "kv_producer); decline_slow_hits expects this many reads at once",
    )
    decline_slow_hits: bool = Field(
        default=True,
        description="do not load a hit from a tier whose measured read speed makes it slower than "
        "recomputing the tokens (kvx.connector.costs)",
    )
    max_ctas: int = Field(
        default=8, ge=0, description="CUDA: thread-block cap of copy_path 'kernel' (the UVA kernel; 0 = no cap)"
    )
    copy_path: Literal["auto", "staged", "dma", "kernel"] = Field(
        default="auto",
        description="CUDA: how chunks cross PCIe: 'staged' (one DMA per layer group to a device staging buffer, "
        "an on-device reshape), 'dma' (DMA straight into the blocks), 'kernel' (the copy kernel over mapped host "
        "memory, on SMs), 'auto' (dma where the pieces are large enough by the measured rule, else staged)",
    )
    staging_bytes: int = Field(
        default=64 * 2**20,
        ge=4096,
        description="CUDA: device memory for the staging buffers (two per direction), e.g. '64MiB'; taken after "
        "vLLM sized its KV cache, from what gpu_memory_utilization leaves free; a layer's copies larger than one "
        "buffer (a quarter) are split. 64 MiB: a pinned copy reaches 97% of PCIe from 8 MiB (H100), so 16 MiB "
        "buffers keep each DMA at line rate",
    )
    max_write_backlog: int = Field(
        default=2**30,
        ge=1,
        description="bytes of chunks queued for writes to one byte tier (per worker), e.g. '256MiB': a save "
        "that would exceed it skips that tier (saves_dropped_backpressure), never waits; at least one chunk",
    )
    admit_after: int = Field(
        default=1,
        ge=1,
        description="store a chunk only once this many requests' prompts covered it (1: always store)",
    )
    admission_capacity: int = Field(
        default=1 << 18,
        ge=1,
        description="admit_after > 1: chunks whose sightings are remembered (least recently seen forgotten)",
    )

    _backlog = field_validator("max_write_backlog", mode="before")(parse_size)
    _staging = field_validator("staging_bytes", mode="before")(parse_size)

    @field_validator("tiers", mode="before")
    @classmethod
    def _tier_models(cls, v):
        # each entry is validated by its type's model (from_extra_config does it first, for per-key errors)
        return [_parse_tier(t) for t in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_tier_per_type(self):
        kinds = [t.type for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"tiers: expected at most one tier of each type, got {kinds}")
        first = [k for k in kinds if k in _FIRST_TIERS]
        if len(first) > 1 or (first and kinds[0] != first[0]):
            raise ValueError(
                f"tiers: expected at most one of 'cpu' and 'node', first in the list (the level the workers copy "
                f"into), got {kinds}"
            )
        return self

    @property
    def cpu_tier(self) -> CPUTierConfig | None:
        return next((t for t in self.tiers if t.type == "cpu"), None)

    @property
    def node_tier(self) -> NodeTierConfig | None:
        return next((t for t in self.tiers if t.type == "node"), None)

    @property
    def byte_tiers(self) -> list[TierConfig]:
        """The tiers after the CPU pool or the node (disk, redis, ...), fastest first."""
        return [t for t in self.tiers if t.type not in _FIRST_TIERS]

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KVXConfig:
        """Validate ``kv_connector_extra_config``; raises :class:`ConfigError` with every problem listed."""
        if extra is not None and not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}")
        raw, lines = dict(extra or {}), []
        if isinstance(raw.get("tiers"), list):
            # validate each tier with its type's model first, so errors name "tiers.<i>.<type>.<key>"
            tiers = []
            for i, t in enumerate(raw["tiers"]):
                try:
                    tiers.append(_parse_tier(t))
                except ValidationError as e:
                    lines += _error_lines(e, ("tiers", i, t["type"]))
                except ValueError as e:
                    lines.append(f"tiers.{i}: tier type: {e} (given: {t!r})")
            # with a bad tier, the other keys are still checked (against the default tiers)
            raw["tiers"] = tiers if not lines else [CPUTierConfig(type="cpu", size=1)]
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as e:
            lines += _error_lines(e)
        else:
            if not lines:
                return cfg
        raise ConfigError("invalid kvx kv_connector_extra_config:\n  " + "\n  ".join(lines)) from None


def _error_lines(e: ValidationError, prefix: tuple = ()) -> list[str]:
    lines = []
    for err in e.errors():
        where = prefix + tuple(err["loc"])
        loc = ".".join(str(p) for p in where) or "kv_connector_extra_config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key (known: {', '.join(sorted(_known_keys(where)))})"
        lines.append(f"{loc}: {msg} (given: {err.get('input')!r})")
    return lines


def _known_keys(loc: tuple) -> list[str]:
    if len(loc) >= 3 and loc[0] == "tiers" and isinstance(loc[2], str):
        try:
            model = _tier_model(loc[2])
        except ValueError:
            return list(KVXConfig.model_fields)
        for part in loc[3:-1]:  # a key of a nested object (a tier's "encryption"): that object's keys
            field = model.model_fields.get(part) if isinstance(part, str) else None
            sub = [t for t in (field.annotation, *typing.get_args(field.annotation))] if field else []
            sub = [t for t in sub if isinstance(t, type) and issubclass(t, BaseModel)]
            if not sub:
                break
            model = sub[0]
        return list(model.model_fields)
    return list(KVXConfig.model_fields)


def check_paths(config: KVXConfig, writes: bool) -> None:
    """Check the tiers' settings on this machine (a disk tier's path is a directory, or can be created
    as one, and is writable when this engine saves: ``writes``, kv_producer or kv_both): each tier type's
    ``check_config``.

    Raises :class:`ConfigError` naming the key, what was expected and what was given."""
    problems = []
    for i, tier in enumerate(config.tiers):
        if tier.type not in _FIRST_TIERS:
            problems += tier_class(tier.type).check_config(tier, f"tiers.{i}", writes)
    if problems:
        raise ConfigError("invalid kvx kv_connector_extra_config:\n  " + "\n  ".join(problems))
