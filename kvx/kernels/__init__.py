"""The copy kernels and their door.

- :mod:`.layout`: one descriptor for every paged KV layout (vLLM 0.32+ views, legacy, MLA, CPU), and the plan
  (descriptors, row size, id kind) the compiled kernels take.
- :mod:`.ops`: the op door: gather/scatter of blocks, slots and raw pages, all layers in one call, and
  :class:`.ops.CopyBatch`; it validates, then runs one implementation (pure torch, ``kvx._C``'s CPU and CUDA
  kernels through :mod:`kvx._ext`, the Triton kernel of ``kvx.triton_kernels``).
- :mod:`.dma`: the host <-> device rule of impl ``cuda``: the copy kernel or DMA, by the threshold
  :func:`.dma.calibrate_h2d` measures once per device and process.
- :mod:`.reference`: the pure-torch oracle of every op.

The ops run on the caller's thread and stream; :mod:`kvx.engine` decides which thread that is.
"""
