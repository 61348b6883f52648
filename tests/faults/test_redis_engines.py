"""Real vLLM engines with a Redis tier, under faults of real ``redis-server`` processes (kvx.testing.redis_server):
two engine processes sharing one server or cluster, a server down at start-up, stopped (SIGSTOP) in the
middle of a load, killed (SIGKILL) and restarted, out of memory (noeviction) and evicting (allkeys-lru),
and a cluster node killed. Each case: greedy tokens equal to an engine without kvx, no crash, no hang, and
the engine's connector settled at the end (nothing pinned or in flight).

Most engines use the Redis tier alone (no CPU tier), so after ``llm.reset_prefix_cache()`` every hit is
a read from Redis; where a CPU tier is configured, ``reset_prefix_cache(reset_connector=True)`` empties
it too. retry_s is short (the cases wait for reconnections); timeout_ms is the tier's default where the
SIGSTOP case measures it, and long elsewhere (see ``SLOW_BOX_TIMEOUT_MS``).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from contextlib import contextmanager

import pytest

from kvx.testing import harness as H
from tests.helpers import is_record, need_redis, stopped, wait_for

from .conftest import (
    CHUNK,
    MAX_TOKENS,
    connector_sides,
    engine,
    engine_process,
    full_hit,
    results,
    settle,
    shared_prefix_prompts,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOPOLOGIES = ["standalone", "cluster"]
TIMEOUT_MS = 1000  # the Redis tier's default deadline, measured by the SIGSTOP case
# The other cases' deadline: kvx's writers run under SCHED_IDLE, and on a busy 2-core box a writer can be
# off the CPU for seconds in the middle of a put; the tier then takes the server for down (a put "timed
# out") and fails the reads too, for retry_s. Faults here are refused connections and error replies,
# answered at once: no case waits for this deadline.
SLOW_BOX_TIMEOUT_MS = 10_000
NO_WAIT_S = 0.8 * SLOW_BOX_TIMEOUT_MS / 1e3  # a request faster than this waited for no deadline
RETRY_S = 0.5  # reconnection attempts: short, so the cases wait little for them
START_TIMEOUT_S = 600  # an engine process's whole run, on a slow, loaded 2-core machine
REQUEST_LIMIT_S = 60.0  # "no hang": one request on a loaded 2-core box, faults included

# Two engines, one server: the second prompt shares the first one's first chunk (5 distinct chunks).
_S = H.prompt_ids(3 * CHUNK + 40, seed=500)
SHARE_PROMPTS = [_S, _S[:CHUNK] + H.prompt_ids(2 * CHUNK + 100, seed=501)]
SHARE_CHUNKS = 3 + 2
# One engine, one server, faults: A is stored and hit again, A2 is new after the server comes back.
A = H.prompt_ids(3 * CHUNK + 40, seed=510)
A2 = H.prompt_ids(2 * CHUNK + 30, seed=511)
# Out of memory: 3 prompts of 3 chunks (9 chunks of 0.5 MiB) for a server with room for ~4.
FULL_PROMPTS = [H.prompt_ids(3 * CHUNK + 11 + i, seed=520 + i) for i in range(3)]
FULL_MAXMEMORY = "4mb"  # an empty server uses ~1 MiB of it
# A cluster: 3 prompts of 3 chunks, spread over the 3 nodes.
CLUSTER_PROMPTS = [H.prompt_ids(3 * CHUNK + 20 + i, seed=530 + i) for i in range(3)]


def soak_pool() -> list[list[int]]:
    """16 prompts over 4 shared prefixes of 1-3 chunks, with tails of 0-2 chunks and odd lengths (26
    distinct chunks, 13 MiB: more than the soak's server holds)."""
    return shared_prefix_prompts(17, prefix_seed=540, tail_seed=550, tails=4, tail_chunks=(0, 3))


SOAK_PROMPTS = soak_pool()
SOAK_REQUESTS = int(os.environ.get("KVX_REDIS_SOAK_REQUESTS", "120"))
SOAK_MAXMEMORY = os.environ.get("KVX_REDIS_SOAK_MAXMEMORY", "8mb")  # chunks in 128 KiB parts
SOAK_MAX_TOKENS = 4
LOOSE_CHUNKS_MAX = 16  # chunk buffers the copy threads may keep: their last job's (<= 6 chunks) each
ALL_PROMPTS = SHARE_PROMPTS + [A, A2] + FULL_PROMPTS + CLUSTER_PROMPTS + SOAK_PROMPTS


@pytest.fixture(scope="module", autouse=True)
def _need_redis():
    need_redis()


def refs_of(reference, prompts):
    """References of ``prompts``; every prompt of the module is computed in one engine, on first use
    (before any kvx engine starts in this process: vLLM's KV-transfer state is process-global)."""
    reference(*ALL_PROMPTS)
    return reference(*prompts)


def redis_tiers(url: str, *, cpu: str | None = None, **redis) -> dict:
    """kvx config: an optional CPU tier, then a Redis tier (``redis``: RedisTierConfig options; timeout_ms
    ``SLOW_BOX_TIMEOUT_MS`` and retry_s ``RETRY_S`` unless given)."""
    t = [{"type": "cpu", "size": cpu}] if cpu else []
    redis = {"timeout_ms": SLOW_BOX_TIMEOUT_MS, "retry_s": RETRY_S, **redis}
    return {"chunk_size": CHUNK, "tiers": t + [{"type": "redis", "url": url, **redis}]}


def totals(worker) -> dict[str, float]:
    """Every counter of the worker since start (reported ones and those of steps not reported yet)."""
    out = dict(worker.totals)
    for k, v in worker.stats.items():
        out[k] = out.get(k, 0) + v
    return out


def redis_sides(llm):
    """(scheduler side, worker side) Redis tier of an in-process engine."""
    sched, worker = connector_sides(llm)
    return sched.tiers["redis"], worker.tiers["redis"]


def wait_tiers_up(llm, timeout: float = RETRY_S + 20.0) -> float:
    """Wait until both sides' Redis tiers know every node is up (their reconnect thread probed it);
    returns the seconds waited."""
    t0 = time.monotonic()
    tiers = redis_sides(llm)
    wait_for(
        lambda: not any(t.stats()["nodes_down"] for t in tiers),
        timeout,
        lambda: f"the Redis tier to reconnect: {[t.stats() for t in tiers]}",
        interval=0.02,
    )
    return time.monotonic() - t0


def timed_generate(
    llm, prompt, max_tokens: int = MAX_TOKENS, salt: str | None = None, limit: float = REQUEST_LIMIT_S
) -> H.Result:
    """:func:`kvx.testing.harness.generate` (optionally with a ``cache_salt``), failing if the request took longer
    than ``limit`` seconds (a request that waits on a faulty server instead of recomputing)."""
    t0 = time.monotonic()
    if salt is None:
        r = H.generate(llm, prompt, max_tokens)
    else:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=max_tokens)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], sp, use_tqdm=False)[0]
        H.drain(llm)
        r = H.Result(0.0, int(out.num_cached_tokens or 0), list(out.outputs[0].token_ids))
    took = time.monotonic() - t0
    assert took < limit, f"a request took {took:.1f} s (limit {limit} s)"
    return r


