"""The transfer engine's CPU copy queue: order, errors, fences, close."""

import sys
import threading
import time

import pytest
import torch

from kvx.engine import TransferEngine
from tests.helpers import wait_for


def test_jobs_run_in_submission_order_off_the_caller_thread():
    eng = TransferEngine("cpu")
    seen, caller = [], threading.get_ident()
    jobs = [
        eng.submit(lambda i=i: (time.sleep(0.002 * (3 - i)), seen.append((i, threading.get_ident())))) for i in range(3)
    ]
    eng.fence(jobs[-1])
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(tid != caller for _, tid in seen)
    assert all(j.done() for j in jobs)
    eng.close()


def test_errors_are_kept_and_reraised():
    eng = TransferEngine("cpu")
    job = eng.submit(lambda: 1 / 0, name="boom")
    with pytest.raises(ZeroDivisionError):
        job.wait()
    assert isinstance(job.error(), ZeroDivisionError)
    ok = eng.submit(lambda: None)  # the queue keeps working after a failed job
    ok.wait()
    assert ok.error() is None
    eng.close()


def test_marker_is_a_no_op_on_cpu_and_wait_times_out():
    eng = TransferEngine("cpu")
    assert eng.marker() is None
    gate = threading.Event()
    job = eng.submit(gate.wait)
    with pytest.raises(TimeoutError, match="did not finish"):
        job.wait(timeout=0.01)
    gate.set()
    job.wait()
    eng.close()


def test_close_drains_and_refuses_new_work():
    eng = TransferEngine("cpu")
    out = torch.zeros(4)
    eng.submit(lambda: out.fill_(3))
    eng.close()
    assert torch.equal(out, torch.full((4,), 3.0))
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(lambda: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")
@pytest.mark.gpu
def test_cuda_side_stream_orders_after_marker():
    eng = TransferEngine("cuda")
    a = torch.zeros(1 << 20, device="cuda")
    a.add_(1)  # compute-stream work
    marker = eng.marker()
    b = torch.empty_like(a)
    job = eng.submit(lambda: b.copy_(a), queue="save", after=[marker])
    eng.fence(job)
    torch.cuda.synchronize()
    assert torch.equal(b, a)


# ---------------------------------------------------------------- the deferred queue (GPU semantics on CPU)
def deferred():
    return TransferEngine("cpu", mode="deferred")


def test_deferred_save_runs_only_after_the_next_forward():
    eng, ran = deferred(), []
    eng.step_begin()
    job = eng.submit(lambda: ran.append("save"), queue="save")
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
    a = eng.submit(lambda: ran.append("a"), queue="save")
    b = eng.submit(lambda: ran.append("b"), queue="save")  # follows a on its queue
    eng.fence(b)
    assert ran == ["a", "b"] and a.done()
    eng.close()


def test_deferred_load_runs_as_early_as_its_edges_allow():
    eng, ran = deferred(), []
    eng.step_begin()
    save = eng.submit(lambda: ran.append("save"), queue="save")
    eng.submit(lambda: ran.append("free load"), queue="load")
    assert ran == ["free load"]  # nothing to wait for: at once
    after = eng.submit(lambda: ran.append("load after save"), queue="load", after=[save])
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
    racing = eng.submit(lambda: ran.append("unordered load"), queue="load")
    ordered = eng.submit(lambda: ran.append("ordered load"), queue="load", after=[eng.marker()])
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
    job = eng.submit(lambda: ran.append(threading.get_ident()), queue="save")
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
    eng, ran = TransferEngine("cpu", mode="thread"), []
    gate = threading.Event()
    save = eng.submit(lambda: (gate.wait(), ran.append("save")), queue="save")
    load = eng.submit(lambda: ran.append("load"), queue="load", after=[save])
    free = eng.submit(lambda: ran.append("other load"), queue="load")
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
    from kvx.engine import BlockOrder

    eng, ran = deferred(), []
    order = BlockOrder(eng)
    eng.step_begin()
    save = order.save([3, 4], lambda: ran.append("save 3,4"))
    load = order.load([4, 5], lambda: ran.append("load 4,5"))  # rule 1: after the save reading block 4
    other = order.load([9], lambda: ran.append("load 9"))  # behind it on the load queue
    assert ran == [] and not load.done() and not other.done()
    order.before_forward([3])  # rule 3: the forward writes block 3
    assert ran == ["save 3,4", "load 4,5", "load 9"]
    assert save.done() and other.done()
    eng.step_begin()
    late = order.save([7], lambda: ran.append("save 7"))
    assert order.before_forward([7]) == [] and late.done()  # fenced: ran before the forward
    assert order.pending() == 0
    eng.close()
