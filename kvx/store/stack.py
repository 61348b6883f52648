"""The scheduler's view of the tiers after the CPU pool: read-first-hit, write-to-all and promotion.

The CPU pool's index stays with the scheduler (:class:`kvx.store.CPUIndex`); this stack holds the byte
tiers in config order (fastest first) and answers, for the connector's scheduler:

- :meth:`TierStack.locate`: which tier serves each chunk: the fastest one holding its record (written once
  every part of the chunk is stored: :mod:`kvx.connector.parts`);
- :meth:`TierStack.lacking`: which tiers a chunk is written to (write-to-all: every tier not known to
  hold it);
- :meth:`TierStack.faster`: which tiers a hit from a slower tier is promoted into.

Queries only: the writes in flight are the connector's :class:`kvx.connector.ledger.ChunkLedger`'s. Scheduler
thread only (no locking).
"""

from __future__ import annotations

from collections.abc import Sequence

from .tier import Tier


class TierStack:
    def __init__(self, tiers: Sequence[Tier]):
        names = [t.type for t in tiers]  # a tier is named by its type: one tier per type
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: expected at most one tier of each type, got {names}")
        self.tiers = list(tiers)
        self.by_name = {t.type: t for t in self.tiers}

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def names(self) -> list[str]:
        return list(self.by_name)

    # ---------------------------------------------------------------- reads
    def locate(self, keys: Sequence[str]) -> list[str | None] | None:
        """Per key, the name of the fastest tier holding it (None: no tier does).

        None: a tier does not know yet without blocking on the network; ask again later."""
        found: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            answers = tier.contains_many([keys[i] for i in todo])
            if answers is None:
                return None
            for i, held in zip(todo, answers):
                if held:
                    found[i] = tier.type
            todo = [i for i, held in zip(todo, answers) if not held]
        return found

    # ---------------------------------------------------------------- writes
    def lacking(self, key: str, among: Sequence[str] | None = None) -> list[str]:
        """The tiers (of ``among``; default all) to write chunk ``key`` to: those not holding it. Only a tier
        whose lookups are local (``Tier.local_lookup``: a stat of a file) is asked here; the others are not
        asked on the scheduler's path (a network round trip per chunk): their puts check for the key before
        sending the bytes, and never overwrite."""
        out = []
        for name in self.names() if among is None else among:
            tier = self.by_name[name]
            if tier.local_lookup and tier.contains_many([key]) == [True]:
                continue
            out.append(name)
        return out

    def faster(self, name: str) -> list[str]:
        """The byte tiers before ``name`` (a hit from ``name`` is promoted into them)."""
        names = self.names()
        return names[: names.index(name)] if name in names else []

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
