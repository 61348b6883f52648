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

import math
import os
import re
from fractions import Fraction
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """Invalid ``kv_connector_extra_config``."""


def parse_size(value: Any) -> int:
    """``4GiB``, ``512MiB``, ``1.5GB``, ``1000000`` -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '4GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value):
        n = int(value)  # str() would give '1e+16', which the pattern below rejects
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size like '4GiB', '500MB' or a byte count, got {value!r}")
        # exact decimal arithmetic: float('4.1') * 10**9 is 4099999999.9999995, i.e. one byte short
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return n


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CPUTierConfig(_Strict):
    """A pool of chunk slots in (pinned, on CUDA) host memory."""

    type: Literal["cpu"]
    size: int = Field(description="bytes, e.g. '4GiB'")

    _size = field_validator("size", mode="before")(parse_size)


class DiskTierConfig(_Strict):
    """One safetensors file per chunk under ``path`` (may be shared by several engines)."""

    type: Literal["disk"]
    path: str
    size: int | None = Field(default=None, description="capacity in bytes, e.g. '100GiB'; none = unbounded")
    fsync: bool = False
    rescan_s: float = Field(default=5.0, ge=0, description="with a size: re-count the (shared) directory at most "
                            "this many seconds apart when writing; engines sharing a path overshoot size by at "
                            "most what the others write in that time")

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str):
        if not v.strip():
            raise ValueError("expected a directory path, got an empty string")
        return v


TierConfig = Annotated[Union[CPUTierConfig, DiskTierConfig], Field(discriminator="type")]


class KVXConfig(_Strict):
    """Validated ``kv_connector_extra_config`` of :class:`kvx.connector.KVXConnector`."""

    chunk_size: int = Field(default=256, gt=0, description="tokens per chunk; a multiple of vLLM's block size")
    tiers: list[TierConfig] = Field(default_factory=lambda: [CPUTierConfig(type="cpu", size=4 * 2**30)],
                                    min_length=1, description="fastest first")
    save_decode: bool = Field(default=False, description="also save chunks completed during decode")
    save_partial_chunks: bool = Field(default=False, description="save a request's trailing partial chunk "
                                      "(rounded down to whole blocks) when it finishes its prompt")
    skip_last_n_tokens: int = Field(default=0, ge=0, description="never save the last n prompt tokens")
    load_async: bool = Field(default=False, description="report hits as async loads (the request waits for "
                             "the load off the critical path) instead of sync layer-wise loads")
    promote: bool = Field(default=True, description="copy hits from slower tiers into the CPU tier")
    format: Literal["auto", "canonical", "pages"] = Field(
        default="auto", description="chunk format: canonical [L,P,T,H,D] (layout independent) or raw pages; "
                                    "auto = canonical unless the backend's pages are opaque")
    kv_layout: str | None = Field(default=None, description="preferred vLLM KV layout (e.g. 'LBNHC')")
    layerwise: bool = Field(default=True, description="CUDA: fence each layer's load in wait_for_layer_load "
                            "(loads overlap the forward; vLLM then uses piecewise CUDA graphs); false: fence "
                            "all loads before the forward")
    save_layerwise: bool = Field(default=True, description="queue each layer group's save gathers as soon as "
                                 "the forward wrote it (save_kv_layer), so the copies overlap the rest of the "
                                 "forward; false: all layers at once in wait_for_save")
    io_threads: int = Field(default=2, ge=1, le=64, description="threads for disk reads, and as many for disk writes")
    max_ctas: int = Field(default=8, ge=0, description="CUDA thread-block cap for copies (0 = no cap)")

    @field_validator("chunk_size", "skip_last_n_tokens", "io_threads", "max_ctas", mode="before")
    @classmethod
    def _no_bool(cls, v):
        # pydantic's lax mode turns true/false into 1/0: "chunk_size": true is a typo, not a chunk size
        if isinstance(v, bool):
            raise ValueError(f"expected an integer, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_tier_per_type(self):
        kinds = [t.type for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"tiers: expected at most one tier of each type, got {kinds}")
        return self

    @property
    def cpu_tier(self) -> CPUTierConfig | None:
        return next((t for t in self.tiers if t.type == "cpu"), None)

    @property
    def disk_tier(self) -> DiskTierConfig | None:
        return next((t for t in self.tiers if t.type == "disk"), None)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KVXConfig:
        """Validate ``kv_connector_extra_config``; raises :class:`ConfigError` with every problem listed."""
        if extra is not None and not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}")
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as e:
            lines = []
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "kv_connector_extra_config"
                given = err.get("input")
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = f"unknown key (known: {', '.join(sorted(_known_keys(cls, err['loc'])))})"
                lines.append(f"{loc}: {msg} (given: {given!r})")
            raise ConfigError("invalid kvx kv_connector_extra_config:\n  " + "\n  ".join(lines)) from None


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    if len(loc) >= 3 and loc[0] == "tiers":
        kind = loc[2] if isinstance(loc[2], str) else None
        for m in (CPUTierConfig, DiskTierConfig):
            if kind == m.model_fields["type"].annotation.__args__[0]:
                return list(m.model_fields)
    return list(model.model_fields)


def check_paths(config: KVXConfig, writes: bool) -> None:
    """Check the tiers' paths on this machine: a disk tier's ``path`` is a directory, or can be created
    as one, and is writable when this engine saves (``writes``: kv_producer or kv_both).

    Raises :class:`ConfigError` naming the key, what was expected and what was given."""
    problems = []
    for i, tier in enumerate(config.tiers):
        if tier.type != "disk":
            continue
        where = f"tiers.{i}.path"
        path = os.path.abspath(os.path.expanduser(tier.path))
        if os.path.lexists(path) and not os.path.isdir(path):
            kind = "a file" if os.path.isfile(path) else "not a directory"
            problems.append(f"{where}: expected a directory (or a path where one can be created), "
                            f"got {tier.path!r}, which is {kind}")
            continue
        probe = path
        while not os.path.isdir(probe):         # the nearest existing ancestor decides what can be created
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            if os.path.lexists(parent) and not os.path.isdir(parent):
                problems.append(f"{where}: expected a directory (or a path where one can be created), "
                                f"got {tier.path!r}, whose parent {parent!r} is not a directory")
                probe = None
                break
            probe = parent
        if probe is None:
            continue
        if os.access(probe, os.W_OK | os.X_OK):
            continue
        if probe != path:
            problems.append(f"{where}: expected a directory that exists or can be created, got {tier.path!r} "
                            f"(it does not exist, and {probe!r} is not writable)")
        elif writes:
            problems.append(f"{where}: expected a writable directory (this engine saves chunks: kv_role "
                            f"kv_producer or kv_both), got {tier.path!r}, which this process cannot write")
    if problems:
        raise ConfigError("invalid kvx kv_connector_extra_config:\n  " + "\n  ".join(problems))
