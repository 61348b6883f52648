"""The transfer engine's copy queues: order, errors, fences, close; the deferred queue's schedule; BlockOrder's
rules, rule 5 (staging buffers) included, each with a case where dropping it gives wrong bytes."""

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvx.engine import BlockOrder, StagingRing, make_engine, on_stream, torch_stream
from kvx.kernels import ops
from kvx.kernels.plan import Copies
from kvx.testing import make_layout, random_fill_
from tests.helpers import wait_for


# ---------------------------------------------------------------- the thread queue (CPU's default; asked for by name,
# so that these hold under KVX_COPY_QUEUE=deferred too)
def test_jobs_run_in_submission_order_off_the_caller_thread():
    eng = make_engine("cpu", mode="thread")
    seen, caller = [], threading.get_ident()
    jobs = [
        eng.submit(lambda s, i=i: (time.sleep(0.002 * (3 - i)), seen.append((i, threading.get_ident()))))
        for i in range(3)
    ]
    eng.fence(jobs[-1])
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(tid != caller for _, tid in seen)
    assert all(j.done() for j in jobs)
    eng.close()


def test_errors_are_kept_and_reraised():
    eng = make_engine("cpu", mode="thread")
    job = eng.submit(lambda s: 1 / 0, name="boom")
    with pytest.raises(ZeroDivisionError):
        job.wait()
    assert isinstance(job.error(), ZeroDivisionError)
    ok = eng.submit(lambda s: None)  # the queue keeps working after a failed job
    ok.wait()
    assert ok.error() is None
    eng.close()


def test_marker_is_a_no_op_on_cpu_and_wait_times_out():
    eng = make_engine("cpu", mode="thread")
    assert eng.marker() is None
    gate = threading.Event()
    job = eng.submit(lambda s: gate.wait())
    with pytest.raises(TimeoutError, match="did not finish"):
        job.wait(timeout=0.01)
    gate.set()
    job.wait()
    eng.close()


