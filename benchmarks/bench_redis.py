"""Redis tier: kvx's ``RedisTier`` against redis-py + hiredis, in the same run.

Why this exists: kvx's Redis tier (:mod:`kvx.store.redis`) speaks RESP itself and reads a value straight
into the caller's CPU-pool slot, instead of letting redis-py build a ``bytes`` object and copying it out.
This benchmark is the measurement behind that choice, and behind the tier's default part size
(``max_value_size``). It starts its own ``redis-server`` processes (:mod:`kvx.testing.redis_server`: one
standalone server listening on loopback TCP and on a unix socket; a 3-node cluster for the lookups) and
stops them at the end. Every method moves the same chunk: a bf16 KV chunk (8 layers x K/V x tokens x 8
heads x 128, 32 KiB per token) of 1, 4 or 16 MiB, encoded by :mod:`kvx.store.codec` (a ~250-byte
safetensors header + the payload; bytes counted = the payload).

GET (into a preallocated destination: a slot of a :class:`kvx.store.CPUPool`), interleaved per repeat::

  redis-py GET + verify (baseline)   r.get(k), then codec.decode_into: decode + check the header, copy the
                                     payload into the slot, CRC32C over it (the checks kvx does)
  kvx get_into                       RedisTier.get_into(key, slot): the same checks
  redis-py GET + copy                r.get(k) + copy of the payload into the slot, no checks
  redis-py GET only                  r.get(k): bytes built, nothing copied or checked
  socket GET into slot (roof)        one plain socket: GET, the value received (recv_into) into a header
                                     buffer and the slot, nothing parsed beyond the length, nothing checked

PUT (from a slot; every put a new key, deleted untimed after it)::

  redis-py SET + encode (baseline)   codec.encode (header + CRC32C), b"".join(header, payload),
                                     r.set(k, value, nx=True)
  kvx put                            RedisTier.put(key, slot): the same encoding
  redis-py SET only                  r.set(k, value, nx=True) of a value encoded beforehand
  socket SET (roof)                  one plain socket: SET NX, the header (built beforehand) and the slot's
                                     memory sent with sendall, no CRC

The destinations (GET) and sources (PUT) rotate over ``--rotate-mib`` of slots and keys (default 64 MiB,
twice the L3 of the machine this was written on), one step per call (every method's call its own chunk,
also within a repeat), so no method reads a cache-warm chunk. Each repeat runs every method once, in an
order shuffled every repeat (seeded): drift of the machine hits every method alike, and so does what a
call leaves behind for the next one. That is measurable: a kvx put right after a redis-py put took
0.24-0.28 ms longer than one right after another kvx put. A rotated order (used before) put each method
after the same one in 3 repeats of 4 (kvx after the baseline).

The redis-py variants (GET + copy, GET only, SET only) stay in the same interleave as the baseline on
purpose, so that the baseline is timed where it runs fastest: redis-py's time depends on how glibc's
malloc reuses its 4 MiB buffers, and the variants' buffers keep that memory in use. Measured (a variant
of this script, 4 MiB over TCP): interleaved with kvx and the roof alone, the PUT baseline ran 11-12 ms (a
SET of a freshly built value: ~4000 page faults a call) against 2.2-2.4 ms with the variants; the GET
baseline ran 6-7% slower without them. Pinning malloc's thresholds (mallopt) is no cure: it cost the GET
baseline ~20% (probably hiredis's growing buffer, copied instead of remapped).

The median of ``--repeats`` after ``--warmup`` is a run's value, and the whole measurement is done ``--runs``
times. ``x baseline`` = the baseline's median time over the method's (> 1: faster than redis-py); ``% roof``
= the roof's over the method's (what is left to win at all).

Back to back: the same methods, chunks and runs once more, each method's calls in blocks in a row
(:func:`time_back_to_back`; the first call of a block untimed), as a connector loads or saves a prefix
chunk after chunk. Both designs are reported and judged: the shuffled one puts another method before
every call, and what a call follows matters here. A kvx GET ends as its last byte lands, so back to back
the server never idles; every redis-py GET leaves it idle for its last ~millisecond of client work; and an
idle server answers later (a PING: ~80 us right after work, ~130 us after 3 ms idle; measured in the same
run, :func:`server_wake`).

Part-size sweep: 4 and 16 MiB chunks through ``RedisTier`` opened with ``max_value_size`` = 512 KiB .. 8 MiB
(GET and PUT as above, interleaved), to back the tier's default. Send-buffer sweep: 4 MiB kvx puts through
data connections opened with SO_SNDBUF = the kernel's default .. 4 MiB, to back ``RedisTier.send_buffer``.
Lookups: ``contains_many`` of a 256-chunk prefix (``lookup_wait_ms`` 1000, so it answers) against a
redis-py pipeline of 256 ``EXISTS``, every repeat on keys not asked for before (a tier that remembers
answers is timed asking the server), on the standalone server and on a 3-node cluster
(``RedisClusterServers``). Also measured in the same run, for the "where the time goes" note: memcpy and
CRC32C of a 4 MiB chunk.

    python benchmarks/bench_redis.py [--quick] [--out DIR] [--runs 5] [--repeats N] [--sizes 1,4,16]

Writes ``redis_cpu.md`` and ``redis_cpu.csv`` into ``--out`` (default benchmarks/results). ``--quick``:
1 MiB chunks, a 2 MiB sweep, 1 run of a few repeats (a smoke run, ``tests/bench/test_bench_redis.py``, ~10 s).
Under pytest-benchmark: ``pytest benchmarks/bench_redis.py --benchmark-only`` (the ``test_*`` functions at
the end: kvx and redis-py at 4 MiB, and the lookup).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

from kvx.store import codec
from kvx.testing.bench_timing import percentile, time_interleaved
from kvx.testing.redis_bench import (
    B2B_CALLS,
    FINGERPRINT,
    GET_BASE,
    GET_KVX,
    GET_METHODS,
    LOOKUP_BASE,
    LOOKUP_KEYS,
    LOOKUP_KVX,
    LOOKUP_METHODS,
    LOOKUP_WAIT_MS,
    PART_SIZES,
    PIECES,
    PUT_BASE,
    PUT_KVX,
    PUT_METHODS,
    SEALED_METHODS,
    SEALED_TARGET,
    SEND_BUFFERS,
    TARGET_MIB,
    MiB,
    RawSocket,
    Result,
    Values,
    _fmt,
    _log_case,
    _piece_name,
    _sndbuf_name,
    check_get,
    check_put,
    cpu_costs,
    default_part,
    deleter,
    get_fns,
    knob_runs,
    make_pool,
    n_rotate,
    new_key,
    open_tier,
    put_fns,
    redis_py,
    server_version,
    server_wake,
    time_back_to_back,
    verdict,
    wmem_max,
)
from kvx.testing.redis_bench_report import write_csv, write_md, write_sealed_md

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_get_put(
    urls: dict[str, str],
    sizes: list[int],
    runs: int,
    repeats: dict[int, int],
    warmup: int,
    rotate_bytes: int,
    g: torch.Generator,
    log,
) -> tuple[list[Result], dict]:
    results: list[Result] = []
    info = {}
    tiers = {t: open_tier(u) for t, u in urls.items()}
    clients = {t: redis_py(u) for t, u in urls.items()}
    raws = {t: RawSocket(u) for t, u in urls.items()}
    any_t = next(iter(urls))
    try:
        pools = {mib: make_pool(mib * MiB, n_rotate(mib * MiB, rotate_bytes), g) for mib in sizes}
        stored = {mib: Values(tiers[any_t], clients[any_t], pools[mib]) for mib in sizes}
        info["header_bytes"] = {mib: v.header_bytes for mib, v in stored.items()}
        info["rotate"] = {mib: p.num_slots for mib, p in pools.items()}
        try:
            for t in urls:
                for mib in sizes:
                    check_get(tiers[t], clients[t], stored[mib], raws[t])
                    check_put(tiers[t], clients[t], pools[mib])
            for run in range(1, runs + 1):
                for t in urls:
                    for mib in sizes:
                        nb = mib * MiB
                        blocks = max(1, math.ceil(repeats[mib] / B2B_CALLS))
                        # shuffled, then the same methods with each one's calls in a row
                        timings = (
                            ("", lambda fns, after: time_interleaved(fns, repeats[mib], warmup, after)),
                            ("-b2b", lambda fns, after: time_back_to_back(fns, blocks, B2B_CALLS, after)),
                        )
                        for sfx, timing in timings:
                            times = timing(get_fns(tiers[t], clients[t], stored[mib], raws[t]), None)
                            written = {m: [] for m in PUT_METHODS}
                            times |= timing(
                                put_fns(tiers[t], clients[t], pools[mib], written, raws[t]),
                                deleter(tiers[t], clients[t], written),
                            )
                            for sec, methods, base in (("get", GET_METHODS, GET_BASE), ("put", PUT_METHODS, PUT_BASE)):
                                for m in methods:
                                    results.append(
                                        Result(
                                            sec + sfx,
                                            t,
                                            "standalone",
                                            nb,
                                            None,
                                            m,
                                            base if m != base else None,
                                            run,
                                            times[m],
                                        )
                                    )
                            _log_case(log, run, runs, results[-len(GET_METHODS) - len(PUT_METHODS) :])
        finally:
            for v in stored.values():
                v.close()
    finally:
        for tier in tiers.values():
            tier.close()
        for c in [*clients.values(), *raws.values()]:
            c.close()
    return results, info


# ------------------------------------------------------------------------------------------ part-size sweep
def bench_sweep(
    urls: dict[str, str],
    mib: int,
    parts: list[int],
    runs: int,
    repeats: int,
    warmup: int,
    rotate_bytes: int,
    g: torch.Generator,
    log,
    info: dict,
) -> list[Result]:
    """GET and PUT of one chunk size through tiers opened with each ``max_value_size``, interleaved."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    info.setdefault("sweep_header_bytes", {})[nb] = len(codec.encode_header(pool.slot(0), new_key(), FINGERPRINT))
    results = []
    dflt = default_part()
    base_name = f"part {_fmt(dflt)}" if dflt in parts else None
    for t, url in urls.items():
        tiers = {p: open_tier(url, p) for p in parts}
        try:
            keys = {p: [new_key() for _ in range(pool.num_slots)] for p in parts}
            for p in parts:
                for i, k in enumerate(keys[p]):
                    tiers[p].put(k, pool.slot(i))
            try:
                for run in range(1, runs + 1):
                    gets = {
                        f"part {_fmt(p)}": (
                            lambda i, p=p: tiers[p].get_into(keys[p][i % pool.num_slots], pool.slot(i % pool.num_slots))
                        )
                        for p in parts
                    }
                    times = time_interleaved(gets, repeats, warmup)
                    part_of = {f"part {_fmt(p)}": p for p in parts}
                    written: dict[str, list[str]] = {m: [] for m in part_of}

                    def put(i, p):
                        k = new_key()
                        written[f"part {_fmt(p)}"].append(k)
                        if not tiers[p].put(k, pool.slot(i % pool.num_slots)):
                            raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

                    def after(m, i):
                        tiers[part_of[m]].delete(written[m].pop())

                    puts = {f"part {_fmt(p)}": (lambda i, p=p: put(i, p)) for p in parts}
                    ptimes = time_interleaved(puts, repeats, warmup, after)
                    for p in parts:
                        m = f"part {_fmt(p)}"
                        b = base_name if m != base_name else None
                        results.append(Result("sweep-get", t, "standalone", nb, p, m, b, run, times[m]))
                        results.append(Result("sweep-put", t, "standalone", nb, p, m, b, run, ptimes[m]))
                        log(
                            f"run {run}/{runs} {t:4s} {mib:2d} MiB max_value_size {_fmt(p):>7s}: GET "
                            f"{statistics.median(times[m]):7.3f} ms {results[-2].gbs:5.2f} GB/s, PUT "
                            f"{statistics.median(ptimes[m]):7.3f} ms {results[-1].gbs:5.2f} GB/s"
                        )
            finally:
                for p in parts:
                    for k in keys[p]:
                        tiers[p].delete(k)
        finally:
            for tier in tiers.values():
                tier.close()
    return results


