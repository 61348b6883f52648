"""The chunk ledger on its own: every transfer from plan to settled, with the real CPU index, a real disk tier
behind a :class:`kvx.store.stack.TierStack`, and the workers' results written as the workers write them (one
outcome per worker and transfer). The simulated-engine suites prove the same through vLLM's scheduler; these pin
each rule to one line."""

from __future__ import annotations

import logging

import pytest
import torch

from kvx.connector.events import KVEvents
from kvx.connector.ledger import ChunkLedger, Kind
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
    return ChunkLedger(CPUIndex(slots), TierStack([disk], lambda k: [k]), num_workers, events, writes=writes)


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
    xfer, slots = led.plan_load("q", [(HOT, "cpu", 16, False, False), (COLD, DISK, 16, True, False)])
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
