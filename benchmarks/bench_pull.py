"""A pull of 64 MiB of chunks from a peer node, against moving the same bytes with nothing around them (issue 45's
measure), in one run, interleaved round by round:

- **socket**: a plain TCP stream of the bytes between two processes (``bench_peer_transfer``'s baseline);
- **nixl**: one raw NIXL READ of them (UCX's defaults: CMA between two processes of one host);
- **pull, tcp** / **pull, nixl**: two ``kvx node`` processes in a cluster (loopback) on that transport; an engine's
  index on node B misses ``--chunks`` chunks that node A holds and B pulls them: the lease (the serving node's
  CRC32C of each chunk; with A the only peer, B's ask: phase ``ask``), PENDING slots, the bytes, the CRC32C check
  here, each chunk READY as it passes, the release. Timed as an engine sees it: from its ask until every chunk is
  READY (its lookup, every 0.5 ms, reports the hit once the pull's slots are there; its load pins them and waits for
  each to turn READY, as a worker does: :meth:`kvx.node.client.NodePool.wait_ready`); new chunks every round.

Targets: a pull over TCP >= 80% of the socket stream; over NIXL (shared memory) >= 90% of the raw NIXL READ.

    python benchmarks/bench_pull.py [--chunks 16] [--chunk-size 4MiB] [--reps 7] [--out DIR]

Writes ``pull_cpu.{md,csv}`` under ``benchmarks/results`` (or ``--out``).
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
# it times the pull over bench_peer_transfer.py's own Layout and process Pair (that script's subject), so imports it
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
RESULTS = os.path.join(REPO, "benchmarks", "results")

import bench_peer_transfer as T  # noqa: E402
import torch  # noqa: E402

from kvx.node.client import NodeIndex, NodePool  # noqa: E402
from kvx.testing.bench import cpu_name  # noqa: E402
from kvx.testing.bench_timing import md_table  # noqa: E402
from kvx.testing.node_procs import Node, free_ports  # noqa: E402

NAMESPACE = bytes(range(16))
SECRET = b"kvx-bench-pull-secret-0123456789"
SETTLE_S = 1.0  # after storing every round's chunks on A: its CRC32C thread is done with them (~0.1 s) before timing


def _wait(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


class PullPair:
    """Two nodes on ``transport`` and an engine's index on each: A stores chunks, B pulls them."""

    def __init__(self, transport: str, chunks: int, chunk_bytes: int, work: str, rounds: int):
        self.name, self.chunks, self.chunk_bytes = f"pull-{transport}", chunks, chunk_bytes
        ports = free_ports(2)
        secret = os.path.join(work, f"secret-{transport}")
        with open(secret, "wb") as f:
            f.write(SECRET)
        size = str((rounds + 2) * chunks * chunk_bytes + (8 << 20))  # A holds every round's chunks at once
        self.nodes = []
        for i in range(2):
            args = ["--listen", f"127.0.0.1:{ports[i]}", "--peers", f"127.0.0.1:{ports[1 - i]}"]
            args += ["--secret-file", secret, "--transport", transport]
            sock = os.path.join(work, f"{transport}{i}.sock")
            log = os.path.join(work, f"{transport}{i}.log")
            self.nodes.append(
                Node(sock, size, str(chunk_bytes), log, *args, pool=f"/dev/shm/kvxb-{os.getpid()}-{transport}{i}")
            )
        for n in self.nodes:
            n.start()
        self.a, self.b = (self._index(n) for n in self.nodes)
        self.pool = NodePool((chunk_bytes,), torch.uint8, None, (chunk_bytes,))
        self.pool.attach(self.a.pool, background=False)
        self.pool_b = NodePool((chunk_bytes,), torch.uint8, None, (chunk_bytes,))  # B's, as its engine's workers map it
        self.pool_b.attach(self.b.pool, background=False)
        self.round = 0
        self.phases: list[dict] = []  # node B's account of each pull (kvx node stats: last_pull)
        self.data = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        # every round's chunks are on A before any pull is timed, as a peer's chunks were stored before another
        # node misses them: A's commit of them (and its CRC32C of each, on its own thread) is not inside a pull
        self.stored = [self._store(r + 1) for r in range(rounds)]
        time.sleep(SETTLE_S)

    def _store(self, r: int) -> list[str]:
        keys = [f"{(r << 32) + j:032x}" for j in range(self.chunks)]
        for k in keys:
            slot = self.a.allocate(k)
            self.pool.slot(slot).copy_(self.data)
            self.a.commit(k)
        return keys

    def _index(self, node: Node) -> NodeIndex:
        index = NodeIndex(node.socket, NAMESPACE, "bench", 16, self.chunk_bytes, timeout=30, pull_wait_ms=60_000)
        _wait(lambda: index.contains_many(["0" * 32]) is not None and index.pool is not None, "hello")
        return index

    def transfer(self) -> float:
        keys = self.stored[self.round]
        self.round += 1
        t0 = time.perf_counter()
        while True:  # as the scheduler looks up (kvx.connector.scheduler: _locate): a pull from the first miss on
            first_miss = next((i for i, hit in enumerate(self.b.contains_many(keys)) if not hit), len(keys))
            if first_miss == len(keys) or self.b.coming(keys[first_miss:]) == len(keys) - first_miss:
                break  # the hit: an engine reports it and its workers wait for each chunk
            if not self.b.pulling(keys[first_miss:]):
                break
            time.sleep(0.0005)  # the engine's idle steps until the pull's slots are there
        slots = self.b.pin(keys)  # as the load is planned
        deadline = time.monotonic() + 30
        for k, slot in zip(keys, slots):  # as a worker's waiter: each chunk READY in turn
            if slot >= 0:
                self.pool_b.wait_ready(slot, k, deadline)
        took = time.perf_counter() - t0
        self.b.unpin(keys)
        wait_pull = time.monotonic() + 30
        while self.b.pulling(keys):  # the node's answer, untimed: the next round starts from a quiet pair
            if time.monotonic() > wait_pull:
                raise TimeoutError(f"{self.name}: no answer to the pull")
            self.b.puller.wait(0.1)
        self.phases.append(self.nodes[1].stats()["cluster"]["last_pull"])
        got = self.b.contains_many(keys)
        if not all(got):
            raise RuntimeError(f"{self.name}: pulled {sum(got)} of {len(keys)} chunks: {self.nodes[1].stats()}")
        return took

    def close(self) -> None:
        for idx in (self.a, self.b):
            idx.close()
        self.pool.close()
        self.pool_b.close()
        for n in self.nodes:
            n.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-size", default="4MiB")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    chunk_bytes = T.parse_size(args.chunk_size)
    total = args.chunks * chunk_bytes
    layout = T.Layout(total=args.chunks * chunk_bytes, chunk=chunk_bytes)
    loadavg = os.getloadavg()[0]
    pairs: list = []
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvxb", dir="/tmp") as work:
        try:
            for name in ("socket", "nixl"):
                p = T.Pair(name, layout)
                p.transfer()
                p.check()
                pairs.append(p)
            for transport in ("tcp", "nixl"):
                p = PullPair(transport, args.chunks, chunk_bytes, work, args.reps + 1)
                p.transfer()  # warm-up: connections, the pools' first pages
                pairs.append(p)
            times = {p.name: [] for p in pairs}
            for r in range(args.reps):
                for p in pairs:
                    times[p.name].append(p.transfer())
                print(f"round {r + 1}: " + ", ".join(f"{n} {total / t[-1] / 1e9:.2f} GB/s" for n, t in times.items()))
            for p in pairs[:2]:
                p.check()
        finally:
            for p in pairs:
                p.close()
    gbs = {n: statistics.median(total / s / 1e9 for s in t) for n, t in times.items()}
    phases = {p.name: p.phases[1:] for p in pairs if isinstance(p, PullPair)}  # the warm-up's left out
    rows = [
        {"variant": n, "median_gbs": round(g, 3), "vs": base, "ratio": round(g / gbs[base], 3)}
        for n, g, base in (
            ("socket", gbs["socket"], "socket"),
            ("nixl", gbs["nixl"], "nixl"),
            ("pull-tcp", gbs["pull-tcp"], "socket"),
            ("pull-nixl", gbs["pull-nixl"], "nixl"),
        )
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pull_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# A pull from a peer node against the same bytes moved bare",
        "",
        f"Machine: {cpu_name()}; load average {loadavg:.2f} at start. "
        f"Command: `python benchmarks/bench_pull.py {shown}`",
        "",
        f"{args.chunks} chunks of {chunk_bytes >> 20} MiB ({total >> 20} MiB) per transfer; {args.reps} rounds, the "
        "variants in turn within each; medians. A pull is timed from the engine's ask until every chunk is READY in "
        "its node (the lease with the peer's CRC32C, which with one peer is the ask, the slots, the bytes, the check; "
        "each chunk READY as it passes, before the release and the node's answer), as the engine's lookup and its "
        "workers see the chunks.",
        "",
    ]
    lines += md_table(
        ["variant", "median GB/s", "against", "ratio"],
        [(r["variant"], f"{r['median_gbs']:.2f}", r["vs"], f"{r['ratio']:.2f}x") for r in rows],
        "lrlr",
    )
    names = [k for k in next(iter(phases.values()))[0] if k.endswith("_ms")]
    lines += [
        "",
        "Where a pull's time goes: the pulling node's phases (`kvx node stats`: `last_pull`), medians in ms, up to "
        "its answer (the release and the end of the pull come after the chunks are READY, so they may run past the "
        "timed pull).",
        "",
    ]
    lines += md_table(
        ["variant", *(k[: -len("_ms")] for k in names), "whole pull"],
        [
            (
                n,
                *(f"{statistics.median(ph[k] for ph in got):.2f}" for k in names),
                f"{statistics.median(times[n]) * 1e3:.2f}",
            )
            for n, got in phases.items()
        ],
        "l" + "r" * (len(names) + 1),
    )
    path = os.path.join(args.out, "pull_cpu.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
