"""Per-request controls: the ``kvx_*`` keys of a request's ``kv_transfer_params``.

A client sets them in the OpenAI request body (``"kv_transfer_params": {"kvx_skip_save": true}``) or, offline,
in ``SamplingParams(extra_args={"kv_transfer_params": {...}})``:

- ``kvx_skip_load`` (bool): do not load this request's prefix from kvx (vLLM's own prefix cache still applies);
- ``kvx_skip_save`` (bool): do not save this request's chunks;
- ``kvx_namespace`` (str): isolate the request's chunks like ``cache_salt`` does (a chunk saved under one
  namespace is a miss under any other, and under none);
- ``kvx_pd_chunks`` (int) and ``kvx_pd_key`` (str): a prefill/decode hand-off. A ``kv_producer`` instance
  returns them with its response: how many full chunks of the prompt it is storing, and the last one's key.
  A ``kv_consumer`` given them (the proxy forwards the producer's ``kv_transfer_params``) waits up to
  ``pd_wait_ms`` for those chunks to appear in a shared tier before computing without them.
- ``kvx_push_to`` (str, ``HOST:PORT``): a producer on a ``kvx node`` in a cluster pushes the request's chunks
  straight into the consumer's node (that node's ``--listen`` address) as they are stored. LMCache's form is
  taken too: ``"disagg_spec": {"receiver_host": H, "receiver_init_port": P, ...}`` (its other fields are not
  used: kvx's consumer node allocates the slots itself).

Keys of other connectors (without the ``kvx_`` prefix) are left alone. An unknown ``kvx_*`` key or a value of the
wrong type is an error naming the key, what was expected and what was given: the request is refused before it
reaches the engine (HTTP 400; ``LLM.generate`` raises), see :func:`install_request_check`. Should a bad value reach
the engine anyway (the check could not be installed), kvx neither loads nor saves that request and logs why; the
engine never fails on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..log import get_logger

log = get_logger(__name__)

PREFIX = "kvx_"
_KEY_RE = re.compile(r"[0-9a-f]{32}")


class RequestParamsError(ValueError):
    """A request's ``kv_transfer_params`` has a bad ``kvx_*`` key or value."""


@dataclass(frozen=True)
class RequestControls:
    skip_load: bool = False
    skip_save: bool = False
    namespace: str | None = None
    pd_chunks: int | None = None  # consumer: chunks the producer announced
    pd_key: str | None = None  # consumer: the key of the last announced chunk
    push_to: str | None = None  # producer: the consumer's node (HOST:PORT) its chunks are pushed to

    @property
    def pd(self) -> bool:
        return self.pd_chunks is not None


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestParamsError(f"kv_transfer_params.{key}: expected true or false, got {v!r}")
    return v


