"""CPUIndex (scheduler-side LRU index of CPU slots) and CPUPool (worker-side bytes).

The index is checked call by call against its documented life cycle, then by a randomized model-based
test: a random sequence of allocate/commit/abort/pin/unpin/hold/clear against a small reference
model of the same rules, checking the invariants after every step."""

import errno
import random
import resource

import numpy as np
import pytest
import torch

from kvx.store.cpu import CPUIndex, CPUPool, SlotState

NUM_SLOTS = [1, 3, 8]
SEEDS = [0, 1, 2, 3, 4]
BAD_NUM_SLOTS = [0, -1, 1.5, "4", True, None]
POOL_SHAPES = [(4,), (2, 3, 5), (2, 1, 16, 2, 8)]  # odd sizes; the last: one chunk [L, P, T, H, D]
POOL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
BAD_SLOT_SHAPES = [(0,), (2, -1), (2.5,), (True, 2), "ab", None, 4]
BAD_DTYPES = ["float16", np.float16, None]
# (refresh action on the oldest entry "a", expected victim when the full pool needs a slot)
REFRESH = [
    ("nothing", "a"),
    ("pin+unpin", "b"),  # only a load (pin) makes a chunk recent
    ("contains", "a"),  # lookups are read-only
    ("state", "a"),
    ("hold+unpin", "a"),  # a hold keeps a chunk for a disk write; it is not a use
]


def ready(idx: CPUIndex, *keys) -> dict[str, int]:
    slots = {}
    for k in keys:
        slots[k] = idx.allocate(k)
        assert slots[k] is not None
        idx.commit(k)
    return slots


def slot_of(idx: CPUIndex, key: str) -> int | None:
    """The slot an entry holds. Callers learn it from allocate/pin/hold; the tests read it back."""
    e = idx._entries.get(key)
    return e.slot if e else None


def use(idx: CPUIndex, *keys) -> None:
    """Make READY entries recent the way the connector does: a load pins them, its end unpins them."""
    idx.pin(list(keys))
    idx.unpin(list(keys))


def free_slots(idx: CPUIndex) -> int:
    return idx.num_slots - len(idx)


# ------------------------------------------------------------------------------------------ life cycle
def test_allocate_commit_contains():
    idx = CPUIndex(4)
    slots = [idx.allocate(k) for k in "abc"]
    assert sorted(slots) == sorted(set(slots)) and all(0 <= s < 4 for s in slots)
    assert [idx.state(k) for k in "abc"] == [SlotState.PENDING] * 3
    assert [slot_of(idx, k) for k in "abc"] == slots
    assert len(idx) == 3
    idx.commit("a")
    idx.commit("b")
    assert idx.state("a") is SlotState.READY and "a" in idx
    assert ["a" in idx, "b" in idx, "c" in idx] == [True, True, False]  # c is PENDING: not a hit
    assert idx.state("zz") is None and slot_of(idx, "zz") is None and "zz" not in idx
    assert idx.stats == {"allocated": 3, "evicted": 0, "committed": 2, "aborted": 0}


def test_pending_is_not_a_hit():
    idx = CPUIndex(2)
    idx.allocate("a")
    assert "a" not in idx
    with pytest.raises(RuntimeError, match=r"pin\(a\): expected a READY slot"):
        idx.pin(["a"])


def test_allocate_of_a_present_key_returns_none():
    idx = CPUIndex(4)
    idx.allocate("p")
    ready(idx, "r")
    assert idx.allocate("p") is None
    assert idx.allocate("r") is None
    assert len(idx) == 2 and idx.stats["allocated"] == 2


@pytest.mark.parametrize("case", ["unknown", "ready", "twice"])
def test_commit_requires_a_pending_slot(case):
    idx = CPUIndex(2)
    if case != "unknown":
        ready(idx, "a")
    with pytest.raises(RuntimeError, match=r"commit\(a\): expected a PENDING slot"):
        idx.commit("a")


