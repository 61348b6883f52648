"""The slot tier's contract (:class:`kvx.store.SlotIndex` + :class:`kvx.store.SlotPool`), run against both tiers
that implement it: the CPU tier (one engine's own slots) and the node tier (a real ``kvx node`` process, its pool
file mapped as a worker maps it). What differs between them is declared (``shared``, ``pool``, ``check``) and
checked here too.

A new slot tier passes this file by adding a factory to TIERS."""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvx.node.client import NodeIndex, NodePool
from kvx.node.protocol import PoolGeometry
from kvx.store import STORED, CPUIndex, CPUPool, SlotIndex, SlotPool, SlotState
from kvx.testing import random_fill_
from kvx.testing.node_procs import Node
from tests.helpers import wait_for

SLOTS = 4
SLOT_BYTES = 4096  # the node's smallest slot (kvx.node.protocol.SLOT_ALIGN)


def _cpu(request):
    return CPUIndex(SLOTS), CPUPool(SLOTS, (SLOT_BYTES,), torch.uint8)


def _node(request):
    sock = f"{tempfile.mkdtemp(prefix='kvxs', dir='/tmp')}/node.sock"
    node = Node(sock, str(PoolGeometry(SLOTS, SLOT_BYTES).file_bytes), str(SLOT_BYTES)).start()  # --size: the file
    request.addfinalizer(node.stop)
    index = NodeIndex(sock, bytes(range(16)), "contract", 16, SLOT_BYTES, timeout=10, retry_s=0.05)
    request.addfinalizer(index.close)
    pool = NodePool((SLOT_BYTES,), torch.uint8, None, (SLOT_BYTES,))
    request.addfinalizer(pool.close)
    wait_for(lambda: index.contains_many(["0" * 32]) is not None and index.pool is not None, 10, "the node's hello")
    pool.attach(index.pool, background=False)
    assert pool.num_slots == SLOTS, pool.num_slots
    return index, pool


TIERS = {"cpu": _cpu, "node": _node}


@pytest.fixture(params=sorted(TIERS))
def tier(request) -> tuple[SlotIndex, SlotPool]:
    return TIERS[request.param](request)


def key(i: int) -> str:
    return f"{i:032x}"


def store(index: SlotIndex, pool: SlotPool, k: str, fill: int) -> int:
    """Allocate, write and commit chunk ``k`` as the connector does; its slot."""
    slot = index.allocate(k)
    assert slot is not None, k
    pool.slot(slot).fill_(fill)
    index.commit(k)
    return slot


def test_both_sides_are_declared(tier):
    index, pool = tier
    assert isinstance(index, SlotIndex) and isinstance(pool, SlotPool)
    assert pool.slot_bytes == SLOT_BYTES and pool.num_slots == SLOTS
    # a shared tier names the pool file its workers map; a tier of one engine's own slots names none
    assert index.shared == (index.pool is not None)


def test_a_slot_is_pending_then_ready_and_its_bytes_round_trip(tier):
    index, pool = tier
    seen = []
    index.subscribe(lambda name, event, keys: seen.append((name, event, list(keys))))
    k = key(1)
    slot = index.allocate(k)
    assert slot is not None and 0 <= slot < SLOTS
    assert index.state(k) is SlotState.PENDING and index.contains_many([k]) == [False]  # PENDING is no hit
    assert index.allocate(k) is None  # present: not allocated twice
    data = random_fill_(torch.empty(SLOT_BYTES, dtype=torch.uint8))
    pool.slot(slot).copy_(data)
    index.commit(k)
    assert index.state(k) is SlotState.READY and index.contains_many([k, key(2)]) == [True, False] and k in index
    assert seen == [("cpu", STORED, [k])]
    assert index.pin([k]) == [slot]
    generation = pool.check(slot, k, reading=True)
    assert (generation is not None) == index.shared  # a shared pool's slots are checked around each copy
    assert torch.equal(pool.slot(slot), data)
    index.unpin([k])


def test_an_aborted_write_frees_its_slot(tier):
    index, pool = tier
    slots = {store(index, pool, key(i), i) for i in range(SLOTS - 1)}
    k = key(99)
    slot = index.allocate(k)
    index.abort(k)
    assert index.state(k) is None and index.contains_many([k]) == [False]
    assert index.allocate(key(100)) == slot and slot not in slots  # the freed slot, no eviction


def test_a_full_tier_evicts_the_least_recently_used_chunk_never_a_pinned_one(tier):
    index, pool = tier
    for i in range(SLOTS):
        store(index, pool, key(i), i)
    index.pin([key(0)])  # the oldest, pinned by a load
    new = index.allocate(key(50))
    assert new is not None and index.state(key(1)) is None  # the least recently used unpinned chunk went
    assert index.contains_many([key(0), key(2), key(3)]) == [True, True, True]
    held = index.hold(key(50))  # a PENDING chunk read for a byte tier's write
    assert held == new
    for i in (2, 3):
        index.pin([key(i)])
    assert index.allocate(key(51)) is None  # every slot pinned, held or pending: nothing to evict
    index.unpin([key(0), key(2), key(3), key(50)])
    index.abort(key(50))
    assert index.allocate(key(51)) is not None


def test_a_slot_out_of_range_is_refused_naming_the_argument(tier):
    _, pool = tier
    for bad in (-1, SLOTS):
        with pytest.raises(ValueError, match="slot"):
            pool.slot(bad)


def test_clear_keeps_a_shared_tiers_chunks(tier):
    index, pool = tier
    store(index, pool, key(7), 7)
    assert index.clear() is True
    assert index.contains_many([key(7)]) == [index.shared]  # a node's chunks are every engine's on the host
