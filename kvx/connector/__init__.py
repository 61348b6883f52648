"""vLLM KV connector: :class:`KVXConnector` (``kv_connector="KVXConnector"``)."""

from .connector import KVXConnector

__all__ = ["KVXConnector"]
