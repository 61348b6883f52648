"""The chunk ledger on its own: every transfer from plan to settled, with the real CPU index, a real disk tier
behind a :class:`kvx.store.stack.TierStack`, and the workers' results written as the workers write them (one
outcome per worker and transfer). The simulated-engine suites prove the same through vLLM's scheduler; these pin
each rule to one line."""

from __future__ import annotations

import logging

import pytest
import torch

from kvx.connector.events import KVEvents
from kvx.connector.ledger import ChunkLedger, Kind, LoadChunk
from kvx.connector.metadata import FAILED, NOOP, OK, KVXWorkerMetadata
from kvx.store import CPUIndex, DiskTier, SlotState
from kvx.store.stack import TierStack

DISK = "disk"
K0, K, HOT, COLD = (f"{i:032x}" for i in (0xA0, 0xB1, 0xC2, 0xD3))  # chunk keys


@pytest.fixture
def disk(tmp_path):
    store = DiskTier.at(tmp_path / "disk", None, "tests-ledger")
    yield store
    store.close()


def ledger(disk, num_workers=1, slots=4, writes=True) -> ChunkLedger:
    events = KVEvents(False, 16, {"cpu": "CPU", DISK: "DISK"})
    return ChunkLedger(CPUIndex(slots), TierStack([disk]), num_workers, events, writes=writes)


def results(*pairs) -> dict[int, list[str]]:
    """The merged results of several workers: (transfer id, outcome) pairs, one per worker report."""
    out = KVXWorkerMetadata()
    for xid, outcome in pairs:
        out.report(xid, outcome)
    return out.results


def test_a_save_commits_its_slot_and_ends_its_tier_write_when_every_worker_reported(disk):
    led = ledger(disk, num_workers=2)
    save = led.plan_save("r", 0, K0, [1, 2], 32, deps=[], skip_tier=None, gather_first=False)
    assert save.slot is not None and list(save.to_tiers) == [DISK] and save.from_slot is None
    assert led.cpu.state(K0) is SlotState.PENDING and led.writes_in_flight() == 2
    assert led.plan_save("r2", 0, K0, [5, 6], 32, [], None, False) is None  # in flight: not planned twice
    led.settle(results((save.slot_xfer, OK), (save.to_tiers[DISK], OK)))  # one worker of two
    assert led.cpu.state(K0) is SlotState.PENDING and not led.idle()
    done = led.settle(results((save.slot_xfer, OK), (save.to_tiers[DISK], NOOP)))
    assert K0 in led.cpu and led.cpu.pinned() == 0 and led.idle() and not done.rewind
    assert led.events.take_counts() == {"disk_stored": 1}  # new bytes from one worker, no failure


def test_an_aborted_slot_write_rewinds_the_requests_that_counted_on_it(disk):
    led = ledger(disk, num_workers=2)
    save = led.plan_save("r", 3, K, [1], 16, deps=[7], skip_tier=None, gather_first=True)
    assert save.to_tiers == {} and save.slot is not None  # with deps and several workers: CPU first
    other = led.plan_save("other", 1, K, [9], 16, [], None, False)  # counts the CPU copy as saved on that write
    assert other.slot is None and list(other.to_tiers) == [DISK]  # (no deps: it writes the disk copy itself)
    led.poison([K])
    done = led.settle(
        results((save.slot_xfer, OK), (save.slot_xfer, OK), (other.to_tiers[DISK], OK), (other.to_tiers[DISK], OK))
    )
    assert led.cpu.state(K) is None and done.aborted == 1
    assert sorted(done.rewind) == [("other", 1)] and led.idle()
    assert led.plan_write_through() == []  # nothing committed: nothing written through


def test_a_committed_chunk_planned_through_is_written_through_from_its_held_slot(disk):
    led = ledger(disk, num_workers=2)
    save = led.plan_save("r", 0, K, [1], 16, deps=[7], skip_tier=None, gather_first=True)
    led.settle(results((save.slot_xfer, OK), (save.slot_xfer, OK)))
    assert K in led.cpu and not led.idle()  # waiting to be written through
    (through,) = led.plan_write_through()
    assert through.from_slot == save.slot and list(through.to_tiers) == [DISK] and led.cpu.pinned() == 1
    led.settle(results((through.to_tiers[DISK], FAILED), (through.to_tiers[DISK], OK)))
    assert led.cpu.pinned() == 0 and led.idle()
    assert led.events.take_counts() == {}  # a rank failed: the chunk is not announced


def test_a_load_pins_its_hits_until_every_worker_finished_it_and_promotes_the_others(disk):
    led = ledger(disk, num_workers=2)
    save = led.plan_save("r", 0, HOT, [1], 16, [], DISK, False)
    led.settle(results((save.slot_xfer, OK), (save.slot_xfer, OK)))
    xfer, slots = led.plan_load("q", [LoadChunk(HOT, "cpu", 16), LoadChunk(COLD, DISK, 16, promote=True)])
    (hot_slot, none), (cold_slot, cold_xfer) = slots
    assert hot_slot == save.slot and none is None and cold_slot is not None and cold_xfer is not None
    assert led.cpu.pinned() == 1
    done = led.settle(results((xfer, OK), (cold_xfer, OK), (cold_xfer, FAILED)))
    assert done.loads_done == [] and led.cpu.pinned() == 1 and led.cpu.state(COLD) is None  # promotion aborted
    done = led.settle(results((xfer, OK)))
    assert done.loads_done == ["q"] and led.cpu.pinned() == 0 and led.idle()
    assert [t.kind for t in led.open_transfers()] == []


