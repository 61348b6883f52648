"""Triton kernels of kvx (``kvx.triton_kernels``).

- :mod:`.copy`: ``copy_rows``, the paged <-> contiguous KV copy (the address math of ``csrc/kv_layout.h``),
  called by :class:`kvx.kernels.plan.Plan` (impl ``triton``). Runs on CUDA caches, and on CPU caches under
  ``TRITON_INTERPRET=1``.

It lives inside ``kvx``: a top-level folder of this name would stand in for the Triton project's
``triton_kernels`` package, which vLLM imports, whenever the repository's root is on ``sys.path``.
"""