def test_slots_are_reused_after_eviction_and_abort():
    idx = CPUIndex(2)
    s = ready(idx, "a", "b")
    assert idx.allocate("c") == s["a"]  # pool full: the LRU READY slot is reused
    assert idx.state("a") is None and idx.stats["evicted"] == 1
    idx.abort("c")
    assert idx.allocate("d") == s["a"]  # the aborted slot is free again
    assert idx.stats["evicted"] == 1


# ------------------------------------------------------------------------------------------ LRU order
@pytest.mark.parametrize("action, victim", REFRESH, ids=[a for a, _ in REFRESH])
def test_lru_eviction_order(action, victim):
    idx = CPUIndex(3)
    ready(idx, "a", "b", "c")  # a is the least recently used
    if action == "pin+unpin":
        use(idx, "a")
    elif action == "contains":
        assert "a" in idx
    elif action == "state":
        assert idx.state("a") is SlotState.READY
    elif action == "hold+unpin":
        idx.hold("a")
        idx.unpin(["a"])
    idx.allocate("d")
    assert idx.state(victim) is None
    assert sorted(k for k in "abcd" if idx.state(k) is not None) == sorted(set("abcd") - {victim})


def test_commit_makes_a_chunk_recent():
    idx = CPUIndex(2)
    idx.allocate("a")
    ready(idx, "b")
    idx.commit("a")  # a was allocated first but committed last
    idx.allocate("c")
    assert idx.state("b") is None and idx.state("a") is SlotState.READY


def test_eviction_follows_full_lru_order():
    idx = CPUIndex(4)
    ready(idx, "a", "b", "c", "d")
    use(idx, "b", "a")  # order now: c, d, b, a
    evicted = []
    for k in "wxyz":
        before = {x for x in "abcd" if idx.state(x) is not None}
        idx.allocate(k)
        idx.commit(k)
        evicted += sorted(before - {x for x in "abcd" if idx.state(x) is not None})
    assert evicted == ["c", "d", "b", "a"]


# ------------------------------------------------------------------------------------------ pins / holds
def test_pinned_entries_are_never_evicted():
    idx = CPUIndex(3)
    ready(idx, "a", "b", "c")
    assert idx.pin(["a", "b"]) == [slot_of(idx, "a"), slot_of(idx, "b")]
    use(idx, "c")
    assert idx.allocate("d") == slot_of(idx, "d")
    assert idx.state("c") is None  # the only unpinned READY entry, though most recent
    assert idx.state("a") is SlotState.READY and idx.state("b") is SlotState.READY
    assert idx.pinned() == 2


def test_held_entries_are_never_evicted():
    idx = CPUIndex(2)
    idx.allocate("a")
    assert idx.hold("a") == slot_of(idx, "a")  # held while PENDING (gather + disk write)
    idx.commit("a")  # READY but still held
    ready(idx, "b")
    use(idx, "b")
    assert idx.allocate("c") is not None
    assert idx.state("b") is None and idx.state("a") is SlotState.READY
    idx.unpin(["a"])
    assert idx.pinned() == 0


def test_pending_entries_are_never_evicted():
    idx = CPUIndex(2)
    idx.allocate("a")
    idx.allocate("b")
    assert idx.allocate("c") is None
    assert idx.state("a") is SlotState.PENDING and idx.state("b") is SlotState.PENDING


@pytest.mark.parametrize("busy", ["pinned", "pending", "held", "mixed"])
def test_allocate_returns_none_when_every_slot_is_busy(busy):
    idx = CPUIndex(3)
    if busy == "pinned":
        ready(idx, "a", "b", "c")
        idx.pin(["a", "b", "c"])
    elif busy == "pending":
        for k in "abc":
            idx.allocate(k)
    elif busy == "held":
        ready(idx, "a", "b", "c")
        for k in "abc":
            idx.hold(k)
    else:
        ready(idx, "a", "b")
        idx.pin(["a"])
        idx.hold("b")
        idx.allocate("c")
    stats = dict(idx.stats)
    assert idx.allocate("d") is None
    assert idx.stats == stats and idx.state("d") is None and len(idx) == 3
    if busy != "pending":  # releasing one READY entry makes room again
        idx.unpin(["a"])
        assert idx.allocate("d") is not None
        assert idx.state("a") is None