def _namespace(key: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > 256:
        raise RequestParamsError(
            f"kv_transfer_params.{key}: expected a non-empty string of at most 256 characters, got {v!r}"
        )
    return v


def _count(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise RequestParamsError(f"kv_transfer_params.{key}: expected a non-negative integer, got {v!r}")
    return v


def _address(key: str, v: Any) -> str:
    host, sep, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestParamsError(f"kv_transfer_params.{key}: expected HOST:PORT (a kvx node's --listen), got {v!r}")
    return v


def _disagg_spec(v: Any) -> str:
    """LMCache's ``disagg_spec``: the consumer's node is ``receiver_host:receiver_init_port``."""
    if not isinstance(v, dict):
        raise RequestParamsError(f"kv_transfer_params.disagg_spec: expected a JSON object, got {v!r}")
    host, port = v.get("receiver_host"), v.get("receiver_init_port")
    if isinstance(port, list) and port:  # LMCache gives one port per TP rank: the node is one per host
        port = port[0]
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        raise RequestParamsError(
            "kv_transfer_params.disagg_spec: expected receiver_host (str) and receiver_init_port (int), got "
            f"{host!r} and {port!r}"
        )
    return _address("disagg_spec", f"{host}:{port}")


def _chunk_key(key: str, v: Any) -> str:
    if not isinstance(v, str) or not _KEY_RE.fullmatch(v):
        raise RequestParamsError(
            f"kv_transfer_params.{key}: expected a kvx chunk key (32 lowercase hex digits), got {v!r}"
        )
    return v


_FIELDS = {
    "kvx_skip_load": ("skip_load", _bool),
    "kvx_skip_save": ("skip_save", _bool),
    "kvx_namespace": ("namespace", _namespace),
    "kvx_pd_chunks": ("pd_chunks", _count),
    "kvx_pd_key": ("pd_key", _chunk_key),
    "kvx_push_to": ("push_to", _address),
}
KNOWN_KEYS = tuple(_FIELDS)
NONE = RequestControls()


def parse_request_params(params: Any) -> RequestControls:
    """The kvx controls of one request's ``kv_transfer_params`` (None: defaults). Raises
    :class:`RequestParamsError` naming the first bad key."""
    if params is None:
        return NONE
    if not isinstance(params, dict):
        raise RequestParamsError(f"kv_transfer_params: expected a JSON object, got {type(params).__name__}")
    fields = {}
    if params.get("disagg_spec") is not None and "kvx_push_to" not in params:
        fields["push_to"] = _disagg_spec(params["disagg_spec"])
    for k, v in params.items():
        if not isinstance(k, str) or not k.startswith(PREFIX):
            continue  # another connector's key
        if k not in _FIELDS:
            raise RequestParamsError(f"kv_transfer_params.{k}: unknown kvx key (known: {', '.join(KNOWN_KEYS)})")
        name, check = _FIELDS[k]
        fields[name] = check(k, v)
    if ("pd_chunks" in fields) != ("pd_key" in fields):
        given, missing = ("kvx_pd_chunks", "kvx_pd_key") if "pd_chunks" in fields else ("kvx_pd_key", "kvx_pd_chunks")
        raise RequestParamsError(
            f"kv_transfer_params.{missing}: expected together with {given} (a producer returns both), got {given} alone"
        )
    return RequestControls(**fields) if fields else NONE


def controls_of(request) -> tuple[RequestControls, str | None]:
    """``(controls, error)`` of a vLLM request; on a bad value the controls skip kvx entirely."""
    try:
        return parse_request_params(getattr(request, "kv_transfer_params", None)), None
    except RequestParamsError as e:
        return RequestControls(skip_load=True, skip_save=True), str(e)


# ------------------------------------------------------------------------------------------ front end
def uses_kvx(kv_transfer_config) -> bool:
    """Whether an engine with this ``KVTransferConfig`` runs a kvx connector (alone or in a MultiConnector)."""
    if kv_transfer_config is None:
        return False
    name = getattr(kv_transfer_config, "kv_connector", None) or ""
    module = getattr(kv_transfer_config, "kv_connector_module_path", None) or ""
    if name == "KVXConnector" or module.startswith("kvx"):
        return True
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    subs = extra.get("connectors") if isinstance(extra, dict) else None
    return any(
        isinstance(c, dict)
        and (c.get("kv_connector") == "KVXConnector" or str(c.get("kv_connector_module_path") or "").startswith("kvx"))
        for c in subs or ()
    )


def install_request_check() -> bool:
    """Refuse a request with bad ``kvx_*`` params where vLLM validates request parameters (its
    ``InputProcessor``, in the front-end process): the OpenAI server answers HTTP 400 naming the key, and
    ``LLM.generate`` raises. Only for engines running kvx; other requests and engines are untouched.
    Returns False when this vLLM has no such place (the engine-side fallback still applies)."""
    try:
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.input_processor import InputProcessor
    except Exception:  # noqa: BLE001 - another vLLM: the scheduler's fallback applies
        return False
    original = InputProcessor.__dict__.get("_validate_params")
    if original is None or not callable(original):
        return False
    if getattr(original, "_kvx_checks", False):
        return True

    def _validate_params(self, params, *args, **kwargs):
        out = original(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None)
        if extra and "kv_transfer_params" in extra and uses_kvx(getattr(self.vllm_config, "kv_transfer_config", None)):
            try:
                parse_request_params(extra["kv_transfer_params"])
            except RequestParamsError as e:
                raise VLLMValidationError(
                    str(e), parameter="kv_transfer_params", value=extra["kv_transfer_params"]
                ) from None
        return out

    _validate_params._kvx_checks = True
    _validate_params.__doc__ = original.__doc__
    InputProcessor._validate_params = _validate_params
    return True
