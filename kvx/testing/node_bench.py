"""What the ``kvx node`` benchmarks share (``benchmarks/bench_node.py``, ``benchmarks/bench_cluster.py``): the
chunk size, an engine's node-tier and CPU-tier configs, the pool file's path, and a row of their result tables.
"""

from __future__ import annotations

import os

CHUNK = 256


def row(measure: str, value, baseline: str = "", ratio: float | str = "") -> dict:
    return {"measure": measure, "value": value, "baseline": baseline, "ratio": ratio}


def shm(work: str) -> str:
    """The pool file: on /dev/shm, as kvx node's default (a tmpfs: no writeback)."""
    return f"/dev/shm/{os.path.basename(work)}.pool"


def node_tier(sock: str) -> dict:
    return {"chunk_size": CHUNK, "tiers": [{"type": "node", "socket": sock, "retry_s": 0.2}]}


def cpu_tier(size: str) -> dict:
    return {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": size}]}
