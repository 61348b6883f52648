"""The kernel suite needs the compiled extension: a missing or broken ``kvx._C`` fails every test here.

``kvx._C`` is always built (``setup.py``: the CPU kernels need only a C++ compiler), so its absence is a
broken install, never a reason to skip: skipping would report a green suite that ran no kernel at all.
Only GPU tests skip (no CUDA device), Triton tests when triton itself is not installed, and cuda_sim tests
when nvcc is absent (or KVX_CUDA=0): cuda_sim is the CUDA kernel's source compiled by nvcc for the host.
"""

import pytest

from kvx._ext import ERROR, C

C_ERROR = None if C is not None else ERROR  # the message names the missing .so or the unresolved symbol


@pytest.fixture(autouse=True)
def _require_compiled_extension():
    if C_ERROR is not None:
        pytest.fail(f"kvx._C failed to import ({C_ERROR}); the kernel tests need it. Build it with "
                    "`./scripts/setup.sh` or `pip install -e .` from the kvx source tree (a C++17 compiler on "
                    "PATH).", pytrace=False)
