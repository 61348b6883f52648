"""``kvx node``'s daemon: the index (:class:`NodeState`, no sockets) call by call and by a randomized sequence checked
against its invariants, then real daemon processes: an engine's cycle against the mapped pool file, a client killed
with SIGKILL, garbage frames, SIGTERM, a second daemon on the same socket, the Prometheus endpoint, a refused uid,
and the ``kvx node`` subcommands."""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from kvx.keys import chunk_keys, request_root
from kvx.node import cli
from kvx.node.connection import Connection, NodeError
from kvx.node.daemon import NodeState, Refused, default_pool_path
from kvx.node.protocol import (
    FREE,
    HEADER,
    MAGIC,
    MAX_BODY,
    PENDING,
    READY,
    VERSION,
    Directory,
    PoolGeometry,
    encode,
    slot_entry,
    unpack_header,
)
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
NS_A, NS_B, NS_C = "a1" * 8, "b2" * 8, "c3" * 8
SLOT = 4096  # bytes: the smallest slot (protocol.SLOT_ALIGN), so a few MiB hold hundreds
SEEDS = [0, 1, 2, 3]
START_S = 30  # seconds a daemon may take to start on a loaded 2-core machine


def key(i: int) -> str:
    return f"{i:032x}"


# ------------------------------------------------------------------------------------------------ NodeState
class Peer:
    """One connection to a :class:`NodeState`, through :meth:`NodeState.request` (the path every frame takes)."""

    def __init__(self, state: NodeState, cid: int, role: str = "engine", ns: str = NS_A, slot_bytes: int = SLOT):
        self.state, self.cid, self._id = state, cid, 0
        state.open(cid, pid=1000 + cid)
        extra = (
            {"namespace": ns, "model": f"m-{ns[:2]}", "chunk_size": 16, "slot_bytes": slot_bytes}
            if role == "engine"
            else {}
        )
        self.hello = self.call("hello", version=VERSION, role=role, pid=1000 + cid, **extra)

    def reply(self, op: str, **args) -> tuple[dict, bool]:
        self._id += 1
        reply, keep = self.state.request(self.cid, {"op": op, "id": self._id, **args})
        assert reply["id"] == self._id
        return reply, keep

    def call(self, op: str, **args) -> dict:
        reply, keep = self.reply(op, **args)
        if not reply["ok"]:
            raise NodeError(reply["error"])
        assert keep
        return reply

    def store(self, *keys: str) -> list[int]:
        """Allocate and commit ``keys``; their slots."""
        slots = []
        for k in keys:
            slots.append(self.call("allocate", key=k)["slot"])
            self.call("commit", key=k)
        return slots

    def close(self) -> None:
        self.state.close(self.cid)


def make_state(num_slots: int = 4, quotas: dict[str, int] | None = None) -> NodeState:
    geom = PoolGeometry(num_slots, SLOT)
    return NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", bytes(range(16)), quotas)


def entry(state: NodeState, slot: int) -> tuple[bytes, int, int]:
    return slot_entry(state.table, state.geom, slot)


def ns_stats(state: NodeState, ns: str = NS_A) -> dict:
    return state.stats()["namespaces"][ns]


def check_invariants(state: NodeState) -> None:
    """Every slot is free or held by one entry (in the index, or doomed and leased); the table says what the index
    says; every counter is what recounting gives."""
    holders: dict[int, object] = {}
    for ns in state._namespaces.values():
        assert ns.chunks == sum(e.state == READY for e in ns.entries.values())
        assert ns.pending == sum(e.state == PENDING for e in ns.entries.values())
        assert ns.admin_pinned == sum(e.admin > 0 for e in ns.entries.values())
        assert list(ns.lru) == [e for e in state._lru if e.ns is ns]
        assert set(ns.lru) == {e for e in ns.entries.values() if e.state == READY and not e.admin}
        for k, e in ns.entries.items():
            assert e.key == k and not e.doomed and e.slot not in holders
            holders[e.slot] = e
            assert entry(state, e.slot) == (bytes.fromhex(k), state._generation[e.slot], e.state)
    leases: Counter = Counter()
    for c in state._clients.values():
        for k, held in c.leases.items():
            assert held and all(e.key == k for e in held)
            leases.update(held)
        assert all(e.state == PENDING and e.owner == c.cid and e.ns.entries.get(k) is e for k, e in c.pending.items())
    for e, n in leases.items():
        assert e.leases == n
        if e.doomed:
            assert e.slot not in holders
            holders[e.slot] = e
    assert all(e.leases == leases[e] for e in holders.values())
    assert sorted([*holders, *state._free]) == list(range(state.geom.num_slots))
    for slot in state._free:
        assert entry(state, slot) == (bytes(16), state._generation[slot], FREE)
    # the directory holds exactly the READY chunks, each found where a lookup probes for it (a key is one
    # namespace's in practice: keys are hash chains rooted in the namespace; the tests reuse keys across them)
    ready = [k for ns in state._namespaces.values() for k, e in ns.entries.items() if e.state == READY]
    others = [k for ns in state._namespaces.values() for k in ns.entries if k not in ready]
    d = Directory(state.table, state.geom, state.epoch)
    assert d.ready("".join(ready)) == [True] * len(ready)
    assert d.ready("".join(others + [key(10_000 + i) for i in range(8)])) == [False] * (len(others) + 8)
    assert int((d.dir["slot"] != 0).sum()) == len(ready)
    assert [d.state(k) for k in ready] == [READY] * len(ready)
    pending = [
        k for ns in state._namespaces.values() for k, e in ns.entries.items() if e.state == PENDING and k not in ready
    ]
    assert [d.state(k) for k in pending] == [PENDING] * len(pending)
    assert {d.state(k) for k in others if k not in pending} | {d.state(key(10_000))} <= {FREE}


