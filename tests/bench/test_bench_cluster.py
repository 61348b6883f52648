"""benchmarks/bench_cluster.py runs at its quick size (one 512-token triple, a 2-layer model; real engines in two
network namespaces) and writes a table and CSV that agree: every TTFT measured, each ratio recomputed from its rows,
the pulled prompt's chunks pulled by B's node and its tokens checked (by the benchmark). No timing is asserted."""

from __future__ import annotations

import csv

import pytest

from kvx.testing import netns
from tests.helpers import load_benchmark

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_cluster_quick_run(monkeypatch, tmp_path):
    reason = netns.available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    bench = load_benchmark(monkeypatch, "bench_cluster")
    # a pull may wait 3 s here (the default 500 ms is what the benchmark measures): a loaded machine still pulls
    assert bench.main(["--quick", "--pull-wait-ms", "3000", "--out", str(tmp_path)]) == 0
    rows = {r["measure"]: r for r in csv.DictReader(open(tmp_path / "cluster_cpu.csv"))}
    md = (tmp_path / "cluster_cpu.md").read_text()
    assert "`python benchmarks/bench_cluster.py --quick --pull-wait-ms 3000 --out " in md
    ms = {k: float(rows[f"ttft_{k}_ms"]["value"]) for k in ("recompute", "local_node_hit", "pulled_from_peer")}
    assert all(v > 0 for v in ms.values()), ms
    pulled = rows["ttft_pulled_from_peer_ms"]
    assert pulled["baseline"] == "ttft_local_node_hit_ms"
    assert abs(ms["pulled_from_peer"] / ms["local_node_hit"] - float(pulled["ratio"])) < 0.01
    over = rows["ttft_pulled_over_recompute"]
    assert abs(ms["pulled_from_peer"] / ms["recompute"] - float(over["ratio"])) < 0.01
    assert int(rows["triples"]["value"]) == 1
    assert float(rows["pulled_tokens_cached_median"]["value"]) > 0  # the fresh engine hit what B's node pulled
    assert int(rows["node_b_chunks_pulled"]["value"]) > 0 and int(rows["node_a_bytes_out"]["value"]) > 0
    assert f"| ttft_pulled_from_peer_ms | {ms['pulled_from_peer']:.1f} | ttft_local_node_hit_ms | " in md
    assert "| triple | reader | first | pulled | local | recompute | pulled / local | cached |" in md
