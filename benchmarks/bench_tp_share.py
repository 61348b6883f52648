"""Loading chunks another TP size wrote (issue 36): a TP=1 worker's load time of chunks written by a TP=2 engine,
against chunks written by a TP=1 engine, in one run, on the disk and Redis tiers; and the bytes stored per chunk.

Chunks are stored as one part per KV head and a record (:mod:`kvx.connector.parts`). Each store is written as an
engine of that TP size writes it (every rank its heads' parts, then the record); a fresh tier instance (a fresh
engine's) then reads every chunk as a TP=1 worker does (:meth:`kvx.connector.parts.PartIO.read`: the record, then
every head's part into the worker's chunk buffer). The buffer is a CPU worker's, head-major (``[H, L, P, T, D]``
seen as ``[L, P, T, H, D]``, :attr:`kvx.connector.cache.RegisteredKV.head_major`: each part lands straight in its
contiguous head slice), and again a CUDA worker's, token-major (``[L, P, T, H, D]``: its DMA moves a token's heads
as one run; each part goes through a scratch buffer, as its head's slice is strided). The last row reads the same
bytes as one object per chunk (``one object``: how kvx stored a TP=1 engine's chunk before parts). The last two
read the same number of bytes stored as raw pages of a head-major page layout (vLLM's CPU backend), one part per
head, into a head-major buffer (``[H, L, S, n, run]`` seen as ``[L, S, n, H, run]``: in place) and into a
page-major one (``[L, S, n, segment_bytes]``: each part through a scratch buffer).

Shape: Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16), 256-token chunks: 32 MiB a chunk, 4 MiB a part.
Stores alternate within each round; a round takes the median per chunk over ``--chunks`` chunks; the table gives
the median over ``--rounds``. Disk: the working directory's file system (page cache warm: every row reads from
it alike). Redis: one ``redis-server`` on loopback TCP, ``max_value_size`` 64 MiB (one value per part).

    python benchmarks/bench_tp_share.py [--rounds 5] [--chunks 8] [--quick] [--out DIR]

Writes ``tp_share_cpu.{md,csv}`` under ``benchmarks/results`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "benchmarks", "results")
FP = "bench-tp-share"
CASES = (
    "written by TP=1",
    "written by TP=2",
    "written by TP=1, token-major buffer",
    "written by TP=2, token-major buffer",
    "one object",
    "raw pages by head, head-major buffer",
    "raw pages by head, page-major buffer",
)


def shares(tp: int, heads: int, layers: int):
    from kvx.connector.parts import Share

    n = heads // tp
    return [Share((r * n, (r + 1) * n), heads, (0, layers)) for r in range(tp)]


def keys(prefix: int, n: int) -> list[str]:
    return [f"{prefix:08x}{i:024x}" for i in range(n)]


def write_store(tier, chunks, tp: int, heads: int, layers: int, prefix: int, fmt="canonical") -> tuple[list[str], int]:
    """Every rank of a ``tp`` engine writes its parts of each chunk, then the record. Returns the keys and the
    bytes stored per chunk (parts and record as the tier counts them). ``fmt`` "pages": ``chunks`` are raw pages
    split by head, ``[L, S, n, H, run]`` (TP=1 only)."""
    from kvx.connector.parts import PartIO, record_of

    before = tier.usage()
    ks = keys(prefix, len(chunks))
    for key, chunk in zip(ks, chunks):
        for sh in shares(tp, heads, layers):
            a, b = sh.heads
            PartIO(sh, fmt).write(tier, key, chunk.narrow(3, a, b - a).contiguous(), {})
        tier.put(key, record_of([(0, layers)], heads).encode(), {"kind": "record"})
    return ks, (tier.usage() - before) // len(chunks)


def timed_reads(read, ks) -> float:
    out = []
    for key in ks:
        t0 = time.perf_counter()
        read(key)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run_tier(name: str, open_tier, args, shape) -> list[dict]:
    import torch

    from kvx.connector.parts import PartIO

    layers, heads = shape[0], shape[3]
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(args.chunks)]
    writer = open_tier()
    k1, bytes1 = write_store(writer, chunks, 1, heads, layers, 1)
    k2, bytes2 = write_store(writer, chunks, 2, heads, layers, 2)
    k0 = keys(3, len(chunks))
    before = writer.usage()
    for key, chunk in zip(k0, chunks):
        writer.put(key, chunk, {})
    bytes0 = (writer.usage() - before) // len(chunks)
    # the same bytes as raw pages of a head-major page layout (vLLM's CPU backend): [L, S, n, H, run], 16-token blocks
    pshape = (layers, 1, shape[2] // 16, heads, 16 * shape[1] * shape[4] * 2)
    pages = [c.view(torch.uint8).reshape(pshape) for c in chunks]  # any bytes do: only their size matters here
    kp, bytesp = write_store(writer, pages, 1, heads, layers, 4, fmt="pages")
    writer.close()

    reader = open_tier()  # a fresh engine's tier
    out = torch.empty(shape, dtype=torch.bfloat16)
    head_major = torch.empty((heads, *shape[:3], shape[4]), dtype=torch.bfloat16).movedim(0, 3)
    io = PartIO(shares(1, heads, layers)[0], "canonical")
    io_pages = PartIO(shares(1, heads, layers)[0], "pages")
    pages_head_major = torch.empty((heads, *pshape[:3], pshape[4]), dtype=torch.uint8).movedim(0, 3)
    pages_out = torch.empty((*pshape[:3], heads * pshape[4]), dtype=torch.uint8)  # [L, S, n, segment_bytes]
    reads = {
        CASES[0]: (lambda key: io.read(reader, key, head_major), k1),
        CASES[1]: (lambda key: io.read(reader, key, head_major), k2),
        CASES[2]: (lambda key: io.read(reader, key, out), k1),
        CASES[3]: (lambda key: io.read(reader, key, out), k2),
        CASES[4]: (lambda key: reader.get_into(key, out), k0),
        CASES[5]: (lambda key: io_pages.read(reader, key, pages_head_major), kp),
        CASES[6]: (lambda key: io_pages.read(reader, key, pages_out), kp),
    }
    for read, ks in reads.values():  # warm-up: the first reads open connections and fill caches
        read(ks[0])
    samples = {c: [] for c in CASES}
    for _ in range(args.rounds):
        for case, (read, ks) in reads.items():
            samples[case].append(timed_reads(read, ks))
    reader.close()
    base = statistics.median(samples[CASES[0]])
    stored = dict(zip(CASES, (bytes1, bytes2, bytes1, bytes2, bytes0, bytesp, bytesp)))
    return [
        {
            "tier": name,
            "case": case,
            "load_ms": round(statistics.median(samples[case]) * 1e3, 3),
            "ratio": round(statistics.median(samples[case]) / base, 3),
            "bytes_per_chunk": stored[case],
        }
        for case in CASES
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="a small shape, 2 rounds of 2 chunks (a smoke run)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    shape = (32, 2, 256, 8, 128)  # [L, P, T, H, D]
    if args.quick:
        shape, args.rounds, args.chunks = (4, 2, 32, 8, 16), 2, 2
    from kvx.store.disk import DiskTier
    from kvx.store.redis import RedisTier, RedisTierConfig
    from kvx.store.tier import TierContext
    from kvx.testing.redis_server import RedisServer

    rows = []
    with tempfile.TemporaryDirectory(dir=REPO if not args.quick else None) as work:
        rows += run_tier("disk", lambda: DiskTier.at(os.path.join(work, "disk"), None, FP), args, shape)
        with RedisServer() as server:
            cfg = RedisTierConfig(type="redis", url=server.url, max_value_size="64MiB", lookup_wait_ms=1000)
            rows += run_tier("redis", lambda: RedisTier.open(cfg, TierContext(FP)), args, shape)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tp_share_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# A TP=1 worker loading chunks written by another TP size (CPU, this machine)",
        "",
        f"`python benchmarks/bench_tp_share.py --rounds {args.rounds} --chunks {args.chunks}"
        + (" --quick" if args.quick else "")
        + f"`; chunk shape [L, P, T, H, D] = {list(shape)} bf16. Median load time per chunk (record + parts, or"
        " one object), median over rounds; ratio against chunks written by TP=1 in the same run.",
        "",
        "| tier | stored as | load ms | ratio | bytes stored per chunk |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tier']} | {r['case']} | {r['load_ms']:.3f} | {r['ratio']:.2f} | {r['bytes_per_chunk']} |" for r in rows
    ]
    with open(os.path.join(args.out, "tp_share_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
