"""kvx: a KV-cache transfer engine for vLLM.

- :mod:`kvx.layout`: one descriptor for every paged KV layout (vLLM 0.32+ views, legacy, MLA, CPU).
- :mod:`kvx.ops`: gather/scatter of blocks, slots and raw pages, all layers in one call.
- :mod:`kvx.reference`: the pure-torch oracle of every op.
"""

__version__ = "0.1.0"
