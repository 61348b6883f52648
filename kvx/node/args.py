"""The arguments of ``kvx node``'s requests: each checked, and a wrong one named in a :class:`BadRequest` with what
was expected and what was given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .protocol import KEY_RE, KEYS_RE


class BadRequest(ValueError):
    """A request with an unknown op or wrong arguments (counted as ``bad_requests``)."""


class Refused(ValueError):
    """A well-formed request the index cannot honour now (commit of a slot that is not PENDING, pin of a chunk that
    is not READY, ...): an error reply, not counted as a bad request (another engine may have evicted the chunk)."""


MISSING = object()


def show(value: Any) -> str:
    if value is MISSING:
        return "nothing"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def arg(args: dict, name: str, ok, expected: str) -> Any:
    value = args.get(name, MISSING)
    if value is MISSING or not ok(value):
        raise BadRequest(f"{name}: expected {expected}, got {show(value)}")
    return value


def key_arg(args: dict, name: str = "key") -> str:
    return arg(args, name, lambda v: isinstance(v, str) and KEY_RE.fullmatch(v), "32 lowercase hex digits")


def keys_arg(args: dict, name: str = "keys") -> list[str]:
    """A request's keys: a list, or one string of keys end to end (:data:`~.protocol.KEYS_RE`: what engines send,
    a quarter of the list's cost to encode and decode), each checked."""
    keys = arg(args, name, lambda v: isinstance(v, (list, str)), "a list of keys (32 lowercase hex digits each)")
    if isinstance(keys, str):
        if not KEYS_RE.fullmatch(keys):
            raise BadRequest(f"{name}: expected keys of 32 lowercase hex digits end to end, got {show(keys)}")
        return [keys[i : i + 32] for i in range(0, len(keys), 32)]
    if all(isinstance(k, str) for k in keys) and KEYS_RE.fullmatch("".join(keys)) and all(len(k) == 32 for k in keys):
        return keys  # one match for the whole list
    for i, k in enumerate(keys):
        if not (isinstance(k, str) and KEY_RE.fullmatch(k)):
            raise BadRequest(f"{name}[{i}]: expected 32 lowercase hex digits, got {show(k)}")
    return keys


def counts(keys: Sequence[str]) -> dict[str, int]:
    count: dict[str, int] = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    return count