def test_auto_slots_are_carved_at_the_first_engines_hello_as_large_as_its_chunks():
    carved = []

    def carve(slot_bytes: int):
        if slot_bytes > 1 << 20:
            raise Refused(f"no room for a slot of {slot_bytes} bytes")
        geom = PoolGeometry.fit(8 << 20, slot_bytes)
        carved.append(geom)
        return geom, bytearray(geom.data_offset), bytes(16)

    state = NodeState(None, None, "/dev/shm/test.pool", None, {NS_B: 4 * SLOT}, carve=carve)
    ctl = Peer(state, 0, role="control")
    assert ctl.hello["pool"] is None and ctl.hello["num_slots"] == 0  # nothing to map yet
    s = state.stats()
    assert (s["pool"]["num_slots"], s["pool"]["slot_bytes"], s["pool"]["bytes"], s["pool"]["path"]) == (
        0,
        None,
        0,
        None,
    )
    # control ops on a namespace known before any engine (a quota) answer from an empty pool
    assert ctl.call("pin_prefix", namespace=NS_B, keys=[key(1)])["pinned"] == 0
    assert ctl.call("evict", namespace=NS_B, keys=[])["evicted"] == 0
    ctl.call("quota", namespace=NS_B, bytes=SLOT)
    assert state.stats()["namespaces"][NS_B]["bytes"] == 0
    with pytest.raises(NodeError, match="no room for a slot of 2097152 bytes"):
        Peer(state, 9, slot_bytes=2 << 20)
    assert state.geom is None and carved == []  # refused: the next engine's hello tries again
    first = Peer(state, 10, slot_bytes=5000).hello
    assert first["slot_bytes"] == 8192 and first["pool"] == "/dev/shm/test.pool"
    assert [g.slot_bytes for g in carved] == [8192] and state.geom == carved[0]
    Peer(state, 11, slot_bytes=100)  # smaller chunks fit
    with pytest.raises(NodeError, match="expected at most the pool's slot size, 8192 bytes, got 9000"):
        Peer(state, 12, slot_bytes=9000)
    assert len(carved) == 1
    assert Peer(state, 13).call("allocate", key=key(1))["slot"] == 0
    check_invariants(state)


def test_allocate_commit_abort_write_the_table():
    state = make_state()
    a, a2 = Peer(state, 1), Peer(state, 2)
    assert a.hello["num_slots"] == 4 and a.hello["slot_bytes"] == SLOT and a.hello["epoch"] == bytes(range(16)).hex()
    got = a.call("allocate", key=key(1))
    assert (got["slot"], got["generation"], got["reason"]) == (0, 1, None)
    assert entry(state, 0) == (bytes.fromhex(key(1)), 1, PENDING)
    assert a.call("lookup", keys=[key(1)])["states"] == [PENDING]
    with pytest.raises(NodeError, match="commit: expected a PENDING key this connection allocated"):
        a2.call("commit", key=key(1))  # same namespace, another connection
    a2.call("abort", key=key(1))  # not its own: a no-op
    assert a.call("allocate", key=key(1))["reason"] == "present"
    assert a2.call("allocate", key=key(1))["reason"] == "present"
    a.call("commit", key=key(1))
    assert entry(state, 0) == (bytes.fromhex(key(1)), 1, READY)  # the generation a reader checks: unchanged
    with pytest.raises(NodeError, match="READY"):
        a.call("commit", key=key(1))
    assert a.call("lookup", keys=[key(1), key(2), key(1)])["states"] == [READY, FREE, READY]
    assert (ns_stats(state)["hits"], ns_stats(state)["misses"]) == (1, 2)  # the first lookup's PENDING: a miss
    assert a.call("lookup", keys=[key(1)])["states"] == [READY]
    assert (ns_stats(state)["hits"], ns_stats(state)["misses"]) == (2, 2)
    assert a.call("allocate", key=key(2))["slot"] == 1
    a.call("abort", key=key(2))
    assert entry(state, 1) == (bytes(16), 2, FREE)
    assert a.call("allocate", key=key(3)) == {"id": a._id, "ok": True, "slot": 1, "generation": 3, "reason": None}
    check_invariants(state)


@pytest.mark.parametrize(("refresh", "victim"), [("nothing", 1), ("pin+unpin", 2), ("lookup", 1), ("hold+unpin", 1)])
def test_lru_eviction_order(refresh, victim):
    """Only a pin (a load) makes a chunk recent; lookups and holds (another tier's write) do not."""
    state = make_state(3)
    a = Peer(state, 1)
    slots = a.store(key(1), key(2), key(3))
    if refresh == "pin+unpin":
        a.call("pin", keys=[key(1)])
        a.call("unpin", keys=[key(1)])
    elif refresh == "lookup":
        a.call("lookup", keys=[key(1)])
    elif refresh == "hold+unpin":
        a.call("hold", key=key(1))
        a.call("unpin", keys=[key(1)])
    got = a.call("allocate", key=key(9))
    assert got["slot"] == slots[victim - 1]
    assert got["generation"] == 3  # 1 (allocate) + 1 (evicted: FREE) + 1 (allocate)
    assert a.call("lookup", keys=[key(victim)])["states"] == [FREE]
    assert ns_stats(state)["evictions"] == 1
    check_invariants(state)


def test_eviction_never_takes_pending_leased_or_admin_pinned_slots():
    state = make_state(4)
    a, b, ctl = Peer(state, 1), Peer(state, 2, ns=NS_B), Peer(state, 3, role="control")
    a.call("allocate", key=key(0))  # PENDING (and oldest)
    a.store(key(1), key(2), key(3))
    a.call("pin", keys=[key(1)])  # a lease
    assert ctl.call("pin_prefix", namespace=NS_A, keys=[key(2)])["pinned"] == 1  # an admin pin
    assert b.call("allocate", key=key(10))["slot"] == 3  # the only candidate: key 3
    assert b.call("allocate", key=key(11))["reason"] == "full"
    b.call("commit", key=key(10))
    assert a.call("lookup", keys=[key(0), key(1), key(2), key(3)])["states"] == [PENDING, READY, READY, FREE]
    b.call("hold", key=key(10))
    assert b.call("allocate", key=key(11))["reason"] == "full"  # held: not evicted either
    b.call("unpin", keys=[key(10)])
    assert b.call("allocate", key=key(11))["slot"] == 3
    check_invariants(state)


