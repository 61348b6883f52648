"""Which KV blocks kvx can vouch for: the one rule that keeps a failed load from poisoning the store.

**Rule.** A chunk is stored only if every block its KV depends on holds verified KV: loaded
successfully, or computed by a forward in which nothing it attends to was unverified. The KV of a token
depends on every block before it in its request's block table (attention reads the whole prefix; under
tensor parallelism every rank's KV also depends on every rank's loads, through the all-reduce), so a
chunk's *dependencies* are the blocks of its request's table up to the chunk's end.

A block is

- *pending* from the step kvx schedules a load into it until every worker has reported that load,
- *invalid* once a worker reported the load failed, until a forward recomputes the block from its first
  token (vLLM rolls the request back to its first failed block and recomputes from there),
- verified otherwise.

The scheduler (:class:`BlockValidity`, scheduler thread only) attaches to each planned save the pending
or invalid blocks among its dependencies (``ChunkSave.deps``; empty, at no cost, whenever no load is in
flight). Then:

- each worker (:class:`LoadOutcomes`) drops, before gathering anything, a save with a dependency whose
  load failed *on that worker*. With one worker that is the whole truth, known in the step itself, so a
  chunk computed against a failed load never reaches any tier;
- the scheduler hears every worker's failed blocks (``KVXWorkerMetadata.failed_blocks``).
  :meth:`BlockValidity.failed` names the in-flight saves this *poisons* (their CPU slots are aborted,
  never committed) and where each affected request's save cursor must rewind to, so that the chunks
  vLLM recomputes are saved again. With several workers one rank cannot know another's failure in
  time, so the scheduler sends saves with dependencies to the CPU tier only, and writes them through
  to disk once committed.

Every load failure, whatever the tier (a corrupt or vanished file today, a remote timeout tomorrow),
reaches this rule the same way: the worker reports the chunk's blocks as failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Guard:
    """An in-flight save that depends on unverified blocks (scheduler side)."""

    req_id: str
    key: str
    deps: dict[int, int]  # unverified block -> index of the request's chunk holding it


@dataclass
class Verdict:
    """What a batch of load failures means for kvx's bookkeeping."""

    poisoned: set[str] = field(default_factory=set)  # keys of in-flight saves that must not be kept
    rewind: dict[str, int] = field(default_factory=dict)  # request -> first chunk to save again

    def _rewind(self, req_id: str, chunk: int) -> None:
        self.rewind[req_id] = min(chunk, self.rewind.get(req_id, chunk))


class BlockValidity:
    """Scheduler-side record of pending and invalid blocks and of the saves that depend on them."""

    def __init__(self, blocks_per_chunk: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self._pending: dict[int, str] = {}  # block -> request whose load writes it
        self._invalid: set[int] = set()
        self._loads: dict[str, dict[int, int]] = {}  # request -> {block its load writes: chunk index}
        self._guards: list[Guard] = []

    def __bool__(self) -> bool:
        """True while anything is unverified (only then do saves need their dependencies)."""
        return bool(self._pending or self._invalid)

    # ---------------------------------------------------------------- block states
    def loading(self, req_id: str, blocks: Mapping[int, int]) -> None:
        """A load of ``req_id`` into ``blocks`` ({block: chunk index}) was scheduled."""
        for b in blocks:
            self._pending[b] = req_id
            self._invalid.discard(b)
        self._loads.setdefault(req_id, {}).update(blocks)

    def load_done(self, req_id: str) -> None:
        """Every worker reported the load of ``req_id``: its blocks not reported failed are verified."""
        for b in self._loads.pop(req_id, ()):
            if self._pending.get(b) == req_id:
                del self._pending[b]

    def computed(self, blocks: Iterable[int]) -> None:
        """This step's forward writes ``blocks`` from their first token: what was loaded there is gone."""
        for b in blocks:
            self._pending.pop(b, None)
            self._invalid.discard(b)

    def failed(self, blocks: Iterable[int]) -> Verdict:
        """Workers reported these blocks' loads failed."""
        hit = {b for b in blocks if self._pending.pop(b, None) is not None}
        self._invalid |= hit
        v = Verdict()
        if not hit:
            return v
        for req_id, loaded in self._loads.items():  # the loading requests recompute from there
            for b in hit.intersection(loaded):
                v._rewind(req_id, loaded[b])
        keep = []
        for g in self._guards:
            bad = hit.intersection(g.deps)
            if bad:
                v.poisoned.add(g.key)
                v._rewind(g.req_id, min(g.deps[b] for b in bad))
            else:
                keep.append(g)
        self._guards = keep
        return v

    def unverified(self, table: Sequence[int], end_block: int) -> dict[int, int]:
        """{block: chunk index} of the pending or invalid blocks among ``table[:end_block]``."""
        if not self:
            return {}
        return {
            b: i // self.blocks_per_chunk
            for i, b in enumerate(table[:end_block])
            if b in self._pending or b in self._invalid
        }

    def known_bad(self, deps: Iterable[int]) -> bool:
        """True if one of ``deps`` is known to hold KV of a failed load (do not plan the save yet)."""
        return not self._invalid.isdisjoint(deps)

    # ---------------------------------------------------------------- saves
    def guard(self, req_id: str, key: str, deps: dict[int, int]) -> None:
        """Watch an in-flight save of ``key`` with these unverified dependencies."""
        self._guards.append(Guard(req_id, key, deps))

    def drop_verified_guards(self) -> None:
        """Forget the guards whose dependencies are all verified. A dependency's outcome is reported no
        later than the save's own completion (a load finishes within its step, a save in it or later),
        so every save is judged before it can be committed."""
        self._guards = [g for g in self._guards if not self._pending.keys().isdisjoint(g.deps)]

    def num_guards(self) -> int:
        return len(self._guards)


class LoadOutcomes:
    """Worker-side record of the blocks whose latest load failed on this worker (worker thread only)."""

    def __init__(self) -> None:
        self._failed: set[int] = set()

    def started(self, blocks: Iterable[int]) -> None:
        """A new load writes ``blocks``: an earlier failure there no longer says anything."""
        self._failed.difference_update(blocks)

    def failed(self, blocks: Iterable[int]) -> None:
        self._failed.update(blocks)

    def taints(self, deps: Iterable[int]) -> bool:
        """True if a save with these dependencies would store KV computed against a failed load."""
        return not self._failed.isdisjoint(deps)
