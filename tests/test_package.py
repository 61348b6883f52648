"""The package layout: kvx's Triton kernels are ``kvx.triton_kernels`` and nothing of the repository stands in for
the top-level package of that name that vLLM imports; the test tooling's names stay importable from
``kvx.testing``."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(REPO, "kvx", "triton_kernels")

# run with the repository root first on sys.path (`python -c` from it: sys.path[0] == "")
PROBE = f"""
import os, sys
assert sys.path[0] == "", sys.path[:2]
try:
    import triton_kernels
except ImportError as e:
    print("absent", e)
else:
    where = [os.path.realpath(p) for p in getattr(triton_kernels, "__path__", [])]
    assert os.path.realpath({FOLDER!r}) not in where, where
    print("other", triton_kernels.__name__, where)
import kvx.triton_kernels.copy as copy
assert copy.__name__ == "kvx.triton_kernels.copy" and hasattr(copy, "copy_rows")
print("kvx", copy.__name__)
"""


def _probe(extra_path: str | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_top_level_triton_kernels_is_never_the_repository_folder():
    lines = _probe()
    assert lines[0].startswith(("absent", "other")), lines
    if lines[0].startswith("absent"):
        assert "No module named 'triton_kernels'" in lines[0], lines
    assert lines[-1] == "kvx kvx.triton_kernels.copy"


def test_a_triton_kernels_package_later_on_sys_path_wins(tmp_path):
    pkg = tmp_path / "triton_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("WHO = 'the real one'\n")
    (pkg / "matmul.py").write_text("")
    lines = _probe(str(tmp_path))  # after the repository root ("") on sys.path
    assert lines[0] == f"other triton_kernels {[os.path.realpath(pkg)]}", lines
    assert lines[-1] == "kvx kvx.triton_kernels.copy"


def test_testing_names_stay_importable():
    from kvx.testing import RUNNER_ORDERS, end_step, make_kv_caches, make_layout, random_fill_  # noqa: F401
