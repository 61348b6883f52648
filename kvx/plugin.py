"""vLLM ``general_plugins`` entry point: registers ``KVXConnector`` with vLLM's connector factory, routes
kvx's log lines through vLLM's logging, and checks kvx's config as early as vLLM allows.

vLLM calls :func:`register` once in every process (front end, engine core, workers), before it builds
its config. It must not raise (an exception there stops vLLM's start-up) and must be idempotent (the
factory refuses duplicates).

Early config errors: vLLM resolves the connector class while it validates its own config
(``VllmConfig.__post_init__``, in the front-end process, before any model is loaded), but on the CPU
backend it hands the class no config there; the first hook that sees kvx's config would run in the
engine core after the model has loaded, 60-120 s later for a real model. So :func:`register` wraps
the factory's ``get_connector_class``: when it resolves a kvx connector for a ``KVTransferConfig``,
the config is checked (:meth:`KVXConnector.check_config`) right then. The wrap changes nothing for any
other connector, and the constructors check again (with the plugin disabled through
``VLLM_PLUGINS``, that is where errors show).

Per-request ``kvx_*`` params are checked where vLLM validates request parameters, so a bad one is an
HTTP 400 naming the key (:func:`kvx.connector.params.install_request_check`).
"""

from __future__ import annotations

from .log import attach_to_vllm, get_logger

log = get_logger(__name__)

NAME = "KVXConnector"


def register() -> None:
    attach_to_vllm()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as e:  # noqa: BLE001 - vLLM without the connector API: nothing to register
        log.debug("kvx: not registering %s: %s", NAME, e)
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    if NAME not in registry:
        try:
            KVConnectorFactory.register_connector(NAME, "kvx.connector", NAME)
        except ValueError:  # registered concurrently under the same name
            pass
    _check_config_on_resolve(KVConnectorFactory)
    from .connector.params import install_request_check

    install_request_check()


def _check_config_on_resolve(factory) -> None:
    """Wrap ``factory.get_connector_class`` so that resolving a kvx connector checks its config."""
    original = factory.__dict__.get("get_connector_class")
    if not isinstance(original, classmethod) or getattr(original.__func__, "_kvx_checks", False):
        return  # an API we do not know, or wrapped already

    def get_connector_class(cls, kv_transfer_config):
        connector_cls = original.__func__(cls, kv_transfer_config)
        check = getattr(connector_cls, "check_config", None)
        if check is not None and getattr(connector_cls, "__module__", "").startswith("kvx."):
            check(kv_transfer_config)
        return connector_cls

    get_connector_class._kvx_checks = True
    get_connector_class.__doc__ = original.__func__.__doc__
    factory.get_connector_class = classmethod(get_connector_class)
