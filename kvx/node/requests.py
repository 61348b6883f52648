"""The daemon's requests (:class:`Requests`): one decoded frame from a connection in, its reply out.

Each op checks its arguments (a :class:`~.args.BadRequest` names the argument, what was expected and what came),
the connection's role, then calls :class:`~.index.NodeState`'s typed method and writes its answer as the reply's
fields. The index knows nothing of frames; this module nothing of slots. Loop thread only (the server's).
"""

from __future__ import annotations

from collections.abc import Callable

from ..log import get_logger
from .args import MISSING, BadRequest, Refused, arg, is_int, key_arg, keys_arg, show
from .index import NodeState
from .protocol import NAMESPACE_RE, VERSION
from .records import Client, Namespace

log = get_logger(__name__)

_LATER = object()  # an op's answer that comes later (a pull's), on the connection it was asked on

Op = Callable[[NodeState, Client, dict], "dict | object"]


class Requests:
    """Answers requests to ``state`` (see the module docstring). Loop thread only."""

    def __init__(self, state: NodeState):
        self.state = state

    def request(self, cid: int, msg: dict) -> tuple[dict | None, bool]:
        """Answer ``msg`` (a decoded frame body) from connection ``cid``: (the reply, whether the connection stays
        open); the reply None if it comes later (a pull's). Never raises: a bad request, a refusal and a bug in the
        daemon are all error replies."""
        state = self.state
        rid = msg.get("id")
        rid = rid if is_int(rid) else None
        c = state.client(cid)
        op = msg.get("op")
        try:
            if rid is None:
                raise BadRequest(f"id: expected an int, got {show(msg.get('id', MISSING))}")
            if c.role is None and op != "hello":
                state.counters["bad_requests"] += 1
                return {"id": rid, "ok": False, "error": f"op: expected 'hello' first, got {show(op)}"}, False
            if not isinstance(op, str) or op not in OPS:
                raise BadRequest(f"op: expected one of {', '.join(OPS)}, got {show(op)}")
            fn, role = OPS[op]
            if role is not None and c.role != role:
                raise BadRequest(f"op {op}: expected a connection with role {role!r}, got role {c.role!r}")
            out = fn(state, c, msg)
            if out is _LATER:
                return None, True
            return {"id": rid, "ok": True, **out}, True
        except BadRequest as e:
            state.counters["bad_requests"] += 1
            return {"id": rid, "ok": False, "error": str(e)}, True
        except Refused as e:
            return {"id": rid, "ok": False, "error": str(e)}, True
        except Exception as e:  # noqa: BLE001 - nothing a client sends may stop the daemon
            state.counters["internal_errors"] += 1
            log.exception("kvx node: op %r of connection %d (pid %d) failed", op, cid, c.pid)
            return {"id": rid, "ok": False, "error": f"internal error in op {op!r}: {type(e).__name__}: {e}"}, True


def _namespace(state: NodeState, args: dict) -> Namespace:
    name = args.get("namespace", MISSING)
    ns = state.namespace(name)
    if ns is None:
        known = ", ".join(state.namespace_names()) or "none yet"
        raise BadRequest(f"namespace: expected a known namespace ({known}), got {show(name)}")
    return ns


def _hello(state: NodeState, c: Client, args: dict) -> dict:
    if c.role is not None:
        raise BadRequest(f"hello: expected once per connection, got a second one (role {c.role!r})")
    arg(args, "version", lambda v: is_int(v) and v == VERSION, f"protocol version {VERSION}")
    role = arg(args, "role", lambda v: v in ("engine", "puller", "control"), "'engine', 'puller' or 'control'")
    pid = args.get("pid", c.pid)
    if not is_int(pid):
        raise BadRequest(f"pid: expected an int, got {show(pid)}")
    if role in ("engine", "puller"):
        name = arg(args, "namespace", lambda v: isinstance(v, str) and NAMESPACE_RE.fullmatch(v), "8-128 hex digits")
        model = arg(args, "model", lambda v: isinstance(v, str), "a model name (str)")
        chunk_size = arg(args, "chunk_size", lambda v: is_int(v) and v > 0, "a positive int (tokens)")
        need = arg(args, "slot_bytes", lambda v: is_int(v) and v > 0, "a positive int (bytes of one chunk)")
        sealed = args.get("sealed", False)  # absent: an engine of a kvx before sealed namespaces
        if not isinstance(sealed, bool):
            raise BadRequest(f"sealed: expected a bool (the engine seals its byte tiers), got {show(sealed)}")
        state.join(c, name, model, chunk_size, need, count=role == "engine", sealed=sealed)
    c.role, c.pid = role, pid
    return state.pool_info()


