"""Connector metrics, reported through vLLM's stats path (its log line and its Prometheus endpoint).

- Counters (:data:`COUNTERS` and, per tier, :data:`_PER_TIER`), summed over workers and steps; exported as
  ``vllm:kvx_<name>_total``. ``<tier>``: ``cpu`` and every registered tier type (``disk``, ``redis``, ...).
- Latency samples (:data:`HISTOGRAMS`, seconds): lists, concatenated over workers; exported as Prometheus
  histograms ``vllm:kvx_<name>``.
- Gauges (:data:`GAUGES`): the scheduler's current value, sent when it changes; ``vllm:kvx_<name>``.
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
                if k in GAUGES:
                    self.data[k] = v  # the latest value
                elif isinstance(v, list):
                    self.data[k] = list(self.data.get(k, [])) + v  # latency samples
                else:
                    self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, list):  # samples: their count and mean in the log line
                if v:
                    out[f"{k}_count"], out[f"{k}_avg_ms"] = len(v), round(sum(v) / len(v) * 1e3, 3)
            else:
                out[k] = round(v, 3) if isinstance(v, float) else v
        if self.data.get("loaded_chunks"):
            out["avg_load_ms_per_chunk"] = round(self.data.get("load_ms", 0.0) / self.data["loaded_chunks"], 3)
        return out

    def is_empty(self) -> bool:
        return not self.data

    @classmethod
    def from_counts(cls, counts: dict[str, Any]) -> KVXStats | None:
        counts = {k: v for k, v in counts.items() if v or k in GAUGES}
        return cls(data=counts) if counts else None


# Counter name -> help text; every key KVXStats may carry, exported as vllm:kvx_<name>_total.
COUNTERS = {
    "lookups": "Prefix lookups by the scheduler",
    "lookups_pending": "Prefix lookups answered 'not known yet' (a tier was still asking; vLLM asks again)",
    "lookups_pulling": "Prefix lookups put off while the node pulled their chunks from a peer node",
    "lookups_coming": "Prefix lookups that found chunks a pull from a peer node was still bringing into the node",
    "hits_coming": "Hits reported with chunks still coming from a peer node (loaded as they arrive, asynchronously)",
    "coming_chunks": "Chunks a worker loaded as they came into the node from a peer (a pull; per worker, summed)",
    "pushes_refused": "P/D producer requests whose chunks could not be pushed to the consumer's node (kvx_push_to)",
    "loads": "Requests admitted with a kvx hit",
    "saves": "Chunk saves planned by the scheduler",
    "hit_tokens_cpu": "Prompt tokens served from the CPU tier",
    "miss_tokens": "Prompt tokens past vLLM's own prefix hit that kvx could not serve (computed)",
    "cpu_stored": "Chunks committed to the CPU tier",
    "cpu_evictions": "Chunks removed from the CPU tier (evicted for room, or reset)",
    "cpu_read_bytes": "Bytes loaded from the CPU tier into the KV cache (per worker, summed)",
    "cpu_write_bytes": "Bytes saved into the CPU tier (per worker, summed)",
    "bad_request_params": "Requests whose kvx_* kv_transfer_params were invalid (kvx skipped them)",
    "pd_waits": "Consumer requests that waited for chunks their producer announced",
    "pd_timeouts": "Consumer requests that stopped waiting after pd_wait_ms (computed the rest)",
    "pd_mismatches": "Consumer requests whose announced chunks were not their prompt's in this namespace",
    "cpu_store_failed": "Chunks whose CPU-tier write failed on a worker",
    "cpu_slots_busy": "Chunk saves that found every CPU slot being written or read (stored in the byte tiers alone)",
    "saves_incomplete": "Chunk saves not made because a sliding-window group had already released one of the "
    "chunk's blocks (the chunk could not serve every group)",
    "saves_deferred": "Chunk saves held back because their KV depends on a failed load (saved after recompute)",
    "saves_poisoned": "In-flight chunk saves discarded because a load they depend on failed",
    "saves_dropped": "Chunk saves a worker dropped because a load they depend on failed there",
    "saves_replanned": "Chunks planned again because the CPU-tier write a request counted on was aborted",
    "loaded_chunks": "Chunks loaded into the paged KV cache",
    "loaded_blocks": "vLLM blocks filled from kvx",
    "load_ms": "Milliseconds spent loading (per worker, summed)",
    "load_errors": "Chunks that failed to load or verify (recomputed by vLLM)",
    "saved_chunks": "Chunks gathered from the paged KV cache",
    "save_ms": "Milliseconds spent gathering chunks (per worker, summed)",
    "save_errors": "Chunk gathers that failed",
    "hits_declined_slow": "Lookups whose hit stopped before a tier slower than recomputing the tokens (measured)",
    "saves_dropped_backpressure": "Chunk writes to a byte tier not made because its write backlog "
    "(max_write_backlog) was full",
    "saves_skipped_admission": "Chunk saves skipped because fewer than admit_after requests had covered the chunk",
    "state_saves": "Hybrid models: recurrent-state objects planned for saving (the state at a chunk's end)",
    "hits_rounded_to_state": "Hybrid models: lookups whose hit was rounded down to the last chunk with a stored state",
}
_PER_TIER = {
    "hit_tokens_{}": "Prompt tokens served from the {} tier",
    "{}_reads": "Chunks read from the {} tier",
    "{}_writes": "Chunks written to the {} tier",
    "{}_write_ms": "Milliseconds spent writing chunks to the {} tier",
    "{}_write_errors": "Chunk writes to the {} tier that failed",
    "{}_full": "Chunk writes refused by the {} tier for lack of room (full, out of memory, or over size)",
    "{}_read_bytes": "Bytes read from the {} tier (per worker, summed)",
    "{}_write_bytes": "Bytes written to the {} tier (per worker, summed)",
    "{}_stored": "Chunks newly stored in the {} tier (every worker's share written)",
    "{}_dropped_backpressure": "Chunk writes to the {} tier not made because its write backlog was full",
    "{}_evictions": "Chunk removals from the {} tier seen by this engine (evicted for room, or dropped as corrupt)",
}
HISTOGRAMS = {
    "load_seconds": "Time to load one request's chunks into the KV cache, from its first read to its last copy "
    "(per worker)",
    "save_seconds": "Time to save one chunk, from the gather being queued to its last tier write (per worker)",
}
GAUGES = {"pending_writes": "Chunk writes in flight (CPU slots being filled and tier writes not yet reported)"}
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def counters() -> dict[str, str]:
    """:data:`COUNTERS` and the per-tier counters of every registered tier type."""
    from ..store import tier_types

    out = dict(COUNTERS)
    for tier in tier_types():
        out.update((name.format(tier), doc.format(tier)) for name, doc in _PER_TIER.items())
    return out


def build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues):
    """Prometheus counters for :class:`KVXStats` (vLLM calls this through the connector class)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class KVXPromMetrics(KVConnectorPromMetrics):
        def __init__(self):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

            def per_engine(cls, name, doc, **kw):
                return create_metric_per_engine(
                    cls(name=name, documentation=doc, labelnames=labelnames, **kw), per_engine_labelvalues
                )

            self._counters = {
                name: per_engine(self._counter_cls, f"vllm:kvx_{name}_total", doc) for name, doc in counters().items()
            }
            self._histograms = {
                name: per_engine(self._histogram_cls, f"vllm:kvx_{name}", doc, buckets=_BUCKETS)
                for name, doc in HISTOGRAMS.items()
            }
            self._gauges = {name: per_engine(self._gauge_cls, f"vllm:kvx_{name}", doc) for name, doc in GAUGES.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            for name, value in (transfer_stats_data or {}).items():
                if name in self._histograms:
                    metric = self._histograms[name].get(engine_idx)
                    for sample in value if metric is not None else ():
                        metric.observe(sample)
                elif name in self._gauges:
                    metric = self._gauges[name].get(engine_idx)
                    if metric is not None:
                        metric.set(value)
                else:
                    metric = self._counters.get(name, {}).get(engine_idx)
                    if metric is not None and value:
                        metric.inc(value)

    return KVXPromMetrics()
