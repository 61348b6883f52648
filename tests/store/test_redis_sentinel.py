"""RedisTier through Redis Sentinel against real processes (no mocks): a master, one replica and three
sentinels (kvx.testing.redis_server.RedisSentinelServers; failures detected after 500 ms). Round trips, a
SIGKILLed master replaced by its replica (replicated chunks still served, new puts on the new master,
nothing waits on the dead one), a master demoted to a replica under open connections (-READONLY: no
write lands on a replica), sentinels all down at open, the sentinels' own password, and config errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from kvx.store.errors import ChunkError, StoreUnavailableError
from kvx.store.redis import RedisTier, RedisTierConfig, sentinel_url
from kvx.store.tier import TierContext
from kvx.testing.redis_server import RedisSentinelServers, RedisServer
from tests.helpers import assert_same_bytes, need_redis, wait_for
from tests.store.conftest import (
    FP,
    MVS,
    SLACK_S,
    assert_fails_at_once,
    commands,
    new_key,
    poisoned,
    random_chunk,
    shape_for,
    works,
)

PASSWORD, SENTINEL_PASSWORD = "data-pw", "sentinel-pw"
FAILOVER_S = 15.0  # a failover takes 1-3 s here (down-after 500 ms): generous bound
FAST = dict(timeout_ms=500, retry_s=0.1)


def deployment(**kwargs) -> RedisSentinelServers:
    need_redis()
    return RedisSentinelServers(**kwargs)


@pytest.fixture(scope="module")
def sentinels():
    """One deployment with passwords on the data servers and on the sentinels, shared by the module's
    tests that leave its master alone (killing it is done on a deployment of one's own)."""
    with deployment(password=PASSWORD, sentinel_password=SENTINEL_PASSWORD) as d:
        yield d


def stored_on(server: RedisServer, key: str) -> bool:
    with server.client() as c:
        return bool(c.exists(f"kvx:1:{{{key}}}"))


def timed(fn, *args):
    """(fn's exception or result, seconds it took)."""
    t0 = time.monotonic()
    try:
        r = fn(*args)
    except (ChunkError, StoreUnavailableError) as e:
        r = e
    return r, time.monotonic() - t0


# ------------------------------------------------------------------------------------------ serving
def test_round_trip_through_sentinel(sentinels, open_tier):
    tier = open_tier(sentinels.url, sentinel_password=SENTINEL_PASSWORD)
    master = sentinels.master()
    keys, chunks = [], []
    for i, size in enumerate(["odd", "multi"]):  # one value, and parts published by the script
        k = new_key()
        x = random_chunk(shape_for(size, torch.bfloat16, k), torch.bfloat16, 100 + i)
        assert tier.put(k, x) is True
        assert tier.put(k, x) is False
        keys.append(k)
        chunks.append(x)
    for k, x in zip(keys, chunks):
        out = poisoned(x)
        tier.get_into(k, out)
        assert_same_bytes(out, x)
        assert stored_on(master, k)
    missing = new_key()
    assert tier.contains_many(keys + [missing]) == [True, True, False]
    with pytest.raises(ChunkError, match="not in redis"):
        tier.get_into(missing, torch.empty(4))
    assert tier.usage() > 0
    st = tier.stats()
    assert st["failovers"] == 0 and st["nodes_down"] == 0 and st["puts"] == 2 and st["gets"] == 2
    assert PASSWORD not in repr(tier) and PASSWORD not in tier.url


def test_sentinels_password_missing_or_wrong_is_down_and_warned(caplog, sentinels, open_tier):
    caplog.set_level(logging.WARNING, logger="kvx")
    for pw in (None, "wrong"):
        caplog.clear()
        tier = open_tier(sentinels.url, sentinel_password=pw, **FAST)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "cannot reach" in text and "no sentinel names a master" in text, text
        assert (pw or SENTINEL_PASSWORD) not in text and PASSWORD not in text
        assert tier.contains_many([new_key()]) == [False]
        with pytest.raises(StoreUnavailableError, match="no master known"):
            tier.put(new_key(), torch.zeros(4))
        assert tier.stats()["nodes_down"] == 1


def test_sentinels_down_at_open_then_up(caplog, sentinels, open_tier):
    """As a standalone server down at start: warn, answer misses at once, and connect once they answer."""
    for s in sentinels.sentinels:
        s.stop()
    try:
        caplog.set_level(logging.WARNING, logger="kvx")
        t0 = time.monotonic()
        tier = open_tier(sentinels.url, sentinel_password=SENTINEL_PASSWORD, **FAST)
        assert time.monotonic() - t0 < 1.0 + SLACK_S  # refused: no timeout waited
        assert any("cannot reach" in r.getMessage() for r in caplog.records)
        assert_fails_at_once(tier, 0.1 + SLACK_S)
        assert tier.stats()["nodes_down"] == 1
    finally:
        for s in sentinels.sentinels:
            s.start()
    wait_for(lambda: works(tier), 10, "the tier to find the master once the sentinels answer")
    assert tier.stats()["failovers"] == 0 and tier.stats()["nodes_down"] == 0


# ------------------------------------------------------------------------------------------ failover
def test_master_killed_failover_serves_replicated_chunks(caplog, monkeypatch):
    """SIGKILL the master: meanwhile every call fails at once (no hang); after the failover the tier
    serves the chunks that reached the replica and stores new ones on the new master; the old master,
    back before the sentinels make it a replica, takes nothing."""
    caplog.set_level(logging.WARNING, logger="kvx")
    with deployment() as d:
        tier = RedisTier.open(
            RedisTierConfig(type="redis", url=d.url, max_value_size=MVS, lookup_wait_ms=1000, **FAST),
            TierContext(fingerprint=FP),
        )
        try:
            old = d.master()
            saved = {}
            for i, size in enumerate(["odd", "multi"]):
                k = new_key()
                saved[k] = random_chunk(shape_for(size, torch.float16, k), torch.float16, 200 + i)
                assert tier.put(k, saved[k])
            with old.client() as c:
                assert c.wait(1, 1000) == 1  # on the replica before the crash
            old.kill()
            worst, r = 0.0, None

            def served() -> bool:  # every call bounded until it is back
                nonlocal worst, r
                k, x = next(iter(saved.items()))
                r, took = timed(tier.get_into, k, poisoned(x))
                r2, took2 = timed(tier.contains_many, list(saved))
                worst = max(worst, took, took2)
                return r is None and r2 == [True, True]

            wait_for(served, FAILOVER_S, lambda: f"the failover: {r}", interval=0.05)
            assert worst < 0.5 + SLACK_S, worst  # timeout_ms, never longer
            new = d.wait_failover(old)
            for k, x in saved.items():
                out = poisoned(x)
                tier.get_into(k, out)
                assert_same_bytes(out, x)
            k = new_key()
            assert tier.put(k, random_chunk((100,), torch.float32, 3)) and stored_on(new, k)
            st = tier.stats()
            assert st["failovers"] == 1 and st["nodes_down"] == 0
            failover_lines = [r for r in caplog.records if "failover" in r.getMessage()]
            assert len(failover_lines) == 1 and f"was {old.host}:{old.port}" in failover_lines[0].getMessage()
            assert not [r for r in caplog.records if "no sentinel names" in r.getMessage()]  # a failover's course

            # the old master back: empty and a master (the sentinels convert it to a replica only 10-20 s
            # later): the tier keeps to the one the sentinels name
            asked = threading.Event()
            follow = tier._follow_master

            def follow_and_tell():
                follow()
                asked.set()

            old.restart()
            monkeypatch.setattr(tier, "_follow_master", follow_and_tell)
            # the tier asks the sentinels every 5 s while its master is up: once it has (and acted on the answer)
            assert asked.wait(FAILOVER_S), "the tier did not ask the sentinels again"
            k = new_key()
            assert tier.put(k, random_chunk((100,), torch.float32, 4))
            assert stored_on(new, k) and not stored_on(old, k)
            assert tier.stats()["failovers"] == 1
        finally:
            tier.close()


def test_master_demoted_under_open_connections_gets_no_write(open_tier):
    """The master turned into a replica while the tier holds connections to it: the put gets -READONLY
    and fails at once; the node stays down (ROLE says replica) while the sentinels still name it, and
    follows them to the new master after the failover."""
    with deployment() as d:
        with RedisServer() as elsewhere:
            tier = open_tier(d.url, **FAST)
            old = d.master()
            assert works(tier)
            with old.client() as c:  # REPLICAOF keeps normal clients connected
                c.replicaof(elsewhere.host, elsewhere.port)
            k, x = new_key(), random_chunk((1000,), torch.float32, 7)
            r, took = timed(tier.put, k, x)
            assert isinstance(r, StoreUnavailableError) and "replica" in str(r), r
            assert took < 0.5 + SLACK_S
            with old.client() as c:  # several probes (retry_s 0.1): ROLE keeps it out
                roles = commands(c, "role")
                wait_for(lambda: commands(c, "role") >= roles + 2, 10, "two probes of the demoted master")
            assert tier.stats()["nodes_down"] == 1 and tier.stats()["failovers"] == 0
            with pytest.raises(StoreUnavailableError):
                tier.put(k, x)
            with elsewhere.client() as c:
                assert c.dbsize() == 0
            with d.sentinel_client() as s:
                s.execute_command("SENTINEL", "FAILOVER", d.service)
            new = d.wait_failover(old)
            wait_for(lambda: works(tier), FAILOVER_S, "the tier to follow the sentinels to the new master")
            assert tier.put(k, x) and stored_on(new, k)
            assert tier.stats()["failovers"] == 1


# ------------------------------------------------------------------------------------------ config
def test_sentinel_url_parsed():
    spec = sentinel_url("redis+sentinel://user:p%40ss@h1:26380,h2,[::1]:5000/my%20svc/3")
    assert spec.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 5000))
    assert (spec.service, spec.db, spec.username, spec.password) == ("my svc", 3, "user", "p@ss")
    spec = sentinel_url("redis+sentinel://h1/mymaster")
    assert (spec.sentinels, spec.db, spec.password) == ((("h1", 26379),), 0, None)
    cfg = RedisTierConfig(type="redis", url="redis+sentinel://:pw@h1:26379/mymaster/0", sentinel_password="spw")
    assert cfg.sentinel_password == "spw" and not cfg.cluster


