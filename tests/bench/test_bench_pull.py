"""The pull benchmark runs end to end at tiny settings and writes its table (its figures: by running it,
``benchmarks/results/pull_cpu.md``)."""

from __future__ import annotations

from tests.helpers import load_benchmark


def test_the_pull_benchmark_writes_its_table(monkeypatch, tmp_path):
    bench = load_benchmark(monkeypatch, "bench_pull")
    assert bench.main(["--chunks", "2", "--chunk-size", "256KiB", "--reps", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "pull_cpu.md").read_text()
    for row in ("| socket |", "| nixl |", "| pull-tcp |", "| pull-nixl |"):
        assert row in text, text
