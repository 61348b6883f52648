"""``kvx node``'s request path (:meth:`~kvx.node.daemon.NodeState.request`, no sockets): bad requests and bad
hellos are answered and counted (the connection may try again), ops before hello close the connection, an op that is
not a string is a bad request, and an op failing inside the daemon is answered, logged and counted."""

from __future__ import annotations

import pytest

from kvx.node import requests
from kvx.node.protocol import VERSION
from kvx.node.requests import Requests
from tests.node.daemon_helpers import NS_A, Peer, key, make_state

BAD_REQUESTS = [  # (op, args, role, what the error names)
    ("nosuch", {}, "engine", "op: expected one of hello, lookup"),
    ("allocate", {"key": "ABC"}, "engine", "key: expected 32 lowercase hex digits, got 'ABC'"),
    ("allocate", {}, "engine", "key: expected 32 lowercase hex digits, got nothing"),
    ("lookup", {"keys": "0" * 33}, "engine", "keys: expected keys of 32 lowercase hex digits end to end"),
    ("lookup", {"keys": 7}, "engine", "keys: expected a list of keys"),
    ("lookup", {"keys": [key(1), 7]}, "engine", "keys[1]: expected 32 lowercase hex digits, got 7"),
    ("allocate", {"key": key(1)}, "control", "op allocate: expected a connection with role 'engine', got role 'con"),
    ("lookup", {"keys": []}, "control", "namespace: expected a namespace"),
    ("evict", {"namespace": "ff" * 8}, "control", f"namespace: expected a known namespace ({NS_A}), got 'ffff"),
    ("quota", {"namespace": NS_A, "bytes": -1}, "control", "bytes: expected a byte count >= 0 or null, got -1"),
    ("quota", {"namespace": NS_A, "bytes": True}, "control", "bytes: expected a byte count >= 0 or null, got True"),
    ("hello", {"version": VERSION, "role": "control"}, "control", "hello: expected once per connection"),
]


@pytest.mark.parametrize(("op", "args", "role", "error"), BAD_REQUESTS)
def test_bad_requests_are_answered_and_counted(op, args, role, error):
    state = make_state()
    Peer(state, 1)  # registers NS_A
    p = Peer(state, 2, role=role)
    reply, keep = p.reply(op, **args)
    assert not reply["ok"] and error in reply["error"] and keep
    assert state.counters["bad_requests"] == 1


BAD_HELLOS = [  # (hello arguments, what the error names)
    ({"version": 1, "role": "engine"}, f"version: expected protocol version {VERSION}, got 1"),
    ({"version": VERSION, "role": "admin"}, "role: expected 'engine', 'puller' or 'control', got 'admin'"),
    ({"version": VERSION, "role": "engine", "namespace": "XY"}, "namespace: expected 8-128 hex digits, got 'XY'"),
    (
        {"version": VERSION, "role": "engine", "namespace": NS_A, "model": "m", "chunk_size": 0},
        "chunk_size: expected a po",
    ),
    (
        {
            "version": VERSION,
            "role": "engine",
            "namespace": NS_A,
            "model": "m",
            "chunk_size": 16,
            "slot_bytes": 1 << 40,
        },
        "slot_bytes: expected chunks that a run of at most",
    ),
    ({"version": VERSION, "role": "control", "pid": "me"}, "pid: expected an int, got 'me'"),
]


@pytest.mark.parametrize(("args", "error"), BAD_HELLOS)
def test_bad_hellos_are_refused_and_the_connection_may_try_again(args, error):
    state = make_state()
    state.open(1)
    reply, keep = Requests(state).request(1, {"op": "hello", "id": 1, **args})
    assert not reply["ok"] and error in reply["error"] and keep
    reply, keep = Requests(state).request(1, {"op": "hello", "id": 2, "version": VERSION, "role": "control"})
    assert reply["ok"] and keep


def test_ops_before_hello_close_the_connection_and_bad_ids_are_answered():
    state = make_state()
    state.open(1)
    assert Requests(state).request(1, {"op": "lookup", "keys": [key(1)]}) == (
        {"id": None, "ok": False, "error": "id: expected an int, got nothing"},
        True,
    )
    reply, keep = Requests(state).request(1, {"op": "stats", "id": 4})
    assert reply == {"id": 4, "ok": False, "error": "op: expected 'hello' first, got 'stats'"} and not keep
    assert state.counters["bad_requests"] == 2


def test_an_op_that_is_not_a_string_is_a_bad_request():
    state = make_state()
    Peer(state, 1)
    reply, keep = Requests(state).request(1, {"op": ["allocate"], "id": 9})
    assert reply == {
        "id": 9,
        "ok": False,
        "error": "op: expected one of " + ", ".join(requests.OPS) + ", got ['allocate']",
    }
    assert keep and state.counters["bad_requests"] == 1


def test_an_op_that_fails_inside_the_daemon_is_answered_logged_and_counted(monkeypatch, caplog):
    state = make_state()
    a = Peer(state, 1)
    monkeypatch.setitem(requests.OPS, "lookup", (lambda state, c, args: 1 / 0, None))
    reply, keep = a.reply("lookup", keys=[])
    assert not reply["ok"] and "internal error in op 'lookup': ZeroDivisionError" in reply["error"] and keep
    assert state.counters["internal_errors"] == 1
    assert "ZeroDivisionError" in caplog.text  # with its traceback
    assert a.call("allocate", key=key(1))["slot"] == 0  # still serving
