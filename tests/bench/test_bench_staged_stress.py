"""benchmarks/gpu_staged_stress.py on CPU: its loop runs every variant, and a copy that loses bytes is counted."""

import torch

from kvx import _ext
from tests.helpers import load_benchmark


def test_every_variant_runs_clean_on_cpu(monkeypatch):
    stress = load_benchmark(monkeypatch, "gpu_staged_stress")
    rows = stress.run(torch.device("cpu"), 0.2)
    assert [r["variant"] for r in rows] == list(stress.VARIANTS)
    assert all(r["rounds"] > 0 and r["bad"] == 0 for r in rows), rows


def test_a_lost_copy_is_counted(monkeypatch):
    stress = load_benchmark(monkeypatch, "gpu_staged_stress")
    # the compiled plan's host executor loses every copy (the reference the check compares with runs in Python)
    monkeypatch.setattr(_ext.C, "run_host", lambda *args, **kwargs: None)
    (row,) = stress.run(torch.device("cpu"), 0.2, ("batch",))
    assert row["rounds"] > 0 and row["bad"] == row["rounds"], row
    assert row["first"] and "differ" in row["first"][0]
