"""Storage tiers for KV chunks.

- :mod:`kvx.store.cpu`: CPU pool of chunk slots (worker bytes) + LRU index (scheduler).
- :mod:`kvx.store.disk`: one safetensors file per chunk; shareable between engines.
"""

from .cpu import CPUIndex, CPUPool, SlotState
from .disk import ChunkError, DiskStore, StoreClosedError, StoreError, StoreFullError

__all__ = ["CPUIndex", "CPUPool", "SlotState", "DiskStore", "StoreError", "ChunkError", "StoreClosedError",
           "StoreFullError"]
