"""The slot tiers' one allocator (:mod:`kvx.store.alloc`), driven directly: the rules both tiers rely on."""

from __future__ import annotations

import random

import pytest

from kvx.store.alloc import Allocator, Chunk


class Owner:
    """An index as the tiers keep one: key -> chunk, taken out when the allocator evicts."""

    def __init__(self, n: int, quarantine_s: float = 0.0):
        self.chunks: dict[str, Chunk] = {}
        self.evicted: list[str] = []
        self.freed: list[int] = []
        self.a = Allocator(n, self._evicted, lambda c: self.freed.append(c.slot), quarantine_s)

    def _evicted(self, c: Chunk) -> None:
        del self.chunks[c.key]
        self.evicted.append(c.key)

    def put(self, key: str, units: int = 1, ready: bool = True) -> Chunk | None:
        c = Chunk(key)
        if not self.a.reserve(c, units):
            return None
        self.chunks[key] = c
        if ready:
            self.a.ready(c)
        return c


def covered(a: Allocator) -> list[int]:
    held = [u for first, c in a.at.items() for u in range(first, first + c.units)]
    free = [u for first, k in a.runs._order.items() for u in range(first, first + (1 << k))]
    quarantined = [u for _, first, n in a.quarantine for u in range(first, first + n)]
    return sorted([*held, *free, *quarantined])


def test_the_lru_chunk_goes_first_and_a_pinned_or_pending_one_never():
    o = Owner(3)
    a, b = o.put("a"), o.put("b")
    o.put("p", ready=False)  # PENDING: never in the LRU
    o.a.pin(a)
    o.a.touch(b)
    assert o.put("c", ready=False) is not None and o.evicted == ["b"]  # a pinned, p pending: b goes, used last
    assert o.put("d") is None and o.evicted == ["b"]  # nothing evictable: no room, nothing evicted
    o.a.unpin(a)
    assert o.put("d") is not None and o.evicted == ["b", "a"]


def test_a_chunk_dropped_while_pinned_keeps_its_slot_until_the_last_unpin():
    o = Owner(1)
    c = o.put("a")
    gen = o.a.generation[c.slot]
    o.a.pin(c)
    o.a.pin(c)
    del o.chunks["a"]
    o.a.drop(c)
    assert c.doomed and o.put("b") is None  # its slot is still read
    assert not o.a.unpin(c) and o.freed == []
    assert o.a.unpin(c) and o.freed == [c.slot]
    assert o.a.generation[c.slot] == gen + 1  # a reader that kept the old generation sees it changed
    assert o.put("b").slot == c.slot


def test_an_exempt_chunk_is_never_evicted_and_comes_back_most_recent():
    o = Owner(2)
    a = o.put("a")
    o.put("b")
    o.a.exempt(a)
    assert o.put("c") is not None and o.evicted == ["b"]
    o.a.exempt(a, False)  # the most recently used now: c goes before it
    assert o.put("d") is not None and o.evicted == ["b", "c"]


def test_a_quarantined_run_is_reused_only_when_its_time_is_over(monkeypatch):
    now = [10.0]
    monkeypatch.setattr("kvx.store.alloc.time.monotonic", lambda: now[0])
    o = Owner(1, quarantine_s=5.0)
    c = o.put("a", ready=False)
    del o.chunks["a"]
    o.a.drop(c, quarantine=True)
    assert o.freed == [c.slot] and o.put("b") is None
    now[0] += 5.0
    assert o.put("b").slot == c.slot


def test_a_longer_run_evicts_the_block_it_needs_and_not_a_chunk_more():
    o = Owner(8)
    small = [o.put(f"s{i}") for i in range(8)]
    o.a.pin(small[1])  # block [0, 4) cannot be freed: its LRU chunk s0 is passed over
    big = o.put("big", units=4)
    assert big is not None and big.slot == 4 and o.evicted == ["s4", "s5", "s6", "s7"]
    assert covered(o.a) == list(range(8))


@pytest.mark.parametrize("seed", range(4))
def test_random_churn_keeps_every_slot_held_free_or_quarantined_once(seed):
    rng = random.Random(seed)
    o = Owner(64)
    pinned: list[Chunk] = []
    for i in range(3000):
        r = rng.random()
        if r < 0.6:
            o.put(f"k{i}", units=rng.choice((1, 1, 2, 3, 5, 8)), ready=rng.random() < 0.9)
        elif r < 0.75 and o.chunks:
            c = o.chunks[rng.choice(list(o.chunks))]
            o.a.pin(c)
            pinned.append(c)
        elif r < 0.9 and pinned:
            o.a.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif o.chunks:
            c = o.chunks.pop(rng.choice(list(o.chunks)))
            o.a.drop(c)
        assert covered(o.a) == list(range(64))
        live = set(o.chunks.values())
        assert set(o.a.lru) <= live
        assert all(c in live or (c.doomed and c.pins) for c in o.a.at.values())  # a doomed run waits for its pins