def test_pins_are_counted():
    idx = CPUIndex(2)
    ready(idx, "a", "b")
    idx.pin(["a"])
    idx.pin(["a"])
    idx.hold("a")
    idx.unpin(["a", "a"])
    assert idx.allocate("c") is not None and idx.state("b") is None  # a still held once
    idx.unpin(["a"])
    with pytest.raises(RuntimeError, match=r"unpin\(a\): the slot is not pinned"):
        idx.unpin(["a"])


def test_pin_is_all_or_nothing():
    idx = CPUIndex(3)
    ready(idx, "a", "b")
    idx.allocate("p")
    for keys in (["a", "b", "missing"], ["a", "p"], ["a", "a", "p"]):
        with pytest.raises(RuntimeError, match=r"pin\((missing|p)\): expected a READY slot"):
            idx.pin(keys)
        assert idx.pinned() == 0
    idx.allocate("d")  # a failed pin did not make "a" recent either
    assert idx.state("a") is None and idx.state("b") is SlotState.READY


@pytest.mark.parametrize("case", ["unknown", "ready", "pending", "over", "partly"])
def test_unpin_of_unpinned_raises(case):
    idx = CPUIndex(3)
    ready(idx, "a", "b")
    idx.allocate("p")
    keys = {"unknown": ["zz"], "ready": ["a"], "pending": ["p"], "over": ["a", "a"], "partly": ["a", "b"]}[case]
    if case in ("over", "partly"):
        idx.pin(["a"])
    with pytest.raises(RuntimeError, match="the slot is not pinned"):
        idx.unpin(keys)
    # all or nothing: a failed unpin leaves every pin in place
    assert idx.pinned() == (1 if case in ("over", "partly") else 0)


def test_hold_of_unknown_raises():
    with pytest.raises(RuntimeError, match=r"hold\(zz\): no such entry"):
        CPUIndex(1).hold("zz")


# ------------------------------------------------------------------------------------------ abort
def test_abort_frees_a_pending_slot():
    idx = CPUIndex(1)
    s = idx.allocate("a")
    idx.abort("a")
    assert idx.state("a") is None and len(idx) == 0
    assert idx.allocate("b") == s
    assert idx.stats["aborted"] == 1 and idx.stats["evicted"] == 0


def test_abort_of_unknown_is_a_no_op():
    idx = CPUIndex(1)
    idx.abort("zz")
    assert idx.stats["aborted"] == 0


@pytest.mark.parametrize("how", ["hold pending", "pin ready"])
def test_abort_while_pinned_is_deferred_to_the_last_unpin(how):
    idx = CPUIndex(2)
    if how == "hold pending":
        s = idx.allocate("a")
        idx.hold("a")
        idx.hold("a")
    else:
        s = ready(idx, "a")["a"]
        idx.pin(["a"])
        idx.pin(["a"])
    idx.abort("a")
    idx.abort("a")  # a second abort changes nothing
    assert idx.stats["aborted"] == 1
    # doomed: not a hit, not committable, not pinnable, not re-allocatable, slot not free
    assert "a" not in idx
    with pytest.raises(RuntimeError, match=r"commit\(a\): expected a PENDING slot, got aborted"):
        idx.commit("a")
    with pytest.raises(RuntimeError, match=r"pin\(a\)"):
        idx.pin(["a"])
    assert idx.allocate("a") is None
    ready(idx, "b")
    assert idx.allocate("c") is not None and idx.state("b") is None  # evicts b, never the doomed slot
    idx.abort("c")
    assert slot_of(idx, "a") == s
    idx.unpin(["a"])
    assert slot_of(idx, "a") == s  # one pin left
    idx.unpin(["a"])
    assert idx.state("a") is None and len(idx) == 0  # freed by the last unpin
    assert sorted(idx.allocate(k) for k in "xy") == [0, 1]
    with pytest.raises(RuntimeError, match="not pinned"):
        idx.unpin(["a"])


def test_abort_of_a_ready_unpinned_entry_frees_it():
    idx = CPUIndex(1)
    s = ready(idx, "a")["a"]
    idx.abort("a")
    assert idx.state("a") is None and idx.allocate("b") == s