def test_pin_hold_unpin_are_all_or_nothing_per_connection():
    state = make_state(4)
    a, a2 = Peer(state, 1), Peer(state, 2)
    slots = a.store(key(1), key(2))
    a.call("allocate", key=key(3))
    with pytest.raises(NodeError, match=f"pin: expected READY keys, got {key(3)} .PENDING"):
        a.call("pin", keys=[key(1), key(3)])
    with pytest.raises(NodeError, match=f"got {key(4)} .absent"):
        a.call("pin", keys=[key(1), key(4)])
    assert sum(e.leases for e in state._namespaces[NS_A].entries.values()) == 0  # nothing pinned
    assert a.call("pin", keys=[key(1), key(2), key(1)]) == {
        "id": a._id,
        "ok": True,
        "slots": [slots[0], slots[1], slots[0]],
        "generations": [1, 1, 1],
    }
    assert a2.call("hold", key=key(3))["generation"] == 1  # PENDING: holdable (read for another tier's write)
    with pytest.raises(NodeError, match="hold: expected a PENDING or READY key"):
        a2.call("hold", key=key(5))
    with pytest.raises(NodeError, match=f"unpin: expected keys this connection leased, got {key(1)} 3 time"):
        a.call("unpin", keys=[key(2), key(1), key(1), key(1)])
    with pytest.raises(NodeError, match="leased 0"):
        a2.call("unpin", keys=[key(1)])  # a's lease, not a2's
    assert state._namespaces[NS_A].entries[key(2)].leases == 1  # the failed unpin released nothing
    a.call("unpin", keys=[key(1), key(1), key(2)])
    a2.call("unpin", keys=[key(3)])
    check_invariants(state)
    assert all(e.leases == 0 for e in state._namespaces[NS_A].entries.values())


def test_namespaces_do_not_see_each_others_keys():
    state = make_state(4)
    a, b = Peer(state, 1), Peer(state, 2, ns=NS_B)
    a.store(key(1))
    assert b.call("lookup", keys=[key(1)])["states"] == [FREE]
    with pytest.raises(NodeError, match="absent"):
        b.call("pin", keys=[key(1)])
    b.call("abort", key=key(1))  # a no-op, and a's chunk stays
    assert b.call("allocate", key=key(1))["slot"] == 1  # its own chunk, its own slot
    assert (ns_stats(state, NS_B)["misses"], ns_stats(state, NS_B)["pending"]) == (1, 1)
    assert ns_stats(state)["chunks"] == 1
    check_invariants(state)