def bench_pieces(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx GET with each cap on the bytes one receive takes (the tier's ``piece``), interleaved."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    results = []
    for t, url in urls.items():
        tier = open_tier(url)
        dflt = _piece_name(tier.piece)  # the tier's own choice for this transport
        keys = [new_key() for _ in range(pool.num_slots)]
        try:
            for i, k in enumerate(keys):
                tier.put(k, pool.slot(i))

            def get(i, p):
                tier.piece = p
                tier.get_into(keys[i % pool.num_slots], pool.slot(i % pool.num_slots))

            results += knob_runs("pieces-get", t, nb, "GET", PIECES, _piece_name, dflt, get, runs, repeats, warmup, log)
        finally:
            for k in keys:
                tier.delete(k)
            tier.close()
    return results


def bench_send_buffers(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx PUT through data connections opened with each SO_SNDBUF (the tier's ``send_buffer``), interleaved:
    one tier per buffer size, its pooled connections reopened with that size."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    results = []
    for t, url in urls.items():
        tiers = {}
        try:
            for b in SEND_BUFFERS:
                tier = tiers[b] = open_tier(url)
                dflt = _sndbuf_name(tier.send_buffer)  # the tier's own choice for this transport
                tier.send_buffer = b
                tier._node.clear()  # the probe opened one with the tier's own
            written: dict[str, list[str]] = {_sndbuf_name(b): [] for b in SEND_BUFFERS}
            buffer_of = {_sndbuf_name(b): b for b in SEND_BUFFERS}

            def put(i, b):
                k = new_key()
                written[_sndbuf_name(b)].append(k)
                if not tiers[b].put(k, pool.slot(i % pool.num_slots)):
                    raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

            def after(m, i):
                tiers[buffer_of[m]].delete(written[m].pop())

            results += knob_runs(
                "sndbuf-put", t, nb, "PUT", SEND_BUFFERS, _sndbuf_name, dflt, put, runs, repeats, warmup, log, after
            )
        finally:
            for tier in tiers.values():
                tier.close()
    return results


def bench_sealed(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx GET and PUT through a tier in the clear and a sealed one (``"encryption"``: AES-256-GCM, a key file
    written here), interleaved in the same run, same slots, same server."""
    import tempfile

    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    clear, sealed = SEALED_METHODS
    results = []
    with tempfile.TemporaryDirectory(prefix="kvx-bench-seal-") as d:
        key_file = os.path.join(d, "key")
        with open(key_file, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        for t, url in urls.items():
            tiers = {clear: open_tier(url), sealed: open_tier(url, encryption={"key_file": key_file})}
            keys = {m: [new_key() for _ in range(pool.num_slots)] for m in tiers}
            try:
                for m, tier in tiers.items():
                    for i, k in enumerate(keys[m]):
                        if not tier.put(k, pool.slot(i)):
                            raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")
                # what a sealed GET returns is the chunk, bit for bit
                check = torch.empty_like(pool.slot(0))
                tiers[sealed].get_into(keys[sealed][0], check)
                if not torch.equal(check.view(torch.uint8), pool.slot(0).view(torch.uint8)):
                    raise RuntimeError("sealed GET returned other bytes than were put")
                written: dict[str, list[str]] = {m: [] for m in tiers}

                def get(i, m):
                    tiers[m].get_into(keys[m][i % pool.num_slots], pool.slot(i % pool.num_slots))

                def put(i, m):
                    k = new_key()
                    written[m].append(k)
                    if not tiers[m].put(k, pool.slot(i % pool.num_slots)):
                        raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

                def after(m, i):
                    tiers[m].delete(written[m].pop())

                for run in range(1, runs + 1):
                    gt = time_interleaved({m: (lambda i, m=m: get(i, m)) for m in tiers}, repeats, warmup)
                    pt = time_interleaved({m: (lambda i, m=m: put(i, m)) for m in tiers}, repeats, warmup, after)
                    for m in tiers:
                        b = clear if m != clear else None
                        results.append(Result("sealed-get", t, "standalone", nb, None, m, b, run, gt[m]))
                        results.append(Result("sealed-put", t, "standalone", nb, None, m, b, run, pt[m]))
                    gs, ps = (
                        statistics.median(gt[clear]) / statistics.median(gt[sealed]),
                        statistics.median(pt[clear]) / statistics.median(pt[sealed]),
                    )
                    log(
                        f"run {run}/{runs} {t:4s} {mib:2d} MiB sealed/clear throughput: GET {gs:.2f} "
                        f"({statistics.median(gt[sealed]):.3f} vs {statistics.median(gt[clear]):.3f} ms), PUT "
                        f"{ps:.2f} ({statistics.median(pt[sealed]):.3f} vs {statistics.median(pt[clear]):.3f} ms)"
                    )
            finally:
                for m, tier in tiers.items():
                    for k in keys[m]:
                        tier.delete(k)
                    tier.close()
    return results


# ------------------------------------------------------------------------------------------ lookups
def bench_lookup(deployment: str, tier, r, repeats: int, warmup: int, log) -> list[Result]:
    """``contains_many`` of 256 stored keys vs a redis-py pipeline of 256 EXISTS; every repeat and method asks
    for keys nobody asked for before (so neither a cache in the tier nor one anywhere else answers)."""
    tiny = torch.zeros(8, 2, 1, 8, 4, dtype=torch.bfloat16)  # 1 KiB chunks: only the keys matter
    kvx_sets = [[new_key() for _ in range(LOOKUP_KEYS)] for _ in range(repeats + warmup)]
    py_sets = [[new_key() for _ in range(LOOKUP_KEYS)] for _ in range(repeats + warmup)]
    enc = b"".join(codec.encode(tiny, "0" * 32, FINGERPRINT))
    for ks in kvx_sets:
        for k in ks:
            tier.put(k, tiny)
    for ks in py_sets:
        pipe = r.pipeline(transaction=False)
        for k in ks:
            pipe.set(k, enc)
        pipe.execute()
    try:
        # a repeat's calls take consecutive indices: i // len(LOOKUP_METHODS) is the repeat
        def kvx(i):
            got = tier.contains_many(kvx_sets[i // len(LOOKUP_METHODS)])
            if got is None or not all(got):
                raise RuntimeError(
                    f"kvx contains_many of {LOOKUP_KEYS} stored keys answered "
                    f"{'None' if got is None else f'{sum(got)} present'} "
                    f"(lookup_wait_ms {LOOKUP_WAIT_MS})"
                )

        def base(i):
            pipe = r.pipeline(transaction=False)
            for k in py_sets[i // len(LOOKUP_METHODS)]:
                pipe.exists(k)
            got = pipe.execute()
            if sum(got) != LOOKUP_KEYS:
                raise RuntimeError(f"redis-py EXISTS of {LOOKUP_KEYS} stored keys: {sum(got)} present")

        times = time_interleaved({LOOKUP_BASE: base, LOOKUP_KVX: kvx}, repeats, warmup)
    finally:
        for ks in kvx_sets:
            for k in ks:
                tier.delete(k)
        for ks in py_sets:
            pipe = r.pipeline(transaction=False)
            for k in ks:
                pipe.delete(k)
            pipe.execute()
    out = [
        Result(
            "lookup", "tcp", deployment, LOOKUP_KEYS, None, m, LOOKUP_BASE if m != LOOKUP_BASE else None, 1, times[m]
        )
        for m in LOOKUP_METHODS
    ]
    for x in out:
        log(
            f"lookup {deployment:10s} {x.method:37s} p50 {x.median:7.3f} ms p90 {percentile(x.times, 90):7.3f} ms "
            f"p99 {percentile(x.times, 99):7.3f} ms"
        )
    return out


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 MiB chunks, a 2 MiB sweep, 1 run of 3 repeats, 20 lookups"
    )
    ap.add_argument(
        "--out",
        default=os.path.join(REPO, "benchmarks", "results"),
        help="directory for redis_cpu.md and redis_cpu.csv",
    )
    ap.add_argument("--sizes", default=None, help="chunk sizes in MiB, comma-separated (default 1,4,16)")
    ap.add_argument(
        "--runs",
        type=int,
        default=None,
        help="whole measurements back to back (default 5: on a shared machine a busy stretch spoils a "
        "run, not the median of five; quick 1)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed ops per method, case and run (default 50 up to 1 MiB, 30 up to 4 MiB, 15 above; quick 3)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed ops per method, case and run")
    ap.add_argument(
        "--sweep-mib",
        default=None,
        help="chunk sizes of the part-size sweep, MiB, comma-separated (default 4,16; quick 2; '' = none)",
    )
    ap.add_argument("--lookup-repeats", type=int, default=None, help="lookups per method (default 300; quick 20)")
    ap.add_argument(
        "--rotate-mib", type=int, default=None, help="slots and keys rotated over per size (default 64 MiB; quick 4)"
    )
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-node cluster lookup")
    ap.add_argument("--no-pieces", action="store_true", help="skip the GET receive-step sweep")
    ap.add_argument("--no-sndbuf", action="store_true", help="skip the PUT send-buffer sweep")
    ap.add_argument("--no-sealed", action="store_true", help="skip sealed (encrypted) against in-the-clear chunks")
    ap.add_argument(
        "--sealed-only",
        action="store_true",
        help="only sealed against in-the-clear GET / PUT (at --sizes, default 4 MiB), into redis_sealed_cpu.md/.csv",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([1] if args.quick else [1, 4, 16])
    except ValueError:
        ap.error(f"--sizes: expected MiB as integers, comma-separated, got {args.sizes!r}")
    runs = args.runs if args.runs is not None else (1 if args.quick else 5)
    try:
        sweep = (
            [int(x) for x in args.sweep_mib.split(",") if x.strip()]
            if args.sweep_mib is not None
            else ([2] if args.quick else [4, 16])
        )
    except ValueError:
        ap.error(f"--sweep-mib: expected MiB as integers, comma-separated, got {args.sweep_mib!r}")
    lookups = args.lookup_repeats if args.lookup_repeats is not None else (20 if args.quick else 300)
    args.rotate_mib = args.rotate_mib if args.rotate_mib is not None else (4 if args.quick else 64)
    if args.repeats is not None:
        repeats = {mib: args.repeats for mib in set(sizes) | set(sweep)}
    else:
        repeats = {
            mib: 3 if args.quick else (50 if mib <= 1 else 30 if mib <= 4 else 15) for mib in set(sizes) | set(sweep)
        }
    if (
        runs < 1
        or args.warmup < 0
        or lookups < 1
        or args.rotate_mib < 1
        or any(x < 1 for x in sizes + sweep)
        or any(x < 1 for x in repeats.values())
    ):
        ap.error(
            "--runs, --repeats, --sizes, --sweep-mib, --lookup-repeats and --rotate-mib must be >= 1, --warmup >= 0"
        )
    try:
        import hiredis
        import redis

        from kvx.testing import redis_server
    except ImportError as e:
        print(f"bench_redis: needs redis-py and hiredis ({e})", file=sys.stderr)
        return 2

    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        print(f"warning: load average {load1:.2f}: timings will be noisy", file=sys.stderr)
    cmd = ("python benchmarks/bench_redis.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    log = lambda s: print(s, flush=True)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    t_start = time.perf_counter()
    info: dict = {
        "server_version": server_version(),
        "redis_py": redis.__version__,
        "hiredis": hiredis.__version__,
        "load": load1,
        "notes": [],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "default_part": default_part(),
        "wmem_max": wmem_max(),
    }
    rotate = args.rotate_mib * MiB
    if args.sealed_only:
        return sealed_main(
            args,
            [int(x) for x in args.sizes.split(",")] if args.sizes else [TARGET_MIB],
            runs,
            repeats,
            rotate,
            g,
            log,
            info,
            cmd,
        )
    results: list[Result] = []
    with redis_server.RedisServer(unix_socket=True) as srv:
        urls = {"tcp": srv.url, "unix": srv.unix_url}
        rs, more = bench_get_put(urls, sizes, runs, repeats, args.warmup, rotate, g, log)
        results += rs
        info.update(more)
        info["wake"] = server_wake(srv.url, 300 if args.quick else 1200)
        log("PING after the server idled " + ", ".join(f"{g:g} ms: {us:.0f} us" for g, us in info["wake"].items()))
        if not args.no_pieces:
            results += bench_pieces(
                urls, TARGET_MIB, runs, repeats.get(TARGET_MIB, 3 if args.quick else 30), args.warmup, rotate, g, log
            )
        if not args.no_sndbuf:
            results += bench_send_buffers(
                urls, TARGET_MIB, runs, repeats.get(TARGET_MIB, 3 if args.quick else 30), args.warmup, rotate, g, log
            )
        if not args.no_sealed:
            results += bench_sealed(
                urls,
                TARGET_MIB if not args.quick else sizes[0],
                runs,
                repeats.get(TARGET_MIB, 3 if args.quick else 30),
                args.warmup,
                rotate,
                g,
                log,
            )
        for mib in sweep:
            results += bench_sweep(urls, mib, list(PART_SIZES), runs, repeats[mib], args.warmup, rotate, g, log, info)
        tier, r = open_tier(srv.url, lookup_wait_ms=LOOKUP_WAIT_MS), redis_py(srv.url)
        try:
            results += bench_lookup("standalone", tier, r, lookups, args.warmup, log)
        finally:
            tier.close()
            r.close()
    if args.no_cluster:
        info["cluster_skipped"] = "--no-cluster."
    else:
        results += run_cluster_lookup(lookups, args.warmup, log, info)
    info["cpu_costs"] = cpu_costs(TARGET_MIB * MiB)
    info["elapsed"] = time.perf_counter() - t_start
    info["load_end"] = os.getloadavg()[0]
    info["repeats_desc"] = (
        ", ".join(f"{repeats[m]} repeats at {m} MiB" for m in sorted(repeats)) + f", {lookups} lookups"
    )
    os.makedirs(args.out, exist_ok=True)
    md, csv_path = os.path.join(args.out, "redis_cpu.md"), os.path.join(args.out, "redis_cpu.csv")
    write_csv(csv_path, results)
    tgt = write_md(md, results, info, args, cmd, args.quick)
    with open(md) as f:
        print(f.read())
    if any(r.section.startswith("sealed-") for r in results):
        smd = os.path.join(args.out, "redis_sealed_cpu.md")
        for t, op, ratio, ok in write_sealed_md(smd, results, info, cmd, args.quick):
            if not args.quick:
                log(f"target sealed {op} >= {SEALED_TARGET:.0%} of clear ({t}): {ratio:.3f} {verdict(ok)}")
        log(f"wrote {smd}")
    for (name, where), (val, ok) in tgt.items():
        log(f"target {name} ({where}): {val:.3f} {'met' if ok else 'MISSED'}")
    log(f"wrote {md} and {csv_path}")
    return 0


def sealed_main(args, sizes, runs, repeats, rotate, g, log, info, cmd) -> int:
    """``--sealed-only``: sealed against in-the-clear GET / PUT at each size, TCP and unix socket."""
    from kvx.testing import redis_server

    results: list[Result] = []
    with redis_server.RedisServer(unix_socket=True) as srv:
        urls = {"tcp": srv.url, "unix": srv.unix_url}
        for mib in sizes:
            reps = args.repeats if args.repeats is not None else (3 if args.quick else 30)
            results += bench_sealed(urls, mib, runs, reps, args.warmup, rotate, g, log)
    info["cpu_costs"] = cpu_costs(TARGET_MIB * MiB)
    os.makedirs(args.out, exist_ok=True)
    md, csv_path = os.path.join(args.out, "redis_sealed_cpu.md"), os.path.join(args.out, "redis_sealed_cpu.csv")
    write_csv(csv_path, results)
    judged = write_sealed_md(md, results, info, cmd, args.quick)
    with open(md) as f:
        print(f.read())
    for t, op, ratio, ok in judged:
        if not args.quick:
            log(f"target sealed {op} >= {SEALED_TARGET:.0%} of clear ({t}): {ratio:.3f} {verdict(ok)}")
    log(f"wrote {md} and {csv_path}")
    return 0


def run_cluster_lookup(lookups: int, warmup: int, log, info: dict) -> list[Result]:
    """The lookup on a 3-node cluster, if ``RedisClusterServers`` and the tier's cluster mode work here."""
    from kvx.testing import redis_server

    try:
        cluster_cm = redis_server.RedisClusterServers(nodes=3)
        cl = cluster_cm.__enter__()
    except Exception as e:  # noqa: BLE001 - a cluster that does not start is reported, not fatal
        info["cluster_skipped"] = f"RedisClusterServers(nodes=3) did not start ({type(e).__name__}: {e})."
        log(f"cluster skipped: {info['cluster_skipped']}")
        return []
    try:
        tier = open_tier(cl.url, lookup_wait_ms=LOOKUP_WAIT_MS, cluster=True)
        r = cl.client()
        try:
            return bench_lookup("cluster (3 nodes)", tier, r, lookups, warmup, log)
        except Exception as e:  # noqa: BLE001 - the standalone results stand; say why this one is missing
            info["cluster_skipped"] = f"the lookup on the 3-node cluster failed ({type(e).__name__}: {e})."
            log(f"cluster lookup failed: {info['cluster_skipped']}")
            return []
        finally:
            tier.close()
            r.close()
    finally:
        cluster_cm.__exit__(None, None, None)


# ------------------------------------------------------------------------------------------ pytest-benchmark
# ``pytest benchmarks/bench_redis.py --benchmark-only``: kvx and redis-py at 4 MiB over TCP, and the lookup.
# (``pytest benchmarks`` collects this file once pytest's python_files includes ``bench_*.py``.)
try:
    import pytest
except ImportError:  # the script does not need pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def _redis():
        pytest.importorskip("redis")
        pytest.importorskip("kvx.store.redis")
        redis_server = pytest.importorskip("kvx.testing.redis_server")
        with redis_server.RedisServer() as srv:
            tier, r = open_tier(srv.url, lookup_wait_ms=LOOKUP_WAIT_MS), redis_py(srv.url)
            pool = make_pool(TARGET_MIB * MiB, n_rotate(TARGET_MIB * MiB, 64 * MiB), torch.Generator().manual_seed(0))
            vals = Values(tier, r, pool)
            yield tier, r, vals
            vals.close()
            tier.close()
            r.close()

    def _rotating(fn):
        state = {"i": 0}

        def call():
            fn(state["i"])
            state["i"] += 1

        return call

    @pytest.mark.parametrize("method", [GET_KVX, GET_BASE])
    def test_get_4mib(benchmark, _redis, method):
        tier, r, vals = _redis
        raw = RawSocket(tier.config.url)
        benchmark(_rotating(get_fns(tier, r, vals, raw)[method]))
        raw.close()

    @pytest.mark.parametrize("method", [PUT_KVX, PUT_BASE])
    def test_put_4mib(benchmark, _redis, method):
        tier, r, vals = _redis
        written = {m: [] for m in PUT_METHODS}
        raw = RawSocket(tier.config.url)
        fn, after = put_fns(tier, r, vals.pool, written, raw)[method], deleter(tier, r, written)
        state = {"i": 0}

        def setup():
            if written[method]:
                after(method, 0)

        def call():
            fn(state["i"])
            state["i"] += 1

        benchmark.pedantic(call, setup=setup, rounds=20, warmup_rounds=2)
        setup()
        raw.close()

    def test_lookup_256(benchmark, _redis):
        tier, r, _ = _redis
        keys = [new_key() for _ in range(LOOKUP_KEYS)]
        tiny = torch.zeros(8, 2, 1, 8, 4, dtype=torch.bfloat16)
        for k in keys:
            tier.put(k, tiny)
        try:
            got = benchmark(tier.contains_many, keys)
            assert got is not None and all(got)
        finally:
            for k in keys:
                tier.delete(k)


if __name__ == "__main__":
    sys.exit(main())