BAD_CONFIG = [
    ({"url": "redis+sentinel://h1:26379/mymaster/0", "cluster": True}, "cluster"),
    ({"url": "redis+sentinel:///mymaster/0"}, "url"),
    ({"url": "redis+sentinel://h1:26379,/mymaster"}, "url"),
    ({"url": "redis+sentinel://h1:sentinel/mymaster"}, "url"),
    ({"url": "redis+sentinel://h1:0/mymaster"}, "url"),
    ({"url": "redis+sentinel://[::1/mymaster"}, "url"),
    ({"url": "redis+sentinel://:pw@h1:26379"}, "url"),
    ({"url": "redis+sentinel://h1:26379/mymaster/zero"}, "url"),
    ({"url": "redis+sentinel://h1:26379/mymaster/0?ssl=true"}, "url"),
    ({"url": "redis://h1:6379/0", "sentinel_password": "spw"}, "sentinel_password"),
    ({"url": "redis+sentinel://h1:26379/mymaster", "sentinel_password": ""}, "sentinel_password"),
]


@pytest.mark.parametrize("bad,name", BAD_CONFIG, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_CONFIG)])
def test_bad_sentinel_config_names_the_key(bad, name):
    with pytest.raises(ValidationError, match=name) as e:
        RedisTierConfig.model_validate({"type": "redis", **bad})
    assert f"Value error, {name}:" in str(e.value)
    assert ":pw@" not in str(e.value)
