"""The copy kernels and their one door: check -> plan -> execute.

- :mod:`.layout`: one descriptor for every paged KV layout (vLLM 0.32+ views, legacy, MLA, CPU), and one copy's
  geometry (:func:`.layout.copy_geometry`) as the compiled kernels take it.
- :mod:`.check`: the checks of a copy's arguments (ids, buffers, implementation, staging).
- :mod:`.plan`: the door. :class:`.plan.Copies` checks copies; :meth:`.plan.Copies.plan` makes the compiled
  :class:`.plan.Plan` (``kvx._C.CopyPlan``: legs, DMA runs, kernel launches decided once); a plan runs now (a one-off
  copy) or is issued by an engine's compiled issue path, one call per layer (:mod:`kvx.engine`).
- :mod:`.ops`: the one-off ops (gather/scatter of blocks, slots and raw pages, all layers in one call): a plan of one
  copy. Implementations: pure torch, ``kvx._C``'s CPU and CUDA kernels (and the CUDA kernel emulated on the CPU), the
  Triton kernel of ``kvx.triton_kernels``.
- :mod:`.dma`: the host <-> device rule: DMA straight into the blocks or staged, by the threshold
  :func:`.dma.calibrate_h2d` measures once per device and process.
- :mod:`.reference`: the pure-torch oracle of every op.
- :mod:`.streams`: CUDA stream handles as torch streams.

Stateless and below the engine: nothing here imports :mod:`kvx.engine` or the connector. A one-off op runs on the
caller's thread and stream.
"""
