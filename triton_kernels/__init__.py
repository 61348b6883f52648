"""Triton kernels of kvx, installed as ``kvx.triton_kernels`` (import them relatively, never as top-level
``triton_kernels``).

- :mod:`.copy`: ``copy_rows``, the paged <-> contiguous KV copy (the address math of ``csrc/kv_layout.h``),
  called by :func:`kvx.kernels.ops._run_triton`. Runs on CUDA caches, and on CPU caches under ``TRITON_INTERPRET=1``.
"""
