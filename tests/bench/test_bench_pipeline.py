"""benchmarks/bench_pipeline.py runs: a CPU smoke run (tiny shape, the thread copy queue, a small matmul as the
compute) writes its results, and every number in them is sane. No timing is asserted: the benchmark's targets
are GPU targets, measured by ``benchmarks/run_gpu.sh``."""

from __future__ import annotations

import csv
import math
import os

import pytest

from kvx import engine as kvx_engine
from kvx.connector.config import KVXConfig
from tests.helpers import load_benchmark

CHUNKS = ("1", "2")  # what --quick runs on CPU
LOAD_MODES = ("compute only", "copy only", "layerwise", "all at start", "no kvx")
SAVE_MODES = ("no saves", "save_layerwise", "all at once", "no kvx")


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_pipeline")


def _num(row: dict, key: str) -> float:
    value = float(row[key])
    assert math.isfinite(value), f"{key} of {row['section']} {row['mode']} x{row['chunks']}: {row[key]!r}"
    return value


def test_cpu_smoke_run_writes_sane_results(bench, tmp_path, monkeypatch):
    # the script runs the thread queue whatever the environment says, and gives the environment back
    monkeypatch.setenv(kvx_engine.ENV, "deferred")
    stem = tmp_path / "pipeline"
    assert bench.main(["--device", "cpu", "--quick", "--out", str(stem)]) == 0
    assert os.environ[kvx_engine.ENV] == "deferred"

    md = (tmp_path / "pipeline.md").read_text()
    assert md.startswith("# SMOKE RUN, not a measurement")
    assert f"Reproduce: `python benchmarks/bench_pipeline.py --device cpu --quick --out {stem}`" in md
    assert "## Loads" in md and "## Saves" in md and "## Host time of the hooks" in md
    # the default config, not one of the script's choosing
    assert f"`max_ctas` {KVXConfig.from_extra_config({}).max_ctas}" in md and "(defaults)" in md
    # targets are named but not judged on CPU
    assert "n/a (CPU smoke)" in md and "MISSED" not in md and ": met |" not in md

    with open(tmp_path / "pipeline.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    loads = [r for r in rows if r["section"] == "load"]
    saves = [r for r in rows if r["section"] == "save"]
    assert sorted((r["chunks"], r["mode"]) for r in loads) == sorted((c, m) for c in CHUNKS for m in LOAD_MODES)
    assert sorted((r["chunks"], r["mode"]) for r in saves) == sorted((c, m) for c in CHUNKS for m in SAVE_MODES)
    for r in rows:
        assert (r["device"], r["copy_queue"], r["smoke"], r["shape"]) == ("cpu", "thread", "True", "tiny")
        assert int(r["repeats"]) == 2 and int(r["host_behind"]) == 0
        assert _num(r, "step_ms") > 0 and _num(r, "host_ms") > 0 and _num(r, "copy_layer_ms") > 0
        assert int(r["layer_bytes"]) == int(r["chunks"]) * 2 * 32 * 2 * 64 * 2  # P x T x H x D x bf16
        assert r["compute_desc"].startswith("matmul 64^2 x ")
        assert int(r["max_ctas"]) == KVXConfig.from_extra_config({}).max_ctas
        if r["mode"] == "no kvx":
            assert r["host_over_ms"] == ""
        else:
            # the hooks' host time per step over the same steps without kvx (a save run's charged to its K saving
            # steps), recomputed from the row's own medians
            steps = 2 if r["mode"] in ("save_layerwise", "all at once") else 3 if r["section"] == "save" else 1
            assert _num(r, "host_over_ms") == pytest.approx(
                (_num(r, "host_ms") - _num(r, "host_nokvx_ms")) / steps, abs=1e-3, rel=1e-3
            )
    for r in loads:
        assert _num(r, "compute_ms") > 0 and _num(r, "copy_ms") > 0
        if r["mode"] in ("layerwise", "all at start"):
            hidden = _num(r, "hidden_frac")
            # 1 - (overlap - compute) / copy, recomputed from the row's own medians
            assert hidden == pytest.approx(
                1 - (_num(r, "step_ms") - _num(r, "compute_ms")) / _num(r, "copy_ms"), abs=0.01, rel=1e-3
            )
        else:
            assert r["hidden_frac"] == ""
    for r in saves:
        assert _num(r, "fwd_ms") > 0 and _num(r, "fwd_nosave_ms") > 0
        assert _num(r, "slowdown_pct") == pytest.approx(
            100 * (_num(r, "fwd_ms") / _num(r, "fwd_nosave_ms") - 1), abs=0.1, rel=1e-3
        )
        if r["mode"] == "no saves":
            assert r["saved_ms"] == "" and _num(r, "slowdown_pct") == 0
        elif r["mode"] == "no kvx":
            assert r["saved_ms"] == ""
        else:
            assert _num(r, "saved_ms") > 0


def test_save_winner_rule(bench):
    nosave = {"fwd_ms": 100.0}
    assert (
        bench.save_winner(nosave, {"fwd_ms": 103.0, "saved_ms": 150.0}, {"fwd_ms": 108.0, "saved_ms": 120.0})
        == "save_layerwise"
    )
    assert (
        bench.save_winner(nosave, {"fwd_ms": 108.0, "saved_ms": 110.0}, {"fwd_ms": 103.0, "saved_ms": 150.0})
        == "all at once"
    )
    # forwards within 1% of the forward without saves: the earlier saved-at decides
    assert (
        bench.save_winner(nosave, {"fwd_ms": 103.0, "saved_ms": 110.0}, {"fwd_ms": 103.5, "saved_ms": 150.0})
        == "save_layerwise (saved sooner)"
    )
    assert (
        bench.save_winner(nosave, {"fwd_ms": 103.0, "saved_ms": 110.0}, {"fwd_ms": 103.0, "saved_ms": 110.5}) == "tie"
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--compute", "sleep"], "--compute sleep"),
        (["--shapes", "llama-70b"], "--shapes"),
        (["--chunk-size", "20"], "--chunk-size"),
    ],
)
def test_bad_arguments_fail_before_any_work(bench, tmp_path, capsys, argv, expected):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "x"), *argv])
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_copy_path_reaches_the_worker_config(bench, tmp_path, capsys):
    # --copy-path sets kv_connector_extra_config copy_path; a kvx without that key refuses it before any work
    argv = ["--device", "cpu", "--quick", "--out", str(tmp_path / "p"), "--copy-path", "staged"]
    if "copy_path" not in KVXConfig.model_fields:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert "--copy-path" in capsys.readouterr().err and not list(tmp_path.iterdir())
        return
    assert bench.main(argv) == 0
    with open(tmp_path / "p.csv", newline="") as f:
        assert {r["copy_path"] for r in csv.DictReader(f)} == {"staged"}
    assert "(--copy-path staged)" in (tmp_path / "p.md").read_text()


def test_host_only_writes_every_target_with_the_cuda_calls_counted(monkeypatch, tmp_path):
    """``--host-only``: the compiled path on a null engine, a small shape so it is quick; every target is in the table
    with a verdict, and the CUDA calls a CUDA engine would make are counted (a load issues DMA batches and launches)."""
    bench = load_benchmark(monkeypatch, "bench_pipeline")
    argv = ["--host-only", "--shapes", "llama3.2-1b", "--chunks", "1,2", "--repeats", "4", "--warmup", "1"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    md = (tmp_path / "host_cpu.md").read_text()
    for target in ("a step loading 1 chunk", "a step saving 1 chunk", "nothing to copy", "one layer's batch", "one op"):
        assert target in md, md
    assert md.count("| met |") + md.count("| MISSED |") == 5  # no 8-chunk step asked for
    with open(tmp_path / "host_cpu.csv", newline="") as f:
        rows = {(r["variant"], r["chunks"]): r for r in csv.DictReader(f)}
    load = rows[("load", "2")]
    assert float(load["dma_calls"]) >= 16 and float(load["launches"]) >= 16, load  # one leg per layer (16 layers)
    assert float(rows[("nothing", "0")]["launches"]) == 0
