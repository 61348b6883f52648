"""Whether a hit is worth loading: a tier slower than recomputing the tokens is not read.

A file-tier hit that takes longer than the prefill it saves makes a request slower than no cache at all (as
users of another KV-cache connector reported; benchmarks/bench_slow_tier.py puts kvx behind a slow link, results
in benchmarks/results/slow_tier_cpu.md). :class:`HitCosts` keeps two moving estimates, each an exponentially
weighted mean (weight :data:`ALPHA` per sample):

- per byte tier, the seconds a chunk read takes per byte, from the workers' read records
  (:attr:`~.metadata.KVXWorkerMetadata.reads`: tier, bytes, seconds per chunk read). Every read is a whole
  object of about one size, so the per-read latency is part of the rate, as it is part of every hit's cost;
- the engine's prefill throughput in tokens per second, from the steps that computed at least
  :data:`MIN_STEP_TOKENS` tokens: their scheduled tokens over the time from the step's metadata
  (``build_connector_meta``) to its results (``update_connector_output``).

A hit's chunks from a tier are expected to take ``bytes x rate / min(io_threads, chunks)`` (each worker reads
its share of the chunks on ``io_threads`` threads) against ``tokens / throughput`` to compute. If the load would
be slower, the hit stops before that tier's first chunk (:meth:`HitCosts.servable`): the request computes the
rest (the CPU tier, the fastest, is never declined). Until both estimates exist every hit is taken, and a tier
declined for :data:`PROBE_S` seconds without a read gets one hit again, so a tier that recovered is measured
anew. Scheduler thread only.
"""

from __future__ import annotations

import time

ALPHA = 0.2  # weight of a new sample in a moving estimate
MIN_STEP_TOKENS = 256  # steps shorter than this say little about prefill throughput
PROBE_S = 10.0  # a declined tier is read again after this long without a sample


class HitCosts:
    """The moving estimates of tier read rates and prefill throughput (see the module docstring). Owned by
    :class:`~.scheduler.KVXScheduler` (scheduler thread)."""

    def __init__(self, io_threads: int, clock=time.monotonic):
        self.io_threads = io_threads
        self.clock = clock
        self.rate: dict[str, float] = {}  # tier -> seconds per byte of a chunk read
        self.sampled: dict[str, float] = {}  # tier -> when its last read sample or probe was
        self.throughput: float | None = None  # prefill tokens per second
        self._step: tuple[float, int] | None = None  # (metadata time, scheduled tokens) of the step in flight

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else (1 - ALPHA) * old + ALPHA * new

    # ---------------------------------------------------------------- samples
    def read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds >= 0:
            self.rate[tier] = self._mean(self.rate.get(tier), seconds / nbytes)
            self.sampled[tier] = self.clock()

    def step_begin(self, tokens: int) -> None:
        self._step = (self.clock(), tokens) if tokens >= MIN_STEP_TOKENS else None

    def step_end(self) -> None:
        if self._step is None:
            return
        t0, tokens = self._step
        self._step = None
        dt = self.clock() - t0
        if dt > 0:
            self.throughput = self._mean(self.throughput, tokens / dt)

    # ---------------------------------------------------------------- decisions
    def load_seconds(self, tier: str, nbytes: int, chunks: int) -> float | None:
        """Expected seconds to read ``chunks`` chunks of ``nbytes`` bytes in all (per worker) from ``tier``."""
        rate = self.rate.get(tier)
        return None if rate is None else nbytes * rate / max(1, min(self.io_threads, chunks))

    def servable(self, tiers: list[str], first: int, chunk_tokens: int, chunk_bytes: int) -> int:
        """How many of a hit's chunks to load: ``tiers[i]`` serves chunk ``i``; chunks before ``first`` are vLLM's
        own hit (not loaded). The hit stops before the first chunk of a tier whose load would take longer than
        computing its chunks' tokens."""
        if self.throughput is None:
            return len(tiers)
        cut = len(tiers)
        now = self.clock()
        for tier in dict.fromkeys(tiers[first:]):
            if tier == "cpu":
                continue
            n = sum(t == tier for t in tiers[first:])
            load = self.load_seconds(tier, n * chunk_bytes, n)
            if load is None or load <= n * chunk_tokens / self.throughput:
                continue
            if now - self.sampled.get(tier, now) >= PROBE_S:
                self.sampled[tier] = now  # one probe per period: this hit is read and measured
                continue
            cut = min(cut, tiers.index(tier, first))
        return cut
