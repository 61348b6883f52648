"""Timing for the benchmarks: the one percentile and median every benchmark reports (:func:`percentile`,
:func:`median`), the wall-clock interleaved loop of the host benchmarks (:func:`time_interleaved`), a markdown
table (:func:`md_table`); for the copy benchmarks (:mod:`kvx.testing.bench`) clocks (CUDA events or the wall
clock), a GEMM load beside the copies, interleaved and queued device timing loops; and this machine's name.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

KiB, MiB = 1 << 10, 1 << 20
HOST = "cuda<->pinned"  # the ``where`` of a table row whose contiguous side is pinned host memory


# ---------------------------------------------------------------------------------------- statistics
def percentile(xs: Iterable[float], p: float, method: str = "linear") -> float:
    """The ``p``-th percentile (``p`` in 0..100) of ``xs``; NaN for no samples.

    ``method="linear"`` (the benchmarks' default): interpolated linearly between the two samples around position
    ``(n - 1) * p / 100`` of the sorted samples: numpy's default, and for a whole ``p`` in 1..99 exactly
    ``statistics.quantiles(xs, n=100, method="inclusive")[p - 1]`` (same arithmetic, same floats). One sample: itself.

    ``method="rank"``: no interpolation: the sorted sample at index ``floor(n * p / 100)`` (the last one past it),
    i.e. the first sample with more than ``p`` % of the samples at or below it (``p=50`` of an even count: the upper
    of the middle two). The node benchmarks' lookups' p50/p90/p99 (``bench_node``, ``bench_cluster_scale``).
    """
    s = sorted(xs)
    n = len(s)
    if not n:
        return math.nan
    if method == "rank":
        return s[min(n - 1, int(p * n // 100))]
    if method != "linear":
        raise ValueError(f"percentile: method is 'linear' or 'rank', got {method!r}")
    m = n - 1
    j = int(p * m // 100)
    if p <= 0 or j >= m:
        return s[0] if p <= 0 else s[m]
    delta = p * m - j * 100
    return (s[j] * (100 - delta) + s[j + 1] * delta) / 100


def median(xs: Iterable[float | None], default: float | None = math.nan) -> float | None:
    """``statistics.median`` of the samples that are not None; ``default`` when there are none."""
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else default


def time_interleaved(
    fns: dict[str, Callable[[int], None]],
    repeats: int,
    warmup: int = 0,
    after: Callable[[str, int], None] | None = None,
    order: str = "shuffle",
    seed: int = 0,
) -> dict[str, list[float]]:
    """Wall-clock milliseconds of every timed call of every method: ``warmup`` untimed repeats, then ``repeats``
    timed ones; each repeat calls every method once, so drift of the machine (other load, frequency, page cache)
    hits every method alike. ``order``: ``"shuffle"``: each repeat in an order drawn by ``random.Random(seed)``
    (the same sequence of orders in every run; each method follows each other about equally often);
    ``"rotate"``: repeat ``r`` (the warm-up ones counted from ``-warmup``) runs the methods of ``fns`` rotated left
    by ``r``. Every call gets its own index ``i``, its place in the whole sequence (``fns[m](i)``; a repeat's calls
    take consecutive ones, the warm-up the first ``warmup * len(fns)``), so a method can pick a fresh chunk or key
    per call. ``after(method, i)`` runs untimed after each call (e.g. a delete)."""
    names = list(fns)
    if order == "shuffle":
        rng = random.Random(seed)
        rounds = [rng.sample(names, len(names)) for _ in range(-warmup, repeats)]
    elif order == "rotate":
        rounds = [names[r % len(names) :] + names[: r % len(names)] for r in range(-warmup, repeats)]
    else:
        raise ValueError(f"time_interleaved: order is 'shuffle' or 'rotate', got {order!r}")
    return timed_calls(fns, [(m, k >= warmup) for k, ms in enumerate(rounds) for m in ms], after)


def timed_calls(
    fns: dict[str, Callable[[int], None]], schedule: list[tuple[str, bool]], after: Callable[[str, int], None] | None
) -> dict[str, list[float]]:
    """Call ``fns[method](i)`` for each (method, timed) of ``schedule`` in order, ``i`` = its place; the
    wall-clock milliseconds of the timed calls per method (``after(method, i)`` untimed after each call)."""
    times: dict[str, list[float]] = {m: [] for m in fns}
    for i, (m, timed) in enumerate(schedule):
        t0 = time.perf_counter()
        fns[m](i)
        dt = time.perf_counter() - t0
        if after is not None:
            after(m, i)
        if timed:
            times[m].append(dt * 1e3)
    return times


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A markdown table's lines: ``header``, the rule, one line per row (cells by ``str``). ``align``: one letter
    per column, ``l`` (``---``) or ``r`` (``---:``); columns past it are ``l``."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


# ---------------------------------------------------------------------------------------- clocks and load
class Clock:
    """Points on the current stream: CUDA events (read after a synchronize), ``perf_counter`` on CPU."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cycles_per_ms = self._sleep_rate() if self.cuda else 0.0

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pad(self, ms: float) -> None:
        """Keep the current stream busy for ``ms`` while the host queues what follows (CUDA)."""
        if self.cuda and ms > 0:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def time_ms(self, fn, repeats: int, pad_ms: float = 0.0) -> float:
        """Median time of ``fn`` on the current stream: events around each call, all calls queued behind a
        pad (CUDA), so the host's cost of issuing them is not timed; ``perf_counter`` on CPU."""
        fn()
        self.sync()
        self.pad(pad_ms)
        marks = []
        for _ in range(repeats):
            a = self.mark()
            fn()
            marks.append((a, self.mark()))
        self.sync()
        return statistics.median(self.ms(a, b) for a, b in marks)

    @staticmethod
    def _sleep_rate() -> float:
        """``torch.cuda._sleep`` cycles per millisecond on this GPU."""
        cycles = 2_000_000
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        evs = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            evs.append((a, b))
        torch.cuda.synchronize()
        return cycles / statistics.median(a.elapsed_time(b) for a, b in evs)


class GemmLoad:
    """A bf16 GEMM loop (``n^3``, every SM busy, as a prefill's GEMMs) on a stream of its own, kept topped up by
    the host while copies run on another stream (``h2d_probe.py`` of the first GPU run did the same with 300
    8192^3 matmuls queued at once). The host queues batches of about ``batch_ms`` and counts what is still
    queued by an event after each batch, so the queue never drains during a timed round and the tail left to
    wait for when a case ends is short."""

    def __init__(self, device: torch.device, n: int = 8192, batch_ms: float = 10.0):
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.c = torch.empty_like(self.a)
            for _ in range(3):
                torch.mm(self.a, self.a, out=self.c)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(5):
                torch.mm(self.a, self.a, out=self.c)
            t1.record()
        t1.synchronize()
        self.unit_ms = t0.elapsed_time(t1) / 5
        self.per_batch = max(1, round(batch_ms / self.unit_ms))
        self.batch_ms = self.per_batch * self.unit_ms
        self.desc = f"bf16 GEMM {n}x{n}x{n} loop ({self.unit_ms:.2f} ms each, alone)"
        self._pending: collections.deque = collections.deque()

    def top_up(self, ahead_ms: float) -> None:
        """Queue GEMMs until at least ``ahead_ms`` of them (by their time alone) have not finished yet."""
        while self._pending and self._pending[0].query():
            self._pending.popleft()
        with torch.cuda.stream(self.stream):
            while len(self._pending) * self.batch_ms < ahead_ms:
                for _ in range(self.per_batch):
                    torch.mm(self.a, self.a, out=self.c)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._pending.append(ev)

    def busy(self) -> bool:
        """GEMMs are still queued or running (so they ran throughout whatever was issued after the last top-up)."""
        return bool(self._pending) and not self._pending[-1].query()

    def drain(self) -> None:
        self.stream.synchronize()
        self._pending.clear()


_CLOCKS: dict[torch.device, Clock] = {}
MAX_QUEUE_PAD_MS = 1000.0


def _time_interleaved(fns: list[Callable[[], None]], repeats: int, on_gpu: bool) -> list[float]:
    """Median milliseconds of each fn, timing them in turn within every repeat, so drift of the machine
    (other load, frequency, page cache) hits the roof and the kernels alike. On a GPU the time is the device's: every
    call is queued behind a pad of 1.5x the host time of issuing them (measured in the warm-up, at most
    :data:`MAX_QUEUE_PAD_MS`), so the events time the GPU work, not the host issuing it (the host's cost of an op is
    the ``layer`` section's ``host us``, and ``bench_pipeline.py --host-only``'s)."""
    t0 = time.perf_counter()
    for fn in fns:  # warm-up
        fn()
    round_ms = (time.perf_counter() - t0) * 1e3
    if on_gpu:
        torch.cuda.synchronize()
        dev = torch.device("cuda", torch.cuda.current_device())
        clock = _CLOCKS.get(dev)
        if clock is None:
            clock = _CLOCKS[dev] = Clock(dev)
        clock.pad(min(MAX_QUEUE_PAD_MS, 1.5 * repeats * round_ms + 1.0))
        events = [
            [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
            for _ in fns
        ]
        for r in range(repeats):
            for fn, ev in zip(fns, events):
                ev[r][0].record()
                fn()
                ev[r][1].record()
        torch.cuda.synchronize()
        return [statistics.median(a.elapsed_time(b) for a, b in ev) for ev in events]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def _time_under_load(fns: list[Callable[[], None]], repeats: int, load: GemmLoad, idle_ms: list[float]) -> list[float]:
    """Median milliseconds of each fn (on the current stream) while ``load`` runs its GEMMs on its own stream:
    rounds of every fn in turn, each round issued behind at least twice its length of queued GEMMs (the first
    guessed from the idle times, 3x: the UVA kernel ran 3x slower under the GEMMs of the first GPU run); a round
    after which the GEMMs had drained is not counted (and the next gets more ahead). NaN where no round counted."""
    for fn in fns:
        fn()
    torch.cuda.current_stream().synchronize()
    round_ms = 3.0 * sum(idle_ms) + 5.0
    kept: list[list[float]] = [[] for _ in fns]
    tries = 0
    while len(kept[0]) < repeats and tries < 2 * repeats + 2:
        tries += 1
        load.top_up(2.0 * round_ms + 10.0)
        evs = []
        for fn in fns:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            evs.append((a, b))
        evs[-1][1].synchronize()
        covered = load.busy()
        times = [a.elapsed_time(b) for a, b in evs]
        round_ms = sum(times) * (1.0 if covered else 2.0)
        if covered:
            for k, t in zip(kept, times):
                k.append(t)
    load.drain()
    return [statistics.median(k) if k else math.nan for k in kept]


@dataclasses.dataclass
class Queued:
    """One fn timed by :func:`_time_queued`: milliseconds per call on the device and on the host."""

    gpu_ms: float
    host_ms: float
    behind: int  # rounds in which the host took longer to queue the calls than the pad lasted


def _time_queued(fns: list[Callable[[], None]], clock: Clock, n_ops: int, rounds: int) -> list[Queued]:
    """Per fn: ``n_ops`` calls queued back to back behind a ``torch.cuda._sleep`` pad (twice the host time the
    calls took unpadded, + 1 ms), so the host is done before the GPU starts them: GPU time per call = events
    around the calls / ``n_ops``; host time per call = wall clock of the enqueue loop / ``n_ops``
    (``overhead_probe.py`` of the first GPU run). Medians of ``rounds`` rounds, the fns interleaved. On CPU
    both are the wall clock per call."""
    for fn in fns:
        fn()
        fn()
    clock.sync()
    unpadded = []
    for fn in fns:
        t0 = time.perf_counter()
        for _ in range(n_ops):
            fn()
        unpadded.append((time.perf_counter() - t0) * 1e3)
        clock.sync()
    gpu: list[list[float]] = [[] for _ in fns]
    host: list[list[float]] = [[] for _ in fns]
    behind = [0] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            pad_ms = min(500.0, 2.0 * unpadded[i] + 1.0)
            clock.pad(pad_ms)
            a = clock.mark()
            t0 = time.perf_counter()
            for _ in range(n_ops):
                fn()
            h_ms = (time.perf_counter() - t0) * 1e3
            b = clock.mark()
            clock.sync()
            gpu[i].append(clock.ms(a, b) / n_ops)
            host[i].append(h_ms / n_ops)
            behind[i] += int(clock.cuda and h_ms > pad_ms)
    return [Queued(statistics.median(g), statistics.median(h), bh) for g, h, bh in zip(gpu, host, behind)]


def cpu_name() -> str:
    """The CPU model and core count, for result files."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def machine() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
