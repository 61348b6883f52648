"""KV cache events for chunks entering and leaving kvx's tiers, in vLLM's own event types (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) and vocabulary, published by vLLM's ``--kv-events-config`` publisher.

A router that places requests by cache contents already follows vLLM's events for the GPU cache. kvx's events
name the same blocks the same way: each chunk's event carries the **vLLM block hashes** of the blocks it holds
(``Request.block_hashes``: vLLM's prefix-cache hash chain, sha256 by default, which is identical across
processes and machines for the same tokens, LoRA, cache_salt and multimodal inputs), converted as vLLM converts
its own (``maybe_convert_block_hash``), with the parent hash, token ids and block size. So a router needs no
knowledge of kvx's own chunk keys (which also cover kvx-only inputs such as ``kvx_namespace``) to match a
kvx-held prefix to a prompt.

The fields are the ones vLLM's ``OffloadingConnector`` fills for its tiers (its self-describing events,
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``, the same in vLLM 0.32 and 0.33):

* ``medium``: ``"CPU"`` for kvx's CPU tier, ``"STORAGE"`` for a byte tier (vLLM's ``MEDIUM_CPU`` /
  ``MEDIUM_STORAGE``; ``Medium`` in ``vllm/v1/kv_offload/base.py``), never a kvx-only word;
* ``locality``: ``"LOCAL"`` (the CPU tier, a disk tier) or ``"REMOTE"`` (a store shared between instances,
  e.g. Redis) relative to the publishing engine (vLLM's ``Locality``); from the tier class's
  ``event_medium`` / ``event_locality``;
* ``ownership``: the tier's name (``"cpu"``, ``"disk"``, ``"redis"``), so two tiers of one medium are told
  apart. (vLLM's offloading connector leaves ``locality`` and ``ownership`` ``None`` on its primary CPU tier,
  sets ``ownership`` only on its ``kvcr`` tier and a file tier's ``locality`` only where configured: kvx always
  sets both, in the same vocabulary);
* ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``: the KV cache group, its spec's kind
  (``get_kv_cache_spec_kind(spec).value``, e.g. ``"full_attention"``) and window, as vLLM's offloading
  connector sets them from ``kv_cache_config`` (:meth:`KVEvents.set_groups`). A kvx chunk holds every group's
  blocks: it is announced once per group that vLLM's offloading connector describes (full attention, MLA: not
  sliding-window, chunked-local or Mamba groups), carrying that group's index; ``BlockRemoved`` carries the same
  ``group_idx``. A hybrid model's recurrent-state objects have no event;
* ``lora_id`` / ``lora_name``: ``lora_request.adapter_id`` / ``.name``; ``extra_keys`` ``None`` and no
  ``session_id`` (vLLM's offloading connector sets neither); ``lookahead_token_ids`` (vLLM 0.33 only) left at
  its default, so the events are built the same way with either version.

Sources (scheduler process): the CPU index (commit, eviction, reset), the byte tiers' writes once every
worker has finished them (a new write by at least one, none failed), and removals that workers or this
process's tier objects observe (eviction to make room, a corrupt file dropped, a delete). A chunk's payload is
captured while its request is alive (when its save or promotion is planned) and kept while some tier holds
it. Removals of chunks this process never stored (written by another instance or an earlier run) carry no
known hashes and produce no event. Scheduler thread only, except :meth:`KVEvents.observe`, which tier threads
call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..store import REMOVED, STORED

MAX_TRACKED = 1 << 18  # chunk payloads kept at most (LRU), bounding memory whatever the tiers' sizes

CPU_PLACE = ("CPU", "LOCAL")  # kvx's CPU tier: vLLM's MEDIUM_CPU, Locality.LOCAL


@dataclass(frozen=True)
class EventGroup:
    """A KV cache group as vLLM's offloading connector describes it in its events."""

    idx: int
    kind: str | None = None  # get_kv_cache_spec_kind(spec).value, e.g. "full_attention"
    sliding_window: int | None = None  # get_kv_cache_spec_sliding_window(spec)


