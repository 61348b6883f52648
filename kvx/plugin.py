"""vLLM ``general_plugins`` entry point: registers ``KVXConnector`` with vLLM's connector factory.

vLLM calls :func:`register` once in every process (frontend, engine core, workers). It must not raise
(an exception there stops vLLM's start-up) and must be idempotent (the factory refuses duplicates).
"""

import logging

log = logging.getLogger("kvx")

NAME = "KVXConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as e:  # noqa: BLE001 - vLLM without the connector API: nothing to register
        log.debug("kvx: not registering %s: %s", NAME, e)
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    if NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(NAME, "kvx.connector", NAME)
    except ValueError:  # registered concurrently under the same name
        pass
