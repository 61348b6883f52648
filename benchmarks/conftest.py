"""pytest-benchmark settings for ``pytest benchmarks --benchmark-only`` (the copy microbenchmarks).

The suite under tests/ never collects this directory (``testpaths = ["tests"]``); the scripts here
(bench_*.py) are not test modules and are not collected either.
"""

from __future__ import annotations


def pytest_benchmark_update_machine_info(config, machine_info):
    """Name the CPU and the torch build in the JSON (pytest-benchmark records only the architecture)."""
    import torch

    from kvx.testing.bench import cpu_name

    machine_info["kvx_cpu"] = cpu_name()
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
