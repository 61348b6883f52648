"""benchmarks/gpu_targets.py judges each GPU target from the CSVs the benchmarks write: synthetic results written by
the benchmarks' own writers (so a renamed column fails here), every target met, then each target missed alone."""

from __future__ import annotations

import csv

import pytest
import torch

from kvx.testing import bench as kb
from tests.helpers import load_benchmark

MiB = 1 << 20
GOOD = dict(
    auto_pct=95.0,  # cache<->pinned, path auto, % of a pinned copy
    load_pct=90.0,  # ... under the GEMM loop
    device_pct=95.0,  # on device, impl cuda, % of a device copy
    bidir_gbs=85.0,
    layer_x=1.2,  # staged over a plain copy, one layer
    batch_host_us=10.0,
    auto_x_best=1.02,  # h2d sweep: auto over the faster of dma and staged
    hidden=0.9,
    slowdown=2.0,
    host_step_ms=0.5,
    host_idle_us=3.0,  # per layer
)
# one miss per target (index in gpu_targets.evaluate's list)
MISSES = [
    (0, dict(auto_pct=80.0)),
    (1, dict(load_pct=70.0)),
    (2, dict(bidir_gbs=70.0)),
    (3, dict(device_pct=80.0)),
    (4, dict(layer_x=2.0)),
    (5, dict(batch_host_us=20.0)),
    (6, dict(auto_x_best=1.10)),
    (7, dict(hidden=0.7)),
    (8, dict(slowdown=8.0)),
    (9, dict(host_step_ms=1.5)),
    (10, dict(host_idle_us=7.0)),
]


@pytest.fixture
def gt(monkeypatch):
    return load_benchmark(monkeypatch, "gpu_targets")


@pytest.fixture
def pipeline(monkeypatch):
    return load_benchmark(monkeypatch, "bench_pipeline")


def _table(v: dict, miss_one: bool) -> list:
    """cache<->pinned and on-device rows of two layouts x four ops; with ``miss_one`` only the last case gets the
    given figures, the others the good ones (a single case below target misses the target)."""
    rows = []
    cases = [
        kb.Case(op, layout, torch.bfloat16, 16, 4096, 8, 8, 128)
        for layout in ("LBNHC", "flash")
        for op in ("gather_blocks", "scatter_blocks", "gather_pages", "scatter_pages")
    ]
    for i, case in enumerate(cases):
        f = v if (not miss_one or i == len(cases) - 1) else GOOD
        nbytes = 128 * MiB
        roof = nbytes / 1e-3 / 1e9  # the roof copy takes 1 ms
        rows += [
            kb.Row(kb.HOST, case, "memcpy (roof)", nbytes, 1.0, roof, 1.0, roof),
            kb.Row(kb.HOST, case, "kvx-cuda staged", nbytes, 1.0, roof, 1.0, roof),
            kb.Row(kb.HOST, case, "kvx-cuda auto", nbytes, 100 / f["auto_pct"], roof, 100 / f["load_pct"], roof),
            kb.Row("cuda", case, "memcpy (roof)", nbytes, 1.0, roof),
            kb.Row("cuda", case, "kvx-cuda", nbytes, 100 / f["device_pct"], roof),
            kb.Row("cuda", case, "kvx-triton", nbytes, 1.0, roof),
        ]
    return rows


