"""benchmarks/bench_tenant_lookup.py runs: a quick run against a baseline revision (HEAD's kvx, from git) starts
its own redis-server, times every case of both implementations, and writes a table and CSV that agree (each
ratio recomputes from its row). No timing is asserted."""

from __future__ import annotations

import csv

from tests.helpers import load_benchmark, need_redis, redis_server_pids


def test_bench_tenant_lookup_quick_run(monkeypatch, tmp_path):
    need_redis()
    bench = load_benchmark(monkeypatch, "bench_tenant_lookup")
    before = redis_server_pids()
    assert bench.main(["--quick", "--baseline", "HEAD", "--out", str(tmp_path)]) == 0
    assert redis_server_pids() <= before, "the benchmark left redis-server processes behind"
    rows = list(csv.DictReader(open(tmp_path / "tenant_lookup_cpu.csv")))
    assert len(rows) == len(bench.TIERS) * len(bench.CASES) * 2
    md = (tmp_path / "tenant_lookup_cpu.md").read_text().splitlines()
    for r in rows:
        b, n = float(r["baseline_us"]), float(r["new_us"])
        assert b > 0 and n > 0 and abs(n / b - float(r["ratio"])) < 2e-3  # the CSV rounds to 0.1 us
        line = [x for x in md if x.startswith(f"| {r['tier']} | {r['case']} | {r['lookup']} | ")]
        assert len(line) == 1 and line[0].endswith(f" | {float(r['ratio']):.2f} |"), line