def test_quota_evicts_the_namespaces_own_chunks_first():
    state = make_state(6, quotas={NS_A: 2 * SLOT})
    a, b, ctl = Peer(state, 1), Peer(state, 2, ns=NS_B), Peer(state, 3, role="control")
    b.store(key(100), key(101))  # the pool's oldest chunks
    a.store(key(1), key(2))
    assert a.call("allocate", key=key(3))["reason"] is None  # at its quota: evicts its own oldest, key 1
    a.call("commit", key=key(3))
    assert a.call("lookup", keys=[key(1), key(2), key(3)])["states"] == [FREE, READY, READY]
    assert b.call("lookup", keys=[key(100), key(101)])["states"] == [READY, READY]
    assert (ns_stats(state)["evictions"], ns_stats(state, NS_B)["evictions"]) == (1, 0)
    a.call("pin", keys=[key(2), key(3)])
    assert a.call("allocate", key=key(4))["reason"] == "quota"  # its own are all leased; others' are not taken
    a.call("unpin", keys=[key(2), key(3)])
    ctl.call("quota", namespace=NS_A, bytes=SLOT)  # lower: evicts its LRU chunk
    assert a.call("lookup", keys=[key(2), key(3)])["states"] == [FREE, READY]
    ctl.call("quota", namespace=NS_A, bytes=SLOT // 2)  # less than a slot: nothing fits
    assert a.call("lookup", keys=[key(3)])["states"] == [FREE]
    assert a.call("allocate", key=key(5))["reason"] == "quota"
    ctl.call("quota", namespace=NS_A, bytes=None)
    assert [a.call("allocate", key=key(i))["reason"] for i in range(5, 11)] == [None] * 6  # B's evicted, then full
    assert a.call("allocate", key=key(11))["reason"] == "full"
    assert ns_stats(state, NS_B)["evictions"] == 2
    assert state.stats()["namespaces"][NS_A]["quota"] is None
    check_invariants(state)


def test_admin_pins_stay_within_the_quota_and_outlive_the_connection():
    state = make_state(4)
    a, ctl = Peer(state, 1), Peer(state, 2, role="control")
    a.store(key(1), key(2), key(3))
    a.call("pin", keys=[key(1), key(2), key(3)])
    ctl.call("quota", namespace=NS_A, bytes=2 * SLOT)  # leased: nothing evicted, the namespace stays over
    assert ns_stats(state)["chunks"] == 3
    keys = [key(1), key(2), key(3)]
    assert ctl.call("pin_prefix", namespace=NS_A, keys=keys)["pinned"] == 2  # a third would exceed the quota
    assert ctl.call("pin_prefix", namespace=NS_A, keys=[key(1)])["pinned"] == 1  # pinned again: no more bytes
    assert ns_stats(state)["pinned"] == 2
    a.call("unpin", keys=keys)
    a.close()
    ctl.close()  # admin pins are the daemon's, not the connection's
    ctl = Peer(state, 3, role="control")
    assert ns_stats(state)["pinned"] == 2
    assert ctl.call("lookup", namespace=NS_A, keys=keys)["ready"] == 3
    ctl.call("quota", namespace=NS_A, bytes=SLOT)  # evicts the unpinned one only
    assert ctl.call("lookup", namespace=NS_A, keys=keys)["ready"] == 2
    assert ctl.call("unpin_prefix", namespace=NS_A, keys=keys)["unpinned"] == 2
    assert ns_stats(state)["pinned"] == 1  # key 1: pinned twice
    assert ctl.call("unpin_prefix", namespace=NS_A, keys=keys)["unpinned"] == 1
    assert ns_stats(state)["pinned"] == 0
    check_invariants(state)


def test_evict_of_a_leased_chunk_dooms_it_until_the_last_unpin():
    state = make_state(4)
    a, b, ctl = Peer(state, 1), Peer(state, 2), Peer(state, 3, role="control")
    (slot,) = a.store(key(1))
    b.call("pin", keys=[key(1)])
    assert ctl.call("evict", namespace=NS_A, keys=[key(1), key(1), key(7)])["evicted"] == 1
    assert a.call("lookup", keys=[key(1)])["states"] == [FREE]  # out of the index at once
    assert entry(state, slot) == (bytes.fromhex(key(1)), 1, READY)  # b's reader still sees its chunk
    assert state.stats()["pool"]["used"] == 1
    new = a.call("allocate", key=key(1))["slot"]  # stored again meanwhile: another slot
    assert new != slot
    check_invariants(state)
    b.call("unpin", keys=[key(1)])  # the doomed chunk's lease
    assert entry(state, slot) == (bytes(16), 2, FREE)
    assert a.call("lookup", keys=[key(1)])["states"] == [PENDING]
    assert ns_stats(state)["evictions"] == 0  # an operator's evict is not an eviction to make room
    check_invariants(state)


def test_evict_a_whole_namespace_leaves_pending_chunks():
    state = make_state(4)
    a, b, ctl = Peer(state, 1), Peer(state, 2, ns=NS_B), Peer(state, 3, role="control")
    a.store(key(1), key(2))
    b.store(key(5))
    a.call("allocate", key=key(3))
    ctl.call("pin_prefix", namespace=NS_A, keys=[key(1)])
    assert ctl.call("evict", namespace=NS_A)["evicted"] == 2  # admin pins too: the operator asked
    assert a.call("lookup", keys=[key(1), key(2), key(3)])["states"] == [FREE, FREE, PENDING]
    assert ns_stats(state)["pinned"] == 0 and ns_stats(state, NS_B)["chunks"] == 1
    a.call("commit", key=key(3))
    check_invariants(state)


def test_closing_a_connection_frees_its_pending_slots_and_releases_its_leases():
    state = make_state(4)
    a, b = Peer(state, 1), Peer(state, 2)
    pending = a.call("allocate", key=key(0))["slot"]
    mine = a.call("allocate", key=key(3))["slot"]
    (ready,) = a.store(key(1))
    a.call("pin", keys=[key(1)])
    a.call("hold", key=key(1))
    a.call("hold", key=key(3))
    b.call("hold", key=key(0))  # b reads a's PENDING chunk for another tier's write
    a.close()
    s = state.stats()
    assert (s["aborted_on_disconnect"], s["leases_released"]) == (2, 3)
    assert entry(state, mine) == (bytes(16), 2, FREE)
    assert b.call("lookup", keys=[key(0), key(1), key(3)])["states"] == [FREE, READY, FREE]
    assert entry(state, pending) == (bytes.fromhex(key(0)), 1, PENDING)  # doomed: b still reads it
    assert (s["pool"]["used"], ns_stats(state)["clients"]) == (2, 1)
    check_invariants(state)
    b.close()
    assert entry(state, pending) == (bytes(16), 2, FREE)
    assert state.stats()["leases_released"] == 4
    assert state.stats()["namespaces"][NS_A]["chunks"] == 1  # READY chunks outlive their writer, unpinned
    c = Peer(state, 3)
    assert c.call("allocate", key=key(9))["slot"] in (pending, mine)
    check_invariants(state)


def test_a_slot_abandoned_pending_is_reused_only_after_the_quarantine(monkeypatch):
    geom = PoolGeometry(1, 4096)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", bytes(16), quarantine_s=5.0)
    now = [100.0]
    monkeypatch.setattr("kvx.node.daemon.time.monotonic", lambda: now[0])
    a = Peer(state, 1)
    slot = a.call("allocate", key=key(0))["slot"]
    a.close()  # its workers may still be writing the slot
    assert entry(state, slot) == (bytes(16), 2, FREE)  # readers and writers of it see it changed at once
    b = Peer(state, 2)
    assert b.call("allocate", key=key(1))["reason"] == "full"
    assert state.stats()["pool"]["quarantined"] == 1
    now[0] += 5.0
    assert b.call("allocate", key=key(1))["slot"] == slot
    assert state.stats()["pool"]["quarantined"] == 0
    check_invariants(state)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sequences_keep_the_invariants(seed):
    """Random ops of three engines (two namespaces, one with a quota) and a control connection, with connections
    closing and reopening: after every step the index, the table and the counters agree."""
    rng = random.Random(seed)
    state = make_state(5, quotas={NS_B: 3 * SLOT})
    ctl = Peer(state, 0, role="control")
    peers = {cid: (Peer(state, cid, ns=ns), ns) for cid, ns in ((1, NS_A), (2, NS_A), (3, NS_B))}
    next_cid = 4
    for _ in range(600):
        cid = rng.choice(list(peers))
        p, ns = peers[cid]
        keys = [key(rng.randrange(10)) for _ in range(rng.randrange(1, 4))]
        op = rng.choice(["allocate", "commit", "abort", "pin", "hold", "unpin", "lookup", "admin", "close"])
        args = {"key": keys[0]} if op in ("allocate", "commit", "abort", "hold") else {"keys": keys}
        if op == "admin":
            cop = rng.choice(["pin_prefix", "unpin_prefix", "evict", "quota", "lookup"])
            cargs = {"bytes": rng.choice([None, SLOT, 4 * SLOT])} if cop == "quota" else {"keys": keys}
            reply, _ = ctl.reply(cop, namespace=ns, **cargs)
        elif op == "close":
            p.close()
            del peers[cid]
            peers[next_cid] = (Peer(state, next_cid, ns=ns), ns)
            next_cid += 1
        else:
            reply, _ = p.reply(op, **args)
        if op != "close":
            assert reply["ok"] or reply["error"].startswith(("commit:", "pin:", "hold:", "unpin:")), reply
        check_invariants(state)
    assert state.counters["bad_requests"] == 0 and state.counters["internal_errors"] == 0


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
    ("hello", {"version": 1, "role": "control"}, "control", "hello: expected once per connection"),
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
    ({"version": 2, "role": "engine"}, "version: expected protocol version 1, got 2"),
    ({"version": 1, "role": "admin"}, "role: expected 'engine' or 'control', got 'admin'"),
    ({"version": 1, "role": "engine", "namespace": "XY"}, "namespace: expected 8-128 hex digits, got 'XY'"),
    ({"version": 1, "role": "engine", "namespace": NS_A, "model": "m", "chunk_size": 0}, "chunk_size: expected a po"),
    (
        {"version": 1, "role": "engine", "namespace": NS_A, "model": "m", "chunk_size": 16, "slot_bytes": SLOT + 1},
        f"slot_bytes: expected at most the pool's slot size, {SLOT} bytes, got {SLOT + 1}",
    ),
    ({"version": 1, "role": "control", "pid": "me"}, "pid: expected an int, got 'me'"),
]


