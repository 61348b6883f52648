"""RedisTier on a redis cluster: lookups spread over every node, a node killed and restarted, MOVED after and ASK
during a real slot migration, and kvx's slot of a key agreeing with redis-py's. The module-scoped 3-node
``redis_cluster`` (conftest.py) is shared by the tests here; tests must leave it serving."""

from __future__ import annotations

import time

import pytest
import torch

from kvx.store.errors import ChunkError, StoreUnavailableError
from kvx.testing.redis_server import RedisClusterServers
from tests.helpers import assert_same_bytes, need_redis, wait_for
from tests.store.conftest import SLACK_S, new_key, poisoned, random_chunk, shape_for


def start_cluster(nodes: int = 3) -> RedisClusterServers:
    need_redis()
    return RedisClusterServers(nodes)


def test_contains_many_cluster_spread(redis_cluster, open_tier):
    tier = open_tier(redis_cluster.url, cluster=True, lookup_wait_ms=1000)
    keys = [new_key() for _ in range(60)]
    x = random_chunk((16,), torch.uint8, 11)
    for k in keys[::2]:
        assert tier.put(k, x)
    ports = {redis_cluster.node_of(f"kvx:1:{{{k}}}").port for k in keys[::2]}
    assert len(ports) == 3  # the stored chunks live on every node
    assert tier.contains_many(keys) == [i % 2 == 0 for i in range(60)]


def test_cluster_node_killed(open_tier):
    with start_cluster() as cl:
        tier = open_tier(cl.url, cluster=True, timeout_ms=400, retry_s=0.2, lookup_wait_ms=1000)
        x = random_chunk(shape_for("multi", torch.uint8, new_key()), torch.uint8, 15)
        keys = [new_key() for _ in range(30)]
        for k in keys:
            assert tier.put(k, x)
        victim = cl.node_of(f"kvx:1:{{{keys[0]}}}")
        on_victim = [cl.node_of(f"kvx:1:{{{k}}}") is victim for k in keys]
        victim.kill()
        t0 = time.monotonic()
        for k, dead in zip(keys, on_victim):
            if dead:
                with pytest.raises(ChunkError):
                    tier.get_into(k, poisoned(x))
            else:
                out = poisoned(x)
                try:  # the other nodes answer until the cluster declares FAIL
                    tier.get_into(k, out)
                    assert_same_bytes(out, x)
                except ChunkError:
                    pass
        took = time.monotonic() - t0
        answer = tier.contains_many(keys)
        assert answer is not None and not any(a for a, dead in zip(answer, on_victim) if dead)
        print(f"\ncluster node killed: 30 gets in {1e3 * took:.0f} ms")
        assert took < 0.4 + SLACK_S
        victim.restart()
        cl.wait_ok()
        k = next(k for k, dead in zip(keys, on_victim) if dead)
        wait_for(lambda: _put_ok(tier, k, x), 10, "the restarted node to serve again")
        out = poisoned(x)
        tier.get_into(k, out)
        assert_same_bytes(out, x)


def _put_ok(tier, key, x) -> bool:
    try:
        return tier.put(key, x)
    except StoreUnavailableError:
        return False


def _node_id(server) -> str:
    return server.client().execute_command("CLUSTER", "MYID").decode()


def _migrate(cl, slot: int, src, dst, finish: bool = True, keys: list[bytes] | None = None) -> None:
    """Move ``slot`` from ``src`` to ``dst`` as redis-cli --cluster reshard does (IMPORTING / MIGRATING,
    MIGRATE of its keys, SETSLOT NODE everywhere); ``finish=False`` stops mid-migration."""
    sc, dc = src.client(), dst.client()
    dc.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
    sc.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst))
    if keys is None:
        keys = sc.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        sc.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
    if finish:
        for n in cl.nodes:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(dst))


@pytest.mark.parametrize("size", ["odd", "multi"])
def test_cluster_moved_after_a_slot_migration(size, redis_cluster, open_tier):
    from redis.crc import key_slot

    tier = open_tier(redis_cluster.url, cluster=True)
    key = new_key()
    x = random_chunk(shape_for(size, torch.float16, key), torch.float16, 16)
    assert tier.put(key, x)
    ck = f"kvx:1:{{{key}}}"
    src = redis_cluster.node_of(ck)
    dst = next(n for n in redis_cluster.nodes if n is not src)
    _migrate(redis_cluster, key_slot(ck.encode()), src, dst)  # the tier's slot map is now stale
    assert redis_cluster.node_of(ck) is dst
    out = poisoned(x)
    tier.get_into(key, out)  # MOVED -> the new node, once
    assert_same_bytes(out, x)
    assert tier.stats()["redirects"] == 1
    assert tier.contains_many([key]) == [True]
    tier.get_into(key, poisoned(x))  # the slot map was updated: no second redirection
    assert tier.stats()["redirects"] == 1


def test_cluster_ask_during_a_slot_migration(redis_cluster, open_tier):
    from redis.crc import key_slot

    tier = open_tier(redis_cluster.url, cluster=True, lookup_wait_ms=1000)
    key = new_key()
    x = random_chunk((500,), torch.float32, 17)
    assert tier.put(key, x)
    ck = f"kvx:1:{{{key}}}"
    slot = key_slot(ck.encode())
    src = redis_cluster.node_of(ck)
    dst = next(n for n in redis_cluster.nodes if n is not src)
    _migrate(redis_cluster, slot, src, dst, finish=False)  # the key moved; the slot is still src's
    try:
        out = poisoned(x)
        tier.get_into(key, out)  # src answers ASK -> ASKING + GET on dst
        assert_same_bytes(out, x)
        assert tier.contains_many([key]) == [True]
        assert tier.stats()["redirects"] >= 2
    finally:
        for n in redis_cluster.nodes:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(dst))
    tier.get_into(key, poisoned(x))


def test_cluster_slots_are_the_ones_redis_computes():
    """kvx's shortcut for a key's cluster slot agrees with redis-py's (and so with the servers)."""
    from redis.crc import key_slot

    from kvx.store.redis import cluster_slot, redis_chunk_key, redis_part_key

    for i in range(500):
        ck = redis_chunk_key(f"{i:08x}{'ab' * 8}")
        assert cluster_slot(ck) == key_slot(ck.encode()) == key_slot(redis_part_key(ck, "0a1b2c", i).encode())
