"""Redis tier under server faults: how long a load takes to fail when the server stops or dies.

Why this exists: the project's target for the Redis tier is "a stopped server turns a load into a
recompute within ``timeout_ms`` + 100 ms": a load that fails is recomputed, so the time it takes to fail
is added to the request. This benchmark measures that time against real ``redis-server`` processes
(:class:`kvx.testing.redis_server.RedisServer`, one standalone server on loopback TCP), never a mock: the fault
is a signal to the server process while kvx's :meth:`RedisTier.get_into` runs.

Scenarios (each trial: put a new chunk, untimed; then time ``get_into(key, out)`` from the call until the
exception it raises)::

  sigstop-before   SIGSTOP (``server.pause()``) before the GET is sent, the process seen stopped
                   (``/proc/<pid>/stat`` state T): the server hangs, its kernel still accepts bytes
  sigstop-mid      SIGSTOP after the first payload bytes landed in ``out``: ``ChunkSink.advance`` (the
                   class attribute the tier's GET calls after every receive) is wrapped for the timed call
                   so that its first call in the PAYLOAD phase calls ``server.pause()`` once
  sigkill-mid      the same trigger, ``server.kill()`` (SIGKILL, reaped): the server dies mid-transfer

After a SIGSTOP trial the server gets SIGCONT (``resume()``), after a SIGKILL trial it is restarted on the
same port (data lost); then, untimed, the benchmark waits until a put + get round trip through the tier
works again (the tier marks a failed node down and probes it every ``retry_s``: 0.1 s here) and records
that time as ``back after``. Every trial checks that the error is a ``ChunkError`` (what the connector
turns into a recompute) and whether its message says the server ``did not answer within <timeout_ms>
ms`` (it must for SIGSTOP; a killed server is a lost connection instead). A GET that returns instead
(the whole value had reached the client's socket before the fault: likely for 4 MiB over loopback) is
checked bit-exact against the chunk put and counted as ``completed``, not timed: nothing to recompute.

Chunks: bf16 KV chunks (8 layers x K/V x tokens x 8 heads x 128, as in bench_redis.py) of 64 MiB (stored
as 16 values of 4 MiB + a manifest: a long transfer, so the mid-transfer fault lands well before the
value is in the socket buffers) and 4 MiB (one value). ``timeout_ms`` 300 and 1000.

Reported per scenario, chunk and ``timeout_ms``: p50 / p90 / max of the time to the error and of the
overshoot (time - ``timeout_ms``), judged against ``timeout_ms`` + 100 ms on p90 and on max separately.

    python benchmarks/bench_redis_faults.py [--trials 20] [--timeouts 300,1000] [--sizes 64,4] [--out DIR]

Writes ``redis_faults_cpu.md`` and ``redis_faults_cpu.csv`` into ``--out`` (default benchmarks/results);
``tests/bench/test_bench_redis_faults.py`` runs a small one. Fewer than 10 trials is a smoke run: the targets
are named, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import select
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field

import torch

from kvx.store.errors import ChunkError, StoreError
from kvx.store.redis import ChunkSink
from kvx.testing.bench import cpu_name
from kvx.testing.bench_timing import median, percentile
from kvx.testing.redis_bench import chunk_shape, fmt6, new_key, open_tier, server_version, verdict
from kvx.testing.redis_server import RedisServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SCENARIOS = ("sigstop-before", "sigstop-mid", "sigkill-mid")
DESCRIBE = {
    "sigstop-before": "SIGSTOP before the GET (server seen stopped first)",
    "sigstop-mid": "SIGSTOP after the first payload bytes landed",
    "sigkill-mid": "SIGKILL after the first payload bytes landed",
}
TIMEOUTS_MS = (300, 1000)
SIZES_MIB = (64, 4)
TRIALS = 20
SMOKE_BELOW = 10  # fewer trials: a smoke run, verdicts not given
RETRY_S = 0.1  # the tier's probe interval for a down node: recovery between trials is quick
TARGET_SLACK_MS = 100  # the target: the error within timeout_ms + this
TIMER_REPS = 10  # idle-socket receives per timeout and kind (timer_overshoot)
RECOVER_S = 30.0  # a server not working again within this after resume / restart: an error

CSV_FIELDS = [
    "scenario",
    "chunk_bytes",
    "timeout_ms",
    "retry_s",
    "trials",
    "chunk_errors",
    "completed",
    "other_outcomes",
    "says_timeout",
    "fault_fired",
    "p50_ms",
    "p90_ms",
    "max_ms",
    "over_p50_ms",
    "over_p90_ms",
    "over_max_ms",
    "target_ms",
    "p90_verdict",
    "max_verdict",
    "fault_at_ms_median",
    "fault_at_payload_bytes_median",
    "fault_call_ms_median",
    "after_fault_ms_median",
    "back_after_ms_median",
    "error_ms_trials",
]


# ------------------------------------------------------------------------------------------ one trial
@dataclass
class Trial:
    """One timed ``get_into`` under a fault."""

    error_ms: float | None  # call -> exception (None: the get returned)
    outcome: str  # "ChunkError"; "completed" (returned, the chunk bit-exact); "WRONG DATA"
    # (returned, other bytes); another exception's type
    message: str
    says_timeout: bool  # the message says "did not answer within <timeout_ms> ms"
    fault_ms: float | None  # call -> fault injected (mid-transfer); 0 for sigstop-before; None: never
    fault_bytes: int | None  # payload bytes in ``out`` when the fault fired
    fault_call_ms: float | None  # the pause() / kill() call itself (inside the timed window when mid-transfer)
    back_ms: float  # after the trial: resume / restart until a put + get round trip worked


class FaultOnPayload:
    """Within the ``with`` block, the first ``ChunkSink.advance`` call that brings payload bytes (the
    sink already in its PAYLOAD phase: the header was verified, bytes landed in ``out``) runs ``fault``
    once, then advances as usual. The original method is back on leaving the block."""

    def __init__(self, fault):
        self.fault = fault
        self.fired_at: float | None = None  # perf_counter() when the fault was called
        self.call_s: float | None = None  # how long the fault call took
        self.payload_bytes: int | None = None

    def __enter__(self) -> FaultOnPayload:
        orig = self._orig = ChunkSink.advance

        def advance(sink, n):
            if self.fired_at is None and sink.phase == sink._PAYLOAD:
                self.payload_bytes = sink.pos + n
                self.fired_at = time.perf_counter()
                self.fault()
                self.call_s = time.perf_counter() - self.fired_at
            return orig(sink, n)

        ChunkSink.advance = advance
        return self

    def __exit__(self, *exc) -> None:
        ChunkSink.advance = self._orig


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until ``/proc/<pid>/stat`` says the process is stopped (T): SIGSTOP is delivered asynchronously."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.0005)
    raise RuntimeError(f"redis-server pid {pid} not stopped {timeout_s:.0f} s after SIGSTOP")


def timer_overshoot(timeout_ms: int, reps: int) -> dict[str, float]:
    """Median and max ms past ``timeout_ms`` at which a receive on an idle socket gives up: blocking with SO_RCVTIMEO
    (as kvx's RESP client waits) and in poll() (the kernel's high-resolution timers), ``reps`` times each. The
    first runs on the kernel's timer wheel: on this machine's HZ it fires several ms late, which a stopped
    server's GET inherits."""
    a, b = socket.socketpair()
    late: dict[str, list[float]] = {"SO_RCVTIMEO": [], "poll": []}
    try:
        us = timeout_ms * 1000
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", us // 1_000_000, us % 1_000_000))
        p = select.poll()
        p.register(a, select.POLLIN)
        for _ in range(reps):
            t = time.perf_counter()
            try:
                a.recv(1)
            except BlockingIOError:
                pass
            late["SO_RCVTIMEO"].append((time.perf_counter() - t) * 1e3 - timeout_ms)
            t = time.perf_counter()
            p.poll(timeout_ms)
            late["poll"].append((time.perf_counter() - t) * 1e3 - timeout_ms)
    finally:
        a.close()
        b.close()
    return {f"{k} {stat}": f(v) for k, v in late.items() for stat, f in (("median", statistics.median), ("max", max))}


