"""The compiled extension: CPU kernels always, CUDA kernels whenever nvcc was there at build time."""

import os
import shutil

import pytest

from kvx import ops

C = pytest.importorskip("kvx._C", reason="kvx._C is not built")


def _nvcc_present() -> bool:
    return bool(shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"))


def test_cpu_kernels_always_built():
    assert "cpu" in ops.available_impls("cpu")
    assert C.cpu_get_num_threads() >= 1


@pytest.mark.skipif(not _nvcc_present() or os.environ.get("KVX_CUDA") == "0",
                    reason="nvcc not found (or KVX_CUDA=0): the CUDA kernels are not expected")
def test_cuda_kernels_compiled_when_nvcc_is_present():
    assert C.has_cuda, "nvcc is on this machine but kvx._C was built without the CUDA kernels"
    # statically linked runtime: without a driver or GPU it answers, it does not crash
    assert C.cuda_device_count() >= 0
