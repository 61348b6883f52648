"""The transfer engine's CPU copy queue: order, errors, fences, close."""

import threading
import time

import pytest
import torch

from kvx.engine import TransferEngine


def test_jobs_run_in_submission_order_off_the_caller_thread():
    eng = TransferEngine("cpu")
    seen, caller = [], threading.get_ident()
    jobs = [eng.submit(lambda i=i: (time.sleep(0.002 * (3 - i)), seen.append((i, threading.get_ident()))))
            for i in range(3)]
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
    ok = eng.submit(lambda: None)          # the queue keeps working after a failed job
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
    a.add_(1)                                   # compute-stream work
    marker = eng.marker()
    b = torch.empty_like(a)
    job = eng.submit(lambda: b.copy_(a), after=marker)
    eng.fence(job)
    torch.cuda.synchronize()
    assert torch.equal(b, a)