def wait_working(tier, probe: torch.Tensor) -> None:
    """Until a put + get round trip of a small chunk through ``tier`` works (at most RECOVER_S)."""
    out = torch.empty_like(probe)
    deadline = time.monotonic() + RECOVER_S
    last = None
    while time.monotonic() < deadline:
        k = new_key()
        try:
            tier.put(k, probe)
            tier.get_into(k, out)
            tier.delete(k)
            if torch.equal(out.view(torch.uint8), probe.view(torch.uint8)):
                return
            last = "the round trip read back other bytes"
        except StoreError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.01)
    raise RuntimeError(f"redis tier {tier.url}: not working {RECOVER_S:.0f} s after the fault: {last}")


def run_trial(
    server: RedisServer, tier, scenario: str, src: torch.Tensor, out: torch.Tensor, probe: torch.Tensor, timeout_ms: int
) -> Trial:
    """Put a new chunk, time one ``get_into`` of it under ``scenario``'s fault, then (untimed) bring the
    server back and wait until the tier works."""
    key = new_key()
    if not tier.put(key, src):
        raise RuntimeError(f"put of a new key {key} answered 'already present'")
    out.view(torch.uint8).fill_(0xA5)  # poisoned: a GET that returns must have written the chunk
    fault_ms = fault_bytes = fault_call_ms = None
    inject: FaultOnPayload | None = None
    if scenario == "sigstop-before":
        t = time.perf_counter()
        server.pause()
        wait_stopped(server.pid)
        fault_ms, fault_call_ms = 0.0, (time.perf_counter() - t) * 1e3
    elif scenario in ("sigstop-mid", "sigkill-mid"):
        inject = FaultOnPayload(server.pause if scenario == "sigstop-mid" else server.kill)
    else:
        raise ValueError(f"scenario: expected one of {SCENARIOS}, got {scenario!r}")
    error_ms, outcome, message = None, "", ""
    try:
        with inject or contextlib.nullcontext():
            t0 = time.perf_counter()
            try:
                tier.get_into(key, out)
            except ChunkError as e:
                error_ms, outcome, message = (time.perf_counter() - t0) * 1e3, "ChunkError", str(e)
            except Exception as e:  # noqa: BLE001 - recorded: the trial's error is not the one a load needs
                error_ms, outcome, message = (time.perf_counter() - t0) * 1e3, type(e).__name__, str(e)
        if not outcome:
            same = torch.equal(out.view(torch.uint8), src.view(torch.uint8))
            outcome = "completed" if same else "WRONG DATA"
        if inject is not None and inject.fired_at is not None:
            fault_ms = (inject.fired_at - t0) * 1e3
            fault_bytes, fault_call_ms = inject.payload_bytes, inject.call_s * 1e3
    finally:
        t = time.perf_counter()
        if not server.running:
            server.restart()
        else:
            server.resume()
        wait_working(tier, probe)
        back_ms = (time.perf_counter() - t) * 1e3
        try:
            tier.delete(key)  # gone already after a restart
        except StoreError:
            pass
    return Trial(
        error_ms,
        outcome,
        message,
        f"did not answer within {timeout_ms} ms" in message,
        fault_ms,
        fault_bytes,
        fault_call_ms,
        back_ms,
    )


