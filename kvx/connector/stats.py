"""Connector metrics: counters summed over workers and steps, reported through vLLM's stats path.

Keys (all counters): ``loaded_chunks``, ``loaded_blocks``, ``load_ms``, ``load_errors``, ``saved_chunks``,
``save_ms``, ``save_errors``, ``saves_dropped`` and per tier ``<tier>_reads``, ``<tier>_writes``,
``<tier>_write_ms``, ``<tier>_write_errors``, ``<tier>_full`` (workers); ``lookups``, ``lookups_pending``,
``loads``, ``saves``, ``hit_tokens_cpu``, ``hit_tokens_<tier>``, ``cpu_store_failed``, ``saves_deferred``,
``saves_poisoned`` (scheduler). ``<tier>``: every registered tier type (``disk``, ``redis``, ...).
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


# Counter name -> help text; every key KVXStats may carry, exported as vllm:kvx_<name>_total.
COUNTERS = {
    "lookups": "Prefix lookups by the scheduler",
    "lookups_pending": "Prefix lookups answered 'not known yet' (a tier was still asking; vLLM asks again)",
    "loads": "Requests admitted with a kvx hit",
    "saves": "Chunk saves planned by the scheduler",
    "hit_tokens_cpu": "Prompt tokens served from the CPU tier",
    "cpu_store_failed": "Chunks whose CPU-tier write failed on a worker",
    "saves_deferred": "Chunk saves held back because their KV depends on a failed load (saved after recompute)",
    "saves_poisoned": "In-flight chunk saves discarded because a load they depend on failed",
    "saves_dropped": "Chunk saves a worker dropped because a load they depend on failed there",
    "loaded_chunks": "Chunks loaded into the paged KV cache",
    "loaded_blocks": "vLLM blocks filled from kvx",
    "load_ms": "Milliseconds spent loading (per worker, summed)",
    "load_errors": "Chunks that failed to load or verify (recomputed by vLLM)",
    "saved_chunks": "Chunks gathered from the paged KV cache",
    "save_ms": "Milliseconds spent gathering chunks (per worker, summed)",
    "save_errors": "Chunk gathers that failed",
}
_PER_TIER = {
    "hit_tokens_{}": "Prompt tokens served from the {} tier",
    "{}_reads": "Chunks read from the {} tier",
    "{}_writes": "Chunks written to the {} tier",
    "{}_write_ms": "Milliseconds spent writing chunks to the {} tier",
    "{}_write_errors": "Chunk writes to the {} tier that failed",
    "{}_full": "Chunk writes refused by the {} tier for lack of room (full, out of memory, or over size)",
}


def counters() -> dict[str, str]:
    """:data:`COUNTERS` and the per-tier counters of every registered tier type."""
    from ..store import tier_types

    out = dict(COUNTERS)
    for tier in tier_types():
        out.update((name.format(tier), doc.format(tier)) for name, doc in _PER_TIER.items())
    return out


def build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues):
    """Prometheus counters for :class:`KVXStats` (vLLM calls this through the connector class)."""
    from prometheus_client import Counter
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class KVXPromMetrics(KVConnectorPromMetrics):
        def __init__(self):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter_cls = metric_types[Counter]
            self._counters = {
                name: create_metric_per_engine(
                    counter_cls(name=f"vllm:kvx_{name}_total", documentation=doc, labelnames=labelnames),
                    per_engine_labelvalues)
                for name, doc in counters().items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            for name, value in (transfer_stats_data or {}).items():
                per_engine = self._counters.get(name)
                if per_engine is not None and engine_idx in per_engine and value:
                    per_engine[engine_idx].inc(value)

    return KVXPromMetrics()
