"""The tier interface: what the connector asks of a store of chunks, and the registry of tier types.

The CPU pool is the stack's first level and its buffer: its index lives with vLLM's scheduler and its
bytes in each worker (:mod:`kvx.store.cpu`). Every level after it is a :class:`Tier`: a byte-oriented
store of encoded chunks (:mod:`kvx.store.codec`), opened once in the scheduler process (lookups) and
once in each worker (gets and puts). The connector names no tier type: it finds the class of each
``tiers`` entry of the config in the registry, so a third-party tier is a class, not a fork::

    from kvx.store import Tier, TierConfig, register_tier

    class S3TierConfig(TierConfig):
        type: Literal["s3"]
        bucket: str

    @register_tier
    class S3Tier(Tier):
        type = "s3"
        config_model = S3TierConfig
        ...

and ``{"type": "s3", "bucket": "kv"}`` in ``kv_connector_extra_config`` once the module is imported,
or ``{"type": "mypkg.s3:S3Tier", ...}`` to have kvx import it.

Names: tier type ``<Name>`` is the class ``<Name>Tier`` with the config model ``<Name>TierConfig``
(``DiskTier`` / ``DiskTierConfig``, ``RedisTier`` / ``RedisTierConfig``; the CPU pool's config is
``kvx.connector.config.CPUTierConfig``), and every tier is constructed from ``(config, ctx)``.

Keys passed to a tier are lowercase hex: the connector stores a chunk as parts (one per KV head) under their own
keys and a record under the chunk key (:mod:`kvx.connector.parts`); a tier stores each as an object. Every operation
may be called from several threads at once.
"""

from __future__ import annotations

import importlib
import re
import threading
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from ..sizes import parse_size  # noqa: F401 - part of kvx.store's API

# tier events (the serving work turns them into vLLM KV events): a chunk became readable / was removed
STORED, REMOVED = "stored", "removed"
Listener = Callable[[str, str, Sequence[str]], None]  # (tier name, STORED | REMOVED, keys)


_KEY = re.compile(r"[0-9a-f]{8,}")


def check_key(key: Any) -> str:
    """``key`` if it is a chunk key (a lowercase hex string of >= 8 digits), else ValueError naming it.
    A compiled pattern: a lookup checks hundreds of keys, and a per-character test in Python costs a
    loop of calls per key."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"key: expected a lowercase hex string of >= 8 digits, got {key!r}")
    return key


def _number_kind(annotation: Any) -> str | None:
    """ "an integer" / "a number" if a field of this type takes numbers (and not booleans), else None."""
    kinds = set()
    todo = [annotation]
    while todo:
        t = todo.pop()
        args = typing.get_args(t)
        if args and typing.get_origin(t) is not Literal:
            todo += args
        elif t is bool:
            return None
        elif t in (int, float):
            kinds.add(t)
    return "a number" if float in kinds else "an integer" if kinds else None


class StrictConfig(BaseModel):
    """Base of every kvx config model (each tier's :class:`TierConfig`, ``kvx.connector.config.KVXConfig``):
    unknown keys are errors, models are immutable, and no number is given as ``true`` / ``false`` (pydantic's
    lax mode reads true as 1: a typo, not a value). Unambiguous JSON spellings stay accepted (``"128"`` for an
    int, ``"true"`` for a bool). Errors name the field (its location), what was expected and what was given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool):
            kind = _number_kind(cls.model_fields[info.field_name].annotation)
            if kind is not None:
                raise ValueError(f"expected {kind}, got {v!r}")
        return v


class TierConfig(StrictConfig):
    """Base of every tier's config model (strict: :class:`StrictConfig`)."""

    type: str


@dataclass(frozen=True)
class TierContext:
    """What a tier is opened with.

    fingerprint: what the chunks' bytes mean (model, layout, dtype, format): a chunk with another
        fingerprint is never served.
    role: "scheduler" (lookups only) or "worker" (gets and puts of this rank's chunks).
    writes: this engine saves chunks (kv_producer or kv_both).
    io_threads: how many threads will call the tier at once (size connection pools to it).
    """

    fingerprint: str
    role: Literal["scheduler", "worker"] = "worker"
    writes: bool = True
    io_threads: int = 2