def serve_again(llm, prompt, ref) -> tuple[H.Result, int, int]:
    """Serve ``prompt`` after ``llm.reset_prefix_cache()`` (vLLM forgets: what is not computed comes from
    kvx), tokens right; returns (the result, chunks read from Redis, chunk loads failed) of the request."""
    _, worker = connector_sides(llm)
    before = totals(worker)
    llm.reset_prefix_cache()
    r = timed_generate(llm, prompt)
    assert r.tokens == ref
    after = totals(worker)
    return r, *(after.get(k, 0) - before.get(k, 0) for k in ("redis_reads", "load_errors"))


def assert_redis_hit(llm, prompt, ref, tokens: int | None = None) -> None:
    """``prompt`` hits ``tokens`` (default: all kvx can serve), every chunk of it read from Redis (vLLM
    counts the tokens of a load that failed, and was recomputed, as cached too)."""
    tokens = full_hit(len(prompt)) if tokens is None else tokens
    r, reads, failed = serve_again(llm, prompt, ref)
    assert (r.num_cached_tokens, reads, failed) == (tokens, -(-tokens // CHUNK), 0), (
        "(cached tokens, chunks read from Redis, failed chunk loads)"
    )


def store_all(llm, prompt, ref, servers, n: int, attempts: int = 5) -> None:
    """Serve ``prompt`` until its ``n`` chunks are in Redis (a case's starting point, with a short
    timeout_ms: a put of a writer starved on a busy box may time out, see ``SLOW_BOX_TIMEOUT_MS``)."""
    for _ in range(attempts):
        llm.reset_prefix_cache()
        assert timed_generate(llm, prompt).tokens == ref
        settle(llm)
        if records_on(servers) >= n:
            return
        wait_tiers_up(llm)
    raise AssertionError(f"{n} chunks not stored in {attempts} attempts ({records_on(servers)} stored)")


def records_on(servers) -> int:
    """Chunks stored whole on ``servers`` (each a RedisServer: a standalone server or a cluster node): their
    records, not their parts (a value per KV head, each under a key of its own) nor the pieces of a value split
    by max_value_size (``kvx:1:{<key>}:<nonce>:<i>``)."""
    n = 0
    for s in servers:
        with s.client() as c:
            for k in c.scan_iter(match="kvx:1:*", count=1000):
                n += k.endswith(b"}") and is_record(c.getrange(k, 0, (1 << 16) - 1))
    return n


def redis_key(sched, prompt, chunk: int) -> str:
    """The Redis key of chunk ``chunk`` of ``prompt`` (no cache_salt): its record's."""
    from kvx.keys import chunk_keys, request_root

    return f"kvx:1:{{{chunk_keys(request_root(sched.namespace), prompt, CHUNK)[chunk]}}}"


@contextmanager
def kvx_warnings():
    """Records of kvx's loggers at WARNING and above while the block runs (inside an engine they go to
    vLLM's handlers, which pytest's caplog does not see)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, log = _Keep(logging.WARNING), logging.getLogger("kvx")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


@contextmanager
def redis_of(topology: str):
    """(the server or cluster, its RedisServer processes)."""
    from kvx.testing.redis_server import RedisClusterServers, RedisServer

    if topology == "cluster":
        with RedisClusterServers(3) as cl:
            yield cl, cl.nodes
    else:
        with RedisServer() as s:
            yield s, [s]


# ------------------------------------------------------------------------------------------ sharing
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_two_engine_processes_share_one_redis(model, reference, tmp_path, topology):
    """Engine A, in its own process, stores its chunks in Redis and exits; engine B (this process, a fresh
    engine: nothing of A in memory, its CPU tier empty) hits them all, with A's tokens. A request of B
    with another cache_salt hits none of them (and stores chunks of its own)."""
    refs = refs_of(reference, SHARE_PROMPTS)
    with redis_of(topology) as (server, nodes):
        extra = redis_tiers(server.url, cpu="64MiB", cluster=topology == "cluster")
        proc = engine_process(tmp_path, model, extra, SHARE_PROMPTS)
        try:
            out, err = proc.communicate(timeout=START_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
        assert proc.returncode == 0 and "DONE" in out, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
        res = results(out)
        assert [r["tokens"] for r in res] == refs
        assert res[0]["cached"] == 0
        assert records_on(nodes) == SHARE_CHUNKS  # A's shutdown waited for its writes

        with engine(model, extra) as llm:
            _, worker = connector_sides(llm)
            salted = timed_generate(llm, SHARE_PROMPTS[0], salt="another-tenant")
            assert salted.num_cached_tokens == 0 and salted.tokens == refs[0]
            assert totals(worker).get("redis_reads", 0) == 0
            for prompt, ref in zip(SHARE_PROMPTS, refs):  # vLLM's own cache holds the shared first chunk
                r = timed_generate(llm, prompt)
                assert r.tokens == ref and r.num_cached_tokens == full_hit(len(prompt))
            reads = totals(worker).get("redis_reads", 0)
            assert reads == SHARE_CHUNKS and not totals(worker).get("load_errors"), "B's hits not read from Redis"
            settle(llm)
            assert records_on(nodes) == SHARE_CHUNKS + 3  # the salted request's own 3 chunks
            llm.reset_prefix_cache(reset_connector=True)  # vLLM and kvx's CPU tier forget
            again = timed_generate(llm, SHARE_PROMPTS[0], salt="another-tenant")
            assert again.num_cached_tokens == full_hit(len(SHARE_PROMPTS[0])) and again.tokens == refs[0]
            assert totals(worker)["redis_reads"] == reads + 3 and not totals(worker).get("load_errors")
        print(
            f"\n{topology}: A stored {SHARE_CHUNKS} chunks; B: {reads} chunk reads from Redis, "
            f"hits {[full_hit(len(p)) for p in SHARE_PROMPTS]} tokens"
        )


# ------------------------------------------------------------------------------------------ one server's faults
def test_server_down_at_engine_start(model, reference):
    """No server when the engine starts: it starts (a warning), serves misses; once a server listens on
    the port, the tier connects within retry_s, and requests store and then hit."""
    from kvx.testing.redis_server import RedisServer

    ref_a, ref_a2 = refs_of(reference, [A, A2])
    probe = RedisServer()
    port = probe.port
    probe.cleanup()  # a free port with nothing listening on it
    url = f"redis://127.0.0.1:{port}/0"
    with kvx_warnings() as warned, engine(model, redis_tiers(url)) as llm:
        _, worker = connector_sides(llm)
        text = "\n".join(r.getMessage() for r in warned)
        assert "cannot reach the server" in text and url in text, text
        assert all(t.stats()["nodes_down"] == 1 for t in redis_sides(llm))
        for _ in range(2):
            llm.reset_prefix_cache()
            r = timed_generate(llm, A, limit=NO_WAIT_S)
            assert r.num_cached_tokens == 0 and r.tokens == ref_a
        settle(llm)
        assert totals(worker).get("redis_write_errors", 0) >= 3  # saves refused at once, not waited for
        assert totals(worker).get("redis_writes", 0) == 0
        with RedisServer(port=port) as srv:
            waited = wait_tiers_up(llm)
            print(f"\nserver up: the tier reconnected after {waited * 1e3:.0f} ms (retry_s={RETRY_S})")
            assert waited <= RETRY_S + 5.0
            for prompt, ref in ((A, ref_a), (A2, ref_a2)):
                llm.reset_prefix_cache()
                assert timed_generate(llm, prompt).tokens == ref  # a miss; stored now
            settle(llm)
            assert records_on([srv]) == 3 + 2
            for prompt, ref in ((A, ref_a), (A2, ref_a2)):
                assert_redis_hit(llm, prompt, ref)
            settle(llm)  # before the server stops


def test_server_stopped_mid_load(model, reference, monkeypatch):
    """The server hangs (SIGSTOP) just before the first read of a load: the read fails at its deadline
    (timeout_ms), the chunks are reported as load errors and recomputed, tokens right; once the server
    resumes, the tier comes back and the stored chunks hit again."""
    from kvx.store.errors import ChunkError
    from kvx.store.redis import RedisTier
    from kvx.testing.redis_server import RedisServer

    ref_a = refs_of(reference, [A])
    get = RedisTier.get_into
    lock = threading.Lock()
    reads: list[tuple[float, BaseException | None, bool]] = []  # (seconds, error, this read paused)
    paused: list[bool] = []

    with RedisServer() as srv:

        def get_after_pause(self, key, out):
            with lock:  # the other reader threads wait here until the server is stopped
                first = not paused
                if first:
                    srv.pause()
                    wait_for(
                        lambda: stopped(srv.pid), 10, f"redis-server {srv.pid} to stop after SIGSTOP", interval=0.001
                    )
                    paused.append(True)
            t0, err = time.monotonic(), None
            try:
                return get(self, key, out)
            except BaseException as e:
                err = e
                raise
            finally:
                reads.append((time.monotonic() - t0, err, first))

        try:
            with engine(model, redis_tiers(srv.url, timeout_ms=TIMEOUT_MS)) as llm:
                _, worker = connector_sides(llm)
                store_all(llm, A, ref_a, [srv], 3)
                monkeypatch.setattr(RedisTier, "get_into", get_after_pause)
                llm.reset_prefix_cache()
                t0 = time.monotonic()
                r = timed_generate(llm, A)
                took = time.monotonic() - t0
                assert r.tokens == ref_a
                monkeypatch.setattr(RedisTier, "get_into", get)
                assert reads, "no read from Redis: the load did not come from the stopped server"
                first = [(s, e) for s, e, f in reads if f]
                assert len(first) == 1
                failed_after, err = first[0]
                print(
                    f"\nSIGSTOP mid-load: the read failed after {failed_after * 1e3:.0f} ms "
                    f"(timeout_ms={TIMEOUT_MS}); other reads {[round(s * 1e3) for s, _, f in reads if not f]} ms; "
                    f"request {took:.2f} s; {type(err).__name__}: {err}"
                )
                assert isinstance(err, ChunkError) and f"did not answer within {TIMEOUT_MS} ms" in str(err)
                assert TIMEOUT_MS / 1e3 - 0.05 <= failed_after <= TIMEOUT_MS / 1e3 + 1.0
                assert all(e is not None for _, e, _ in reads)  # nothing read from a stopped server
                assert totals(worker).get("load_errors", 0) >= 1
                settle(llm)  # the saves of the recomputed chunks fail
                srv.resume()
                wait_tiers_up(llm)
                assert_redis_hit(llm, A, ref_a)
        finally:
            srv.resume()


def test_server_killed_and_restarted_between_requests(model, reference):
    """SIGKILL between requests: the next requests miss (lookups and saves fail, at once), tokens right;
    the server restarts on the same port, empty: the tier reconnects, requests store and hit again."""
    from kvx.testing.redis_server import RedisServer

    ref_a, ref_a2 = refs_of(reference, [A, A2])
    with RedisServer() as srv, engine(model, redis_tiers(srv.url)) as llm:
        sched_tier, _ = redis_sides(llm)
        _, worker = connector_sides(llm)
        assert timed_generate(llm, A).tokens == ref_a
        settle(llm)
        assert records_on([srv]) == 3
        srv.kill()
        for prompt, ref in ((A, ref_a), (A2, ref_a2)):
            llm.reset_prefix_cache()
            r = timed_generate(llm, prompt, limit=NO_WAIT_S)
            assert r.num_cached_tokens == 0 and r.tokens == ref
        settle(llm)
        assert totals(worker).get("redis_write_errors", 0) >= 1
        assert sched_tier.stats()["nodes_down"] == 1  # the lookup found it gone
        srv.restart()  # same port, data lost
        wait_tiers_up(llm)
        assert sched_tier.stats()["reconnects"] >= 1
        writes = totals(worker).get("redis_writes", 0)
        for prompt, ref in ((A, ref_a), (A2, ref_a2)):
            llm.reset_prefix_cache()
            r = timed_generate(llm, prompt)
            assert r.num_cached_tokens == 0 and r.tokens == ref  # the restart lost A's chunks
        settle(llm)
        assert totals(worker)["redis_writes"] == writes + 3 + 2 and records_on([srv]) == 3 + 2
        for prompt, ref in ((A, ref_a), (A2, ref_a2)):
            assert_redis_hit(llm, prompt, ref)


# ------------------------------------------------------------------------------------------ memory
def flatten_kept_log_records() -> None:
    """pytest keeps every log record of a test, with its args: a logged exception keeps its traceback's
    frames alive, and a failed read's frame its chunk buffer. Reduce the kept records to their text."""
    for handler in logging.getLogger().handlers:
        for record in getattr(handler, "records", ()):
            record.msg, record.args, record.exc_info = record.getMessage(), None, None


def loose_chunk_buffers(worker) -> list:
    """Chunk-sized tensors alive in this process other than the worker's write buffers: the buffers
    that Redis reads without a CPU slot allocate (each copy thread keeps its last job's, so a few), and
    any a test before this one left."""
    import gc

    import torch

    flatten_kept_log_records()
    shape, staging = tuple(worker.chunk_shape(CHUNK)), {id(t) for t in worker.saves.buffers.buffers}
    gc.collect()
    return [
        o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape and id(o) not in staging
    ]


def holders(objs) -> dict[str, int]:
    """What refers to each of ``objs`` (the first three referrers up the chain): a failure's clue."""
    import gc
    import types
    from collections import Counter

    out, mine = Counter(), {id(objs)}
    for o in objs:
        chain = []
        for _ in range(3):
            refs = gc.get_referrers(o)
            mine.add(id(refs))
            refs = [r for r in refs if id(r) not in mine]
            mine.add(id(refs))
            if not refs:
                break
            o = refs[0]
            chain.append(
                f"{o.f_code.co_name}:{o.f_lineno}"
                if isinstance(o, types.FrameType)
                else getattr(o, "__qualname__", type(o).__name__)
            )
        out[" <- ".join(chain)] += 1
    return dict(out)


def assert_worker_bounded(llm, loose_before: int = 0) -> dict[str, int]:
    """After settle: nothing of the worker's or the tiers' bookkeeping grows with the requests served
    (``loose_before``: chunk buffers alive before the engine served anything)."""
    from kvx.store import redis as redis_mod

    settle(llm)
    sched, worker = connector_sides(llm)
    tiers = redis_sides(llm)
    loose = loose_chunk_buffers(worker)
    state = {
        "worker_busy": int(not worker.idle()),
        "staging_out": len(worker.saves.buffers.buffers) - len(worker.saves.buffers._free),
        "inflight": len(sched.ledger.open_transfers()),
        "trackers": len(sched.trackers),
        "lookups": max(len(t._lookups) for t in tiers),
        "idle_conns": max(len(n._idle) for t in tiers for n in t._nodes.values()),
        "loose_chunks": len(loose) - loose_before,
    }
    assert state["worker_busy"] == state["staging_out"] == 0, state
    assert state["inflight"] == 0 and state["trackers"] == 0, state
    assert state["lookups"] <= redis_mod.LOOKUP_KEEP, state
    assert state["idle_conns"] <= tiers[1].config.connections, state
    assert state["loose_chunks"] <= LOOSE_CHUNKS_MAX, (state, holders(loose))
    return state


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def test_maxmemory_noeviction_then_allkeys_lru_soak(model, reference):
    """Noeviction: a server with room for ~4 of 9 chunks refuses the others (OOM, counted as redis_full,
    no part left behind), the requests go on with right tokens, and what fits hits. Then the same server
    as an allkeys-lru cache of 8 MiB (chunks in 128 KiB parts, so evictions tear chunks): a soak of
    requests over 26 distinct chunks, every result compared with the reference, hits read from Redis,
    and the worker's and the tier's bookkeeping bounded after every settle."""
    from kvx.testing.redis_server import RedisServer

    refs = refs_of(reference, FULL_PROMPTS)
    soak_refs = refs_of(reference, SOAK_PROMPTS)
    with (
        RedisServer(maxmemory=FULL_MAXMEMORY, policy="noeviction") as srv,
        engine(model, redis_tiers(srv.url, max_value_size="128KiB")) as llm,
    ):
        sched, worker = connector_sides(llm)
        loose_before = len(loose_chunk_buffers(worker))
        t0 = time.monotonic()
        for prompt, ref in zip(FULL_PROMPTS, refs):
            assert timed_generate(llm, prompt).tokens == ref
        settle(llm)
        took = time.monotonic() - t0
        stats = totals(worker)
        stored = records_on([srv])
        with srv.client() as c:
            keys = set(c.scan_iter(match="kvx:1:*"))
            # chunks stored, from each prompt's first on (the two writer threads race for the last bytes: which
            # chunks fit varies from run to run)
            leads = []
            for prompt in FULL_PROMPTS:
                present = [redis_key(sched, prompt, i).encode() in keys for i in range(len(prompt) // CHUNK)]
                leads.append(present.index(False) if False in present else len(present))
        print(
            f"\nnoeviction, maxmemory {FULL_MAXMEMORY}: {stored} of 9 chunks stored (leading chunks per prompt "
            f"{leads}), redis_full {stats.get('redis_full', 0)}, redis_write_errors "
            f"{stats.get('redis_write_errors', 0)}; 3 requests in {took:.1f} s"
        )
        # a chunk is stored whole once its parts are (redis_writes) and then its record: a record refused for
        # memory leaves a chunk written but not stored
        assert stats.get("redis_full", 0) >= 1 and stored <= stats.get("redis_writes", 0)
        assert 0 < stored < 9
        # the refused chunks' parts were taken back
        orphans = [k for k in keys if not k.endswith(b"}") and k[: k.index(b"}") + 1] not in keys]
        assert not orphans, f"parts of refused chunks left behind: {orphans[:5]}"
        for prompt, ref, lead in zip(FULL_PROMPTS, refs, leads):  # what fits is served, the rest computed
            assert_redis_hit(llm, prompt, ref, min(lead * CHUNK, full_hit(len(prompt))))
        assert_worker_bounded(llm, loose_before)

        with srv.client() as c:
            c.flushall()
        srv.config_set("maxmemory", SOAK_MAXMEMORY)
        srv.config_set("maxmemory-policy", "allkeys-lru")
        rng = random.Random(23)
        reads0, served, wrong, hits = totals(worker).get("redis_reads", 0), 0, [], 0
        states = []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=SOAK_MAX_TOKENS)
        t0, rss0 = time.monotonic(), rss_mib()
        while served < SOAK_REQUESTS:
            llm.reset_prefix_cache()  # vLLM forgets: the tokens come from Redis or compute
            batch = rng.sample(range(len(SOAK_PROMPTS)), rng.choice((1, 1, 2, 3)))
            outs = llm.generate([TokensPrompt(prompt_token_ids=SOAK_PROMPTS[i]) for i in batch], sp, use_tqdm=False)
            H.drain(llm)
            for i, out in zip(batch, outs):
                served += 1
                hits += int(out.num_cached_tokens or 0) > 0
                if list(out.outputs[0].token_ids) != soak_refs[i][:SOAK_MAX_TOKENS]:
                    wrong.append((served, i, out.num_cached_tokens))
            if served % 10 < len(batch):
                states.append(assert_worker_bounded(llm, loose_before))
        took = time.monotonic() - t0
        stats = totals(worker)
        with srv.client() as c:
            evicted = c.info("stats")["evicted_keys"]
            used = c.info("memory")["used_memory"]
        reads = stats.get("redis_reads", 0) - reads0
        tier = worker.tiers["redis"].stats()
        print(
            f"allkeys-lru soak ({SOAK_MAXMEMORY}): {served} requests in {took:.1f} s, {len(wrong)} wrong, {hits} "
            f"with hits, {reads} chunk reads from Redis, {stats.get('load_errors', 0)} failed chunk loads (tier: "
            f"{tier['misses']} evicted after the lookup, {tier['errors']} torn or failed, {tier['dropped']} "
            f"dropped), {stats.get('redis_full', 0)} puts refused, {evicted} keys evicted, used_memory "
            f"{used / 2**20:.1f} MiB; RSS {rss0:.0f} -> {rss_mib():.0f} MiB; bookkeeping after settles {states[-1]}, "
            f"at most {max(st['loose_chunks'] for st in states)} loose chunk buffers"
        )
        assert not wrong, f"{len(wrong)} of {served} requests got wrong tokens: {wrong[:10]}"
        assert hits > 0 and reads > 0 and evicted > 0 and len(states) >= 2
        assert_worker_bounded(llm, loose_before)


# ------------------------------------------------------------------------------------------ cluster
def test_cluster_node_killed_while_serving(model, reference):
    """A node of a 3-node cluster is killed: requests go on with right tokens (its chunks miss, the other
    nodes serve until the cluster declares the failure, then every node refuses), none hangs. Restarted,
    the node rejoins and the tier stores and serves chunks again."""
    from kvx.testing.redis_server import RedisClusterServers

    refs = refs_of(reference, CLUSTER_PROMPTS)
    with RedisClusterServers(3) as cl, engine(model, redis_tiers(cl.url, cluster=True)) as llm:
        sched, worker = connector_sides(llm)
        for prompt, ref in zip(CLUSTER_PROMPTS, refs):
            assert timed_generate(llm, prompt).tokens == ref
        settle(llm)
        assert records_on(cl.nodes) == 9
        victim = cl.node_of(redis_key(sched, CLUSTER_PROMPTS[0], 0))
        victim.kill()
        t_kill = time.monotonic()
        rounds = []
        for _ in range(3):  # right after the kill, and after the cluster noticed (~2-4 s)
            t0 = time.monotonic()
            cached = []
            for prompt, ref in zip(CLUSTER_PROMPTS, refs):
                llm.reset_prefix_cache()
                r = timed_generate(llm, prompt, limit=NO_WAIT_S)
                assert r.tokens == ref
                cached.append(r.num_cached_tokens)
            rounds.append((round(t0 - t_kill, 1), round(time.monotonic() - t0, 1), cached))
            assert cached[0] == 0  # its first chunk lived on the killed node
            if time.monotonic() - t_kill < 4.5:
                time.sleep(max(0.0, 4.5 - (time.monotonic() - t_kill)))
        settle(llm)
        print(
            f"\ncluster node killed: rounds (s after the kill, s taken, cached tokens) {rounds}; "
            f"worker {dict((k, v) for k, v in totals(worker).items() if k.startswith(('redis', 'load_err')))}"
        )
        victim.restart()
        cl.wait_ok()
        wait_tiers_up(llm)
        tries, last = 0, None

        def hit_again() -> bool:  # the tier's slot map and the nodes' state settle after the rejoin
            nonlocal tries, last
            serve_again(llm, CLUSTER_PROMPTS[0], refs[0])  # stores the chunks the kill lost
            settle(llm)
            r, reads, failed = serve_again(llm, CLUSTER_PROMPTS[0], refs[0])
            tries, last = tries + 1, (r.num_cached_tokens, reads, failed)
            return r.num_cached_tokens == full_hit(len(CLUSTER_PROMPTS[0])) and reads == 3 and not failed

        wait_for(
            hit_again, 30, lambda: f"a full hit after the rejoin (cached tokens, reads, failed): {last}", interval=0.5
        )
        print(f"rejoined: a full hit from Redis after {tries} tries")
