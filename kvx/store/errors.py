"""Errors every tier raises (the connector handles them the same way, whatever the tier)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base of the tiers' errors."""


class ChunkError(StoreError):
    """A chunk could not be read back correctly (missing, torn, corrupt, not what was asked for, or the
    store did not answer in time): the load fails and vLLM recomputes the chunk."""


class StoreClosedError(StoreError):
    """An operation on a tier after ``close()``."""


class StoreFullError(StoreError):
    """A put found no room (full disk, capacity reached, a server out of memory). Nothing was written;
    the chunk stays uncached (vLLM recomputes it when needed)."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached (down, stopped, refusing us): the operation was not done."""
