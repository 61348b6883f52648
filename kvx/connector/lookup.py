"""The lookup's hit filters: the policies that narrow a request's hit before it is reported. Scheduler thread
only (no locking): every filter is made, called and read there.

``get_num_new_matched_tokens`` (:class:`~.scheduler.KVXScheduler`) finds where each chunk of the prompt is and
builds a :class:`Lookup`: the hit so far is the leading run of chunks some tier holds. Each filter of
:func:`hit_filters`, in order, then narrows ``Lookup.tiers`` (or adds to the hit: ``state``, ``extra``) and returns
True, or returns False to put the lookup off (vLLM skips the request this step and asks again):

1. :class:`DeclineSlow` (``decline_slow_hits``): stop before a tier slower than recomputing its chunks;
2. :class:`RoundToState` (a hybrid model): end where a state object is stored;
3. :class:`WaitForProducer`: a P/D consumer waits while its producer's chunks are still landing (its state per
   request is the tracker's :class:`~.tracker.PDWait`; per step, :attr:`WaitForProducer.waiting`, which the
   scheduler's ``build_connector_meta`` takes);
4. :class:`AddPartial` (``save_partial_chunks``): a hit of every full chunk goes on with the stored partial chunk.

The scheduler then reports the hit (a :class:`~.tracker.LoadPlan`). The filters count what they do in the
scheduler's counters (``stats``: one Counter, shared, emptied by ``take_stats`` and never replaced).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..keys import state_key
from ..log import get_logger
from .config import KVXConfig
from .costs import HitCosts
from .tracker import RequestTracker, StateRef

log = get_logger(__name__)


@dataclass(frozen=True)
class Partial:
    """A request's trailing partial chunk: its key, its tokens, and the tier holding it (None: none)."""

    key: str
    tokens: int
    tier: str | None


@dataclass
class Lookup:
    """One lookup of a request's prefix, as the hit filters narrow it (scheduler thread, one call)."""

    t: RequestTracker
    num_computed: int  # vLLM's own prefix hit
    keys: list[str]  # the full chunks looked up
    tiers: list[str]  # the hit: per leading chunk, the fastest tier holding it
    stored: list[str | None] = field(default_factory=list)  # hybrid models: per chunk, the tier of its state object
    partial: Partial | None = None  # the trailing partial chunk
    extra: Partial | None = None  # the partial chunk, added to the hit (a tier holds it)
    state: StateRef | None = None  # hybrid models: the hit's last state object
    coming: frozenset[str] = frozenset()  # keys found in "cpu" still on their way into it (SlotIndex.coming)


class DeclineSlow:
    """``decline_slow_hits``: stop the hit before a tier slower than recomputing its chunks (:class:`HitCosts`)."""

    def __init__(self, costs: HitCosts, chunk_size: int, chunk_bytes: int, stats: Counter):
        self.costs, self.chunk_size, self.chunk_bytes, self.stats = costs, chunk_size, chunk_bytes, stats

    def __call__(self, lk: Lookup) -> bool:
        if lk.tiers:
            n = self.costs.servable(lk.tiers, lk.num_computed // self.chunk_size, self.chunk_size, self.chunk_bytes)
            if n < len(lk.tiers):
                self.stats["hits_declined_slow"] += 1
                del lk.tiers[n:]
        return True


class RoundToState:
    """A hybrid model's hit ends where a state object is stored: the longest prefix of chunks, rounded down to
    one whose state is."""

    def __init__(self, stats: Counter):
        self.stats = stats

    def __call__(self, lk: Lookup) -> bool:
        n = next((j for j in range(len(lk.tiers), 0, -1) if lk.stored[j - 1] is not None), 0)
        if n < len(lk.tiers):
            self.stats["hits_rounded_to_state"] += 1
        del lk.tiers[n:]
        lk.state = StateRef(state_key(lk.keys[n - 1]), lk.stored[n - 1]) if n else None
        return True


class WaitForProducer:
    """A P/D consumer's request: put the lookup off while its producer's chunks are still landing.
    :attr:`waiting`: a lookup waited since the scheduler last took it (:meth:`take_waiting`)."""

    def __init__(self, config: KVXConfig, stats: Counter):
        self.config, self.stats = config, stats
        self.waiting = False

    def __call__(self, lk: Lookup) -> bool:
        if lk.t.controls.pd and self.wait(lk.t, lk.keys, len(lk.tiers)):
            self.waiting = True
            return False
        return True

    def take_waiting(self) -> bool:
        """Whether a lookup waited since the last call (once per step: the step's metadata tells the workers)."""
        waiting, self.waiting = self.waiting, False
        return waiting

    def wait(self, t: RequestTracker, keys: list[str], hits: int) -> bool:
        """A consumer's request whose producer announced chunks (``kvx_pd_chunks``, ``kvx_pd_key``): True while
        some of them are not in a tier yet and ``pd_wait_ms`` has not passed since the first lookup (the
        producer's writes may still be landing); then it goes on with what is there."""
        n, pd = t.controls.pd_chunks, t.pd_wait
        if n == 0 or hits >= n or pd.settled:
            return False
        if n > len(keys) or keys[n - 1] != t.controls.pd_key:
            # another prompt, model or engine namespace: those chunks can never be ours
            log.warning(
                "kvx: request %s: its producer's chunks (%d, last %s) are not this prompt's chunks in this "
                "engine's namespace; not waiting for them",
                t.req_id,
                n,
                t.controls.pd_key,
            )
            self.stats["pd_mismatches"] += 1
            pd.settled = True
            return False
        now = time.monotonic()
        if pd.since is None:
            pd.since = now
            self.stats["pd_waits"] += 1
        if (now - pd.since) * 1e3 < self.config.pd_wait_ms:
            return True
        log.warning(
            "kvx: request %s: %d of the %d chunks its producer announced arrived within pd_wait_ms=%d; "
            "computing the rest",
            t.req_id,
            hits,
            n,
            self.config.pd_wait_ms,
        )
        self.stats["pd_timeouts"] += 1
        pd.settled = True
        return False


class AddPartial:
    """``save_partial_chunks``: a hit of every full chunk goes on with the trailing partial chunk, if stored."""

    def __call__(self, lk: Lookup) -> bool:
        if lk.partial is not None and len(lk.tiers) == len(lk.keys) and lk.partial.tier is not None:
            lk.extra = lk.partial
        return True


def hit_filters(
    config: KVXConfig,
    costs: HitCosts | None,
    chunk_bytes: int,
    state_groups: bool,
    producer_wait: WaitForProducer,
    stats: Counter,
) -> tuple:
    """The lookup's filters, in the order they run (see the module docstring)."""
    return tuple(
        ([DeclineSlow(costs, config.chunk_size, chunk_bytes, stats)] if costs is not None else [])
        + ([RoundToState(stats)] if state_groups else [])
        + [producer_wait]
        + ([AddPartial()] if config.save_partial_chunks and not state_groups else [])
    )
