"""Connector metrics: counters summed over workers and steps, reported through vLLM's stats path.

Keys (all counters): ``loaded_chunks``, ``loaded_blocks``, ``load_ms``, ``load_errors``, ``disk_reads``,
``saved_chunks``, ``save_ms``, ``save_errors``, ``disk_writes``, ``disk_write_ms``, ``disk_write_errors``
(workers); ``lookups``, ``loads``, ``saves``, ``hit_tokens_cpu``, ``hit_tokens_disk``,
``cpu_store_failed`` (scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVXStats(KVConnectorStats):
    """``data`` maps counter name -> number; aggregation sums."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and not other.is_empty():
            for k, v in other.data.items():
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items())}
        if self.data.get("loaded_chunks"):
            out["avg_load_ms_per_chunk"] = round(self.data.get("load_ms", 0.0) / self.data["loaded_chunks"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def from_counts(cls, counts: dict[str, Any]) -> KVXStats | None:
        counts = {k: v for k, v in counts.items() if v}
        return cls(data=counts) if counts else None
