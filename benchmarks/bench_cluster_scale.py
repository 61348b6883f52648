"""What a ``kvx node`` cluster's lookups cost as it grows (the figures behind the README's "Nodes across hosts").

A miss asks every peer at once (``have``: a fan-out; no index). For ``--nodes`` N in turn, N node processes on this
host's loopback, each the peer of every other (TCP, the cluster secret), and an engine's index on node 0:

1. **A miss everywhere**: the engine's pull of 16 keys no node holds, from its ask to the node's answer (N-1
   ``have`` requests in parallel); ``--reps`` times, median and p90.
2. **A pull of one 1 MiB chunk** that only the last node holds (the fan-out, the lease, the read, the CRC32C,
   the release), against the fan-out alone (1).
3. **What one ``have`` costs the node that answers it**: ``--haves`` requests from one member over one connection,
   the answering daemon's CPU time (``/proc/PID/stat``: user + system) per request.

With these, the README's model: in a cluster of N nodes where each node's engines miss ``r`` times a second, every
node answers ``(N - 1) * r`` haves a second, ``(N - 1) * r * cost`` of a core; an index (one lookup per miss in a
shared directory, one update per stored chunk) costs each node O(1) per miss instead, plus a service to run.

    python benchmarks/bench_cluster_scale.py [--nodes 2,4,8,16] [--reps 40] [--haves 2000] [--out DIR]

Writes ``cluster_scale_cpu.{md,csv}`` under ``benchmarks/results`` (or ``--out``).
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
RESULTS = os.path.join(REPO, "benchmarks", "results")

import torch  # noqa: E402

from kvx.node import handshake  # noqa: E402
from kvx.node.client import NodeIndex, NodePool  # noqa: E402
from kvx.testing.bench import cpu_name  # noqa: E402
from kvx.testing.bench_timing import percentile  # noqa: E402
from kvx.testing.node_procs import Node, free_ports  # noqa: E402

SLOT = 1 << 20
NAMESPACE = bytes(range(16))
SECRET = b"kvx-bench-cluster-secret-0123456789"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _index(node: Node) -> NodeIndex:
    index = NodeIndex(node.socket, NAMESPACE, "bench", 16, SLOT, timeout=10, retry_s=0.05, pull_wait_ms=5000)
    deadline = time.monotonic() + 10
    while index.contains_many(["0" * 32]) is None or index.pool is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the node's hello")
        time.sleep(0.01)
    return index


def _pull(index: NodeIndex, keys: list[str]) -> float:
    t0 = time.perf_counter()
    while index.pulling(keys):
        time.sleep(0.0001)
    return time.perf_counter() - t0


def measure(n: int, reps: int, haves: int, work: str) -> dict:
    ports = free_ports(n)
    secret = os.path.join(work, "secret")
    with open(secret, "wb") as f:
        f.write(SECRET)
    nodes = []
    try:
        for i, port in enumerate(ports):
            peers = ",".join(f"127.0.0.1:{p}" for p in ports if p != port)
            args = ["--listen", f"127.0.0.1:{port}", "--peers", peers, "--secret-file", secret]
            sock = os.path.join(work, f"n{n}-{i}.sock")
            nodes.append(Node(sock, "8MiB", str(SLOT), None, *args, pool=sock + ".pool").start())
        first, last = _index(nodes[0]), _index(nodes[-1])
        pool = NodePool((SLOT,), torch.uint8, None, (SLOT,))
        pool.attach(last.pool, background=False)
        misses, pulls = [], []
        for r in range(reps):
            keys = [f"{(n << 48) + (r << 8) + j:032x}" for j in range(16)]
            misses.append(_pull(first, keys))
            k = f"{(n << 48) + (1 << 40) + r:032x}"
            slot = last.allocate(k)
            pool.slot(slot).fill_(r & 0xFF)
            last.commit(k)
            pulls.append(_pull(first, [k]))
            first.contains_many([k])
        # what one have costs the node that answers it
        sock, _ = handshake.dial(("127.0.0.1", ports[-1]), SECRET, "bench", "control", 10)
        msg = {"op": "have", "namespace": NAMESPACE.hex(), "keys": "".join(f"{j:032x}" for j in range(16))}
        pid = nodes[-1].proc.pid
        c0, t0 = _cpu_s(pid), time.perf_counter()
        for _ in range(haves):
            handshake.send(sock, msg)
            handshake.recv(sock)
        wall = time.perf_counter() - t0
        cpu = _cpu_s(pid) - c0
        sock.close()
        for idx in (first, last):
            idx.close()
        pool.close()
        return {
            "nodes": n,
            "miss_p50_ms": statistics.median(misses) * 1e3,
            "miss_p90_ms": percentile(misses, 90, "rank") * 1e3,
            "pull_1mib_p50_ms": statistics.median(pulls) * 1e3,
            "have_cpu_us": cpu / haves * 1e6,
            "have_rtt_us": wall / haves * 1e6,
        }
    finally:
        for node in nodes:
            node.stop()


def write(rows: list[dict], out: str, argv: list[str]) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cluster_scale_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cost = statistics.median(r["have_cpu_us"] for r in rows)
    lines = [
        "# kvx node cluster: lookup cost as the cluster grows (loopback, TCP)",
        "",
        f"Machine: {cpu_name()}; every node on this host. Command: "
        f"`python benchmarks/bench_cluster_scale.py {' '.join(argv)}`",
        "",
        "| nodes | a miss everywhere p50 (ms) | p90 (ms) | a 1 MiB pull p50 (ms) | CPU per have answered (us) "
        "| have round trip (us) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['miss_p50_ms']:.2f} | {r['miss_p90_ms']:.2f} | {r['pull_1mib_p50_ms']:.2f} "
            f"| {r['have_cpu_us']:.0f} | {r['have_rtt_us']:.0f} |"
        )
    lines += [
        "",
        f"The model (README): each node answers (N - 1) x r haves a second for r misses a second per node; at "
        f"{cost:.0f} us of CPU each (the median above):",
        "",
        "| nodes N | misses/s per node r | haves answered/s per node | CPU of one core |",
        "|---|---|---|---|",
    ]
    for n in (16, 64, 256, 1024):
        for r in (1, 10):
            load = (n - 1) * r
            lines.append(f"| {n} | {r} | {load} | {load * cost / 1e6:.1%} |")
    path = os.path.join(out, "cluster_scale_cpu.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4,8,16", help="cluster sizes, comma-separated (default 2,4,8,16)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--haves", type=int, default=2000)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",")]
    if any(n < 2 for n in sizes):
        ap.error(f"--nodes: expected sizes of at least 2, got {args.nodes}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvxs", dir="/tmp") as work:
        for n in sizes:
            rows.append(measure(n, args.reps, args.haves, work))
            print(rows[-1], flush=True)
    print(write(rows, args.out, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
