"""``kvx node``'s index (:class:`~kvx.node.daemon.NodeState`, no sockets), what makes room and what is kept: LRU
eviction (only a pin makes a chunk recent), what eviction never takes (pending, leased, admin-pinned), per-namespace
quotas, admin pins (within the quota, outliving their connection) and an operator's evict (of leased chunks: doomed
until the last unpin; of a whole namespace)."""

from __future__ import annotations

import pytest

from kvx.node.protocol import FREE, PENDING, READY
from tests.node.daemon_helpers import NS_A, NS_B, NS_C, SLOT, Peer, check_invariants, entry, key, make_state, ns_stats


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


def test_a_larger_run_evicts_only_a_block_it_can_free():
    """A run of 2 slots needs an aligned pair free: the LRU chunk whose pair holds a leased chunk is kept (evicting
    it would free nothing usable), and the next pair whose chunks are all evictable goes."""
    state = make_state(4)
    a, big = Peer(state, 1), Peer(state, 2, ns=NS_B, slot_bytes=2 * SLOT)
    assert a.store(key(0), key(1), key(2), key(3)) == [0, 1, 2, 3]
    a.call("pin", keys=[key(1)])  # key 0's buddy is leased
    assert big.call("allocate", key=key(10))["slot"] == 2
    assert a.call("lookup", keys=[key(0)])["states"] == [READY]  # the LRU chunk, kept: its pair is not freeable
    assert [a.call("lookup", keys=[key(i)])["states"][0] for i in (2, 3)] == [FREE, FREE]
    assert ns_stats(state)["evictions"] == 2
    check_invariants(state)


def test_a_leased_run_reaching_into_the_victims_block_keeps_the_victim():
    """A chunk of 3 slots (0-2) reaches into the pair (2, 3). While it is leased, the LRU chunk at slot 3 is kept
    (evicting it frees no pair) and a 2-slot run takes the next pair whose chunks are all evictable."""
    state = make_state(8)
    three, one = Peer(state, 1, ns=NS_A, slot_bytes=3 * SLOT), Peer(state, 2, ns=NS_B)
    two = Peer(state, 3, ns=NS_C, slot_bytes=2 * SLOT)
    assert three.store(key(0)) == [0]
    assert one.store(*(key(i) for i in range(1, 6))) == [3, 4, 5, 6, 7]
    three.call("pin", keys=[key(0)])
    assert two.call("allocate", key=key(9))["slot"] == 4
    assert [one.call("lookup", keys=[key(i)])["states"][0] for i in (1, 2, 3)] == [READY, FREE, FREE]
    three.call("unpin", keys=[key(0)])  # now the chunk reaching in goes with its neighbour, and the pair is free
    assert two.call("allocate", key=key(10))["slot"] == 0  # slots 0-3 free: the lowest pair
    assert three.call("lookup", keys=[key(0)])["states"] == [FREE]
    assert one.call("lookup", keys=[key(1)])["states"] == [FREE]
    check_invariants(state)