# ------------------------------------------------------------------------------------------ clear
def test_clear_keeps_pinned_and_pending_entries():
    idx = CPUIndex(5)
    ready(idx, "a", "b", "c")
    idx.pin(["a"])
    idx.allocate("p")
    assert idx.clear() is False
    assert {k for k in "abcp" if idx.state(k) is not None} == {"a", "p"}
    assert "a" in idx
    idx.unpin(["a"])
    idx.commit("p")
    assert idx.clear() is True
    assert len(idx) == 0
    assert sorted(idx.allocate(k) for k in "vwxyz") == [0, 1, 2, 3, 4]  # every slot free again
    assert idx.stats["evicted"] == 0


def test_clear_keeps_doomed_entries():
    idx = CPUIndex(2)
    ready(idx, "a")
    idx.hold("a")
    idx.abort("a")
    assert idx.clear() is False and slot_of(idx, "a") is not None
    idx.unpin(["a"])
    assert idx.clear() is True


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("n", BAD_NUM_SLOTS, ids=repr)
def test_index_bad_num_slots(n):
    with pytest.raises(ValueError, match="^num_slots: expected a positive int"):
        CPUIndex(n)


# ------------------------------------------------------------------------------------------ model-based
class RefIndex:
    """The documented rules, written as plainly as possible (a list for LRU order, dicts for entries)."""

    def __init__(self, n):
        self.n = n
        self.order: list[str] = []  # LRU first
        self.state: dict[str, str] = {}  # "pending" | "ready" | "doomed"
        self.pins: dict[str, int] = {}

    def _bump(self, k):
        self.order.remove(k)
        self.order.append(k)

    def _drop(self, k):
        self.order.remove(k)
        del self.state[k], self.pins[k]

    def allocate(self, k):
        """-> (ok, victim)"""
        if k in self.state:
            return False, None
        victim = None
        if len(self.state) == self.n:
            victim = next((v for v in self.order if self.state[v] == "ready" and self.pins[v] == 0), None)
            if victim is None:
                return False, None
            self._drop(victim)
        self.state[k], self.pins[k] = "pending", 0
        self.order.append(k)
        return True, victim

    def commit(self, k):
        if self.state.get(k) != "pending":
            return False
        self.state[k] = "ready"
        self._bump(k)
        return True

    def abort(self, k):
        if k not in self.state or self.state[k] == "doomed":
            return
        if self.pins[k]:
            self.state[k] = "doomed"
        else:
            self._drop(k)

    def pin(self, keys):
        if any(self.state.get(k) != "ready" for k in keys):
            return False
        for k in keys:
            self.pins[k] += 1
            self._bump(k)
        return True

    def hold(self, k):
        if k not in self.state:
            return False
        self.pins[k] += 1
        return True

    def unpin(self, keys):
        need = {k: keys.count(k) for k in keys}
        if any(self.pins.get(k, 0) < c for k, c in need.items()):
            return False
        for k in keys:
            self.pins[k] -= 1
            if self.state[k] == "doomed" and self.pins[k] == 0:
                self._drop(k)
        return True

    def clear(self):
        for k in [k for k in self.order if self.state[k] == "ready" and self.pins[k] == 0]:
            self._drop(k)
        return not self.state


def check_invariants(idx: CPUIndex, ref: RefIndex, keys):
    live = {k: slot_of(idx, k) for k in keys if idx.state(k) is not None}
    assert set(live) == set(ref.state), "index and model disagree on which keys are present"
    slots = list(live.values())
    assert len(slots) == len(set(slots)), "a slot is used twice"
    assert all(0 <= s < idx.num_slots for s in slots)
    runs = idx._slots.runs  # the allocator's free blocks (kvx.store.runs), as slots
    free = [u for first, k in runs._order.items() for u in range(first, first + (1 << k))]
    assert len(free) == len(set(free)) and not set(free) & set(slots), "a slot is free and used"
    assert len(free) + len(live) == idx.num_slots, "free + used != num_slots"
    assert set(free) | set(slots) == set(range(idx.num_slots))
    for k, st in ref.state.items():
        want = SlotState.READY if st == "ready" else SlotState.PENDING
        assert idx.state(k) is want, k
        assert (k in idx) == (st == "ready"), k
    assert idx.pinned() == sum(1 for p in ref.pins.values() if p)
    lru = [k for k in ref.order if ref.state[k] == "ready"]
    assert [e.key for e in idx._slots.lru] == lru, "LRU order differs from the model"


