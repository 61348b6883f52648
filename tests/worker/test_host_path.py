"""The worker's hot path as a CUDA engine runs it, on a null engine (:class:`kvx.engine.NullEngine`: everything on the
host but the CUDA calls, which it counts): a step's copies planned once, each layer one compiled call, a step with
nothing to copy making no engine call at all."""

import pytest
import torch

from kvx import _ext
from kvx.testing import host_time

SHAPE = host_time.Shape("small", 6, 2, 64, block_size=16, chunk=64)


@pytest.fixture
def worker():
    w = host_time.Worker(SHAPE, 2)
    yield w
    w.close()


def _count(monkeypatch, name):
    calls = []
    real = getattr(_ext.C, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_ext.C, name, spy)
    return calls


def _planned(monkeypatch, w):
    plans = []
    cache = w.worker.cache
    real = cache.plan

    def spy(copies, name=""):
        plans.append(name)
        return real(copies, name)

    monkeypatch.setattr(cache, "plan", spy)
    return plans


def test_a_step_with_nothing_to_copy_calls_no_engine(worker, monkeypatch):
    fences, saves = _count(monkeypatch, "fence_range"), _count(monkeypatch, "issue_save_range")
    q = worker.engine.queues
    before = q.total
    for _ in range(3):
        worker.step(worker.nothing_meta())
    assert q.total == before and not fences and not saves


def test_a_load_is_planned_once_and_each_layer_fenced_by_one_compiled_call(worker, monkeypatch):
    fences, plans = _count(monkeypatch, "fence_range"), _planned(monkeypatch, worker)
    q = worker.engine.queues
    q.reset()
    worker.step(worker.load_meta(2))
    assert plans == ["load hit"]  # one plan of both chunks, at start_load_kv
    assert [args[2] for args in fences] == list(range(SHAPE.layers))  # one call per layer, in order
    assert (q.dma_calls, q.launches) == (SHAPE.layers, SHAPE.layers)  # a leg per layer: one DMA batch, one launch
    assert q.uploads == 2  # the id table, once
    # per layer: the reshape after its DMA, its buffer after the reshape that last read it, the forward after it
    assert q.waits == 1 + 3 * SHAPE.layers - 2


def test_a_save_is_planned_at_its_first_layer_and_each_layer_issued_by_one_compiled_call(worker, monkeypatch):
    issued, plans = _count(monkeypatch, "issue_save_range"), _planned(monkeypatch, worker)
    q = worker.engine.queues
    q.reset()
    worker.step(worker.save_meta(2))
    assert plans == ["save 2 chunks"]
    assert [args[3] for args in issued] == list(range(SHAPE.layers))  # (queues, plan, ring, range, after, marker)
    assert all(args[5] is True for args in issued)  # each takes its layer's marker (rule 2)
    assert (q.dma_calls, q.launches) == (SHAPE.layers, SHAPE.layers)


def test_the_null_engine_copies_nothing(worker):
    """What the host-time benchmark measures never touches the bytes: the blocks stay as they were."""
    lay = worker.worker.layout
    before = [t.clone() for t in lay.layers[:2]]
    worker.step(worker.load_meta(2))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, lay.layers[:2]))