def _lookup(state: NodeState, c: Client, args: dict) -> dict:
    if "namespace" in args:
        return {"ready": state.ready_prefix(_namespace(state, args), keys_arg(args))}
    if c.role != "engine":
        raise BadRequest("namespace: expected a namespace (a lookup without one is an engine's), got nothing")
    return {"states": state.lookup(c, keys_arg(args))}


def _tally(state: NodeState, c: Client, args: dict) -> dict:
    counts = [arg(args, name, lambda v: is_int(v) and v >= 0, "a count (an int >= 0)") for name in ("hits", "misses")]
    state.tally(c.ns, *counts)
    return {}


def _allocate(state: NodeState, c: Client, args: dict) -> dict:
    return state.allocate(c, key_arg(args))


def _commit(state: NodeState, c: Client, args: dict) -> dict:
    state.commit(c, key_arg(args))
    return {}


def _abort(state: NodeState, c: Client, args: dict) -> dict:
    state.abort(c, key_arg(args))
    return {}


def _pin(state: NodeState, c: Client, args: dict) -> dict:
    entries = state.pin(c, keys_arg(args))
    return {"slots": [e.slot for e in entries], "generations": [state.generation(e.slot) for e in entries]}


def _hold(state: NodeState, c: Client, args: dict) -> dict:
    e = state.hold(c, key_arg(args))
    return {"slot": e.slot, "generation": state.generation(e.slot)}


def _unpin(state: NodeState, c: Client, args: dict) -> dict:
    state.unpin(c, keys_arg(args))
    return {}


def _pin_prefix(state: NodeState, c: Client, args: dict) -> dict:
    return {"pinned": state.pin_prefix(_namespace(state, args), keys_arg(args))}


def _unpin_prefix(state: NodeState, c: Client, args: dict) -> dict:
    return {"unpinned": state.unpin_prefix(_namespace(state, args), keys_arg(args))}


def _evict(state: NodeState, c: Client, args: dict) -> dict:
    ns = _namespace(state, args)
    keys = keys_arg(args) if args.get("keys") is not None else None
    return {"evicted": state.evict(ns, keys)}


def _quota(state: NodeState, c: Client, args: dict) -> dict:
    ns = _namespace(state, args)
    quota = arg(args, "bytes", lambda v: v is None or (is_int(v) and v >= 0), "a byte count >= 0 or null")
    state.set_quota(ns, quota)
    return {}


def _pull(state: NodeState, c: Client, args: dict) -> dict | object:
    keys = keys_arg(args)
    budget = arg(args, "budget_ms", lambda v: is_int(v) and v > 0, "a positive int (ms)") / 1e3
    n = state.pull(c, args["id"], keys, budget)
    return _LATER if n is None else {"pulled": n}


def _push(state: NodeState, c: Client, args: dict) -> dict:
    keys = keys_arg(args)
    to = arg(args, "to", lambda v: isinstance(v, str) and 0 < len(v) <= 300, "HOST:PORT (str)")
    return {"pushing": state.push(c, keys, to)}


# op -> (its function, the role a connection needs for it: None, any)
OPS: dict[str, tuple[Op, str | None]] = {
    "hello": (_hello, None),
    "lookup": (_lookup, None),
    "allocate": (_allocate, "engine"),
    "commit": (_commit, "engine"),
    "abort": (_abort, "engine"),
    "pin": (_pin, "engine"),
    "hold": (_hold, "engine"),
    "unpin": (_unpin, "engine"),
    "tally": (_tally, "engine"),
    "stats": (lambda state, c, a: state.stats(), None),
    "pin_prefix": (_pin_prefix, None),
    "unpin_prefix": (_unpin_prefix, None),
    "evict": (_evict, None),
    "quota": (_quota, None),
    "pull": (_pull, "puller"),
    "push": (_push, "engine"),
}
