"""Faults that need engines in separate processes: an engine killed (``kill -9``) in the middle of writing a
chunk's file (a part or its record), and two engines serving from one store at the same time (with and without
a size cap). Each case: greedy tokens equal to an engine without kvx, no crash (exit codes; the killed engine
excepted), every stored record and part verifies and no temporary file is left, and an in-process engine on the
store at the end settles (nothing pinned or in flight).

References are computed before any kvx engine starts in this process: vLLM's KV-transfer state is
process-global, so no second engine is built in-process while one is alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvx.store.disk import DiskTierConfig
from kvx.testing import harness as H
from tests.helpers import dir_bytes, stopped, store_objects, stored_chunk_keys, wait_for

from .conftest import (
    CHUNK,
    CHUNK_BYTES,
    KV_HEADS,
    MAX_TOKENS,
    assert_store_sound,
    connector_sides,
    engine,
    engine_process,
    full_hit,
    parts,
    records,
    results,
    settle,
    tiers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# kill -9: 6 unrelated prompts of 8 full chunks each (48 chunks: a record and 2 parts of 256 KiB each) and an odd
# tail.
KILL_PROMPTS = [H.prompt_ids(8 * CHUNK + 17 + i, seed=200 + i) for i in range(6)]
# Two engines: 6 prompts on one shared prefix of 8 chunks, branching after 1-8 of its chunks into tails of
# their own of 0-6 full chunks and an odd remainder: (shared chunks, own chunks, extra tokens).
BRANCHES = [(2, 1, 37), (5, 2, 100), (8, 0, 9), (3, 4, 200), (6, 1, 128), (1, 6, 5)]
_SHARED = H.prompt_ids(8 * CHUNK, seed=300)
SHARED_PROMPTS = [
    _SHARED[: k * CHUNK] + H.prompt_ids(m * CHUNK + r, seed=310 + i) for i, (k, m, r) in enumerate(BRANCHES)
]
DISTINCT_CHUNKS = 8 + sum(m for _, m, _ in BRANCHES)  # 22 chunks in all
ALL_PROMPTS = KILL_PROMPTS + SHARED_PROMPTS

IO_THREADS = 2  # kvx's default io_threads
START_TIMEOUT_S = 600  # an engine's whole run, on a slow, loaded 2-core machine


def refs_of(reference, prompts):
    """References of ``prompts``; every prompt of the module is computed in one engine, on first use."""
    reference(*ALL_PROMPTS)
    return reference(*prompts)


class Child:
    """An :func:`engine_process` whose stdout and stderr are read by threads while it runs (a full pipe
    would stall it), so the test can poll its progress and its store."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._out: list[str] = []
        self._err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(s, buf), daemon=True)
            for s, buf in ((proc.stdout, self._out), (proc.stderr, self._err))
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, buf):
        for line in stream:
            buf.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self._out)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(30)
        return rc

    def stop(self) -> None:
        """Kill it if it still runs (a test's ``finally``)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)

    def describe(self) -> str:
        return (
            f"pid {self.proc.pid} rc {self.proc.poll()}\nstdout:\n{self.stdout[-2000:]}\nstderr:\n{self.stderr[-4000:]}"
        )


def temp_files(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".tmp")]


def chunk_files(store) -> list[str]:
    """Every chunk file of ``store``: records and parts."""
    recs, prts = store_objects(store)
    return recs + prts


def kill_mid_write(child: Child, store, after_results: int, after_chunks: int, timeout: float) -> tuple[str, list[str]]:
    """Once ``child`` has printed ``after_results`` results and ``store`` holds ``after_chunks`` chunks stored
    whole (records), wait for a temporary file in ``store``; stop the process, and if the file is still there
    (its write has not finished), kill it. Returns (the temporary file, the chunk files present at the kill)."""
    pid = child.proc.pid

    def killed() -> tuple[str, list[str]] | None:
        if child.proc.poll() is not None:
            pytest.fail(
                f"the engine ended before the kill could land in the middle of a chunk write "
                f"(no temporary file seen while it ran):\n{child.describe()}"
            )
        if len(results(child.stdout)) < after_results or len(records(store)) < after_chunks:
            time.sleep(0.05)
            return None
        tmps = temp_files(store)
        if not tmps:
            # kvx's writers run under SCHED_IDLE: a short sleep, not a busy loop, lets them run (and the
            # poll that wakes up preempts them in the middle of a write)
            time.sleep(0.001)
            return None
        os.kill(pid, signal.SIGSTOP)
        wait_for(
            lambda: stopped(pid), 60, lambda: f"pid {pid} to stop after SIGSTOP:\n{child.describe()}", interval=0.001
        )
        alive = [t for t in tmps if os.path.exists(t)]
        if alive:
            present = chunk_files(store)
            os.kill(pid, signal.SIGKILL)
            return alive[0], present
        os.kill(pid, signal.SIGCONT)  # renamed into place meanwhile: try the next write
        return None

    return wait_for(
        killed, timeout, lambda: f"a kill to land in the middle of a chunk write:\n{child.describe()}", interval=0
    )


def test_kill_9_mid_write_then_restart_on_the_same_store(model, reference, tmp_path):
    """An engine killed while writing a chunk's file (a part, or the record) leaves its temporary file; an engine
    started on the store removes it, serves the chunks the killed engine completed (their records), and computes
    (and stores) the rest."""
    from kvx.store.disk import survey

    refs = refs_of(reference, KILL_PROMPTS)
    store = tmp_path / "store"
    # each write holds its temporary file 50 ms: on a fast or a loaded machine alike, the writes cannot all
    # slip between the polls below before the engine ends
    child = Child(engine_process(tmp_path, model, tiers(store, cpu=None), KILL_PROMPTS, write_delay_s=0.05))
    try:
        # after 2 prompts and 10 chunks stored whole (the writes lag behind the prompts: kvx's writers run only
        # on idle cores), so that the first prompt's chunks are complete on disk when the kill lands
        tmp, present = kill_mid_write(child, store, after_results=2, after_chunks=10, timeout=START_TIMEOUT_S)
        rc = child.wait(60)
    finally:
        child.stop()
    assert rc == -signal.SIGKILL, child.describe()
    assert os.path.exists(tmp), "the killed write left no temporary file"
    assert sorted(chunk_files(store)) == sorted(present)
    _, key, _, pid, _, _ = os.path.basename(tmp).split(".")  # .<key>.<host>.<pid>.<random>.tmp
    assert pid == str(child.proc.pid)
    left = {t.path: t for t in survey(str(store)).temps}  # read-only survey: names it stale, keeps it
    assert tmp in left and left[tmp].stale, left
    p = subprocess.run(
        [sys.executable, "-m", "kvx.tools.cli", "store", "verify", str(store)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # verify passes, lists the leftover as stale and changes nothing
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(ln.startswith(f"TMP {tmp}:") and "stale" in ln for ln in p.stdout.splitlines()), p.stdout
    assert os.path.exists(tmp)

    with engine(model, tiers(store, cpu=None)) as llm:
        assert not os.path.exists(tmp), "the store's start-up did not remove the killed writer's temporary file"
        assert not any(os.path.exists(t) for t in left), "stale temporary files survived the start-up"
        sched, worker = connector_sides(llm)
        assert worker.tiers["disk"].stats()["tmp_removed"] + sched.tiers["disk"].stats()["tmp_removed"] >= 1
        # chunks the killed engine completed (their records): a prompt hits its leading chunks present on disk
        chunks = [stored_chunk_keys(llm, prompt, CHUNK) for prompt in KILL_PROMPTS]
        leading = []
        for objs in chunks:
            on_disk = sched.tiers["disk"].contains_many([k for k, _ in objs])
            leading.append(on_disk.index(False) if False in on_disk else len(on_disk))
        owner = {o: k for objs in chunks for k, ps in objs for o in (k, *ps)}  # record or part key -> chunk key
        present_recs, present_parts = store_objects(store)  # (the files present at the kill, asserted above)

        def names(files):
            return {os.path.basename(f)[: -len(".safetensors")] for f in files}

        assert names(present_recs) <= {k for objs in chunks for k, _ in objs}
        assert names(present_parts) <= {p for objs in chunks for _, ps in objs for p in ps}
        # the chunk whose part or record was being written when killed: a miss
        assert key in owner and sched.tiers["disk"].contains_many([owner[key]]) == [False]
        assert len(present_recs) >= sum(leading)
        assert max(leading) == 8, f"no prompt had all its chunks on disk at the kill: {leading}"
        for prompt, ref, lead in zip(KILL_PROMPTS, refs, leading):
            r = H.generate(llm, prompt, MAX_TOKENS)
            assert r.tokens == ref
            assert r.num_cached_tokens == min(lead * CHUNK, full_hit(len(prompt))), (leading, r.num_cached_tokens)
        settle(llm)
        for prompt, ref in zip(KILL_PROMPTS, refs):  # everything from disk now, the recomputed chunks too
            llm.reset_prefix_cache()
            r = H.generate(llm, prompt, MAX_TOKENS)
            assert r.num_cached_tokens == full_hit(len(prompt)) and r.tokens == ref
    assert_store_sound(store, min_chunks=8 * len(KILL_PROMPTS))


class DirSampler:
    """Samples a store every ``period`` seconds from a thread: which files (chunks and temporary files, by
    path and inode: a file written again is a new one) it holds, and when each chunk file appeared.

    One walk of the directory is not one instant: a file deleted after the walk counted it and another
    created before the walk reached it would both count. A file seen by two consecutive walks was there
    all the time between them, so ``peak`` counts, for each pair, the files both saw: bytes that were
    on disk at the same instant (files shorter-lived than a sample period are missed)."""

    def __init__(self, path, period: float = 0.02):
        self.path, self.period = path, period
        self.samples = 0
        self.peak = 0  # most bytes on disk at one instant (files seen by two consecutive walks)
        self.appeared: dict[tuple[str, int], tuple[float, int]] = {}  # chunk (path, inode) -> (time, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _walk(self) -> dict[tuple[str, int], int]:
        now, files = time.monotonic(), {}
        for d, _, fs in os.walk(self.path):
            for f in fs:
                try:
                    st = os.stat(os.path.join(d, f))
                except FileNotFoundError:
                    continue
                files[(os.path.join(d, f), st.st_ino)] = st.st_size
                if f.endswith(".safetensors"):
                    self.appeared.setdefault((os.path.join(d, f), st.st_ino), (now, st.st_size))
        return files

    def _run(self):
        prev: dict[tuple[str, int], int] = {}
        while True:
            cur = self._walk()
            self.samples += 1
            self.peak = max(self.peak, sum(size for k, size in cur.items() if k in prev))
            prev = cur
            if self._stop.is_set():  # a last pair of walks after the engines ended
                break
            self._stop.wait(self.period)

    def most_written_within(self, window: float) -> int:
        """Most bytes of chunk files that appeared within any ``window`` seconds (every engine's writes
        together; a file written and deleted between two samples is missed)."""
        ev = sorted(self.appeared.values())
        best = acc = lo = 0
        for t, size in ev:
            acc += size
            while ev[lo][0] < t - window:
                acc -= ev[lo][1]
                lo += 1
            best = max(best, acc)
        return best

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("capped", [False, True], ids=["unbounded", "capped"])
def test_two_engines_sharing_one_store(model, reference, tmp_path, capped):
    """Two engines started together on one store serve overlapping prompts in opposite orders (racing on
    the same chunks); with a cap of a third of the chunks they also evict each other's files."""
    refs = refs_of(reference, SHARED_PROMPTS)
    store = tmp_path / "store"
    chunk_bytes_guess = CHUNK_BYTES + (KV_HEADS + 1) * 4096  # KV bytes + a header (< 4 KiB) per part and the record
    cap = DISTINCT_CHUNKS // 3 * chunk_bytes_guess if capped else None
    extra = tiers(store, disk_size=cap)
    orders = [list(range(len(SHARED_PROMPTS))), list(reversed(range(len(SHARED_PROMPTS))))]
    children: list[Child] = []
    try:
        with DirSampler(store) as sampler:
            for n, order in enumerate(orders):
                (tmp_path / f"e{n}").mkdir()
                children.append(
                    Child(engine_process(tmp_path / f"e{n}", model, extra, [SHARED_PROMPTS[i] for i in order]))
                )
            rcs = [c.wait(START_TIMEOUT_S) for c in children]
    finally:
        for c in children:
            c.stop()
    for c, rc in zip(children, rcs):
        assert rc == 0 and "DONE" in c.stdout, c.describe()
    for c, order in zip(children, orders):
        res = results(c.stdout)
        assert [r["i"] for r in res] == list(range(len(order)))
        for r, i in zip(res, order):
            assert r["tokens"] == refs[i], f"prompt {i}: wrong tokens"
    n_chunks = assert_store_sound(store)
    file_bytes = max(os.path.getsize(f) for f in parts(store))  # the largest file a put writes: a part
    if not capped:
        assert n_chunks == DISTINCT_CHUNKS and len(parts(store)) == KV_HEADS * DISTINCT_CHUNKS
    else:
        # README: N engines on one path stay within size + (N-1) x min(size, W x rescan + (io_threads + 1) x
        # chunk file), W one engine's write rate: what the others write between two counts of the directory
        # (a chunk file: one put's, here a part)
        rescan_s = DiskTierConfig.model_fields["rescan_s"].default
        written = sampler.most_written_within(rescan_s)
        n = len(children)
        bound = cap + (n - 1) * min(cap, written + (IO_THREADS + 1) * file_bytes)
        peak = sampler.peak
        assert peak <= bound, (
            f"store held {peak} bytes at once ({peak / file_bytes:.1f} chunk files), bound {bound} "
            f"({bound / file_bytes:.1f} files: cap {cap / file_bytes:.1f}, {written / file_bytes:.1f} files written "
            f"within {rescan_s} s; {sampler.samples} samples)"
        )
        assert peak > 0 and dir_bytes(store) <= bound

    # a third engine, in this process, after them: every chunk on disk serves (unbounded), tokens right
    with engine(model, tiers(store, cpu=None, disk_size=cap)) as llm:
        for prompt, ref in zip(SHARED_PROMPTS, refs):
            llm.reset_prefix_cache()
            r = H.generate(llm, prompt, MAX_TOKENS)
            assert r.tokens == ref
            if not capped:
                assert r.num_cached_tokens == full_hit(len(prompt))
    assert_store_sound(store)
