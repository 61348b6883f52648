"""benchmarks/bench_disk_put.py runs (it measures kvx's disk writer against safetensors' save_file) and
writes its results; no timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_disk_put.py"


def test_quick_run_writes_results(tmp_path):
    out = tmp_path / "res"
    (tmp_path / "d").mkdir()
    p = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path / "d"), "--tmpfs", "", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    md = (tmp_path / "res.md").read_text()
    assert "save_file" in md and "DiskTier.get accepts both" in md
    rows = (tmp_path / "res.csv").read_text().splitlines()
    assert len(rows) > 1
