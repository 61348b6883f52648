"""benchmarks/bench_tp_share.py runs: a quick run starts its own redis-server, times every case on both tiers, and
writes a table and CSV that agree (each ratio recomputes from its tier's TP=1 row); bytes stored per chunk on disk
do not depend on the TP size that wrote them. No timing is asserted."""

from __future__ import annotations

import csv

from tests.helpers import load_benchmark, need_redis, redis_server_pids


def test_bench_tp_share_quick_run(monkeypatch, tmp_path):
    need_redis()
    bench = load_benchmark(monkeypatch, "bench_tp_share")
    before = redis_server_pids()
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    assert redis_server_pids() <= before, "the benchmark left redis-server processes behind"
    rows = list(csv.DictReader(open(tmp_path / "tp_share_cpu.csv")))
    assert [(r["tier"], r["case"]) for r in rows] == [(t, c) for t in ("disk", "redis") for c in bench.CASES]
    md = (tmp_path / "tp_share_cpu.md").read_text().splitlines()
    for tier in ("disk", "redis"):
        mine = {r["case"]: r for r in rows if r["tier"] == tier}
        base = float(mine[bench.CASES[0]]["load_ms"])
        for r in mine.values():
            assert float(r["load_ms"]) > 0 and abs(float(r["load_ms"]) / base - float(r["ratio"])) < 0.02
            line = [x for x in md if x.startswith(f"| {tier} | {r['case']} | ")]
            assert len(line) == 1 and f" | {float(r['ratio']):.2f} | " in line[0], line
    disk = {r["case"]: int(r["bytes_per_chunk"]) for r in rows if r["tier"] == "disk"}
    assert disk[bench.CASES[0]] == disk[bench.CASES[1]] > 0  # written by TP=1 or TP=2: the same bytes