@dataclass
class Case:
    """The trials of one scenario, chunk size and ``timeout_ms``."""

    scenario: str
    chunk_bytes: int
    timeout_ms: int
    trials: list[Trial] = field(default_factory=list)

    @property
    def times(self) -> list[float]:
        """Milliseconds to the error of the trials that raised a ChunkError."""
        return [t.error_ms for t in self.trials if t.outcome == "ChunkError"]

    @property
    def completed(self) -> int:
        return sum(t.outcome == "completed" for t in self.trials)

    @property
    def bad(self) -> int:
        """Trials that ended neither in a ChunkError nor with the chunk read whole."""
        return sum(t.outcome not in ("ChunkError", "completed") for t in self.trials)

    @property
    def target_ms(self) -> int:
        return self.timeout_ms + TARGET_SLACK_MS

    def stats(self) -> dict[str, float] | None:
        xs = self.times
        if not xs:
            return None
        return {"p50": statistics.median(xs), "p90": percentile(xs, 90), "max": max(xs)}

    def verdicts(self, smoke: bool) -> tuple[str, str]:
        s = self.stats()
        if smoke:
            return "n/a (smoke run)", "n/a (smoke run)"
        if self.bad:
            return "MISSED", "MISSED"  # neither a recompute nor a good load
        if s is None:
            return "n/a (no load failed)", "n/a (no load failed)"
        return verdict(s["p90"] <= self.target_ms), verdict(s["max"] <= self.target_ms)


def _after_fault(c: Case) -> list[float]:
    """Ms from the fault (mid-transfer: inside the timed call) to the error, per trial that had both."""
    return [t.error_ms - t.fault_ms for t in c.trials if t.error_ms is not None and t.fault_ms is not None]


