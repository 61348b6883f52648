"""RedisTier lookups on a standalone server: batched ``contains_many``, the EXISTS fast path of ``RespConnection``
(suffixes of a sealed tier's rotation, replies across reads, per-key error replies) and non-blocking lookups
(``lookup_wait_ms=0``: None, then the answer). Lookups across a cluster are in test_redis_cluster.py."""

from __future__ import annotations

import time

import torch

from kvx.store.resp import RespConnection
from tests.helpers import wait_for
from tests.store.conftest import new_key, random_chunk


def test_contains_many_batched(redis_server, open_tier):
    tier = open_tier(redis_server.url, lookup_wait_ms=1000)
    keys = [new_key() for _ in range(300)]
    x = random_chunk((16,), torch.uint8, 9)
    for k in keys[::3]:
        assert tier.put(k, x)
    t0 = time.monotonic()
    assert tier.contains_many(keys) == [i % 3 == 0 for i in range(300)]
    print(f"\ncontains_many of 300 keys: {1e3 * (time.monotonic() - t0):.2f} ms")
    assert tier.contains_many([]) == []


def test_exists_each_with_suffixes_asks_one_exists_per_key(redis_server):
    """A sealed tier during a rotation: one ``EXISTS key-new key-old`` per chunk (its names under each secret),
    answered with how many exist; one suffix is one name per key, as without."""
    c = redis_server.client()
    keys = [f"kvx:1:{{{new_key()}}}" for _ in range(3000)]
    for i, k in enumerate(keys):
        for s in ("-new", "-old")[: i % 3]:  # none, -new, or both
            c.set(k + s, b"x")
    conn = RespConnection("127.0.0.1", redis_server.port, deadline=time.monotonic() + 5)
    try:
        before = c.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
        assert conn.exists_each(keys, time.monotonic() + 10, ("-new", "-old")) == [i % 3 for i in range(len(keys))]
        assert c.info("commandstats")["cmdstat_exists"]["calls"] - before == len(keys)
        assert conn.exists_each(keys, time.monotonic() + 10, ("-old",)) == [int(i % 3 == 2) for i in range(len(keys))]
        assert conn.exists_each(keys[:3], time.monotonic() + 10) == [0, 0, 0]  # the names without a suffix
    finally:
        conn.close()


def test_exists_each_parses_replies_across_reads_and_keeps_error_replies_in_place(redis_server):
    """The lookup's EXISTS fast path on a real server: 40000 replies (several reads of the 64 KiB buffer) in
    order, and per-key error replies (an ACL user may not see some keys: -NOPERM) in their places without
    fouling the connection."""
    c = redis_server.client()
    keys = [f"kvx:1:{{{new_key()}}}" for _ in range(40000)]
    pipe = c.pipeline(transaction=False)
    for k in keys[::3]:
        pipe.set(k, b"x")
    pipe.execute()
    conn = RespConnection("127.0.0.1", redis_server.port, deadline=time.monotonic() + 5)
    try:
        assert conn.exists_each(keys, time.monotonic() + 10) == [int(i % 3 == 0) for i in range(len(keys))]
        c.execute_command("ACL", "SETUSER", "lookups", "on", ">pw", "~kvx:1:{a*", "+exists", "+ping")
        limited = RespConnection(
            "127.0.0.1", redis_server.port, username="lookups", password="pw", deadline=time.monotonic() + 5
        )
        try:
            mixed = ["kvx:1:{a1}", "kvx:1:{b1}", "kvx:1:{a2}"]
            c.set("kvx:1:{a2}", b"x")
            got = limited.exists_each(mixed, time.monotonic() + 5)
            assert got[0] == 0 and got[2] == 1
            assert isinstance(got[1], Exception) and "NOPERM" in str(got[1]), got[1]
            assert limited.command("PING", deadline=time.monotonic() + 5) == "PONG"  # the stream is intact
        finally:
            limited.close()
            c.execute_command("ACL", "DELUSER", "lookups")
    finally:
        conn.close()
        c.delete(*keys[::3], "kvx:1:{a2}")


def test_contains_many_none_then_answer(redis_server, open_tier):
    tier = open_tier(redis_server.url, lookup_wait_ms=0)
    keys = [new_key() for _ in range(5)]
    assert tier.put(keys[1], random_chunk((8,), torch.uint8, 10))

    def ask_while_paused():
        # the server is stopped (SIGSTOP) for the call: its answer cannot be there before the call returns,
        # however the threads are scheduled; it is resumed well within timeout_ms (not marked down)
        redis_server.pause()
        try:
            return tier.contains_many(keys)
        finally:
            redis_server.resume()

    assert ask_while_paused() is None  # lookup_wait_ms=0: never blocks the caller
    answer = wait_for(lambda: tier.contains_many(keys), 5, "the lookup's answer")
    assert answer == [False, True, False, False, False]
    assert tier.put(keys[3], random_chunk((8,), torch.uint8, 10))
    assert ask_while_paused() is None  # an answer is served once: a new lookup starts
    assert wait_for(lambda: tier.contains_many(keys), 5, "the new answer") == [False, True, False, True, False]
