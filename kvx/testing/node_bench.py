"""What the ``kvx node`` benchmarks share (``benchmarks/bench_node.py``, ``benchmarks/bench_cluster.py``): the
chunk size, an engine's node-tier and CPU-tier configs, the pool file's path, and their result table's rows.
"""

from __future__ import annotations

import os

from ..node.daemon import NodeState
from ..node.directory import Directory
from ..node.protocol import VERSION, PoolGeometry
from ..node.requests import Requests
from .bench_timing import md_table

CHUNK = 256
OPS = ("allocate", "commit")  # a chunk stored READY


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


def directory_holding(keys: list[str], slots: int, slot_bytes: int, epoch: bytes) -> Directory:
    """A node's index in this process (no daemon), a pool of ``slots`` slots of ``slot_bytes`` with ``epoch``,
    holding ``keys`` READY, and its directory as an engine maps it (the directory benchmark's and tests' pool)."""
    geom = PoolGeometry(slots, slot_bytes)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/directory.pool", epoch)
    state.open(1, pid=1)
    requests = Requests(state)
    hello = {"version": VERSION, "role": "engine", "namespace": "a1" * 8, "model": "m", "chunk_size": 16}
    msgs = [{"op": "hello", "id": 0, "pid": 1, "slot_bytes": slot_bytes, **hello}]
    msgs += [{"op": op, "id": 2 * i + 1 + (op == "commit"), "key": k} for i, k in enumerate(keys) for op in OPS]
    for msg in msgs:
        reply = requests.request(1, msg)[0]
        if not reply["ok"]:
            raise RuntimeError(f"the node's index refused {msg['op']}: {reply}")
    return Directory(state.table, geom, epoch)
