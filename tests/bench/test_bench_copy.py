"""benchmarks/bench_copy.py (kvx/testing/bench.py): its GPU sections (one layer's copies, both directions at once,
the per-layer host <-> device sweep) run on CPU as smoke runs and write what benchmarks/gpu_targets.py reads;
a row whose bytes are wrong is left out and named. No timing is asserted. The staged rows run the staged path's CPU
twin (the same run lists by memcpy, the reshape by the CPU kernel)."""

from __future__ import annotations

import csv
import functools

import pytest
import torch

from kvx.kernels.layout import KVLayout
from kvx.testing import bench as kb
from kvx.testing import make_kv_caches
from tests.helpers import load_benchmark


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_gpu_sections_smoke_on_cpu(tmp_path, monkeypatch):
    stem = tmp_path / "copy_cuda_quick"
    argv = ["--device", "cpu", "--quick", "--sections", "layer,bidir,h2d", "--out", str(stem)]
    assert kb.main(argv) == 0

    layer = _rows(f"{stem}_layer.csv")
    for c in kb.LAYER_CHUNKS:
        for direction in ("d2h", "h2d"):
            got = {r["row"]: r for r in layer if (int(r["chunks"]), r["direction"]) == (c, direction)}
            want = {"plain copy", "staged", "auto"} | ({"batch"} if c in kb.BATCH_CHUNKS else set())
            assert set(got) == want, (c, direction)
            assert float(got["plain copy"]["x_plain"]) == 1.0
            assert all(int(r["bytes"]) == c * kb.TINY.chunk_layer_bytes for r in got.values())
            if c in kb.BATCH_CHUNKS:
                assert int(got["batch"]["ops"]) == c  # one copy per chunk, as the worker adds them
            for r in got.values():
                assert float(r["gpu_us"]) > 0 and float(r["host_us"]) > 0 and r["smoke"] == "True"
                assert float(r["x_plain"]) == pytest.approx(
                    float(r["gpu_us"]) / float(got["plain copy"]["gpu_us"]), rel=0.01, abs=2e-3
                )

    bidir = _rows(f"{stem}_bidir.csv")
    assert [r["path"] for r in bidir] == ["plain copies (roof)", "staged", "auto"]
    assert all(float(r["GB/s"]) > 0 for r in bidir)

    h2d = _rows(tmp_path / "copy_h2d_cpu.csv")
    points = {(r["direction"], r["pieces"], r["piece_bytes"]) for r in h2d}
    assert len(points) == 2 * 2 * 2  # directions x (4 KiB, 64 KiB) x (16, 128) pieces
    for p in points:
        got = {r["path"]: r for r in h2d if (r["direction"], r["pieces"], r["piece_bytes"]) == p}
        assert set(got) == {kb.H2D_ROOF, "staged", "auto"}
        auto = got["auto"]
        assert float(auto["auto_x_best"]) == pytest.approx(
            float(auto["gpu_us"]) / float(got["staged"]["gpu_us"]), rel=0.01, abs=2e-3
        )
        assert auto["auto_within_5pct"] == str(float(auto["auto_x_best"]) <= kb.AUTO_SLACK)

    md = (tmp_path / "copy_cuda_quick.md").read_text()
    assert "## One layer's copy of a step (SMOKE RUN on CPU" in md and "## Both directions at once (SMOKE" in md
    assert "Errors" not in md
    assert "SMOKE RUN" in (tmp_path / "copy_h2d_cpu.md").read_text()

    # what gpu_targets makes of them: shown, never judged
    gt = load_benchmark(monkeypatch, "gpu_targets")
    (tmp_path / "copy_h2d_cpu.csv").rename(tmp_path / gt.FILES["h2d"])
    targets = gt.evaluate({k: gt.load_csv(str(tmp_path / f)) for k, f in gt.FILES.items()})
    # bidir, on device (no table), the layer ratio (its >= 1 MiB copies: the tiny shape has none), batch host, h2d
    assert [t.verdict for t in targets[2:7]] == [gt.SMOKE, gt.NOT_MEASURED, gt.NOT_MEASURED, gt.SMOKE, gt.SMOKE]


def test_a_row_with_wrong_bytes_is_left_out_and_named(tmp_path):
    caches = make_kv_caches(
        "LBNHC", num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_size=64, dtype=torch.bfloat16
    )
    lay = KVLayout.from_tensors(caches, "LBNHC")
    ids = torch.tensor([5, 1, 3])
    out = torch.empty(lay.canonical_shape(48), dtype=torch.bfloat16)
    src = torch.zeros_like(out)
    gather = kb.path_fn("gather_blocks", lay, ids, out, "auto")
    kb.check_copy("gather_blocks", lay, ids, out, gather)  # right bytes: passes
    with pytest.raises(RuntimeError, match="differs from impl 'reference'"):
        kb.check_copy("gather_blocks", lay, ids, out, lambda: None)  # a copy that copied nothing
    with pytest.raises(RuntimeError, match="differs"):
        kb.check_copy("scatter_blocks", lay, ids, src, lambda: None)
    errors: list[str] = []
    check = functools.partial(kb.check_copy, "gather_blocks", lay, ids, out)
    kept = kb._usable([("good", gather, check), ("broken", lambda: None, check)], errors, "where", lambda _: None)
    assert [k[0] for k in kept] == ["good"]
    assert len(errors) == 1 and errors[0].startswith("where broken: RuntimeError")


def test_auto_verdicts():
    def row(path, ms, n=16, piece=4096):
        return kb.H2DRow("host->device", piece, n, n * piece, path, ms, 0.01, 1.0, 0)

    rows = [row("dma", 1.0), row("staged", 2.0), row("auto", 1.04), row("dma", 3.0, n=128), row("staged", 2.0, n=128)]
    rows += [row("auto", 2.2, n=128), row("kernel", 0.5, n=128)]  # the kernel is not a candidate
    v = {x["pieces"]: x for x in kb.auto_verdicts(rows)}
    assert (v[16]["best"], v[16]["within"]) == ("dma", True) and v[16]["auto_x_best"] == pytest.approx(1.04)
    assert (v[128]["best"], v[128]["within"]) == ("staged", False) and v[128]["auto_x_best"] == pytest.approx(1.1)
    # staged missing (a kvx without it): judged against what was measured
    assert kb.auto_verdicts([row("dma", 1.0), row("auto", 1.0)])[0]["compared"] == "dma"