def _opt(x: float | None, fmt: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def run_case(
    server: RedisServer, tier, case: Case, src: torch.Tensor, out: torch.Tensor, probe: torch.Tensor, trials: int, log
) -> None:
    for i in range(trials):
        case.trials.append(run_trial(server, tier, case.scenario, src, out, probe, case.timeout_ms))
        t = case.trials[-1]
        if t.outcome not in ("ChunkError", "completed"):
            log(f"  trial {i + 1}: expected a ChunkError, got {t.outcome}: {t.message[:200]}")
    s = case.stats()
    log(
        f"{case.scenario:15s} {case.chunk_bytes // MiB:3d} MiB timeout_ms {case.timeout_ms:5d}: "
        f"ChunkError {len(case.times)}/{len(case.trials)}, completed {case.completed}, says timeout "
        f"{sum(t.says_timeout for t in case.trials)}/{len(case.trials)}"
        + (f", p50 {s['p50']:.1f} p90 {s['p90']:.1f} max {s['max']:.1f} ms (target {case.target_ms} ms)" if s else "")
    )


# ------------------------------------------------------------------------------------------ results
def write_csv(path: str, cases: list[Case], smoke: bool) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for c in cases:
            s = c.stats()
            vp, vm = c.verdicts(smoke)
            stat = (lambda k: fmt6(s[k])) if s else (lambda k: "")
            over = (lambda k: fmt6(s[k] - c.timeout_ms)) if s else (lambda k: "")
            opt = lambda x: "" if x is None else fmt6(x)  # noqa: E731
            w.writerow(
                [
                    c.scenario,
                    c.chunk_bytes,
                    c.timeout_ms,
                    RETRY_S,
                    len(c.trials),
                    len(c.times),
                    c.completed,
                    c.bad,
                    sum(t.says_timeout for t in c.trials),
                    sum(t.fault_ms is not None for t in c.trials),
                    stat("p50"),
                    stat("p90"),
                    stat("max"),
                    over("p50"),
                    over("p90"),
                    over("max"),
                    c.target_ms,
                    vp,
                    vm,
                    opt(median((t.fault_ms for t in c.trials), None)),
                    opt(median((t.fault_bytes for t in c.trials), None)),
                    opt(median((t.fault_call_ms for t in c.trials), None)),
                    opt(median(_after_fault(c), None)),
                    opt(median((t.back_ms for t in c.trials), None)),
                    " ".join(fmt6(t) for t in c.times),
                ]
            )


def write_md(path: str, cases: list[Case], info: dict, cmd: str, trials: int, smoke: bool) -> None:
    title = "Redis tier: time from a load to its error when the server stops or dies"
    lines = [f"# SMOKE RUN, not a measurement ({trials} trials): {title}" if smoke else f"# {title}", ""]
    lines += [
        f"Machine: {cpu_name()}; kernel {platform.release()}; redis-server {info['server_version']}; "
        f"torch {torch.__version__}; Python {platform.python_version()}. {info['date']}. {trials} trials "
        f"per scenario, chunk and timeout_ms; retry_s {RETRY_S}; load average at start {info['load']:.2f}, "
        f"at the end {info['load_end']:.2f}; total {info['elapsed']:.0f} s.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "One local `redis-server` (loopback TCP, started by the benchmark through `kvx.testing.redis_server`: no "
        "persistence), one `RedisTier` per `timeout_ms` (opened as bench_redis.py does, `retry_s` "
        f"{RETRY_S}). Each trial puts a new chunk (untimed), then times `tier.get_into(key, out)` from the "
        "call to the exception it raises while a fault hits the server process:",
        "",
    ]
    lines += [f"- `{s}`: {d}." for s, d in DESCRIBE.items()]
    lines += [
        "",
        "Fault injection: `sigstop-before` sends SIGSTOP (`RedisServer.pause()`) and waits until "
        "`/proc/<pid>/stat` shows the process stopped, then starts the clock. The `-mid` scenarios wrap "
        "`kvx.store.redis.ChunkSink.advance` (called by the tier's GET after every receive) for the timed "
        "call only: its first call in the PAYLOAD phase (header verified, payload bytes in `out`) calls "
        "`pause()` (SIGSTOP) or `kill()` (SIGKILL, then reaped) once; that call is inside the timed window "
        "(`fault call`). Chunks: bf16 KV chunks; 64 MiB is stored as 16 values of 4 MiB + a manifest, "
        "4 MiB as one value. After each trial (untimed) the server gets SIGCONT or is restarted on its port, "
        "and the benchmark waits until a put + get round trip through the tier works (`back after`).",
        "",
    ]

    lines += [
        "## Target: the error within timeout_ms + 100 ms",
        "",
        "Times over the trials that ended in a `ChunkError` (the error the connector turns into a "
        "recompute); overshoot = time - `timeout_ms` (negative: before the deadline). Judged on p90 and "
        "on max separately. A load that returned the chunk bit-exact (`completed` below: the fault came "
        "after the whole value was in the client's socket) is not timed; any other outcome makes the case "
        "MISSED.",
        "",
        "| scenario | chunk | timeout_ms | target ms | p50 ms | p90 ms | max ms | overshoot p50 | p90 | max | "
        "verdict (p90) | verdict (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in cases:
        s = c.stats()
        vp, vm = c.verdicts(smoke)
        if s is None:
            lines.append(
                f"| {c.scenario} | {c.chunk_bytes // MiB} MiB | {c.timeout_ms} | {c.target_ms} | - | - | - "
                f"| - | - | - | {vp} | {vm} |"
            )
            continue
        o = {k: s[k] - c.timeout_ms for k in s}
        lines.append(
            f"| {c.scenario} | {c.chunk_bytes // MiB} MiB | {c.timeout_ms} | {c.target_ms} | "
            f"{s['p50']:.1f} | {s['p90']:.1f} | {s['max']:.1f} | {o['p50']:+.1f} | {o['p90']:+.1f} | "
            f"{o['max']:+.1f} | {vp} | {vm} |"
        )

    lines += [
        "",
        "## Every trial checked",
        "",
        "`ChunkError`: trials whose error was a ChunkError. `completed`: trials whose GET returned the "
        "chunk, bit-exact (the fault hit a server that had sent the whole value). `says timeout`: trials "
        "whose message says the server `did not answer within <timeout_ms> ms` (expected for every SIGSTOP "
        "trial that failed; a killed server is a lost connection). `fault at`: median ms from the call to "
        "the fault, and payload bytes in `out` then. `fault call`: median ms the pause() / kill() call took "
        "(kill: until the process is reaped). `after fault`: median ms from the fault to the error. `back "
        "after`: median ms from SIGCONT / restart until a round trip worked (untimed).",
        "",
        "| scenario | chunk | timeout_ms | ChunkError | completed | says timeout | fault fired | fault at ms | "
        "fault at payload | fault call ms | after fault ms | back after ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        n = len(c.trials)
        fm, fb = median((t.fault_ms for t in c.trials), None), median((t.fault_bytes for t in c.trials), None)
        fc, ba = median((t.fault_call_ms for t in c.trials), None), median((t.back_ms for t in c.trials), None)
        af = median(_after_fault(c), None)
        lines.append(
            f"| {c.scenario} | {c.chunk_bytes // MiB} MiB | {c.timeout_ms} | {len(c.times)}/{n} | "
            f"{c.completed}/{n} | {sum(t.says_timeout for t in c.trials)}/{n} | "
            f"{sum(t.fault_ms is not None for t in c.trials)}/{n} | {_opt(fm, '.2f')} | "
            f"{_opt(fb and fb / 1024, '.0f', ' KiB')} | {_opt(fc, '.2f')} | {_opt(af, '.1f')} | {ba:.0f} |"
        )

    lines += ["", "Example error message per scenario (first trial of the first case):", ""]
    for s in DESCRIBE:
        c = next((c for c in cases if c.scenario == s and c.trials), None)
        if c is not None:
            t = c.trials[0]
            lines.append(f"- `{s}` ({t.outcome}): `{t.message[:300]}`")
    timer = info.get("timer") or {}
    if timer:
        lines += [
            "",
            "## Where a SIGSTOP overshoot comes from (same run)",
            "",
            "kvx's RESP client waits in blocking receives bounded by SO_RCVTIMEO (re-armed only when off by more "
            "than 5 ms). A receive on an idle socketpair with SO_RCVTIMEO = `timeout_ms` against poll() with "
            f"the same timeout, {info['timer_reps']} times each, ms past the timeout:",
            "",
            "| timeout_ms | SO_RCVTIMEO median | SO_RCVTIMEO max | poll() median | poll() max |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {ms} | {v['SO_RCVTIMEO median']:+.1f} | {v['SO_RCVTIMEO max']:+.1f} | {v['poll median']:+.1f} "
            f"| {v['poll max']:+.1f} |"
            for ms, v in sorted(timer.items())
        ]
    slow = [
        (c, i, t)
        for c in cases
        for i, t in enumerate(c.trials)
        if t.outcome == "ChunkError" and t.error_ms > c.target_ms
    ]
    other = [(c, i, t) for c in cases for i, t in enumerate(c.trials) if t.outcome not in ("ChunkError", "completed")]
    if slow or other:
        lines += ["", "Trials over the target, or neither a ChunkError nor the chunk read whole:", ""]
        for c, i, t in slow + other:
            what = f"{t.error_ms:.1f} ms" if t.outcome == "ChunkError" else t.outcome
            lines.append(
                f"- {c.scenario} {c.chunk_bytes // MiB} MiB timeout_ms {c.timeout_ms}, trial {i + 1}: "
                f"{what} (fault at {'-' if t.fault_ms is None else f'{t.fault_ms:.1f}'} ms): "
                f"`{t.message[:200]}`"
            )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------ main
def _ints(ap, name: str, text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{name}: expected integers, comma-separated, got {text!r}")
    if not xs or any(x < 1 for x in xs):
        ap.error(f"{name}: expected integers >= 1, comma-separated, got {text!r}")
    return xs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trials",
        type=int,
        default=TRIALS,
        help=f"trials per scenario, chunk and timeout_ms "
        f"(default {TRIALS}; fewer than {SMOKE_BELOW}: a smoke run, not judged)",
    )
    ap.add_argument("--timeouts", default=",".join(map(str, TIMEOUTS_MS)), help="timeout_ms values, comma-separated")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument(
        "--out",
        default=os.path.join(REPO, "benchmarks", "results"),
        help="directory for redis_faults_cpu.md and redis_faults_cpu.csv",
    )
    args = ap.parse_args(argv)
    if args.trials < 1:
        ap.error(f"--trials: expected an integer >= 1, got {args.trials}")
    timeouts, sizes = _ints(ap, "--timeouts", args.timeouts), _ints(ap, "--sizes", args.sizes)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        ap.error(f"--scenarios: expected some of {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    smoke = args.trials < SMOKE_BELOW

    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        print(f"warning: load average {load1:.2f}: timings will be noisy", file=sys.stderr)
    cmd = ("python benchmarks/bench_redis_faults.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    log = lambda s: print(s, flush=True)  # noqa: E731
    info = {
        "server_version": server_version(),
        "load": load1,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(chunk_shape(32 << 10), generator=g).to(torch.bfloat16)  # 32 KiB round trip
    cases: list[Case] = []
    with RedisServer() as server:
        for timeout_ms in timeouts:
            tier = open_tier(server.url, timeout_ms=timeout_ms, retry_s=RETRY_S)
            try:
                wait_working(tier, probe)
                for mib in sizes:
                    src = torch.randn(chunk_shape(mib * MiB), generator=g).to(torch.bfloat16)
                    out = torch.empty_like(src)
                    out.view(torch.uint8).fill_(0)  # pages committed before any timed call
                    for scenario in scenarios:
                        case = Case(scenario, mib * MiB, timeout_ms)
                        cases.append(case)
                        run_case(server, tier, case, src, out, probe, args.trials, log)
            finally:
                tier.close()
    info["timer_reps"] = min(TIMER_REPS, args.trials)
    info["timer"] = {ms: timer_overshoot(ms, info["timer_reps"]) for ms in timeouts}
    log(
        "receive on an idle socket, median ms past the timeout: "
        + "; ".join(
            f"{ms} ms: SO_RCVTIMEO {v['SO_RCVTIMEO median']:+.1f}, poll {v['poll median']:+.1f}"
            for ms, v in info["timer"].items()
        )
    )
    info["elapsed"] = time.perf_counter() - t_start
    info["load_end"] = os.getloadavg()[0]
    os.makedirs(args.out, exist_ok=True)
    md, csv_path = os.path.join(args.out, "redis_faults_cpu.md"), os.path.join(args.out, "redis_faults_cpu.csv")
    write_csv(csv_path, cases, smoke)
    write_md(md, cases, info, cmd, args.trials, smoke)
    with open(md) as f:
        print(f.read())
    log(f"wrote {md} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
