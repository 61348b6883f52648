"""The disk tier's config (:class:`DiskTierConfig`: the ``"disk"`` entry of ``tiers``) and its check on this
machine (:func:`check_path`). Immutable values: any thread."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from ..seal import EncryptionConfig
from ..tier import TierConfig, parse_size


class DiskTierConfig(TierConfig):
    """One chunk file per chunk under ``path`` (may be shared by several engines)."""

    type: Literal["disk"]
    path: str
    size: int | None = Field(default=None, description="capacity in bytes, e.g. '100GiB'; none = unbounded")
    fsync: bool = False
    rescan_s: float = Field(
        default=5.0,
        ge=0,
        description="with a size: re-count the (shared) directory at most "
        "this many seconds apart when writing; engines sharing a path overshoot size by at "
        "most what the others write in that time",
    )
    encryption: EncryptionConfig | None = Field(
        default=None,
        description='{"key_file": PATH} or {"key_files": [newest, ..., oldest]}: seal every chunk with '
        "AES-256-GCM (kvx.store.seal); read only chunks sealed with one of these secrets",
    )

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


def check_path(config: DiskTierConfig, where: str, writes: bool) -> list[str]:
    """``config.path`` is a directory, or can be created as one, and is writable if this engine saves."""
    where = f"{where}.path"
    path = os.path.abspath(os.path.expanduser(config.path))
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = "a file" if os.path.isfile(path) else "not a directory"
        return [
            f"{where}: expected a directory (or a path where one can be created), got {config.path!r}, which is {kind}"
        ]
    probe = path
    while not os.path.isdir(probe):  # the nearest existing ancestor decides what can be created
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return [
                f"{where}: expected a directory (or a path where one can be created), "
                f"got {config.path!r}, whose parent {parent!r} is not a directory"
            ]
        probe = parent
    if os.access(probe, os.W_OK | os.X_OK):
        return []
    if probe != path:
        return [
            f"{where}: expected a directory that exists or can be created, got {config.path!r} "
            f"(it does not exist, and {probe!r} is not writable)"
        ]
    if writes:
        return [
            f"{where}: expected a writable directory (this engine saves chunks: kv_role "
            f"kv_producer or kv_both), got {config.path!r}, which this process cannot write"
        ]
    return []