@pytest.mark.parametrize("n", NUM_SLOTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_against_a_model(n, seed):
    rng = random.Random(seed * 1000 + n)
    keys = [f"k{i}" for i in range(2 * n + 2)]
    idx, ref = CPUIndex(n), RefIndex(n)
    ops = ["allocate"] * 4 + ["commit"] * 3 + ["abort", "pin", "pin", "unpin", "unpin", "hold"]
    seen = set()
    for step in range(1500):
        op = rng.choice(ops + (["clear"] if step % 97 == 0 else []))
        k = rng.choice(keys)
        many = rng.sample(keys, rng.randint(1, 3))
        seen.add(op)
        if op == "allocate":
            before = {x: slot_of(idx, x) for x in keys if idx.state(x) is not None}
            ok, victim = ref.allocate(k)
            slot = idx.allocate(k)
            assert (slot is not None) == ok, (step, op, k)
            if ok:
                assert slot not in [s for x, s in before.items() if x != victim]
                if victim is not None:  # only READY, unpinned entries are evicted, LRU first
                    assert slot == before[victim] and idx.state(victim) is None
        elif op == "commit":
            if ref.commit(k):
                idx.commit(k)
            else:
                with pytest.raises(RuntimeError):
                    idx.commit(k)
        elif op == "abort":
            ref.abort(k)
            idx.abort(k)
        elif op == "pin":
            if ref.pin(many):
                assert idx.pin(many) == [slot_of(idx, x) for x in many]
            else:
                with pytest.raises(RuntimeError):
                    idx.pin(many)
        elif op == "unpin":
            if ref.unpin(many):
                idx.unpin(many)
            else:
                with pytest.raises(RuntimeError):
                    idx.unpin(many)
        elif op == "hold":
            if ref.hold(k):
                assert idx.hold(k) == slot_of(idx, k)
            else:
                with pytest.raises(RuntimeError):
                    idx.hold(k)
        elif op == "clear":
            assert idx.clear() == ref.clear()
        check_invariants(idx, ref, keys)
    assert seen >= set(ops)


@pytest.mark.parametrize("n", NUM_SLOTS)
def test_random_operations_exercise_evictions_and_doomed_entries(n):
    """Guards the model-based test: its random mix does reach evictions and deferred frees."""
    rng = random.Random(n)
    idx = CPUIndex(n)
    keys = [f"k{i}" for i in range(2 * n + 2)]
    doomed = 0
    for _ in range(1500):
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.4 and idx.allocate(k) is not None:
            continue
        if r < 0.7 and idx.state(k) is SlotState.PENDING and rng.random() < 0.8:
            try:
                idx.commit(k)
            except RuntimeError:
                pass
        elif r < 0.8 and idx.state(k) is not None:
            idx.hold(k)
            if rng.random() < 0.5:
                idx.abort(k)
                doomed += idx.state(k) is not None
            idx.unpin([k])
    assert idx.stats["evicted"] > 0 and doomed > 0


# ------------------------------------------------------------------------------------------ logging
def test_store_modules_log_under_kvx_so_vllm_routes_them():
    """kvx.log.attach_to_vllm hands vLLM's handlers to the "kvx" logger: the stores must log below it."""
    from kvx.store import cpu, disk

    assert cpu.log.name == "kvx.store.cpu" and disk.log.name == "kvx.store.disk"


# ------------------------------------------------------------------------------------------ CPUPool
@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", POOL_SHAPES, ids=str)
def test_pool_slots_are_distinct_memory(shape, dtype):
    n = 5
    pool = CPUPool(n, shape, dtype)
    assert pool.data.shape == (n, *shape) and pool.data.dtype == dtype
    elem = pool.data.element_size()
    assert pool.slot_bytes == int(np.prod(shape)) * elem
    for i in range(n):
        v = pool.slot(i)
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
        assert v.data_ptr() == pool.data.data_ptr() + i * pool.slot_bytes  # back to back, no overlap
        v.fill_(i + 1)
    for i in range(n):
        assert torch.all(pool.slot(i) == i + 1), f"slot {i} was overwritten by another slot"
    pool.close()


def test_pool_slot_is_a_view_of_the_pool():
    pool = CPUPool(3, (2, 4), torch.float32)
    pool.data.zero_()
    pool.slot(1).copy_(torch.arange(8.0).reshape(2, 4))
    assert torch.equal(pool.data[1], torch.arange(8.0).reshape(2, 4))
    assert torch.count_nonzero(pool.data[0]) == 0 and torch.count_nonzero(pool.data[2]) == 0


def test_pool_accepts_numpy_ints():
    pool = CPUPool(2, (np.int64(3), np.int32(2)), torch.float16)
    assert pool.slot_shape == (3, 2) and all(type(s) is int for s in pool.slot_shape)
    assert pool.slot(np.int64(1)).shape == (3, 2)


@pytest.mark.parametrize("i", [-1, 4, 5, 100, 1.0, True, "0", None], ids=repr)
def test_pool_slot_out_of_range(i):
    pool = CPUPool(4, (2,), torch.float32)
    with pytest.raises(ValueError, match="^slot: expected"):
        pool.slot(i)


@pytest.mark.parametrize("n", BAD_NUM_SLOTS, ids=repr)
def test_pool_bad_num_slots(n):
    with pytest.raises(ValueError, match="^num_slots: expected a positive int"):
        CPUPool(n, (2,), torch.float32)


@pytest.mark.parametrize("shape", BAD_SLOT_SHAPES, ids=repr)
def test_pool_bad_slot_shape(shape):
    with pytest.raises(ValueError, match="^slot_shape: expected a sequence of positive ints"):
        CPUPool(2, shape, torch.float32)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=repr)
