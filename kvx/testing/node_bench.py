"""What the ``kvx node`` benchmarks share (``benchmarks/bench_node.py``, ``benchmarks/bench_cluster.py``): the
chunk size, an engine's node-tier and CPU-tier configs, the pool file's path, and their result table's rows.
"""

from __future__ import annotations

import os

from .bench_timing import md_table

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


def rows_md(rows: list[dict]) -> list[str]:
    """The markdown table of :func:`row` rows: measure, value (floats to 0.1), against, ratio (``1.23x``)."""

    def cells(r: dict) -> tuple:
        value = f"{r['value']:.1f}" if isinstance(r["value"], float) else str(r["value"])
        return r["measure"], value, r["baseline"], f"{r['ratio']:.2f}x" if r["ratio"] != "" else ""

    return md_table(["measure", "value", "against", "ratio"], [cells(r) for r in rows], "lrlr")
