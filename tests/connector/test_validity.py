"""The validity rule's bookkeeping (kvx.connector.validity), one transition at a time."""

from kvx.connector.validity import BlockValidity, LoadOutcomes


def test_nothing_unverified_costs_nothing():
    v = BlockValidity(blocks_per_chunk=2)
    assert not v
    assert v.unverified(list(range(100)), 100) == {}


def test_a_load_is_pending_until_every_worker_reported_it():
    v = BlockValidity(blocks_per_chunk=2)
    v.loading("a", {10: 0, 11: 0, 12: 1, 13: 1})
    assert v.unverified([10, 11, 12, 13, 14, 15], 6) == {10: 0, 11: 0, 12: 1, 13: 1}
    assert v.unverified([10, 11, 12, 13, 14, 15], 3) == {10: 0, 11: 0, 12: 1}
    v.load_done("a")
    assert not v and v.unverified([10, 11, 12, 13], 4) == {}


def test_a_failed_load_poisons_the_saves_depending_on_it_and_rewinds_every_request_involved():
    v = BlockValidity(blocks_per_chunk=2)
    v.loading("b", {1: 0, 2: 0, 3: 1, 4: 1})
    table_b = [1, 2, 3, 4, 5, 6]
    table_c = [1, 2, 3, 4, 7, 8, 9, 10]  # c shares b's blocks through vLLM's prefix cache
    v.guard("b", "kb2", v.unverified(table_b, 6))
    v.guard("c", "kc2", v.unverified(table_c, 6))
    v.guard("c", "kc3", v.unverified(table_c, 8))
    unrelated = [20, 21]
    v.guard("d", "kd0", v.unverified(unrelated, 2))  # no dependencies: nothing to watch
    verdict = v.failed([3, 4])
    assert verdict.poisoned == {"kb2", "kc2", "kc3"}
    assert verdict.rewind == {"b": 1, "c": 1}  # both save again from the chunk that failed
    assert v.known_bad([3]) and not v.known_bad([1, 2])
    assert v.failed([3, 4]).poisoned == set()  # reported once
    v.load_done("b")
    assert v.unverified(table_b, 6) == {3: 1, 4: 1}  # loaded fine: 1, 2; failed: 3, 4 until recomputed
    v.computed([3, 4])  # vLLM recomputes from the first failed block
    assert not v


def test_guards_are_forgotten_once_their_loads_are_verified():
    v = BlockValidity(blocks_per_chunk=1)
    v.loading("a", {1: 0})
    v.guard("a", "k1", v.unverified([1, 2], 2))
    v.drop_verified_guards()
    assert v.num_guards() == 1
    v.load_done("a")
    v.drop_verified_guards()
    assert v.num_guards() == 0
    assert v.failed([1]).poisoned == set()  # a late report for a verified block changes nothing


def test_a_block_recomputed_from_its_start_is_no_longer_pending():
    v = BlockValidity(blocks_per_chunk=1)
    v.loading("a", {5: 0})
    v.computed([5])  # freed and rewritten by another request's forward
    assert not v
    assert v.failed([5]).rewind == {}


def test_worker_outcomes_forget_a_failure_when_a_new_load_writes_the_block():
    w = LoadOutcomes()
    assert not w.taints([1, 2])
    w.failed([1, 2])
    assert w.taints([2, 9]) and not w.taints([3])
    w.started([2])
    assert not w.taints([2]) and w.taints([1])
