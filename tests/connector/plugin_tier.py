"""A third-party tier for the tests: the disk tier behind lookups that take a few scheduler steps to
answer, as a remote store's do. Loaded by import path (``"type": "tests.connector.plugin_tier:SlowLookupDiskTier"``),
never registered by kvx."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from pydantic import Field

from kvx.store import DiskTier, TierConfig, TierContext


class SlowLookupDiskTierConfig(TierConfig):
    type: Literal["slow-lookup-disk"]
    path: str
    pending: int = Field(default=3, ge=0, description="answer None this many times per distinct lookup")


class SlowLookupDiskTier(DiskTier):
    type = "slow-lookup-disk"
    config_model = SlowLookupDiskTierConfig
    hit_source = "external_unspecified"
    local_lookup = False

    @classmethod
    def open(cls, config: SlowLookupDiskTierConfig, ctx: TierContext) -> SlowLookupDiskTier:
        tier = cls.at(config.path, None, ctx.fingerprint)
        tier.pending = config.pending
        tier.asked = Counter()
        return tier

    def contains_many(self, keys):
        t = tuple(keys)
        self.asked[t] += 1
        if self.asked[t] <= self.pending:
            return None
        return super().contains_many(keys)
