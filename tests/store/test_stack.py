"""The tier stack's queries on real tiers: a disk tier (local lookups) in front of a tier whose lookups are remote
(the disk tier behind lookups that take a few calls to answer, as a network store's do)."""

from __future__ import annotations

import pytest
import torch

from kvx.store import DiskTier, TierContext
from kvx.store.stack import TierStack

CHUNKS = [f"{i:032x}" for i in range(1, 6)]


@pytest.fixture
def tiers(tmp_path):
    from tests.connector.plugin_tier import SlowLookupDiskTier, SlowLookupDiskTierConfig

    fast = DiskTier.at(tmp_path / "fast", None, "tests-stack")
    config = SlowLookupDiskTierConfig(type="slow-lookup-disk", path=str(tmp_path / "slow"), pending=1)
    slow = SlowLookupDiskTier.open(config, TierContext("tests-stack", role="scheduler", writes=True, io_threads=1))
    yield fast, slow
    fast.close()
    slow.close()


def put(tier, key: str) -> None:
    tier.put(key, torch.full((8,), 1, dtype=torch.uint8))


def test_locate_answers_the_fastest_tier_holding_the_chunk(tiers):
    fast, slow = tiers
    stack = TierStack([fast, slow])
    put(fast, CHUNKS[0])
    put(slow, CHUNKS[0])
    put(slow, CHUNKS[1])
    put(slow, CHUNKS[2])
    assert stack.locate(CHUNKS[:4]) is None  # the remote tier is still looking: ask again later
    assert stack.locate(CHUNKS[:4]) == [fast.type, slow.type, slow.type, None]


def test_lacking_asks_local_tiers_only_and_faster_names_the_tiers_in_front(tiers):
    fast, slow = tiers
    stack = TierStack([fast, slow])
    put(fast, CHUNKS[0])
    put(slow, CHUNKS[0])
    asked = sum(slow.asked.values())
    # the disk tier is asked (a stat per file) and holds it; the remote one is not asked on this path
    assert stack.lacking(CHUNKS[0]) == [slow.type]
    assert stack.lacking(CHUNKS[1]) == [fast.type, slow.type]
    assert stack.lacking(CHUNKS[1], among=[slow.type]) == [slow.type]
    assert stack.faster(slow.type) == [fast.type] and stack.faster(fast.type) == []
    assert stack.faster("not-a-tier") == [] and stack.names() == [fast.type, slow.type]
    assert sum(slow.asked.values()) == asked


def test_one_tier_per_type(tiers):
    fast, _ = tiers
    with pytest.raises(ValueError, match=r"tiers: expected at most one tier of each type, got \['disk', 'disk'\]"):
        TierStack([fast, fast])
    assert not TierStack([])
