"""benchmarks/bench_disk_read.py runs: a small run (page cache evicted per file, not machine-wide) writes its
table and CSV, reads back exactly the data it wrote, and every ratio recomputes from the rows. No timing is
asserted."""

from __future__ import annotations

import csv
import shutil
import statistics

from tests.helpers import load_benchmark


def test_bench_disk_read_small_run(monkeypatch, tmp_path):
    bench = load_benchmark(monkeypatch, "bench_disk_read")
    out = str(tmp_path / "disk_read")
    assert bench.main(["--chunks", "2", "--runs", "2", "--fadvise", "--dir", str(tmp_path / "fs"), "--out", out]) == 0
    rows = list(csv.DictReader(open(out + ".csv")))
    methods = sorted({r["method"] for r in rows})
    n = 4 + bool(shutil.which("fio"))  # dd, kvx with 1 / 2 / 4 readers, fio where it is installed
    assert len(rows) == 2 * n and len(methods) == n
    assert all(
        float(r["gb_s"]) > 0 and abs(float(r["bytes"]) / float(r["seconds"]) / 1e9 - float(r["gb_s"])) < 1e-6
        for r in rows
    )
    md = open(out + ".md").read()
    assert "Data check after the runs: ok" in md and "(fadvise)" in md
    base = statistics.median(float(r["gb_s"]) for r in rows if r["method"].startswith("dd"))
    for m in methods:
        med = statistics.median(float(r["gb_s"]) for r in rows if r["method"] == m)
        assert f"| {m} | {med:.2f} | {med / base:.2f} |" in md
    ref = max(
        statistics.median(float(r["gb_s"]) for r in rows if r["method"] == m)
        for m in methods
        if not m.startswith("kvx")
    )
    best = max(
        statistics.median(float(r["gb_s"]) for r in rows if r["method"] == m) for m in methods if m.startswith("kvx")
    )
    assert f"{best / ref:.2f}x: {'met' if best / ref >= 0.8 else 'NOT met'}" in md


def test_bench_disk_read_sealed(monkeypatch, tmp_path):
    """``--sealed``: a sealed copy of the chunks read by 1 and 2 readers too; the data check covers it."""
    bench = load_benchmark(monkeypatch, "bench_disk_read")
    out = str(tmp_path / "disk_read")
    argv = ["--chunks", "2", "--runs", "1", "--fadvise", "--sealed", "--dir", str(tmp_path / "fs"), "--out", out]
    assert bench.main(argv) == 0
    methods = {r["method"] for r in csv.DictReader(open(out + ".csv"))}
    assert {"kvx sealed get_into, 1 reader", "kvx sealed get_into, 2 readers"} <= methods
    md = open(out + ".md").read()
    assert "Data check after the runs: ok" in md and "--sealed" in md
    assert "Sealed (`encryption`, AES-256-GCM) against in the clear, 2 readers:" in md