def test_pool_bad_dtype(dtype):
    with pytest.raises(ValueError, match="^dtype: expected a torch.dtype"):
        CPUPool(2, (2,), dtype)


def _populate_supported() -> bool:
    from kvx._ext import C as _C

    probe = CPUPool(1, (4096,), torch.uint8, populate=False)
    return _C.cpu_populate_write(probe.data.data_ptr(), 4096) == 0


def _minor_faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.view(torch.uint8).fill_(0x5A)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs per-thread fault counts (Linux)")
def test_pool_pages_are_committed_up_front():
    if not _populate_supported():
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    slot_shape = (2, 2, 256, 2, 64)  # 256 KiB bf16 slots, 16 of them: 1024 pages
    pool = CPUPool(16, slot_shape, torch.bfloat16)
    faults = sum(_minor_faults_writing(pool.slot(i)) for i in range(16))
    assert faults < 64, f"{faults} page faults writing 1024 pages of a populated pool"
    lazy = CPUPool(16, slot_shape, torch.bfloat16, populate=False)
    assert sum(_minor_faults_writing(lazy.slot(i)) for i in range(16)) > faults  # what populate saves


@pytest.mark.parametrize("offset,length", [(0, 1), (1, 4095), (1, 4096), (4095, 8193), (3, 3 * 4096 + 5), (0, 0)])
def test_populate_leaves_contents_alone(offset, length):
    from kvx._ext import C as _C

    pool = CPUPool(1, (6 * 4096,), torch.uint8, populate=False)
    data = pool.data.view(-1)
    data[: 2 * 4096].copy_(torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8))  # half written, half not
    before = data.clone()
    err = _C.cpu_populate_write(data.data_ptr() + offset, length, 3)
    assert err in (0, errno.EINVAL)
    assert torch.equal(data, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin=True page-locks the pool through CUDA")
def test_pool_pinned():
    pool = CPUPool(4, (2, 1, 16, 2, 8), torch.float16, pin=True)
    assert pool.pinned and pool.data.is_pinned()
    pool.slot(3).fill_(7)
    gpu = pool.slot(3).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.all(gpu == 7)
    pool.close()
    pool.close()
