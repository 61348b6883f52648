"""The pull benchmark runs end to end at tiny settings and writes its table (its figures: by running it,
``benchmarks/results/pull_cpu.md``)."""

from __future__ import annotations

import importlib.util
import os
import sys

from kvx.testing.node_procs import ROOT


def test_the_pull_benchmark_writes_its_table(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_pull", os.path.join(ROOT, "benchmarks", "bench_pull.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--chunks", "2", "--chunk-size", "256KiB", "--reps", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "pull_cpu.md").read_text()
    for row in ("| socket |", "| nixl |", "| pull-tcp |", "| pull-nixl |"):
        assert row in text, text
