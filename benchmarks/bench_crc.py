"""The codec's checksum: kvx's own CRC32C (``kvx._C.crc32c``, AVX-512 VPCLMULQDQ folding, used where the
CPU has it) against the ``crc32c`` package (ICRAR, SSE4.2: the codec's choice elsewhere) and
``google-crc32c`` (used before).

Two things matter for a tier's CRC32C pass over a chunk: its speed (cache-cold: a chunk being stored was
written some time ago; in cache: a GET checksums each receive as it lands) and whether it holds the GIL.
A writer or reader thread that holds the GIL for a whole chunk stalls every other Python thread of the
process (vLLM's scheduler and model runner) for that long, and, once another thread waits, up to the
interpreter's switch interval (5 ms).

- speed: median ms per CRC of 256 KiB (a GET's receive step), 1, 4 and 16 MiB, cold (buffers rotate
  over 64 MiB, twice the L3) and hot (the same buffer again), and each library's time over the crc32c
  package's, measured in the same run;
- GIL: a thread sleeping 0.2 ms in a loop while the main thread checksums 4 MiB buffers back to back; its
  wake-up latency p50 / p90 / max (no CRC running: ~0.3 ms here, the sleep's own granularity).

    pip install google-crc32c    # the comparison only; kvx needs crc32c (its fallback)
    python benchmarks/bench_crc.py [--repeats 200]

Writes benchmarks/results/crc_cpu.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import crc32c
import numpy as np

from kvx import _ext
from kvx.store import codec
from kvx.testing.bench import cpu_name

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 1 << 20
_C = _ext.require()


def libraries() -> dict:
    libs = {}
    if _C.crc32c_accelerated():
        libs["kvx._C"] = _C.crc32c
    else:
        print("bench_crc: this CPU lacks AVX-512 VPCLMULQDQ: no kvx._C.crc32c (the codec uses crc32c)")
    libs["crc32c"] = crc32c.crc32c
    try:
        import google_crc32c

        libs["google-crc32c"] = google_crc32c.value
    except ImportError:
        print("bench_crc: google-crc32c is not installed (pip install google-crc32c): crc32c only")
    return libs


def speed(fn, nbytes: int, repeats: int) -> tuple[float, float]:
    """(cold, hot) median ms of ``fn`` over ``nbytes``."""
    n = max(2, (64 * MiB) // nbytes)
    bufs = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8) for i in range(n)]
    cold, hot = [], []
    for i in range(repeats + n):  # the first n: warm-up, one pass over every buffer
        b = bufs[i % n]
        t0 = time.perf_counter()
        fn(b)
        t1 = time.perf_counter()
        fn(b)
        t2 = time.perf_counter()
        if i >= n:
            cold.append(t1 - t0)
            hot.append(t2 - t1)
    return statistics.median(cold) * 1e3, statistics.median(hot) * 1e3


def gil_stall(fn, repeats: int) -> tuple[float, float, float]:
    """Wake-up latency (p50, p90, max ms) of a thread sleeping 0.2 ms while ``fn`` runs on 4 MiB buffers
    back to back (``fn`` None: nothing runs beside it but this thread's own sleeps)."""
    bufs = [np.random.default_rng(i).integers(0, 255, 4 * MiB, dtype=np.uint8) for i in range(16)]
    lat: list[float] = []
    stop = threading.Event()

    def sleeper():
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0002)
            lat.append(time.perf_counter() - t0)

    th = threading.Thread(target=sleeper)
    th.start()
    time.sleep(0.02)
    for i in range(repeats):
        if fn is None:
            time.sleep(0.0003)
        else:
            fn(bufs[i % len(bufs)])
    stop.set()
    th.join()
    lat.sort()
    return (lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.9)] * 1e3, lat[-1] * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    libs = libraries()
    rows = []
    for mib in (0.25, 1, 4, 16):
        for name, fn in libs.items():
            cold, hot = speed(fn, int(mib * MiB), args.repeats)
            rows.append((name, mib, cold, hot))
            print(
                f"{name:14s} {mib:5g} MiB cold {cold:.3f} ms ({mib * MiB / cold / 1e6:.1f} GB/s) "
                f"hot {hot:.3f} ms ({mib * MiB / hot / 1e6:.1f} GB/s)"
            )
    ref = {m: (c, h) for n, m, c, h in rows if n == "crc32c"}
    stalls = [("nothing (sleep 0.3 ms)", gil_stall(None, args.repeats))]
    stalls += [(name, gil_stall(fn, args.repeats)) for name, fn in libs.items()]
    for name, (p50, p90, mx) in stalls:
        print(f"GIL: beside {name:24s} wake-up p50 {p50:.3f} p90 {p90:.3f} max {mx:.3f} ms")
    lines = [
        "# CRC32C: kvx._C against crc32c and google-crc32c",
        "",
        f"Machine: {cpu_name()}; crc32c {crc32c.__version__} (hardware: {crc32c.hardware_based}); kvx._C.crc32c "
        f"{'runs (AVX-512 VPCLMULQDQ)' if _C.crc32c_accelerated() else 'not run: the CPU lacks AVX-512 VPCLMULQDQ'}; "
        f"the codec uses {codec.CRC32C_IMPL}. "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {args.repeats} repeats.",
        "",
        "Reproduce: `pip install google-crc32c; python benchmarks/bench_crc.py`",
        "",
        "## Speed",
        "",
        "Median ms per checksum. Cold: the buffers rotate over 64 MiB; hot: the same buffer again at once. "
        "`x crc32c` = the crc32c package's median time / the library's (same run; > 1: faster).",
        "",
        "| library | bytes | cold ms | cold GB/s | cold x crc32c | hot ms | hot GB/s | hot x crc32c |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {m:g} MiB | {c:.3f} | {m * MiB / c / 1e6:.1f} | {ref[m][0] / c:.2f} | {h:.3f} | "
        f"{m * MiB / h / 1e6:.1f} | {ref[m][1] / h:.2f} |"
        for n, m, c, h in rows
    ]
    lines += [
        "",
        "## GIL",
        "",
        "Wake-up latency of a thread that sleeps 0.2 ms in a loop while the main thread checksums 4 MiB "
        "buffers back to back: a library that holds the GIL makes it wait for the checksum, then for the "
        "interpreter's switch interval (5 ms).",
        "",
        "| beside | p50 ms | p90 ms | max ms |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {n} | {a:.3f} | {b:.3f} | {c:.3f} |" for n, (a, b, c) in stalls]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "crc_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(args.out, 'crc_cpu.md')}")


if __name__ == "__main__":
    main()
