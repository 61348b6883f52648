"""benchmarks/bench_node.py runs: a quick lookup run starts its own ``kvx node``, times an engine's lookup of 256
chunks against the in-process CPU index, stops the node, and writes a table and CSV that agree (each ratio
recomputes from its rows). The engine cases (TTFT, sharing, soak) run in the benchmark itself, not here: they start
a dozen vLLM engines. No timing is asserted."""

from __future__ import annotations

import csv

from tests.helpers import load_benchmark


def test_bench_node_quick_lookup_run(monkeypatch, tmp_path):
    bench = load_benchmark(monkeypatch, "bench_node")
    assert bench.main(["--quick", "--only", "lookup", "--out", str(tmp_path)]) == 0
    rows = {r["measure"]: r for r in csv.DictReader(open(tmp_path / "node_cpu.csv"))}
    md = (tmp_path / "node_cpu.md").read_text()
    for q in ("p50", "p99"):
        node, cpu = rows[f"lookup_256_chunks_{q}_us_node"], rows[f"lookup_256_chunks_{q}_us_cpu_index"]
        assert node["baseline"] == cpu["measure"] and float(node["value"]) > 0 and float(cpu["value"]) > 0
        assert abs(float(node["value"]) / float(cpu["value"]) - float(node["ratio"])) < 0.01
        assert f"| {node['measure']} | {float(node['value']):.1f} | {cpu['measure']} | " in md
