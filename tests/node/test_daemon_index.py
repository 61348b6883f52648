"""``kvx node``'s index (:class:`~kvx.node.daemon.NodeState`, no sockets), the slot life cycle call by call:
pool carving at the first engine's hello, allocate / commit / abort in the table, pins, holds and unpins (leases),
namespaces, what closing a connection frees, the quarantine of an abandoned slot, a randomized sequence checked
against the invariants after every step, and the pool geometry (slots per file size)."""

from __future__ import annotations

import random

import pytest

from kvx.node.args import BadRequest
from kvx.node.connection import NodeError
from kvx.node.daemon import NodeState, Refused
from kvx.node.protocol import FREE, MAX_PULLS, PENDING, READY, PoolGeometry
from tests.node.daemon_helpers import (
    NS_A,
    NS_B,
    NS_C,
    SLOT,
    Peer,
    check_invariants,
    entry,
    key,
    make_state,
    ns_stats,
)

SEEDS = [0, 1, 2, 3]


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
    big = Peer(state, 12, ns=NS_C, slot_bytes=9000)  # larger ones take a run of slots (kvx.store.runs)
    with pytest.raises(NodeError, match="slot_bytes: expected chunks that a run of at most 512 slots of 8192 bytes"):
        Peer(state, 14, slot_bytes=513 * 8192)
    assert len(carved) == 1
    assert Peer(state, 13).call("allocate", key=key(1))["slot"] is not None
    assert big.call("allocate", key=key(2))["slot"] is not None  # a run of 2 slots
    assert Peer(state, 15).call("allocate", key=key(3))["slot"] is not None
    assert state.stats()["pool"]["used"] == 4
    check_invariants(state)  # the runs overlap nothing


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


def test_pin_hold_unpin_are_all_or_nothing_per_connection():
    state = make_state(4)
    a, a2 = Peer(state, 1), Peer(state, 2)
    slots = a.store(key(1), key(2))
    a.call("allocate", key=key(3))
    with pytest.raises(NodeError, match=f"pin: expected READY keys, got {key(3)} .PENDING"):
        a.call("pin", keys=[key(1), key(3)])
    with pytest.raises(NodeError, match=f"got {key(4)} .absent"):
        a.call("pin", keys=[key(1), key(4)])
    assert sum(e.pins for e in state._namespaces[NS_A].entries.values()) == 0  # nothing pinned
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
    assert state._namespaces[NS_A].entries[key(2)].pins == 1  # the failed unpin released nothing
    a.call("unpin", keys=[key(1), key(1), key(2)])
    a2.call("unpin", keys=[key(3)])
    check_invariants(state)
    assert all(e.pins == 0 for e in state._namespaces[NS_A].entries.values())


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
    got = {c.call("allocate", key=key(9 + i))["slot"] for i in range(3)}  # the 3 slots not READY
    assert got == {0, 1, 2, 3} - {ready} and {pending, mine} <= got
    check_invariants(state)


def test_a_slot_abandoned_pending_is_reused_only_after_the_quarantine(monkeypatch):
    geom = PoolGeometry(1, 4096)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", bytes(16), quarantine_s=5.0)
    now = [100.0]
    monkeypatch.setattr("kvx.store.alloc.time.monotonic", lambda: now[0])
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


def test_a_pulls_slots_are_pinned_pending_made_ready_one_by_one_and_freed_at_once_when_they_fail(monkeypatch):
    """An engine's load may pin the PENDING slots a pull from a peer is filling (its workers wait for them), not those
    of another engine's save; the pull makes each READY as it arrives; a chunk it does not bring reads FREE in the table
    at once (the waiting load fails now), and its run is quarantined after the engine's last unpin (a late transfer may
    still land in it)."""
    geom = PoolGeometry(4, SLOT)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", bytes(16), quarantine_s=5.0)
    now = [100.0]
    monkeypatch.setattr("kvx.store.alloc.time.monotonic", lambda: now[0])
    engine, saver = Peer(state, 1), Peer(state, 2)
    saver.call("allocate", key=key(3))
    owner = state.open_internal("pull")
    assert [k for k, _ in state.pull_alloc(owner, NS_A, [key(0), key(1), key(2)])] == [key(0), key(1), key(2)]
    slot = {k: e.slot for k, e in state._namespaces[NS_A].entries.items()}
    with pytest.raises(NodeError, match=f"pin: expected READY keys, got {key(3)} .PENDING"):
        engine.call("pin", keys=[key(3)])  # another engine's save: not a pull's
    engine.call("pin", keys=[key(0), key(1), key(2)])
    state.pull_commit(owner, key(0))
    assert engine.call("lookup", keys=[key(0), key(1)])["states"] == [READY, PENDING]
    assert entry(state, slot[key(0)])[2] == READY
    check_invariants(state)
    assert state.pull_end(owner, [key(0)]) == 1  # keys 1 and 2 did not arrive
    for k in (key(1), key(2)):
        assert entry(state, slot[k]) == (bytes(16), 1, FREE)  # at once, though still leased
    assert engine.call("lookup", keys=[key(0), key(1)])["states"] == [READY, FREE]
    check_invariants(state)
    engine.call("unpin", keys=[key(0), key(1), key(2)])
    assert state.stats()["pool"]["quarantined"] == 2
    assert saver.call("allocate", key=key(5))["slot"] == slot[key(0)]  # evicted: unpinned, and the LRU
    assert saver.call("allocate", key=key(6))["reason"] == "full"  # not into a quarantined run
    now[0] += 5.0
    assert saver.call("allocate", key=key(7))["slot"] in (slot[key(1)], slot[key(2)])
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


@pytest.mark.parametrize("slot_bytes", [SLOT, 3 * SLOT, 1 << 20])
@pytest.mark.parametrize("num_slots", [1, 3, 4, 17, 300])
def test_a_pool_of_exactly_the_file_size_of_n_slots_holds_n_slots(num_slots, slot_bytes):
    size = PoolGeometry(num_slots, slot_bytes).file_bytes
    assert PoolGeometry.fit(size, slot_bytes).num_slots == num_slots
    assert PoolGeometry.fit(size - 1, slot_bytes).num_slots == num_slots - 1


def test_an_engine_has_at_most_max_pulls_in_flight():
    state = make_state(8)
    taken = []
    state.on_pull = lambda cid, rid, ns, keys, nbytes, budget: taken.append(keys) or True
    c = Peer(state, 1)
    for i in range(MAX_PULLS):
        assert state.pull(state.client(1), i, [key(10 * i)], 1.0) is None
    with pytest.raises(BadRequest, match=f"pull: expected at most {MAX_PULLS} pulls in flight"):
        state.pull(state.client(1), 99, [key(99)], 1.0)
    assert state.pull_done(1)  # one answered: room for another
    assert state.pull(state.client(1), 100, [key(100)], 1.0) is None
    assert len(taken) == MAX_PULLS + 1
    c.close()
    assert not state.pull_done(1)  # the connection is gone: nobody to answer
