"""Triton kernels of kvx, installed as ``kvx.triton_kernels`` (import them relatively, never as top-level
``triton_kernels``).

- :mod:`.copy`: ``copy_rows``, the paged <-> contiguous KV copy (the address math of ``csrc/kv_layout.h``),
  called by :class:`kvx.kernels.plan.Plan` (impl ``triton``). Runs on CUDA caches, and on CPU caches under
  ``TRITON_INTERPRET=1``.

The top-level name ``triton_kernels`` belongs to the Triton project's package, which vLLM imports. With this
repository's root on ``sys.path`` (``python -m`` or ``python -c`` run from it, ``PYTHONPATH`` naming it) this
folder is found under that name; it then steps aside: the package of that name found on the rest of ``sys.path``
is imported in its place, or the import fails as if this folder were not there. (Without this file the folder
would still be found, as a namespace portion, and setuptools' editable installs cannot map a namespace package
inside ``kvx``.)
"""

if __name__ == "triton_kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _rest)
    if _spec is None or _spec.loader is None:  # none, or only namespace portions: as if this folder were absent
        raise ModuleNotFoundError(
            f"No module named {__name__!r} (this repository's {__name__}/ is kvx's, imported as kvx.{__name__})",
            name=__name__,
        )
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module  # what the import statement returns (importlib re-reads the entry)
    _spec.loader.exec_module(_module)
