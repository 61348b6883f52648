"""benchmarks/bench_redis_faults.py runs: a small run against a real redis-server stops it (SIGSTOP) and kills
it (SIGKILL) under a 64 MiB load, every load ends in a ChunkError (a stopped server's saying it did not answer
within timeout_ms), the mid-transfer faults fire after payload bytes landed, the results are written and
their percentiles recompute from the trials. No timing is asserted."""

from __future__ import annotations

import csv
import math
import statistics

import pytest

from tests.helpers import load_benchmark, need_redis, redis_server_pids

MiB = 1 << 20


@pytest.fixture
def bench(monkeypatch):
    need_redis()
    return load_benchmark(monkeypatch, "bench_redis_faults")


def test_small_run_every_load_fails_with_a_chunk_error(bench, tmp_path):
    from kvx.store.redis import ChunkSink

    advance = ChunkSink.advance
    before = redis_server_pids()
    # 64 MiB: 16 values of 4 MiB, far more than the socket buffers hold when the mid-transfer fault fires
    assert bench.main(["--trials", "2", "--timeouts", "300", "--sizes", "64", "--out", str(tmp_path)]) == 0
    assert redis_server_pids() <= before, "the benchmark left redis-server processes behind"
    assert ChunkSink.advance is advance, "the fault trigger was left in place"

    md = (tmp_path / "redis_faults_cpu.md").read_text()
    assert md.startswith("# SMOKE RUN, not a measurement (2 trials)")
    assert (
        f"Reproduce: `python benchmarks/bench_redis_faults.py --trials 2 --timeouts 300 --sizes 64 --out "
        f"{tmp_path}`" in md
    )
    assert "## Target: the error within timeout_ms + 100 ms" in md and "## Every trial checked" in md
    assert "| MISSED |" not in md and "| met |" not in md  # a smoke run names the target, does not judge it

    with open(tmp_path / "redis_faults_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == bench.CSV_FIELDS
    assert [r["scenario"] for r in rows] == list(bench.SCENARIOS)
    for r in rows:
        assert (int(r["chunk_bytes"]), int(r["timeout_ms"]), int(r["trials"])) == (64 * MiB, 300, 2)
        assert int(r["chunk_errors"]) == 2, f"{r['scenario']}: a load did not end in a ChunkError"
        assert int(r["fault_fired"]) == 2
        # SIGSTOP: the tier says the server did not answer in time; SIGKILL: a lost connection, not a timeout
        assert int(r["says_timeout"]) == (0 if r["scenario"] == "sigkill-mid" else 2), r["scenario"]
        if r["scenario"].endswith("-mid"):
            # the fault came after payload bytes landed, before the chunk did
            assert 0 < float(r["fault_at_payload_bytes_median"]) < 64 * MiB
        times = [float(x) for x in r["error_ms_trials"].split()]
        assert len(times) == 2 and all(math.isfinite(t) and t > 0 for t in times)
        assert float(r["p50_ms"]) == pytest.approx(statistics.median(times), rel=1e-4)
        assert float(r["max_ms"]) == pytest.approx(max(times), rel=1e-4)
        assert float(r["over_max_ms"]) == pytest.approx(max(times) - 300, rel=1e-4, abs=1e-3)
        assert int(r["target_ms"]) == 400 and r["p90_verdict"] == r["max_verdict"] == "n/a (smoke run)"
        assert f"| {r['scenario']} | 64 MiB | 300 | 2/2 |" in md


def test_bad_arguments_fail_before_any_work(bench, tmp_path, capsys):
    for args, flag in (
        (["--trials", "0"], "--trials"),
        (["--timeouts", "300,soon"], "--timeouts"),
        (["--scenarios", "sigterm"], "--scenarios"),
    ):
        with pytest.raises(SystemExit):
            bench.main([*args, "--out", str(tmp_path / "x")])
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
