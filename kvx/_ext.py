"""The one import of kvx's compiled extension ``kvx._C`` (``csrc/bindings.cpp``: the CPU and CUDA copy kernels,
their host-side plan, the CUDA kernel's CPU emulation, CRC32C, page population). Every other module takes it from
here.

The extension is optional at import time, so that a broken build still imports kvx and says what to do:

- :data:`C`: the module, or ``None`` when it failed to import; :data:`ERROR` then holds the import error's message.
- :func:`require`: the module, or RuntimeError with :data:`BUILD_HINT` (what the ops raise).
- :func:`load`: the module, or ImportError with the original message (for callers with a pure-Python fallback).

Imported once per process, by whichever thread imports kvx first; read-only afterwards.
"""

from __future__ import annotations

from types import ModuleType

try:
    from . import _C as C  # type: ignore[attr-defined]

    ERROR: str | None = None
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    C: ModuleType | None = None  # type: ignore[no-redef]
    ERROR = str(e)

BUILD_HINT = (
    "the compiled extension kvx._C is not available ({err}); build it with `pip install .` "
    "(or `pip install -e .`) from the kvx source tree, with a C++17 compiler on PATH"
)


def require() -> ModuleType:
    """``kvx._C``; RuntimeError saying how to build it when it is not available."""
    if C is None:
        raise RuntimeError(BUILD_HINT.format(err=ERROR))
    return C


def load() -> ModuleType:
    """``kvx._C``; ImportError with the original message when it is not available."""
    if C is None:
        raise ImportError(ERROR)
    return C