class Tier(ABC):
    """A store of encoded chunks below the CPU pool (disk, Redis, ...).

    Subclasses set ``type`` (the config's ``"type"``), ``config_model`` (a :class:`TierConfig`) and
    ``hit_source`` (how vLLM's metrics name hits from it: a ``CacheHitSource`` value), ``event_medium`` and
    ``event_locality`` (the ``medium`` and ``locality`` of its KV cache events, in vLLM's terms), and implement
    :meth:`open` and the operations below. Errors are the ones of :mod:`kvx.store.errors`.
    """

    type: ClassVar[str]
    config_model: ClassVar[type[TierConfig]]
    hit_source: ClassVar[str] = "external_unspecified"
    # KV events, as vLLM's offloading connector names its tiers: medium "CPU" or "STORAGE", locality "LOCAL" (this
    # machine's) or "REMOTE" (shared between instances)
    event_medium: ClassVar[str] = "STORAGE"
    event_locality: ClassVar[str] = "REMOTE"
    # contains_many answers from local state (a file system stat), cheaply enough for the scheduler to
    # ask before planning each save
    local_lookup: ClassVar[bool] = False

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._listeners_lock = threading.Lock()

    @classmethod
    @abstractmethod
    def open(cls, config: TierConfig, ctx: TierContext) -> Tier:
        """Open the tier. A store that cannot be reached now must not fail the engine: open anyway, warn,
        answer misses and retry in the background."""

    @classmethod
    def check_config(cls, config: TierConfig, where: str, writes: bool) -> list[str]:
        """Problems with ``config`` on this machine, checked when the engine starts (each a line naming
        ``where`` and the key, what was expected and what was given). ``writes``: this engine saves."""
        return []

    @property
    def name(self) -> str:
        return self.type

    # ---------------------------------------------------------------- lookups
    @abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Which of ``keys`` can be read now (a batched lookup).

        ``None``: the answer is not known yet and getting it would block the caller on the network; the
        tier gets it in the background, and the caller asks again (vLLM's scheduler asks at its next
        step). A store that is down answers all False."""

    # ---------------------------------------------------------------- bytes
    @abstractmethod
    def get_into(self, key: str, out: torch.Tensor) -> None:
        """Read chunk ``key`` into ``out`` (a contiguous CPU tensor: a CPU-pool slot or a pinned buffer),
        verified: format, key, fingerprint, dtype, shape and checksum.

        Raises :class:`ChunkError` if it is missing, torn, corrupt, not what ``out`` expects, or the store
        did not answer in time; ``out`` may then hold anything (it is not served)."""

    @abstractmethod
    def put(self, key: str, chunk: torch.Tensor, extra: dict[str, str] | None = None) -> bool:
        """Store ``chunk`` (a contiguous CPU tensor) as ``key``, atomically: readers see all of it or
        nothing. Returns False if the key was present already (nothing written).

        Raises :class:`StoreFullError` (no room), :class:`StoreUnavailableError` (unreachable) or
        another :class:`StoreError` / ``OSError``: nothing readable was left behind."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was not there."""

    # ---------------------------------------------------------------- capacity and stats
    def capacity(self) -> int | None:
        """Bytes this tier may hold (None: no limit kvx knows of)."""
        return None

    @abstractmethod
    def usage(self) -> int:
        """Bytes held now (as far as the tier can tell cheaply)."""

    def stats(self) -> dict[str, int]:
        """Counters since open (gets, puts, bytes, errors, ...)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: a tier holding nothing to release keeps this one
        """Release connections, files and threads. Idempotent."""

    # ---------------------------------------------------------------- events
    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(tier name, STORED | REMOVED, keys)`` when chunks this process wrote become
        readable, or chunks it knows of are removed (evicted, deleted). Listeners run on the thread that
        made the change, maybe under the tier's locks: they must be quick and not call the tier."""
        with self._listeners_lock:
            self._listeners.append(listener)

    def _emit(self, event: str, keys: Sequence[str]) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(self.name, event, list(keys))


# ------------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Tier]] = {}


def register_tier(cls: type[Tier]) -> type[Tier]:
    """Make a :class:`Tier` subclass available under ``cls.type`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"register_tier: expected a Tier subclass, got {cls!r}")
    kind = getattr(cls, "type", None)
    if not isinstance(kind, str) or not kind or kind in ("cpu", "node"):
        raise ValueError(f"register_tier: {cls.__name__}.type must be a name other than 'cpu' and 'node', got {kind!r}")
    model = getattr(cls, "config_model", None)
    if not (isinstance(model, type) and issubclass(model, TierConfig)):
        raise TypeError(f"register_tier: {cls.__name__}.config_model must be a TierConfig subclass")
    old = _REGISTRY.get(kind)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"register_tier: type {kind!r} is taken by {old.__module__}.{old.__qualname__}")
    _REGISTRY[kind] = cls
    return cls


def tier_types() -> list[str]:
    return sorted(_REGISTRY)


def tier_class(kind: str) -> type[Tier]:
    """The class of tier type ``kind``: a registered name, or ``"package.module:Class"`` (imported)."""
    cls = _REGISTRY.get(kind)
    if cls is not None:
        return cls
    if ":" in kind:
        mod, _, attr = kind.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"expected an importable 'module:Class', got {kind!r} ({e})") from None
        if not (isinstance(cls, type) and issubclass(cls, Tier)):
            raise ValueError(f"expected {kind!r} to name a kvx.store.Tier subclass, got {cls!r}")
        return register_tier(cls)  # from now on known by its type too (the config carries the type)
    raise ValueError(f"expected one of {['cpu', 'node'] + tier_types()} or 'module:Class', got {kind!r}")


def parse_tier_config(raw: Any) -> TierConfig:
    """Validate one ``tiers`` entry with its type's model (raises ``ValueError`` / pydantic's
    ``ValidationError``)."""
    if isinstance(raw, TierConfig):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object with a 'type', got {raw!r}")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ValueError(
            f"expected a 'type' naming a tier (one of {['cpu', 'node'] + tier_types()} or 'module:Class'), got {kind!r}"
        )
    cls = tier_class(kind)
    if ":" in kind:  # the model's type field names the registered type; accept the import path too
        raw = {**raw, "type": cls.type}
    return cls.config_model.model_validate(raw)
