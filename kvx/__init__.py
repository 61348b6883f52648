"""kvx: a KV-cache transfer engine for vLLM.

- :mod:`kvx.kernels`: the copy kernels and their door (:mod:`kvx.kernels.ops`: gather/scatter of blocks, slots
  and raw pages, all layers in one call; :mod:`kvx.kernels.layout`: one descriptor for every paged KV layout;
  :mod:`kvx.kernels.reference`: the pure-torch oracle of every op).
- :mod:`kvx._ext`: the one import of the compiled extension ``kvx._C``.
- :mod:`kvx.engine`: the copy queues and the order of copies against the forwards.
- :mod:`kvx.store`: the tiers (CPU pool, disk, Redis) and the chunk codec.
- :mod:`kvx.connector`: the vLLM KV connector; :mod:`kvx.plugin`: vLLM's entry point; :mod:`kvx.log`: logging.
- :mod:`kvx.tools`: the ``kvx`` command and the prefill/decode proxy.
- :mod:`kvx.testing`: test and benchmark tooling (cache builders, vLLM engines and servers, Redis servers).
"""

__version__ = "0.1.0"
