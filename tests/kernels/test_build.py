"""The compiled extension: CPU kernels always, CUDA kernels whenever nvcc was there at build time."""

import os
import shutil

import pytest
import torch

from kvx.kernels import ops


def _nvcc_present() -> bool:
    return bool(shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"))


def test_extension_imports():
    import kvx._C  # noqa: F401  # a failure here shows the import error's own traceback


def test_cpu_kernels_always_built():
    from kvx._ext import C

    assert "cpu" in ops.available_impls("cpu")
    assert C.cpu_get_num_threads() >= 1


@pytest.mark.skipif(
    not _nvcc_present() or os.environ.get("KVX_CUDA") == "0",
    reason="nvcc not found (or KVX_CUDA=0): the CUDA kernels are not expected",
)
def test_cuda_kernels_compiled_when_nvcc_is_present():
    from kvx._ext import C

    assert C.has_cuda, "nvcc is on this machine but kvx._C was built without the CUDA kernels"
    # and their CPU emulation (copy_sim.cu): the kernel's source, run by the CPU tests as impl "cuda_sim"
    assert C.has_cuda_sim and "cuda_sim" in ops.available_impls("cpu")
    # statically linked runtime: without a driver or GPU it answers (0), it does not crash
    n = C.cuda_device_count()
    if torch.cuda.is_available():
        assert n == torch.cuda.device_count()
    elif not os.path.exists("/dev/nvidiactl"):
        assert n == 0, f"no NVIDIA driver on this machine, yet cuda_device_count() = {n}"


def test_descriptors_are_built_by_field_name():
    """kvx._C.PagedDesc/ContigDesc take keywords only, so a positional tuple can never swap strides."""
    from kvx._ext import C
    from kvx.kernels.layout import ContigDesc, CopyGeometry, PagedDesc, c_descs

    paged = PagedDesc(
        plane_stride=11,
        block_stride=12,
        token_stride=13,
        head_stride=14,
        num_blocks=15,
        num_planes=2,
        block_size=16,
        num_heads=17,
    )
    contig = ContigDesc(layer_stride=21, plane_stride=22, token_stride=23, head_stride=24)
    cp, cc = c_descs(CopyGeometry(paged, contig, 8, 1, 1, 0))
    for name, value in vars(paged).items():
        assert getattr(cp, name) == value, name
    for name, value in vars(contig).items():
        assert getattr(cc, name) == value, name
    with pytest.raises(TypeError):
        C.PagedDesc(11, 12, 13, 14, 15, 2, 16, 17)
    with pytest.raises(TypeError):
        C.ContigDesc(21, 22, 23, 24)
