"""What Redis holds per chunk (issue 46, item 7): ``used_memory`` grown per stored chunk, against the chunk's bytes,
for the chunks of ``bench_tp_share.py`` (its shape and its ways of storing a chunk, imported from it), with the
value layout kvx uses now and the one before (values sized for Redis's allocator, or not).

Redis's allocator (jemalloc) gives a value the smallest of its size classes that holds it (four per doubling:
4, 5, 6, 7, 8 MiB ...). A KV head's part is 4 MiB of payload plus a codec header: stored as one value it takes a
5 MiB allocation. Now a value is split where that takes less memory (:func:`kvx.store.redis.layout.value_split`):
4 MiB - 12 bytes (a full 4 MiB class) and one value of what is left, published under one manifest as before.

Layouts: ``after``: kvx as it is; ``before``: the split kvx made before (one value while the payload fits
``max_value_size``, the header riding along; else equal parts), put back in place of ``value_split`` for the run
(headers are under 1 KiB, so the payload's size is the value's less 1 KiB for that rule). Each case: a fresh
``FLUSHALL``, one chunk written first (connections and buffers warm), then ``used_memory`` (``INFO memory``) before
and after writing ``--chunks`` chunks; the ratio is the growth per chunk over the chunk's payload bytes. Load ms:
the median time a TP=1 worker reads a chunk back (record + parts, or the object), informative only; then one
head's part read back in either layout, the reads interleaved (what the split costs a read).

    python benchmarks/bench_redis_memory.py [--chunks 8] [--quick] [--out DIR]

Writes ``redis_memory_cpu.{md,csv}`` under ``benchmarks/results`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
RESULTS = os.path.join(REPO, "benchmarks", "results")
FP = "bench-redis-memory"
CASES = ("written by TP=1", "written by TP=2", "one object", "raw pages by head")
LAYOUTS = ("before", "after")
PART_SIZES = ("64MiB", "4MiB")  # bench_tp_share's max_value_size, and the tier's default
TARGET = 0.03  # what the tier may hold beyond a chunk's bytes


def legacy_split(total: int, limit: int) -> tuple[int, int]:
    """The split kvx made before issue 46: one value while the payload (here: ``total`` less 1 KiB, more than any
    header) fits ``limit``, else equal parts."""
    n = max(1, -(-(total - 1024) // limit))
    psize = -(-total // n)
    return -(-total // psize), psize


@contextmanager
def layout(name: str):
    import kvx.store.redis.tier as tier_module

    saved = tier_module.value_split
    if name == "before":
        tier_module.value_split = legacy_split
    try:
        yield
    finally:
        tier_module.value_split = saved


def run_case(server, part_size: str, case: str, chunks, shape, args) -> dict:
    import bench_tp_share as tp
    import torch

    from kvx.connector.parts import PartIO
    from kvx.store.redis import RedisTier, RedisTierConfig
    from kvx.store.tier import TierContext

    layers, heads = shape[0], shape[3]
    cfg = RedisTierConfig(
        type="redis", url=server.url, max_value_size=part_size, lookup_wait_ms=1000, timeout_ms=30_000
    )  # a busy machine: a slow op is not what this measures
    c = server.client()
    c.flushall()
    tier = RedisTier.open(cfg, TierContext(FP))
    pshape = (layers, 1, shape[2] // 16, heads, 16 * shape[1] * shape[4] * 2)  # bench_tp_share's raw pages
    if case == "raw pages by head":
        data = [x.view(torch.uint8).reshape(pshape) for x in chunks]
    else:
        data = chunks
    tp_size = 2 if case == "written by TP=2" else 1
    fmt = "pages" if case == "raw pages by head" else "canonical"

    def write(xs, prefix):
        if case == "one object":
            ks = tp.keys(prefix, len(xs))
            for key, x in zip(ks, xs):
                assert tier.put(key, x, {})
            return ks
        return tp.write_store(tier, xs, tp_size, heads, layers, prefix, fmt)[0]

    write(data[:1], 9)  # warm: connections, the server's buffers
    before, keys_before = int(c.info("memory")["used_memory"]), c.dbsize()
    ks = write(data, 5)
    grown = (int(c.info("memory")["used_memory"]) - before) / len(data)
    values = (c.dbsize() - keys_before) / len(data)
    tier.close()

    reader = RedisTier.open(cfg, TierContext(FP))
    if case == "one object":
        out = torch.empty(shape, dtype=torch.bfloat16)
        read = lambda key: reader.get_into(key, out)  # noqa: E731
    elif case == "raw pages by head":
        out = torch.empty((heads, *pshape[:3], pshape[4]), dtype=torch.uint8).movedim(0, 3)
        io = PartIO(tp.shares(1, heads, layers)[0], "pages")
        read = lambda key: io.read(reader, key, out)  # noqa: E731
    else:
        out = torch.empty((heads, *shape[:3], shape[4]), dtype=torch.bfloat16).movedim(0, 3)
        io = PartIO(tp.shares(1, heads, layers)[0], "canonical")
        read = lambda key: io.read(reader, key, out)  # noqa: E731
    read(ks[0])
    times = []
    for _ in range(args.rounds):
        for key in ks:
            t0 = time.perf_counter()
            read(key)
            times.append(time.perf_counter() - t0)
    reader.close()
    chunk_bytes = chunks[0].numel() * chunks[0].element_size()
    return {
        "max_value_size": part_size,
        "case": case,
        "chunk_bytes": chunk_bytes,
        "values_per_chunk": round(values, 2),
        "used_memory_per_chunk": round(grown),
        "ratio": round(grown / chunk_bytes, 4),
        "load_ms": round(statistics.median(times) * 1e3, 3),
    }


def part_reads(server, part_bytes: int, args) -> dict[str, float]:
    """Median ms of a GET of one head's part (``part_bytes`` + its header) stored in each layout, the layouts'
    reads interleaved (a busy machine slows both alike): the split adds a round trip (manifest, then values)."""
    import torch

    from kvx.store.redis import RedisTier, RedisTierConfig
    from kvx.store.tier import TierContext

    server.client().flushall()
    cfg = RedisTierConfig(type="redis", url=server.url, lookup_wait_ms=1000, timeout_ms=30_000)
    x = torch.randint(0, 256, (part_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    names = {}
    for i, name in enumerate(LAYOUTS):
        with layout(name):
            tier = RedisTier.open(cfg, TierContext(FP))
            names[name] = [f"{i + 6:08x}{j:024x}" for j in range(args.chunks)]
            for key in names[name]:
                assert tier.put(key, x)
            tier.close()
    tier = RedisTier.open(cfg, TierContext(FP))
    out = torch.empty_like(x)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(5 * args.rounds):
        for name in LAYOUTS:
            for key in names[name]:
                t0 = time.perf_counter()
                tier.get_into(key, out)
                times[name].append(time.perf_counter() - t0)
    tier.close()
    return {name: round(statistics.median(ts) * 1e3, 3) for name, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="reads of every chunk for the load time")
    p.add_argument("--quick", action="store_true", help="a smaller chunk (512 KiB parts), 2 chunks (a smoke run)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    import torch

    from kvx.testing.redis_server import RedisServer

    shape = (32, 2, 256, 8, 128)  # bench_tp_share's [L, P, T, H, D]: 32 MiB a chunk, 4 MiB a head's part
    if args.quick:
        shape, args.chunks, args.rounds = (4, 2, 256, 8, 128), 2, 1
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    rows = []
    with RedisServer() as server:
        version = server.client().info("server")["redis_version"]
        allocator = server.client().info("memory")["mem_allocator"]
        for name in LAYOUTS:
            with layout(name):
                for part_size in PART_SIZES:
                    for case in CASES:
                        row = {"layout": name, **run_case(server, part_size, case, chunks, shape, args)}
                        print(row, flush=True)
                        rows.append(row)
        part_bytes = chunks[0].numel() * 2 // shape[3]
        reads = part_reads(server, part_bytes, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "redis_memory_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Redis memory per stored chunk (CPU, this machine)",
        "",
        f"`python benchmarks/bench_redis_memory.py --chunks {args.chunks}" + (" --quick" if args.quick else "") + "`; "
        f"redis-server {version} ({allocator}), loopback TCP; chunk shape [L, P, T, H, D] = {list(shape)} bf16 "
        f"({chunks[0].numel() * 2} bytes), stored as `bench_tp_share.py` stores it. `used_memory` grown per chunk "
        f"(record, parts, manifests, keys) over the chunk's bytes; target: within {TARGET:.0%}. Values: Redis keys "
        "per chunk. Load ms: a TP=1 worker's read of a chunk, median (informative).",
        "",
        "| layout | max_value_size | stored as | values | used_memory per chunk | ratio | load ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['layout']} | {r['max_value_size']} | {r['case']} | {r['values_per_chunk']:g} | "
        f"{r['used_memory_per_chunk']} | {r['ratio']:.4f} | {r['load_ms']:.3f} |"
        for r in rows
    ]
    lines += [
        "",
        f"One head's part ({part_bytes} bytes + its header) read back with `get_into`, the layouts' reads "
        f"interleaved, median of {5 * args.rounds * args.chunks}: "
        + ", ".join(f"{name} {ms:.3f} ms" for name, ms in reads.items())
        + f" ({reads['after'] / reads['before']:.2f}x: the manifest's round trip).",
    ]
    with open(os.path.join(args.out, "redis_memory_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