def event_groups(kv_cache_config) -> tuple[EventGroup, ...]:
    """The groups a kvx chunk is announced for, described from vLLM's ``kv_cache_config`` as vLLM's
    ``OffloadingConnector`` describes them (``get_offloading_event_group_spec``): the groups it publishes
    self-describing events for, those whose hit window is unbounded (``get_sliding_window_size_in_chunks`` is
    None: full attention, MLA). Sliding-window, chunked-local and Mamba groups get placeholder payloads there,
    which consumers ignore; here, no event."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    windowed = (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
    return tuple(
        EventGroup(i, get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if not isinstance(g.kv_cache_spec, windowed)
    )


@dataclass(frozen=True)
class _Payload:
    block_hashes: tuple
    parent: object
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


class KVEvents:
    """Turns tier changes into vLLM ``KVCacheEvent``s; :meth:`take` drains them (``take_events``).

    ``places``: tier name -> ``(medium, locality)`` in vLLM's vocabulary (``CPU_PLACE`` for the CPU tier; a byte
    tier's ``event_medium``, ``event_locality``). ``groups``: see :func:`event_groups` (default: one group 0 of
    unknown kind, until :meth:`set_groups`)."""

    def __init__(
        self,
        enabled: bool,
        block_size: int,
        places: dict[str, tuple[str, str | None]],
        groups: tuple[EventGroup, ...] = (EventGroup(0),),
    ):
        self.enabled = enabled
        self.block_size = block_size
        self.places = {name: tuple(p) for name, p in places.items()}
        self.groups = tuple(groups)
        self._payloads: OrderedDict[str, _Payload] = OrderedDict()
        self._where: dict[str, set[str]] = {}  # key -> tiers announced as holding it
        self._events: list = []
        self._observed: list[tuple[str, str, list[str]]] = []  # from other threads
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}  # "<tier>_stored" / "<tier>_evictions" (since last take)

    def set_groups(self, groups) -> None:
        """The engine's KV cache groups (:func:`event_groups`), once its ``kv_cache_config`` is known."""
        self.groups = tuple(groups)

    def place(self, tier: str) -> tuple[str, str | None]:
        """``(medium, locality)`` of ``tier``'s events (a tier kvx was not told about: remote storage)."""
        return self.places.get(tier, ("STORAGE", "REMOTE"))

    # ------------------------------------------------------------------ payloads
    def record(self, key: str, request, first_block: int, num_blocks: int) -> None:
        """Capture the event payload of chunk ``key``: blocks ``[first_block, first_block + num_blocks)`` of
        ``request`` (a live vLLM Request)."""
        if not self.enabled or key in self._payloads:
            return
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if len(hashes) < first_block + num_blocks:
            return  # vLLM hashes at another granularity (or not at all): nothing a router could match
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        self._payloads[key] = _Payload(
            tuple(maybe_convert_block_hash(h) for h in hashes[first_block : first_block + num_blocks]),
            maybe_convert_block_hash(hashes[first_block - 1]) if first_block > 0 else None,
            tuple(request.all_token_ids[first_block * bs : (first_block + num_blocks) * bs]),
            lora.adapter_id if lora is not None else None,  # as vLLM's events: LoRARequest.adapter_id / .name
            lora.name if lora is not None else None,
        )
        while len(self._payloads) > MAX_TRACKED:
            old, _ = self._payloads.popitem(last=False)
            self._where.pop(old, None)

    # ------------------------------------------------------------------ changes
    def observe(self, tier: str, event: str, keys) -> None:
        """A tier listener (``Tier.subscribe``): any thread."""
        with self._lock:
            self._observed.append((tier, event, list(keys)))

    def stored(self, tier: str, key: str) -> None:
        self._count(f"{tier}_stored")
        p = self._payloads.get(key)
        if p is None:
            return  # events off, or a chunk whose request this process never saw
        where = self._where.setdefault(key, set())
        if tier in where:
            return
        where.add(tier)
        self._payloads.move_to_end(key)
        from vllm.distributed.kv_events import BlockStored

        medium, locality = self.place(tier)
        for g in self.groups:  # keyword arguments only: vLLM 0.33 adds a field (lookahead_token_ids, default None)
            self._events.append(
                BlockStored(
                    block_hashes=list(p.block_hashes),
                    parent_block_hash=p.parent,
                    token_ids=list(p.token_ids),
                    block_size=self.block_size,
                    lora_id=p.lora_id,
                    medium=medium,
                    lora_name=p.lora_name,
                    extra_keys=None,
                    group_idx=g.idx,
                    kv_cache_spec_kind=g.kind,
                    kv_cache_spec_sliding_window=g.sliding_window,
                    locality=locality,
                    ownership=tier,
                )
            )

    def removed(self, tier: str, key: str) -> None:
        self._count(f"{tier}_evictions")
        where = self._where.get(key)
        if where is None or tier not in where:
            return  # never announced here (another instance's chunk), or announced gone already
        where.discard(tier)
        from vllm.distributed.kv_events import BlockRemoved

        medium, locality = self.place(tier)
        hashes = self._payloads[key].block_hashes
        for g in self.groups:
            self._events.append(
                BlockRemoved(
                    block_hashes=list(hashes), medium=medium, group_idx=g.idx, locality=locality, ownership=tier
                )
            )
        if not where:
            del self._where[key]
            self._payloads.pop(key, None)

    def cleared(self) -> None:
        """Every tier is empty (a reset with no tier after the CPU pool): one AllBlocksCleared instead of a
        BlockRemoved per chunk."""
        with self._lock:
            self._observed.clear()
        self._where.clear()
        self._payloads.clear()
        if self.enabled:
            from vllm.distributed.kv_events import AllBlocksCleared

            self._events.append(AllBlocksCleared())

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    # ------------------------------------------------------------------ drain
    def apply_observed(self) -> None:
        """Apply what tier threads observed (scheduler thread)."""
        with self._lock:
            observed, self._observed = self._observed, []
        for tier, event, keys in observed:
            for key in keys:
                (self.stored if event == STORED else self.removed)(tier, key)

    def take(self) -> list:
        self.apply_observed()
        out, self._events = self._events, []
        return out

    def take_counts(self) -> dict[str, int]:
        self.apply_observed()
        out, self.counts = self.counts, {}
        return out


__all__ = ["KVEvents", "EventGroup", "event_groups", "CPU_PLACE", "STORED", "REMOVED"]