@pytest.mark.parametrize(("args", "error"), BAD_HELLOS)
def test_bad_hellos_are_refused_and_the_connection_may_try_again(args, error):
    state = make_state()
    state.open(1)
    reply, keep = state.request(1, {"op": "hello", "id": 1, **args})
    assert not reply["ok"] and error in reply["error"] and keep
    reply, keep = state.request(1, {"op": "hello", "id": 2, "version": 1, "role": "control"})
    assert reply["ok"] and keep


def test_ops_before_hello_close_the_connection_and_bad_ids_are_answered():
    state = make_state()
    state.open(1)
    assert state.request(1, {"op": "lookup", "keys": [key(1)]}) == (
        {"id": None, "ok": False, "error": "id: expected an int, got nothing"},
        True,
    )
    reply, keep = state.request(1, {"op": "stats", "id": 4})
    assert reply == {"id": 4, "ok": False, "error": "op: expected 'hello' first, got 'stats'"} and not keep
    assert state.counters["bad_requests"] == 2


def test_an_op_that_is_not_a_string_is_a_bad_request():
    state = make_state()
    Peer(state, 1)
    reply, keep = state.request(1, {"op": ["allocate"], "id": 9})
    assert reply == {
        "id": 9,
        "ok": False,
        "error": "op: expected one of " + ", ".join(state._ops) + ", got ['allocate']",
    }
    assert keep and state.counters["bad_requests"] == 1


def test_an_op_that_fails_inside_the_daemon_is_answered_logged_and_counted(monkeypatch, caplog):
    state = make_state()
    a = Peer(state, 1)
    monkeypatch.setattr(state, "_ops", {**state._ops, "lookup": (lambda c, args: 1 / 0, None)})
    reply, keep = a.reply("lookup", keys=[])
    assert not reply["ok"] and "internal error in op 'lookup': ZeroDivisionError" in reply["error"] and keep
    assert state.counters["internal_errors"] == 1
    assert "ZeroDivisionError" in caplog.text  # with its traceback
    assert a.call("allocate", key=key(1))["slot"] == 0  # still serving


# ------------------------------------------------------------------------------------------------ processes
class Daemon:
    """A ``kvx node`` process on a short temporary directory."""

    def __init__(self, root: Path, *args: str, pool: str | None = "pool", size: str = "8MiB"):
        self.root = root
        self.socket = str(root / "s")
        self.pool = str(root / pool) if pool else default_pool_path(self.socket)
        self.log = root / f"daemon-{len(list(root.glob('daemon-*')))}.log"
        cmd = [sys.executable, "-m", "kvx.node.cli", "--socket", self.socket, "--size", size, "--slot-size", str(SLOT)]
        cmd += ["--pool", self.pool] if pool else []
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*cmd, *args], cwd=REPO, stderr=log, stdout=log)

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> Daemon:
        def ready():
            assert self.proc.poll() is None, f"kvx node exited with {self.proc.returncode}: {self.stderr()}"
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return True
            except OSError:
                return False

        wait_for(ready, START_S, lambda: f"kvx node to listen on {self.socket}: {self.stderr()}")
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def control(self) -> Connection:
        c = Connection(self.socket, timeout=10)
        c.call("hello", version=VERSION, role="control", pid=os.getpid())
        return c

    def engine(self, ns: str, chunk_size: int = 16) -> Connection:
        """An engine's connection; its hello reply in ``.hello``."""
        c = Connection(self.socket, timeout=10)
        c.hello = c.call(
            "hello", version=VERSION, role="engine", namespace=ns, model="tiny", chunk_size=chunk_size, slot_bytes=SLOT
        )
        return c

    def stats(self) -> dict:
        c = self.control()
        try:
            return c.call("stats")
        finally:
            c.close()


