"""benchmarks/bench_peer_transfer.py runs at a tiny size (2 spans of 64 KiB, 1 round) and writes its table and CSV:
every variant that can run here moved the bytes (the benchmark checks them) and has a row; no timing is asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peer_transfer.py"


def test_tiny_run_writes_the_table(tmp_path):
    stem = tmp_path / "peer"
    p = subprocess.run(
        [sys.executable, str(BENCH), "--total", "128KiB", "--chunk", "64KiB", "--reps", "1", "--out", str(stem)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    md = (tmp_path / "peer.md").read_text()
    assert "| variant | median GB/s | p10 | p90 | x socket |" in md
    for label in ("socket (baseline)", "nixl, UCX defaults", "nixl, UCX_TLS=tcp,self"):
        assert f"| {label} |" in md, md
    with open(tmp_path / "peer.csv", newline="") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert {"socket", "nixl", "nixl-tcp"} <= set(rows)
    assert float(rows["socket"]["x_socket"]) == 1.0
    for r in rows.values():
        assert int(r["bytes"]) == 128 * 1024 and int(r["spans"]) == 2 and int(r["rounds"]) == 1
        assert float(r["median_GB/s"]) > 0