def test_a_report_of_a_transfer_not_in_flight_is_ignored(disk, caplog):
    led = ledger(disk)
    save = led.plan_save("r", 0, K, [1], 16, [], None, False)
    led.settle(results((save.slot_xfer, OK), (save.to_tiers[DISK], OK)))
    with caplog.at_level(logging.WARNING, logger="kvx"):
        led.settle(results((save.slot_xfer, FAILED)))
    assert K in led.cpu and "not in flight" in caplog.text


def test_a_tier_that_holds_the_chunk_is_not_written_again(disk):
    disk.put(K, torch.zeros(4, dtype=torch.uint8))
    led = ledger(disk)
    save = led.plan_save("r", 0, K, [1], 16, [], None, False)
    assert save.to_tiers == {} and led.lacking(K) == []
    assert [t.kind for t in led.open_transfers()] == [Kind.SLOT]


# ------------------------------------------------------------------------------------------ write backlog
def bounded(disk, backlog, slots=8) -> ChunkLedger:
    events = KVEvents(False, 16, {"cpu": "CPU", DISK: "DISK"})
    return ChunkLedger(
        CPUIndex(slots) if slots else None,
        TierStack([disk]),
        1,
        events,
        writes=True,
        backlog=backlog,
        object_bytes=lambda tokens, state: 10 if state else tokens,
        slot_bytes=100,
    )


def keys(n, base=0x100):
    return [f"{base + i:032x}" for i in range(n)]


def test_a_tier_write_past_the_backlog_is_not_planned_and_is_counted(disk):
    led = bounded(disk, backlog=64)
    a, b, c = keys(3)
    s1 = led.plan_save("r", 0, a, [1], 32, [], None, False)  # gathered into its CPU slot: 32 bytes queued
    s2 = led.plan_save("r", 1, b, [2], 32, [], None, False)
    assert list(s1.to_tiers) == [DISK] and list(s2.to_tiers) == [DISK] and led.pending_bytes(DISK) == 64
    s3 = led.plan_save("r", 2, c, [3], 32, [], None, False)  # the CPU copy still saved; the disk write not
    assert s3.slot is not None and s3.to_tiers == {} and led.dropped == {DISK: 1} and led.pending_bytes(DISK) == 64
    led.settle(results((s1.slot_xfer, OK), (s1.to_tiers[DISK], OK)))
    assert led.pending_bytes(DISK) == 32  # the tier caught up with one: room again
    # c's CPU copy is still being written: a second save would stage it (a whole buffer: no room)
    assert led.plan_save("r2", 2, c, [3], 32, [], None, False) is None and led.dropped[DISK] == 2
    led.settle(results((s3.slot_xfer, OK)))
    again = led.plan_save("r2", 2, c, [3], 32, [], None, False)  # written from its READY CPU copy: 32 bytes fit
    assert again.from_slot is not None and list(again.to_tiers) == [DISK] and led.pending_bytes(DISK) == 64


def test_a_staged_save_counts_a_whole_buffer(disk):
    led = bounded(disk, backlog=250, slots=0)  # no CPU tier: a write buffer per save
    saves = [led.plan_save("r", i, k, [i], 32, [], None, False) for i, k in enumerate(keys(4))]
    assert [s is not None for s in saves] == [True, True, False, False]  # 100 bytes each: two fit in 250
    assert all(s.slot is None and s.from_slot is None for s in saves[:2]) and led.pending_bytes(DISK) == 200
    assert led.dropped[DISK] == 2
    for s in saves[:2]:
        led.settle(results((s.to_tiers[DISK], FAILED)))  # a failed write ends too
    assert led.pending_bytes(DISK) == 0 and led.idle()


def test_write_through_respects_the_backlog(disk):
    led = bounded(disk, backlog=40)
    a, b = keys(2, 0x200)
    sa = led.plan_save("r", 0, a, [1], 32, deps=[5], skip_tier=None, gather_first=True)
    sb = led.plan_save("r", 1, b, [2], 32, deps=[5], skip_tier=None, gather_first=True)
    led.settle(results((sa.slot_xfer, OK), (sb.slot_xfer, OK)))
    through = led.plan_write_through()  # both committed; only one 32-byte write fits in 40
    assert len(through) == 1 and led.dropped[DISK] == 1 and led.cpu.pinned() == 1  # the dropped one holds nothing
    led.settle(results((through[0].to_tiers[DISK], OK)))
    assert led.idle() and led.cpu.pinned() == 0 and led.pending_bytes(DISK) == 0