def write_results(tmp_path, gt, pipeline, v: dict, skip: tuple[str, ...] = ()) -> None:
    d = tmp_path
    if "copy" not in skip:
        kb.write_table_csv(_table(v, miss_one=True), str(d / gt.FILES["copy"]))
    if "layer" not in skip:
        rows = []
        for c in (1, 2, 8, 32):
            for direction in ("d2h", "h2d"):
                nbytes, plain = c * MiB, 0.02 * c
                x = v["layer_x"] if c == 8 else GOOD["layer_x"]
                rows += [
                    kb.LayerRow(c, direction, "plain copy", 1, nbytes, plain, 0.004, plain, 0),
                    kb.LayerRow(c, direction, "staged", 1, nbytes, x * plain, 0.005, plain, 0),
                    kb.LayerRow(c, direction, "auto", 1, nbytes, x * plain, 0.005, plain, 0),
                ]
                if c in kb.BATCH_CHUNKS:
                    host = v["batch_host_us"] / 1e3 if c == 2 else GOOD["batch_host_us"] / 1e3
                    rows.append(kb.LayerRow(c, direction, "batch", c, nbytes, x * plain, host, plain, 0))
        kb.write_layer_csv(rows, str(d / gt.FILES["layer"]), "llama3-8b", smoke=False)
    if "bidir" not in skip:
        nbytes = 256 * MiB

        def ms(gbs: float) -> float:
            return 2 * nbytes / (gbs * 1e9) * 1e3

        rows = [kb.BidirRow("plain copies (roof)", nbytes, ms(90.0), ms(90.0))]
        rows += [kb.BidirRow(p, nbytes, ms(v["bidir_gbs"]), ms(90.0)) for p in ("staged", "auto")]
        kb.write_bidir_csv(rows, str(d / gt.FILES["bidir"]), "llama3-8b", smoke=False)
    if "h2d" not in skip:
        rows = []
        for n in kb.H2D_COUNTS:
            for piece in (4096, 1 << 20):
                for direction, _ in kb._H2D_DIRECTIONS:
                    x = v["auto_x_best"] if (n, piece) == (128, 4096) else GOOD["auto_x_best"]
                    for path, t in (
                        ("pinned copy (roof)", 0.9),
                        ("dma", 1.0),
                        ("staged", 1.5),
                        ("kernel", 3.0),
                        ("auto", x),
                    ):
                        rows.append(kb.H2DRow(direction, piece, n, n * piece, path, t, 0.01, 0.9, 0))
        kb.write_h2d_results(rows, None, str(d / gt.FILES["h2d"]).removesuffix(".csv"), "test")
    if "pipeline" not in skip:
        rows = []

        def row(section, mode, chunks, compute, **kw):
            r = dict(section=section, shape="llama3-8b", layers=32, chunks=chunks, compute=compute, mode=mode)
            r.update(copy_path="auto", smoke=False, compute_factor=1.0, host_nokvx_ms=0.2, fwd_nosave_ms=10.0, **kw)
            rows.append(r)

        for chunks in (1, 8):
            for compute in ("matmul", "sleep"):
                hidden = v["hidden"] if chunks == 8 else GOOD["hidden"]
                row("load", "layerwise", chunks, compute, hidden_frac=hidden, host_over_ms=GOOD["host_step_ms"])
                row("load", "all at start", chunks, compute, hidden_frac=0.1, host_over_ms=0.3)
                row("load", "compute only", chunks, compute, host_over_ms=v["host_idle_us"] * 32 / 1e3)
                for factor in (1.0, 8.0):
                    slow = v["slowdown"] if factor == 1.0 else GOOD["slowdown"]
                    row(
                        "save", "no saves", chunks, compute, slowdown_pct=0.0, host_over_ms=GOOD["host_idle_us"] * 0.032
                    )
                    row("save", "save_layerwise", chunks, compute, slowdown_pct=slow, host_over_ms=v["host_step_ms"])
                    row("save", "all at once", chunks, compute, slowdown_pct=20.0, host_over_ms=0.2)
                    rows[-3:] = [dict(r, compute_factor=factor) for r in rows[-3:]]
        path = d / gt.FILES["pipeline"]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, pipeline.COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)


def judge(gt, tmp_path) -> list:
    return gt.evaluate({k: gt.load_csv(str(tmp_path / f)) for k, f in gt.FILES.items()})


def test_every_target_met(gt, pipeline, tmp_path):
    write_results(tmp_path, gt, pipeline, GOOD)
    targets = judge(gt, tmp_path)
    assert len(targets) == len(MISSES)
    assert [t.verdict for t in targets] == [gt.MET] * len(targets), [(t.name, t.measured) for t in targets]
    assert all(t.measured and t.baseline for t in targets)


@pytest.mark.parametrize("index, figures", MISSES, ids=[str(i) for i, _ in MISSES])
def test_each_target_missed_alone(gt, pipeline, tmp_path, index, figures):
    write_results(tmp_path, gt, pipeline, {**GOOD, **figures})
    verdicts = [t.verdict for t in judge(gt, tmp_path)]
    assert verdicts == [gt.MISSED if i == index else gt.MET for i in range(len(verdicts))]


def test_figures_and_baselines_in_the_summary(gt, pipeline, tmp_path):
    write_results(tmp_path, gt, pipeline, {**GOOD, "auto_pct": 80.0, "bidir_gbs": 70.0, "hidden": 0.7})
    t = judge(gt, tmp_path)
    assert t[0].measured.startswith("worst 80%") and "pinned copy 134.2 GB/s" in t[0].baseline
    assert "1/8 cases" not in t[0].detail and "7/8 cases met" in t[0].detail
    assert t[2].measured.startswith("70.0 GB/s") and "90.0 GB/s" in t[2].baseline
    assert t[7].measured.startswith("worst 70%") and "10% hidden" in t[7].baseline
    assert t[6].measured == "8/8 points; worst 1.02x"


def test_missing_files_are_not_measured_and_smoke_runs_not_judged(gt, pipeline, tmp_path):
    write_results(tmp_path, gt, pipeline, GOOD, skip=("copy", "pipeline"))
    verdicts = [t.verdict for t in judge(gt, tmp_path)]
    assert verdicts == [gt.NOT_MEASURED] * 2 + [gt.MET] + [gt.NOT_MEASURED] + [gt.MET] * 3 + [gt.NOT_MEASURED] * 4
    # a smoke run's rows (bench_copy's GPU sections on CPU) are shown, never judged
    rows = gt.load_csv(str(tmp_path / gt.FILES["bidir"]))
    with open(tmp_path / gt.FILES["bidir"], "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows([dict(r, smoke=True) for r in rows])
    assert judge(gt, tmp_path)[2].verdict == gt.SMOKE


def test_main_writes_the_summary_named_after_the_device(gt, pipeline, tmp_path, capsys):
    write_results(tmp_path, gt, pipeline, {**GOOD, "slowdown": 8.0})
    assert gt.main(["--results", str(tmp_path), "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    text = (tmp_path / "gpu_targets_h100.md").read_text()
    assert text.startswith("# kvx GPU targets on NVIDIA H100 80GB HBM3")
    assert "**10 met, 1 missed, 0 not measured** (of 11)" in text and "**MISSED**" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, slug",
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"), ("Some GPU", "some_gpu")],
)
def test_device_slug(gt, name, slug):
    assert gt.device_slug(name) == slug
