"""Storage tiers for KV chunks.

- :mod:`kvx.store.tier`: the tier interface (:class:`Tier`), the registry of tier types, and the strict base of
  every config model (:class:`StrictConfig`).
- :mod:`kvx.store.codec`: the one chunk codec of every byte-oriented tier.
- :mod:`kvx.store.cpu`: the CPU pool of chunk slots (worker bytes) + its LRU index (scheduler): the
  stack's first level, and the buffer every other tier reads into and writes from.
- :mod:`kvx.store.disk`: one safetensors file per chunk; shareable between engines (``"disk"``).
- :mod:`kvx.store.redis`: chunks in Redis / Redis Cluster, shared by many instances (``"redis"``).
- :mod:`kvx.store.stack`: the scheduler's view of the stack: read-first-hit, write-to-all, promotion.
"""

from .cpu import CPUIndex, CPUPool
from .disk import DiskTier, DiskTierConfig  # noqa: E402 - registers "disk"
from .errors import ChunkError, StoreClosedError, StoreError, StoreFullError, StoreUnavailableError
from .redis import RedisTier, RedisTierConfig  # noqa: E402 - registers "redis"
from .slots import SlotIndex, SlotPool, SlotState
from .tier import (
    REMOVED,
    STORED,
    StrictConfig,
    Tier,
    TierConfig,
    TierContext,
    parse_size,
    parse_tier_config,
    register_tier,
    tier_class,
    tier_types,
)

__all__ = [
    "CPUIndex",
    "CPUPool",
    "SlotIndex",
    "SlotPool",
    "SlotState",
    "DiskTier",
    "DiskTierConfig",
    "StoreError",
    "ChunkError",
    "StoreClosedError",
    "StoreFullError",
    "RedisTierConfig",
    "RedisTier",
    "StoreUnavailableError",
    "Tier",
    "StrictConfig",
    "TierConfig",
    "TierContext",
    "register_tier",
    "tier_class",
    "tier_types",
    "parse_tier_config",
    "parse_size",
    "STORED",
    "REMOVED",
]
