"""The kernel suite needs the compiled extension: a missing or broken ``kvx._C`` fails every test here.

``kvx._C`` is always built (``setup.py``: the CPU kernels need only a C++ compiler), so its absence is a
broken install, never a reason to skip: skipping would report a green suite that ran no kernel at all.
Only GPU tests skip (no CUDA device), Triton tests when triton itself is not installed, and cuda_sim tests
when nvcc is absent (or KVX_CUDA=0): cuda_sim is the CUDA kernel's source compiled by nvcc for the host.

Helpers the kernel tests share: :func:`impl_or_skip`, :func:`two_layouts` (import them from ``.conftest``).
"""

import importlib.util
import os
import shutil

import pytest
import torch

from kvx._ext import ERROR, C
from kvx.kernels import ops
from kvx.kernels.layout import KVLayout
from kvx.testing import make_kv_caches

C_ERROR = None if C is not None else ERROR  # the message names the missing .so or the unresolved symbol


@pytest.fixture(autouse=True)
def _require_compiled_extension():
    if C_ERROR is not None:
        pytest.fail(
            f"kvx._C failed to import ({C_ERROR}); the kernel tests need it. Build it with "
            "`./scripts/setup.sh` or `pip install -e .` from the kvx source tree (a C++17 compiler on "
            "PATH).",
            pytrace=False,
        )


def nvcc_path() -> str | None:
    """The nvcc setup.py would build with (CUDA_HOME / CUDA_PATH, PATH, the usual places), or None; also
    None under KVX_CUDA=0, which builds without it."""
    if os.environ.get("KVX_CUDA", "").lower() in ("0", "off", "false", "no"):
        return None
    candidates = [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def impl_or_skip(impl, device="cpu"):
    """Skip only for what this machine lacks (a CUDA device, triton, the interpreter flag on CPU, nvcc for
    cuda_sim); an implementation that should run here but is unavailable (kvx._C missing or broken,
    kvx.triton_kernels failing to import, kvx._C built without nvcc although nvcc is here) fails the test."""
    if impl not in ops.available_impls(device):
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (none present)")
        if impl == "triton" and importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        if impl == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton runs CPU caches only in its interpreter: set TRITON_INTERPRET=1")
        if impl == "cuda_sim" and C is not None and nvcc_path() is None:
            pytest.skip(
                "cuda_sim is the CUDA kernel compiled by nvcc as host code: no nvcc here (or KVX_CUDA=0), "
                "so kvx._C has none"
            )
        why = ERROR or ""
        if impl == "cuda_sim" and C is not None:
            why = (
                f"nvcc is at {nvcc_path()} but kvx._C was built without it (has_cuda_sim is False): rebuild "
                "with `pip install -e .` (KVX_CUDA=1 makes a missing nvcc a build error)"
            )
        if impl == "triton":
            try:
                import kvx.triton_kernels.copy  # noqa: F401
            except Exception as e:  # noqa: BLE001 - the message is the point
                why = f"{type(e).__name__}: {e}"
        pytest.fail(
            f"impl {impl!r} should run on {device} here but is unavailable "
            f"(available: {ops.available_impls(device)}){'; ' + why if why else ''}",
            pytrace=False,
        )
    return impl


def two_layouts(name, geom, dtype, padded, seed, device="cpu"):
    """Two identical caches (one for the implementation under test, one for the reference)."""
    a, b = (
        make_kv_caches(
            name, **geom, dtype=dtype, device=device, padded=padded, generator=torch.Generator().manual_seed(seed)
        )
        for _ in range(2)
    )
    return KVLayout.from_tensors(a, name), KVLayout.from_tensors(b, name)
