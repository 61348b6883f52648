"""Chunks of any size in one node pool (:mod:`kvx.store.runs`): a chunk takes a run of slots from a buddy allocator
that gives exactly the run asked for; models of different chunk sizes share the pool, evicting each other LRU."""

from __future__ import annotations

import random

import pytest

from kvx.node.requests import Requests
from kvx.store.runs import Runs
from tests.node.daemon_helpers import NS_A, NS_B, NS_C, SLOT, Peer, check_invariants, key, make_state


@pytest.mark.parametrize("n", [1, 7, 1000, 1024, 4097])
def test_runs_never_overlap_and_coalesce_back_to_the_whole_pool(n):
    r, held, rng = Runs(n), {}, random.Random(n)
    assert r.free_units == n and r.max_units == 1 << (n.bit_length() - 1)
    for _ in range(3000):
        if held and rng.random() < 0.5:
            first = rng.choice(list(held))
            r.give(first, held.pop(first))
        else:
            u = min(rng.choice([1, 3, 8, 12, 16, 40]), r.max_units)
            first = r.take(u)
            if first is None:
                assert not r.can(u)
                continue
            assert 0 <= first and first + u <= n
            assert all(first + u <= g or g + v <= first for g, v in held.items())
            held[first] = u
        assert r.free_units + sum(held.values()) == n
    for first, u in list(held.items()):
        r.give(first, u)
    assert r.free_units == n and r.largest() == r.max_units


def test_two_models_of_different_chunk_sizes_share_the_pool_and_evict_each_other():
    state = make_state(64)
    small, large = Peer(state, 1, ns=NS_A, slot_bytes=SLOT), Peer(state, 2, ns=NS_B, slot_bytes=3 * SLOT)
    assert small.store(*[key(i) for i in range(40)])
    assert large.store(*[key(100 + i) for i in range(8)])  # 8 runs of 3 slots (in blocks of 4): room made LRU
    check_invariants(state)
    s = state.stats()
    a, b = s["namespaces"][NS_A], s["namespaces"][NS_B]
    assert b["chunks"] == 8 and b["bytes"] == 8 * 3 * SLOT and a["evictions"] == 40 - a["chunks"]
    assert s["pool"]["used"] == a["chunks"] + 3 * b["chunks"]
    third = Peer(state, 3, ns=NS_C, slot_bytes=5 * SLOT)  # a third model after them: runs of 5 (blocks of 8)
    assert third.store(*[key(200 + i) for i in range(4)])
    check_invariants(state)
    s = state.stats()
    assert (s["namespaces"][NS_B]["chunks"], s["namespaces"][NS_C]["chunks"], s["pool"]["free"]) == (8, 4, 20)
    assert small.store(*[key(300 + i) for i in range(20)])  # the runs' tails hold chunks of the smaller model
    s = state.stats()
    assert [s["namespaces"][n]["chunks"] for n in (NS_A, NS_B, NS_C)] == [20, 8, 4] and s["pool"]["free"] == 0
    check_invariants(state)
    with pytest.raises(Exception, match="expected chunks that a run of at most 64 slots"):
        Peer(state, 4, ns=NS_C, slot_bytes=65 * SLOT)


def test_a_large_run_evicts_small_chunks_until_a_block_is_whole_and_a_pinned_one_blocks_it():
    state = make_state(4)
    small, large = Peer(state, 1, ns=NS_A), Peer(state, 2, ns=NS_B, slot_bytes=4 * SLOT)
    small.store(key(0), key(1), key(2), key(3))
    small.call("pin", keys=[key(3)])
    assert large.call("allocate", key=key(9))["reason"] == "full"  # 3 evicted, the pinned one holds the block
    check_invariants(state)
    small.call("unpin", keys=[key(3)])
    assert large.call("allocate", key=key(9))["slot"] == 0
    check_invariants(state)


def occupancy(pool_bytes: int, sizes: list[int], steps: int, unit: int = 64 << 10, seed: int = 0) -> float:
    """Chunk bytes held / pool bytes, averaged over the second half of ``steps`` stores of random models' chunks
    (``sizes``: each model's chunk bytes) into a full pool under LRU eviction."""
    from kvx.node.daemon import NodeState
    from kvx.node.protocol import VERSION, PoolGeometry

    geom = PoolGeometry(pool_bytes // unit, unit)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/x.pool", bytes(range(16)))
    for i, b in enumerate(sizes):
        state.open(i + 1, pid=1)
        hello = {"version": VERSION, "role": "engine", "namespace": f"{i + 1:02x}" * 8, "model": "m", "chunk_size": 1}
        assert Requests(state).request(i + 1, {"op": "hello", "id": 0, "slot_bytes": b, **hello})[0]["ok"]
    rng, held = random.Random(seed), []
    for t in range(steps):
        c = state._clients[rng.randrange(len(sizes)) + 1]
        assert state.allocate(c, f"{t:032x}")["slot"] is not None
        state.commit(c, f"{t:032x}")
        if t >= steps // 2:
            held.append(sum(ns.chunks * ns.chunk_bytes for ns in state._namespaces.values()) / pool_bytes)
    check_invariants(state)
    return sum(held) / len(held)


@pytest.mark.parametrize(
    ("sizes", "least"),
    [
        ([512 << 10, 768 << 10, 1 << 20], 0.85),  # the e2e test's three models: 90% measured (256 MiB, 20000 stores)
        ([32 << 20, 14 << 20], 0.9),  # Llama-3-8B and Qwen2-7B, 256 tokens, bf16: 96% measured (16 GiB)
    ],
)
def test_models_of_different_chunk_sizes_keep_the_pool_mostly_full_under_churn(sizes, least):
    got = occupancy(64 * max(sizes) * 4, sizes, 3000)
    print(f"occupancy {got:.1%} for chunks of {sizes}")
    assert got >= least