@pytest.fixture(scope="module")
def short_dir():
    """A directory with a short path (a unix socket's path must be < 108 bytes), that uid 65534 may traverse."""
    root = Path(tempfile.mkdtemp(prefix="kvxd", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def node(short_dir):
    """One daemon for the tests that do not stop it: socket mode 666 (the refused-uid test's child may connect, to
    be refused by its credentials), a metrics port."""
    port = free_port()
    (short_dir / "main").mkdir()
    (short_dir / "main").chmod(0o755)
    d = Daemon(short_dir / "main", "--socket-mode", "666", "--metrics-port", str(port))
    d.metrics_port = port
    try:
        yield d.wait_ready()
    finally:
        assert d.stop() == 0, d.stderr()


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def read_reply(s: socket.socket) -> dict | None:
    """The next reply on a raw socket, or None if the daemon closed it."""
    try:
        header = recv_exact(s, HEADER.size)
        if header is None:
            return None
        return json.loads(recv_exact(s, HEADER.unpack(header)[3]))
    except ConnectionResetError:
        return None


def raw(node: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(node.socket)
    return s


def test_an_engine_cycle_matches_the_mapped_pool_file(node):
    eng = node.engine(NS_A)
    hello = eng.hello
    assert hello["pool"] == node.pool and oct(os.stat(node.pool).st_mode & 0o777) == oct(0o666)
    k1, k2 = key(0xA1), key(0xA2)
    a1 = eng.call("allocate", key=k1)
    a2 = eng.call("allocate", key=k2)
    eng.call("commit", key=k1)
    pinned = eng.call("pin", keys=[k1])
    assert pinned["slots"] == [a1["slot"]] and pinned["generations"] == [a1["generation"]]
    assert eng.call("lookup", keys=[k1, k2, key(0xA3)])["states"] == [READY, PENDING, FREE]
    with open(node.pool, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        geom, epoch = unpack_header(m)
        assert (geom.num_slots, geom.slot_bytes, geom.data_offset) == (
            hello["num_slots"],
            hello["slot_bytes"],
            hello["data_offset"],
        )
        assert epoch.hex() == hello["epoch"] and len(m) >= geom.file_bytes
        assert slot_entry(m, geom, a1["slot"]) == (bytes.fromhex(k1), a1["generation"], READY)
        assert slot_entry(m, geom, a2["slot"]) == (bytes.fromhex(k2), a2["generation"], PENDING)
        eng.call("abort", key=k2)
        assert slot_entry(m, geom, a2["slot"]) == (bytes(16), a2["generation"] + 1, FREE)
    eng.call("unpin", keys=[k1])
    eng.close()


def test_posted_requests_are_answered_in_order_and_read_by_the_next_call(node, caplog):
    eng = node.engine(NS_A)
    k1, k2 = key(0xB1), key(0xB2)
    got = []
    eng.post("allocate", got.append, key=k1)
    eng.post("commit", got.append, key=k1)
    eng.post("pin", keys=[k2])  # refused (not stored), without on_reply: logged, never raised
    eng.post("unpin", got.append, keys=[k2])  # refused too: handed to on_reply
    assert eng.call("lookup", keys=[k1])["states"] == [READY]  # read after the four posted replies
    assert [type(r).__name__ for r in got] == ["dict", "dict", "NodeError"]
    assert got[0]["slot"] >= 0 and "unpin: expected keys this connection leased" in str(got[2])
    assert "kvx node: pin:" in caplog.text
    eng.post("pin", got.append, keys=[k1])
    wait_for(lambda: node.stats()["leases"] == 1, 10, "the posted pin to be held")
    eng.poll()  # its reply is here: read without a request
    assert got[-1]["slots"] == [got[0]["slot"]] and not eng._posted
    eng.post("unpin", keys=[k1])
    eng.drain()
    assert node.stats()["leases"] == 0
    eng.close()


def test_a_node_index_pin_is_posted_with_the_directorys_slots_and_released_by_unpin(node):
    from kvx.node.client import NodeIndex

    writer = node.engine(NS_C)
    k1, k2, gone = key(0xC1), key(0xC2), key(0xC3)
    s1, s2 = writer.call("allocate", key=k1)["slot"], writer.call("allocate", key=k2)["slot"]
    writer.call("commit", key=k1)
    writer.call("commit", key=k2)
    idx = NodeIndex(node.socket, bytes.fromhex(NS_C), "tiny", 16, SLOT, timeout=10)
    try:
        assert idx.contains_many([k1, k2, gone]) == [True, True, False]
        assert idx.pin([k1, k2, gone]) == [s1, s2, -1]  # no round trip: the directory's slots
        idx.unpin([k1, k2, gone])  # at once: the pin's reply is read first, so both leases are released
        idx.conn.drain()
        assert node.stats()["leases"] == 0 and not idx._held
        assert idx.pin([k1]) == [s1] and idx.pin([k1]) == [s1]  # two loads of one chunk: two leases
        wait_for(lambda: node.stats()["leases"] == 2, 10, "both posted pins to be held")
        idx.unpin([k1])
        idx.conn.drain()
        assert node.stats()["leases"] == 1 and idx._held == Counter({k1: 1})
    finally:
        idx.close()
        writer.close()
    wait_for(lambda: node.stats()["leases"] == 0, 10, "the closed connection's lease to be released")


KILLED_CLIENT = textwrap.dedent(
    """
    import sys
    from kvx.node.connection import Connection

    c = Connection(sys.argv[1])
    c.call("hello", version=1, role="engine", namespace=sys.argv[2], model="tiny", chunk_size=16, slot_bytes=1)
    pending = c.call("allocate", key="%032x" % 1)["slot"]
    ready = c.call("allocate", key="%032x" % 2)["slot"]
    c.call("commit", key="%032x" % 2)
    c.call("pin", keys=["%032x" % 2])
    c.call("hold", key="%032x" % 2)
    print(pending, ready, flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_a_client_killed_with_sigkill_leaves_nothing_pinned_or_pending(node):
    before = node.stats()
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, node.socket, NS_B],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pending, ready = map(int, child.stdout.readline().split())
        ns = node.stats()["namespaces"][NS_B]
        assert (ns["pending"], ns["chunks"], ns["clients"]) == (1, 1, 1)
    finally:
        child.kill()
        child.wait()

    def released():
        s = node.stats()
        gone = s["namespaces"][NS_B]["clients"] == 0
        return gone and s

    after = wait_for(released, 10, "the daemon to see the killed client's connection close")
    assert after["aborted_on_disconnect"] - before["aborted_on_disconnect"] == 1
    assert after["leases_released"] - before["leases_released"] == 2
    assert (after["namespaces"][NS_B]["pending"], after["namespaces"][NS_B]["chunks"]) == (0, 1)
    assert after["pool"]["quarantined"] == 1  # its abandoned slot waits --quarantine-s (5 s) before reuse
    with open(node.pool, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        geom, _ = unpack_header(m)
        assert slot_entry(m, geom, pending)[2] == FREE
        ctl = node.control()
        assert ctl.call("evict", namespace=NS_B, keys=[key(2)])["evicted"] == 1
        assert slot_entry(m, geom, ready)[2] == FREE  # no lease left: freed at once, not doomed
        ctl.close()


def frame(magic: bytes = MAGIC, version: int = VERSION, body: bytes = b"{}", length: int | None = None) -> bytes:
    return HEADER.pack(magic, version, 0, len(body) if length is None else length) + body


BAD_FRAMES = [  # (what, bytes sent, what the error reply names)
    ("random bytes", random.Random(7).randbytes(64), "frame: expected magic"),
    ("wrong magic", frame(magic=b"HTTP"), "frame: expected magic b'KVXN', got b'HTTP'"),
    ("wrong version", frame(version=2), "frame: expected protocol version 1, got 2"),
    ("oversize", frame(length=MAX_BODY + 1, body=b""), f"frame: expected a body of at most {MAX_BODY} bytes"),
    ("not JSON", frame(body=b"\xff{not json"), "body: expected a JSON object, got undecodable bytes"),
    ("a JSON list", frame(body=b"[1, 2]"), "body: expected a JSON object, got list"),
    ("deeply nested JSON", frame(body=b"[" * 100_000), "maximum recursion depth exceeded"),
]


def test_garbage_frames_get_an_error_and_a_closed_connection(node):
    before = node.stats()
    for what, data, error in BAD_FRAMES:
        with raw(node) as s:
            s.sendall(data)
            reply = read_reply(s)
            assert reply is not None and reply["id"] is None and not reply["ok"] and error in reply["error"], what
            assert read_reply(s) is None, f"{what}: the connection stays open"
    with raw(node) as s:  # an op before hello: an error, then closed
        s.sendall(encode({"op": "lookup", "id": 1, "keys": []}))
        assert "expected 'hello' first" in read_reply(s)["error"]
        assert read_reply(s) is None
    with raw(node) as s:  # bad requests on a good connection: answered, the connection stays open
        hello = encode({"op": "hello", "id": 1, "version": 1, "role": "engine", "namespace": NS_C, "model": "t"})
        hello = encode({**json.loads(hello[HEADER.size :]), "chunk_size": 16, "slot_bytes": 1})
        for byte in hello:  # a frame that arrives one byte at a time
            s.send(bytes([byte]))
        assert read_reply(s)["ok"]
        requests = [
            ({"op": "frobnicate", "id": 2}, "op: expected one of"),
            ({"op": "allocate", "id": 3, "key": "k"}, "key: expected 32 lowercase hex digits, got 'k'"),
            ({"op": "evict", "id": 4, "namespace": "00" * 8}, "namespace: expected a known namespace ("),
        ]
        s.sendall(b"".join(encode(msg) for msg, _ in requests))  # pipelined
        for msg, error in requests:
            reply = read_reply(s)
            assert reply["id"] == msg["id"] and not reply["ok"] and error in reply["error"]
        s.sendall(encode({"op": "lookup", "id": 5, "keys": [key(1)]}))
        assert read_reply(s) == {"id": 5, "ok": True, "states": [FREE]}
    after = node.stats()
    assert after["bad_frames"] - before["bad_frames"] == len(BAD_FRAMES)
    assert after["bad_requests"] - before["bad_requests"] == 4
    assert after["internal_errors"] == 0


def test_a_lookup_of_256_keys(node):
    eng = node.engine(NS_C)
    keys = [key(0xC000 + i) for i in range(256)]
    for k in keys:
        assert eng.call("allocate", key=k)["reason"] is None
        eng.call("commit", key=k)
    assert eng.call("lookup", keys=keys)["states"] == [READY] * 256
    assert eng.call("lookup", keys=[*keys[:100], key(1), *keys[100:]])["states"][100] == FREE
    assert len(eng.call("pin", keys=keys)["slots"]) == 256
    eng.call("unpin", keys=keys)
    eng.close()


def test_the_metrics_endpoint(node):
    eng = node.engine(NS_A)
    eng.call("lookup", keys=[key(0xA1)])  # stored by the engine-cycle test, or not: a hit or a miss

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
        return f'kvx_node_hits_total{{model="tiny",namespace="{NS_A}"}}' in text and text

    text = wait_for(scrape, 10, "the metrics to show the namespace")
    eng.close()
    s = node.stats()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvx_")
    }
    assert values["kvx_node_slots"] == s["pool"]["num_slots"]
    assert values["kvx_node_pool_bytes"] == s["pool"]["num_slots"] * SLOT
    for name in ("kvx_node_slots_used", "kvx_node_clients", "kvx_node_refused_clients_total"):
        assert name in values
    assert values["kvx_node_bad_frames_total"] >= 0
    labels = f'{{model="tiny",namespace="{NS_A}"}}'
    for name in ("chunks", "bytes", "hits_total", "misses_total", "evictions_total", "pinned_chunks"):
        assert f"kvx_node_{name}{labels}" in values
    assert f"kvx_node_quota_bytes{labels}" not in values  # no quota


NOBODY = 65534


def hello_as_nobody(path: str) -> str:
    """In a forked child running as uid and gid 65534: connect to ``path`` and say hello. What happened: "closed"
    (no reply), "ok", "refused: <error>", or "failed: <exception>"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(path)
                s.sendall(encode({"op": "hello", "id": 1, "version": 1, "role": "control"}))
                reply = read_reply(s)
            what = "closed" if reply is None else "ok" if reply["ok"] else f"refused: {reply['error']}"
        except BrokenPipeError:
            what = "closed"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            what = f"failed: {e!r}"
        os.write(w, what.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        what = f.read().decode()
    os.waitpid(pid, 0)
    return what


def test_a_refused_uid_is_disconnected_and_counted(node):
    if os.getuid() != 0:
        pytest.skip("needs root, to run a child as uid 65534")
    before = node.stats()["refused_clients"]
    assert hello_as_nobody(node.socket) == "closed"  # the socket's mode (666) let it connect; its uid did not
    assert node.stats()["refused_clients"] == before + 1


def test_an_allowed_gid_is_admitted_and_given_the_socket_and_pool(short_dir):
    if os.getuid() != 0:
        pytest.skip("needs root, to run a child as uid 65534")
    root = short_dir / "gid"
    root.mkdir()
    root.chmod(0o755)
    d = Daemon(root, "--allow-gid", str(NOBODY)).wait_ready()  # socket mode 660: the group's
    try:
        assert os.stat(d.socket).st_gid == NOBODY and os.stat(d.pool).st_gid == NOBODY
        assert oct(os.stat(d.pool).st_mode & 0o777) == oct(0o660)
        assert hello_as_nobody(d.socket) == "ok"
        assert d.stats()["refused_clients"] == 0
    finally:
        assert d.stop() == 0, d.stderr()


def test_cli_subcommands(node, capsys):
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    eng = node.engine(NS_C, chunk_size=16)
    keys = chunk_keys(request_root(bytes.fromhex(NS_C), "salt", None, None), tokens, 16)
    for k in keys[:3]:
        eng.call("allocate", key=k)
        eng.call("commit", key=k)

    def run(*args: str) -> dict:
        assert cli.main([args[0], "--socket", node.socket, *args[1:]]) == 0
        return json.loads(capsys.readouterr().out)

    prompt = ["--namespace", NS_C, "--tokens", ",".join(map(str, tokens)), "--cache-salt", "salt"]
    assert run("lookup", *prompt) == {"namespace": NS_C, "tokens": len(tokens), "cached_tokens": 48}
    no_salt = ["--namespace", NS_C, "--tokens", ",".join(map(str, tokens))]
    assert run("lookup", *no_salt)["cached_tokens"] == 0  # another root: other keys
    tokens_file = node.root / "tokens.json"
    tokens_file.write_text(json.dumps(tokens[:40]))
    from_file = ["--namespace", NS_C, "--tokens-file", str(tokens_file), "--cache-salt", "salt"]
    assert run("lookup", *from_file) == {"namespace": NS_C, "tokens": 40, "cached_tokens": 32}
    assert run("pin", *prompt)["pinned_tokens"] == 48
    assert node.stats()["namespaces"][NS_C]["pinned"] == 3
    assert cli.main(["stats", "--socket", node.socket]) == 0
    table = capsys.readouterr().out
    assert "pool " in table and NS_C[:16] in table and "pinned" in table
    assert cli.main(["stats", "--socket", node.socket, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"][NS_C]["pinned"] == 3
    assert run("unpin", *prompt)["unpinned_tokens"] == 48
    assert run("evict", *from_file) == {"namespace": NS_C, "evicted": 2}
    assert run("lookup", *prompt)["cached_tokens"] == 0
    assert run("quota", "--namespace", NS_C, "--bytes", "8KiB") == {"namespace": NS_C, "quota": 8192}
    assert node.stats()["namespaces"][NS_C]["chunks"] <= 2
    assert run("quota", "--namespace", NS_C, "--bytes", "none") == {"namespace": NS_C, "quota": None}
    left = node.stats()["namespaces"][NS_C]["chunks"]
    assert left > 0
    assert run("evict", "--namespace", NS_C) == {"namespace": NS_C, "evicted": left}
    assert node.stats()["namespaces"][NS_C]["chunks"] == 0
    eng.close()


CLI_ERRORS = [  # (arguments after the subcommand, exit code, what the one line says)
    (["lookup", "--namespace", "ff" * 8, "--tokens", "1,2"], 2, "--namespace: expected one the daemon knows ("),
    (["lookup", "--namespace", "XYZ", "--tokens", "1,2"], 2, "argument --namespace: expected 8-128 lowercase hex"),
    (["lookup", "--namespace", NS_A, "--tokens", "1,b"], 2, "argument --tokens: expected comma-separated token ids"),
    (["lookup", "--namespace", NS_A], 2, "one of the arguments --tokens --tokens-file is required"),
    (["pin", "--namespace", NS_A, "--tokens-file", "/nonexistent"], 2, "argument --tokens-file: expected a JSON"),
    (["quota", "--namespace", NS_A, "--bytes", "lots"], 2, "argument --bytes: expected a size like '4GiB'"),
    (["quota", "--namespace", "ff" * 8, "--bytes", "1GiB"], 2, "namespace: expected a known namespace ("),
    (["evict", "--namespace", "ff" * 8], 2, "namespace: expected a known namespace ("),
]


@pytest.mark.parametrize(("args", "code", "error"), CLI_ERRORS)
def test_cli_errors_are_one_line(node, capsys, args, code, error):
    node.engine(NS_A).close()  # NS_A is known
    assert cli.main([args[0], "--socket", node.socket, *args[1:]]) == code
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_without_a_daemon_or_with_bad_sizes(short_dir, capsys):
    assert cli.main(["stats", "--socket", str(short_dir / "nobody")]) == 1
    err = capsys.readouterr().err
    assert "kvx node stats: --socket: expected a running kvx node, got" in err and err.count("\n") == 1
    sock = str(short_dir / "x")
    assert cli.main(["--socket", sock, "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--size: expected room for the table and at least one slot of --slot-size auto" in err
    assert cli.main(["--socket", sock, "--size", "40MiB", "--slot-size", "64MiB"]) == 2
    err = capsys.readouterr().err
    assert "--size: expected room for the table and at least one slot of --slot-size 67108864 (" in err
    assert cli.main(["--socket", sock, "--size", "64GiB", "--quota", "nothex=1GiB"]) == 2
    assert "argument --quota: expected 8-128 lowercase hex digits, got 'nothex'" in capsys.readouterr().err
    assert cli.main(["--socket", sock, "--size", "-3"]) == 2
    assert "argument --size: expected" in capsys.readouterr().err
    assert not os.path.exists(sock)


def test_a_daemon_with_auto_slots_makes_its_pool_at_the_first_engines_hello(short_dir, capsys):
    root = short_dir / "auto"
    root.mkdir()
    d = Daemon(root, "--slot-size", "auto").wait_ready()
    try:
        assert cli.main(["stats", "--socket", d.socket]) == 0
        assert "pool: not made yet (its slots are sized by the first engine's chunks)" in capsys.readouterr().out
        assert not os.path.exists(d.pool)
        eng = Connection(d.socket, timeout=10)
        hello = eng.call(
            "hello", version=VERSION, role="engine", namespace=NS_A, model="m", chunk_size=16, slot_bytes=3 * SLOT - 1
        )
        assert hello["slot_bytes"] == 3 * SLOT and hello["pool"] == d.pool and os.path.exists(d.pool)
        pool = d.stats()["pool"]
        assert pool["slot_bytes"] == 3 * SLOT and pool["num_slots"] * 3 * SLOT <= 8 << 20
        assert eng.call("allocate", key=key(1))["slot"] == 0
        eng.close()
        assert "slots sized by the first engine's chunks" in d.stderr()
    finally:
        assert d.stop() == 0, d.stderr()
    assert not os.path.exists(d.pool)


def test_sigterm_stops_cleanly_and_a_second_daemon_refuses_the_socket(short_dir):
    root = short_dir / "term"
    root.mkdir()
    stale = socket.socket(socket.AF_UNIX)  # a socket file whose daemon died: reused
    stale.bind(str(root / "s"))
    stale.close()
    first = Daemon(root, pool=None).wait_ready()  # the default pool path, on /dev/shm
    try:
        pool_inode = os.stat(first.pool).st_ino
        eng = first.engine(NS_A)
        eng.call("allocate", key=key(1))
        second = Daemon(root, pool=None)
        assert second.proc.wait(START_S) == 1
        assert f"another kvx node is listening on {first.socket}" in second.stderr()
        assert os.stat(first.pool).st_ino == pool_inode  # the second daemon did not touch the first's pool
        assert eng.call("lookup", keys=[key(1)])["states"] == [PENDING]
    finally:
        assert first.stop() == 0, first.stderr()
    assert closed_by_daemon(eng)
    assert not os.path.exists(first.socket) and not os.path.exists(first.pool)
    assert "stopping; closing 1 connection(s)" in first.stderr()


def closed_by_daemon(conn: Connection) -> bool:
    """True if the connection was closed by the daemon."""
    try:
        conn.call("lookup", keys=[])
    except OSError:
        return True
    return False


@pytest.mark.parametrize("slot_bytes", [SLOT, 3 * SLOT, 1 << 20])
@pytest.mark.parametrize("num_slots", [1, 3, 4, 17, 300])
def test_a_pool_of_exactly_the_file_size_of_n_slots_holds_n_slots(num_slots, slot_bytes):
    size = PoolGeometry(num_slots, slot_bytes).file_bytes
    assert PoolGeometry.fit(size, slot_bytes).num_slots == num_slots
    assert PoolGeometry.fit(size - 1, slot_bytes).num_slots == num_slots - 1
