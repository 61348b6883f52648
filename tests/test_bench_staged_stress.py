"""benchmarks/gpu_staged_stress.py on CPU: its loop runs every variant, and a copy that loses bytes is counted."""

import torch

from kvx.kernels.staged import TransferBatch
from tests.helpers import load_benchmark


def test_every_variant_runs_clean_on_cpu(monkeypatch):
    stress = load_benchmark(monkeypatch, "gpu_staged_stress")
    rows = stress.run(torch.device("cpu"), 0.2)
    assert [r["variant"] for r in rows] == list(stress.VARIANTS)
    assert all(r["rounds"] > 0 and r["bad"] == 0 for r in rows), rows


def test_a_lost_dma_is_counted(monkeypatch):
    stress = load_benchmark(monkeypatch, "gpu_staged_stress")
    monkeypatch.setattr(TransferBatch, "dma", lambda self, part, staging=None, stream=None: None)
    (row,) = stress.run(torch.device("cpu"), 0.2, ("batch",))
    assert row["rounds"] > 0 and row["bad"] == row["rounds"], row
    assert row["first"] and "differ" in row["first"][0]
