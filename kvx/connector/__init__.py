"""vLLM KV connector: :class:`KVXConnector` (``kv_connector="KVXConnector"``).

``KVXConnector`` is imported lazily, so the vLLM-free parts (``keys``, ``config``) load without vLLM.
"""

__all__ = ["KVXConnector"]


def __getattr__(name):
    if name == "KVXConnector":
        from .connector import KVXConnector

        return KVXConnector
    raise AttributeError(f"module 'kvx.connector' has no attribute {name!r}")
