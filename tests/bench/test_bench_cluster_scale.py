"""The cluster-scale benchmark runs end to end at tiny settings and writes its table (not its figures: those are
measured by running it, ``benchmarks/results/cluster_scale_cpu.md``)."""

from __future__ import annotations

from tests.helpers import load_benchmark


def test_the_cluster_scale_benchmark_writes_its_table(monkeypatch, tmp_path):
    bench = load_benchmark(monkeypatch, "bench_cluster_scale")
    assert bench.main(["--nodes", "2,3", "--reps", "2", "--haves", "20", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "cluster_scale_cpu.md").read_text()
    assert "| 2 |" in text and "| 3 |" in text and "| 1024 | 10 |" in text
    rows = (tmp_path / "cluster_scale_cpu.csv").read_text().splitlines()
    assert rows[0].startswith("nodes,miss_p50_ms") and len(rows) == 3