def test_close_drains_and_refuses_new_work():
    eng = make_engine("cpu", mode="thread")
    out = torch.zeros(4)
    eng.submit(lambda s: out.fill_(3))
    eng.close()
    assert torch.equal(out, torch.full((4,), 3.0))
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(lambda s: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")
@pytest.mark.gpu
def test_cuda_side_stream_orders_after_marker():
    eng = make_engine("cuda")
    a = torch.zeros(1 << 20, device="cuda")
    a.add_(1)  # compute-stream work
    marker = eng.marker()
    b = torch.empty_like(a)

    def copy(stream):
        with on_stream(stream):
            b.copy_(a)

    job = eng.submit(copy, queue="save", after=[marker])
    eng.fence(job)
    torch.cuda.synchronize()
    assert torch.equal(b, a)


# ---------------------------------------------------------------- the deferred queue (GPU semantics on CPU)
def deferred():
    return make_engine("cpu", mode="deferred")


def test_deferred_save_runs_only_after_the_next_forward():
    eng, ran = deferred(), []
    eng.step_begin()
    job = eng.submit(lambda s: ran.append("save"), queue="save")
    eng.forward_done()  # the forward of the step that queued it: not yet
    assert not job.done() and ran == []
    eng.step_begin()
    eng.forward_done()  # the next step's forward: on a GPU, perhaps still running
    assert not job.done()
    eng.step_begin()
    eng.forward_done()  # it has surely written the cache: now (too late, unless fenced)
    assert job.done() and ran == ["save"]
    eng.close()


def test_deferred_fence_runs_the_job_and_what_it_follows_now():
    eng, ran = deferred(), []
    eng.step_begin()
    a = eng.submit(lambda s: ran.append("a"), queue="save")
    b = eng.submit(lambda s: ran.append("b"), queue="save")  # follows a on its queue
    eng.fence(b)
    assert ran == ["a", "b"] and a.done()
    eng.close()


def test_deferred_load_runs_as_early_as_its_edges_allow():
    eng, ran = deferred(), []
    eng.step_begin()
    save = eng.submit(lambda s: ran.append("save"), queue="save")
    free = eng.submit(lambda s: ran.append("free load"), queue="load")
    assert ran == [] and not free.done()  # not when submitted: at the next observation point
    eng.poll()
    assert ran == ["free load"]  # nothing to wait for: at once
    after = eng.submit(lambda s: ran.append("load after save"), queue="load", after=[save])
    eng.poll()
    assert not after.done()
    eng.fence(save)
    assert ran == ["free load", "save", "load after save"]
    eng.close()


def test_deferred_virtual_compute_orders_markers_and_fences():
    """A forward on the virtual compute stream runs lazily; a load taken after a marker waits for it; a job
    fenced before the next forward runs before that forward."""
    eng, ran = deferred(), []
    eng.step_begin()
    eng.compute(lambda: ran.append("forward 1"))
    racing = eng.submit(lambda s: ran.append("unordered load"), queue="load")
    ordered = eng.submit(lambda s: ran.append("ordered load"), queue="load", after=[eng.marker()])
    eng.poll()
    assert ran == ["unordered load"] and not ordered.done()  # the race a GPU's host-ahead step allows
    eng.fence(ordered)
    eng.compute(lambda: ran.append("forward 2"))
    eng.flush()
    assert ran == ["unordered load", "forward 1", "ordered load", "forward 2"]
    assert racing.done()
    eng.close()


def test_deferred_io_thread_waits_for_the_engine_thread():
    """A disk writer waiting for a gather does not run it (it would race the host's forward); the engine's
    thread does, at the latest at close."""
    eng, ran = deferred(), []
    eng.step_begin()
    job = eng.submit(lambda s: ran.append(threading.get_ident()), queue="save")
    waited = threading.Event()
    t = threading.Thread(target=lambda: (job.wait(), waited.set()))
    t.start()
    assert not waited.wait(0.05)
    eng.close()
    t.join(5)
    assert waited.is_set() and ran == [threading.get_ident()]


def parked(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in a ``threading`` wait (an Event's or a Condition's): a queue thread
    waiting for a job of the other queue. (Waiting for its next job, it blocks in SimpleQueue.get instead.)"""
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_filename == threading.__file__ and frame.f_code.co_name == "wait"


def test_thread_mode_two_queues_and_a_cross_queue_edge():
    eng, ran = make_engine("cpu", mode="thread"), []
    gate = threading.Event()
    save = eng.submit(lambda s: (gate.wait(), ran.append("save")), queue="save")
    load = eng.submit(lambda s: ran.append("load"), queue="load", after=[save])
    free = eng.submit(lambda s: ran.append("other load"), queue="load")
    loader = next(t for t in eng._threads if t.name.endswith("-load"))
    wait_for(lambda: parked(loader), 10, "the load queue's thread to wait for the save")
    assert ran == []  # the load queue waits for the save it must follow
    gate.set()
    free.wait()
    assert ran == ["save", "load", "other load"] and load.done()
    eng.close()


def test_copy_queue_env_is_checked(monkeypatch):
    from kvx.engine import copy_queue_mode

    monkeypatch.setenv("KVX_COPY_QUEUE", "deferred")
    assert copy_queue_mode("cpu") == "deferred"
    monkeypatch.setenv("KVX_COPY_QUEUE", "lazy")
    with pytest.raises(ValueError, match=r"KVX_COPY_QUEUE: expected one of 'auto', 'thread', 'deferred', got 'lazy'"):
        copy_queue_mode("cpu")
    monkeypatch.delenv("KVX_COPY_QUEUE")
    assert copy_queue_mode("cpu") == "thread"


def test_block_order_the_rule():
    eng, ran = deferred(), []
    order = BlockOrder(eng)
    eng.step_begin()
    save = order.save([3, 4], lambda s: ran.append("save 3,4"))
    load = order.load([4, 5], lambda s: ran.append("load 4,5"))  # rule 1: after the save reading block 4
    other = order.load([9], lambda s: ran.append("load 9"))  # behind it on the load queue
    eng.poll()
    assert ran == [] and not load.done() and not other.done()
    order.before_forward([3])  # rule 3: the forward writes block 3
    assert ran == ["save 3,4", "load 4,5", "load 9"]
    assert save.done() and other.done()
    eng.step_begin()
    late = order.save([7], lambda s: ran.append("save 7"))
    assert order.before_forward([7]) == [] and late.done()  # fenced: ran before the forward
    assert order.pending() == 0
    eng.close()


def test_make_engine_modes_and_their_properties():
    thread, lazy = make_engine("cpu", mode="thread"), make_engine("cpu", mode="deferred")
    assert (thread.layerwise, thread.staged, thread.host_copies) == (False, False, True)
    assert (lazy.layerwise, lazy.staged, lazy.host_copies) == (True, True, False)
    with pytest.raises(ValueError, match=r"mode: expected one of \('cuda', 'thread', 'deferred'\), got 'fast'"):
        make_engine("cpu", mode="fast")
    with pytest.raises(ValueError, match="mode: 'cuda' does not run on a cpu device"):
        make_engine("cpu", mode="cuda")
    thread.close()
    lazy.close()


# ---------------------------------------------------------------- staging buffers (rule 5)
LAYERS = 6  # a leg per layer through a ring of two buffers: each buffer is reused twice


def _plan(lay, op, buf):
    """A staged plan of one copy of block 1, a leg per layer (the compiled path, as a worker's step plans it)."""
    copies = Copies(lay, path="staged")
    copies.add(op, [1], buf)
    return copies.plan([(layer, layer + 1) for layer in range(lay.num_layers)], 1 << 10)


def _staged_engine(rule5: bool):
    eng = deferred()
    eng.configure_staging(4 << 10)  # rings of two 1 KiB buffers; a layer's leg is 128 bytes
    for direction in ("load", "save"):
        eng.ring(direction).c.rule5 = rule5
    return eng, BlockOrder(eng)


@pytest.mark.parametrize("rule5", [True, False], ids=["rule5", "no-rule5"])
def test_staged_loads_reuse_a_buffer_only_after_its_reshape(rule5):
    """The deferred queue runs a ready DMA before a ready reshape (both legal on a GPU), so without rule 5 leg 2's
    DMA lands in buffer 0 before leg 0's reshape read it: layer 0 gets layer 2's bytes."""
    lay = make_layout(
        "LBNHC", num_layers=LAYERS, num_blocks=4, block_size=4, num_heads=1, head_size=8, dtype=torch.bfloat16
    )
    src = random_fill_(torch.empty(lay.canonical_shape(4), dtype=lay.dtype), torch.Generator().manual_seed(1))
    eng, order = _staged_engine(rule5)
    eng.step_begin()
    order.load_plan([1], _plan(lay, "scatter_blocks", src))
    eng.flush()
    got = ops.gather_blocks(lay, [1], impl="reference")
    assert torch.equal(got.view(torch.int16), src.view(torch.int16)) == rule5
    if not rule5:
        assert not torch.equal(got[0].view(torch.int16), src[0].view(torch.int16))  # layer 0 holds another's
    eng.close()


@pytest.mark.parametrize("rule5", [True, False], ids=["rule5", "no-rule5"])
def test_staged_saves_and_rule_5(rule5):
    """Saves run late, gathers before DMAs: without rule 5, leg 2's gather fills buffer 0 before leg 0's DMA
    emptied it."""
    lay = make_layout(
        "LBNHC", num_layers=LAYERS, num_blocks=4, block_size=4, num_heads=1, head_size=8, dtype=torch.bfloat16
    )
    out = torch.zeros(lay.canonical_shape(4), dtype=lay.dtype)
    eng, order = _staged_engine(rule5)
    eng.step_begin()
    plan = _plan(lay, "gather_blocks", out)
    for r in range(plan.num_ranges):  # layer by layer, as save_kv_layer issues them
        order.save_plan([1], plan, r, first=r == 0, last=r == plan.num_ranges - 1)
    for _ in range(3):  # two more steps' forwards: the saves run, as late as allowed
        eng.step_begin()
        eng.forward_done()
    assert plan.done(plan.num_legs - 1).query()
    expected = ops.gather_blocks(lay, [1], impl="reference")
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16)) == rule5
    eng.close()


def test_ring_hands_out_buffers_in_turn_with_their_users():
    eng = deferred()
    ring = StagingRing(torch.device("cpu"), 2, 64)
    i0, a0, users0 = ring.c.acquire()
    job = eng.submit(lambda s: None, queue="h2d")
    ring.c.note(i0, eng.event_of(job))
    i1, a1, users1 = ring.c.acquire()
    i2, a2, users2 = ring.c.acquire()
    assert (i0, i1, i2) == (0, 1, 0) and a2 == a0 == ring.buffers[0].data_ptr() and a1 != a0
    assert users0 == users1 == [] and [u.payload for u in users2] == [job]  # the next writer follows its user
    assert ring.c.acquire()[2] == []  # handed out with its users: the next turn has none
    ring.c.rule5 = False  # the seeded bug: handed out without them
    ring.c.note(1, eng.event_of(job))
    assert ring.c.acquire()[2] == []
    with pytest.raises(ValueError, match="count, capacity: expected >= 1"):
        StagingRing(torch.device("cpu"), 0, 64)
    eng.close()


def test_engine_staging_budget_is_split_in_two_rings():
    eng = deferred()
    eng.configure_staging(64 << 20)
    assert eng.ring("load").capacity == eng.ring("save").capacity == 16 << 20
    assert len(eng.ring("load").buffers) == 2 and eng.staging_bytes == 64 << 20
    eng.drop_staging()
    with pytest.raises(RuntimeError, match="no staging ring for 'load'"):
        eng.ring("load")
    with pytest.raises(ValueError, match="budget: expected at least 1024 bytes"):
        eng.configure_staging(100)
    eng.close()


def test_torch_stream_maps_handle_0_to_the_default_stream(monkeypatch):
    """A handle names a CUDA stream; 0 is the legacy default stream. ``torch.cuda.ExternalStream(0)`` is not it: torch
    takes a zero pointer as "none given" and hands out a new stream of its pool, which neither waits for the default
    stream nor is waited for (an upload issued there raced the kernels on handle 0, H100, 2026-11-27). The rule, with
    torch.cuda's stream functions stood in for (no GPU here; tests/kernels/test_h2d.py has the GPU twin)."""
    current, default, external = SimpleNamespace(cuda_stream=7), SimpleNamespace(cuda_stream=0), []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda h, device=None: external.append(h) or ("external", h))
    assert torch_stream(None) is current and torch_stream(7) is current
    assert torch_stream(0) is default
    assert torch_stream(5) == ("external", 5) and external == [5]


def test_the_null_engine_runs_nothing_and_counts_what_cuda_would_call():
    """The host-only benchmark's engine: submits, markers and fences are counted as the CUDA calls they would be
    (a record per job and marker, a wait per edge and fence), and no job is run; its rings hold no memory."""
    from kvx.engine import NullEngine

    eng = NullEngine(torch.device("cpu"))
    ran = []
    marker = eng.marker()
    job = eng.submit(lambda s: ran.append(1), queue="save", after=[marker, None])
    eng.fence(job)
    assert ran == [] and job.done()
    q = eng.queues
    assert (q.records, q.waits, q.dma_calls, q.launches) == (2, 2, 0, 0)
    eng.configure_staging(1 << 20)
    assert eng.ring("load").buffers == [] and eng.staging_bytes == 1 << 20
    assert eng.ring("load").c.address(0) != eng.ring("save").c.address(0)
    eng.close()
