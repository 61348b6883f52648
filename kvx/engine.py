"""Transfer engine: ordered asynchronous copies beside the model's compute.

One *copy queue* per engine, with the same API on both devices:

- CUDA: a low-priority side stream. ``submit(fn, after=marker)`` makes the side stream wait for a
  marker recorded on the compute stream (so a save never reads KV before the forward wrote it), runs
  ``fn`` with the side stream current (the kernels launch there, the host does not wait), and records an
  event. ``fence(job)`` makes the *compute* stream wait for that event (no host sync), which is how a
  load is ordered before attention reads the blocks, and a save before the blocks are reused.
- CPU: a single worker thread plays the stream: jobs run in submission order; a marker is a no-op
  (the CPU forward has already finished when the host reaches the save), and ``fence`` waits on the
  host for the job.

``Job.done()`` polls without blocking; ``Job.wait()`` blocks; an exception raised by ``fn`` is kept and
re-raised by ``wait()`` / returned by ``error()``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class Job:
    """One submitted copy: poll with :meth:`done`, block with :meth:`wait`."""

    __slots__ = ("_event", "_done", "_error", "name")

    def __init__(self, name: str = "", event=None):
        self.name = name
        self._event = event                    # CUDA event, or None on CPU
        self._done = threading.Event() if event is None else None
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        if self._done is not None:
            self._done.set()

    def done(self) -> bool:
        return self._event.query() if self._event is not None else self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job finished; re-raise its error."""
        if self._event is not None:
            self._event.synchronize()
        elif not self._done.wait(timeout):
            raise TimeoutError(f"copy job {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error

    def error(self) -> BaseException | None:
        return self._error


class TransferEngine:
    """An ordered copy queue on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", name: str = "kvx-copy"):
        self.device = torch.device(device)
        self._closed = False
        if self.device.type == "cuda":
            lo, _hi = torch.cuda.Stream.priority_range()
            self._stream = torch.cuda.Stream(device=self.device, priority=lo)  # lowest priority
            self._queue = None
            self._thread = None
        else:
            self._stream = None
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    @property
    def stream(self):
        """The CUDA side stream (None on CPU)."""
        return self._stream

    def marker(self):
        """A point on the compute stream that later copies may wait for (CUDA event; None on CPU)."""
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def submit(self, fn: Callable[[], None], *, after=None, name: str = "") -> Job:
        """Queue ``fn`` on the copy queue, after ``after`` (a :meth:`marker`) if given."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if self._stream is not None:
            if after is not None:
                self._stream.wait_event(after)
            error = None
            with torch.cuda.stream(self._stream):
                try:
                    fn()
                except BaseException as e:  # surfaced through the job, like on CPU
                    error = e
                ev = torch.cuda.Event()
                ev.record(self._stream)
            job = Job(name, ev)
            job._error = error
            return job
        job = Job(name)
        self._queue.put((fn, job))
        return job

    def fence(self, job: Job) -> None:
        """Order the compute stream after ``job`` (CUDA: stream wait, no host sync; CPU: host wait)."""
        if job._event is not None:
            torch.cuda.current_stream(self.device).wait_event(job._event)
            if job._error is not None:
                raise job._error
        else:
            job.wait()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, job = item
            try:
                fn()
            except BaseException as e:
                job._finish(e)
            else:
                job._finish()

    def close(self) -> None:
        """Finish queued jobs and stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        elif self._stream is not None:
            self._stream.synchronize()
