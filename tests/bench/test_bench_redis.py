"""benchmarks/bench_redis.py runs: a quick run starts its own servers, writes its results, stops the servers,
and every ratio and GB/s in the CSV recomputes from the row's own columns. No timing is asserted."""

from __future__ import annotations

import csv
import math

import pytest

from kvx.store.redis import SNDBUF_UNIX
from kvx.testing.redis_bench import CSV_FIELDS, ROOF_OF
from tests.helpers import load_benchmark, need_redis, redis_server_pids


@pytest.fixture(autouse=True)
def _need_redis():
    need_redis()


MiB = 1 << 20


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_redis")


def _num(row: dict, key: str) -> float:
    value = float(row[key])
    assert math.isfinite(value) and value > 0, f"{key} of {row['section']} {row['method']}: {row[key]!r}"
    return value


def test_quick_run_writes_consistent_results(bench, tmp_path):
    before = redis_server_pids()
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    assert redis_server_pids() <= before, "the benchmark left redis-server processes behind"

    md = (tmp_path / "redis_cpu.md").read_text()
    assert md.startswith("# SMOKE RUN, not a measurement")
    assert f"Reproduce: `python benchmarks/bench_redis.py --quick --out {tmp_path}`" in md
    assert "## Targets" in md and "## GET into a slot and PUT" in md and "## Lookup of a 256-chunk prefix" in md
    assert "MISSED" not in md and "| met |" not in md  # targets are named, not judged, in a smoke run

    with open(tmp_path / "redis_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == CSV_FIELDS
    sections = {r["section"] for r in rows}
    gp = ("get", "put", "get-b2b", "put-b2b")
    assert {*gp, "sweep-get", "sweep-put", "pieces-get", "sndbuf-put", "lookup"} <= sections
    # every method of every GET / PUT case, shuffled and back to back, over TCP and the unix socket, at 1 MiB
    got = {(r["section"], r["transport"], r["method"]) for r in rows if r["section"] in gp}
    assert got == {
        (s + b2b, t, m)
        for t in ("tcp", "unix")
        for s, ms in (("get", bench.GET_METHODS), ("put", bench.PUT_METHODS))
        for m in ms
        for b2b in ("", "-b2b")
    }
    assert {int(r["chunk_bytes"]) for r in rows if r["section"] in gp} == {1 * MiB}
    assert "## GET into a slot and PUT, back to back" in md and "a PING right after the server was busy" in md
    assert {int(r["part_bytes"]) for r in rows if r["section"].startswith("sweep")} == set(bench.PART_SIZES)
    # the send-buffer sweep: every size over both transports, compared with the tier's own choice
    sb = [r for r in rows if r["section"] == "sndbuf-put"]
    assert {(r["transport"], r["part_bytes"] and int(r["part_bytes"])) for r in sb} == {
        (t, b or "") for t in ("tcp", "unix") for b in bench.SEND_BUFFERS
    }
    assert {(r["transport"], r["method"]) for r in sb if not r["baseline"]} == {
        ("tcp", "kernel default"),
        ("unix", f"SO_SNDBUF {bench._fmt(SNDBUF_UNIX)}"),
    }
    assert "## PUT: socket send buffer" in md

    by_case = {}
    for r in rows:
        case = (r["section"], r["transport"], r["deployment"], r["chunk_bytes"], r["run"])  # sweep: parts = methods
        by_case.setdefault(case, {})[r["method"]] = r
    for case, methods in by_case.items():
        for r in methods.values():
            assert int(r["repeats"]) >= 3
            ms = _num(r, "median_ms")
            assert _num(r, "p90_ms") >= ms and _num(r, "p99_ms") >= _num(r, "p90_ms")
            if r["section"] == "lookup":
                assert r["GB/s"] == "" and int(r["chunk_bytes"]) == bench.LOOKUP_KEYS
            else:
                assert _num(r, "GB/s") == pytest.approx(int(r["chunk_bytes"]) / (ms * 1e-3) / 1e9, rel=1e-4)
            if r["baseline"]:
                # the baseline is a method of the same case and run, and the ratio recomputes from its time
                base = methods[r["baseline"]]
                assert not base["baseline"]
                assert _num(r, "baseline_median_ms") == pytest.approx(_num(base, "median_ms"), rel=1e-5)
                assert _num(r, "x_baseline") == pytest.approx(_num(base, "median_ms") / ms, rel=1e-4)
            else:
                assert r["baseline_median_ms"] == "" and r["x_baseline"] == ""
            if r["section"] in gp:
                # so is the share of the roof (a plain socket moving the same value), measured in the same run
                roof = methods[ROOF_OF[r["section"]]]
                assert _num(r, "roof_median_ms") == pytest.approx(_num(roof, "median_ms"), rel=1e-5)
                assert _num(r, "pct_roof") == pytest.approx(100 * _num(roof, "median_ms") / ms, rel=1e-4)
            else:
                assert r["roof_median_ms"] == "" and r["pct_roof"] == ""
        if case[0] in (*gp, "lookup"):
            base = {"get": bench.GET_BASE, "put": bench.PUT_BASE, "lookup": bench.LOOKUP_BASE}[case[0].split("-")[0]]
            assert sum(1 for r in methods.values() if not r["baseline"]) == 1 and not methods[base]["baseline"]
    lookups = {r["deployment"] for r in rows if r["section"] == "lookup"}
    assert "standalone" in lookups


def test_bad_arguments_fail_before_any_work(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--out", str(tmp_path / "x"), "--sizes", "4,big"])
    assert "--sizes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_every_call_gets_its_own_index_so_no_method_reads_the_chunk_the_one_before_it_read(bench):
    """Methods pick their chunk by the call's index: within a repeat each takes the next one (the method
    run first in a repeat once read a cold chunk, the others the same chunk warm)."""
    seen, after = [], []
    fns = {m: (lambda i, m=m: seen.append((m, i))) for m in "abc"}
    times = bench.time_interleaved(fns, repeats=4, warmup=1, after=lambda m, i: after.append((m, i)))
    assert [i for _, i in seen] == list(range(15)) and after == seen
    assert all(len(t) == 4 for t in times.values())


def test_each_method_follows_each_other_one_about_equally_often(bench):
    """A call leaves state behind for the next (a put after a redis-py put measured slower than one after
    another kvx put): the shuffled order gives every method every predecessor. A rotated order gave each
    method the same predecessor in 3 repeats of 4. The orders repeat from run to run (seeded)."""

    def run():
        seen = []
        bench.time_interleaved({m: (lambda i, m=m: seen.append(m)) for m in "abcd"}, repeats=400, warmup=0)
        return seen

    seen = run()
    assert all(sorted(seen[k : k + 4]) == list("abcd") for k in range(0, len(seen), 4))  # each repeat: each once
    pairs = {}
    for a, b in zip(seen, seen[1:]):
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    after_other = [pairs.get((a, b), 0) for a in "abcd" for b in "abcd" if a != b]
    assert min(after_other) > 0.6 * max(after_other), pairs
    assert run() == seen


def test_back_to_back_times_each_call_right_after_the_methods_own_previous_one(bench):
    """Blocks of one method's calls in a row: the first of each block untimed (it follows another method),
    the rest timed, each right after a call of the same method; the blocks of the methods in a shuffled
    (seeded) order, every method the same number of blocks; every call its own index, ``after`` after
    each."""
    seen, after = [], []
    fns = {m: (lambda i, m=m: seen.append((m, i))) for m in "abc"}
    times = bench.time_back_to_back(fns, blocks=20, calls=3, after=lambda m, i: after.append((m, i)))
    assert [i for _, i in seen] == list(range(3 * 20 * 4)) and after == seen
    assert all(len(t) == 20 * 3 for t in times.values())
    blocks = [seen[k : k + 4] for k in range(0, len(seen), 4)]
    assert all(len({m for m, _ in b}) == 1 for b in blocks)  # a block: one method
    order = [b[0][0] for b in blocks]
    assert all(sorted(order[k : k + 3]) == list("abc") for k in range(0, len(order), 3))
    assert len({tuple(order[k : k + 3]) for k in range(0, len(order), 3)}) > 1  # shuffled, not rotated
    seen2 = []
    bench.time_back_to_back({m: (lambda i, m=m: seen2.append((m, i))) for m in "abc"}, blocks=20, calls=3)
    assert seen2 == seen  # seeded: the same order every run


def test_sealed_only_quick_run(bench, tmp_path):
    """``--sealed-only``: sealed (AES-256-GCM) against in-the-clear GET / PUT, both transports, in one run; the
    ratios in the CSV recompute from its own columns."""
    before = redis_server_pids()
    assert bench.main(["--sealed-only", "--quick", "--sizes", "1", "--out", str(tmp_path)]) == 0
    assert redis_server_pids() <= before, "the benchmark left redis-server processes behind"
    md = (tmp_path / "redis_sealed_cpu.md").read_text()
    assert md.startswith("# SMOKE RUN, not a measurement") and "sealed / clear throughput" in md
    with open(tmp_path / "redis_sealed_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    clear, sealed = bench.SEALED_METHODS
    got = {(r["section"], r["transport"], r["method"]) for r in rows}
    assert got == {(s, t, m) for s in ("sealed-get", "sealed-put") for t in ("tcp", "unix") for m in (clear, sealed)}
    for r in rows:
        if r["method"] == sealed:
            assert r["baseline"] == clear
            ratio = _num(r, "baseline_median_ms") / _num(r, "median_ms")
            assert abs(ratio - _num(r, "x_baseline")) < 1e-4 * ratio
