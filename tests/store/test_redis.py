"""RedisTier against real redis-server processes (no mocks): bit-exact round trips over TCP, a unix socket
and a 3-node cluster (single values, values exactly at the part size, multi-part chunks), NX semantics,
verification (missing, wrong fingerprint / shape / dtype, torn and corrupt parts), batched and
non-blocking lookups, faults (SIGSTOP, SIGKILL and restart, before and in the middle of a transfer, down
at open, wrong password, out of memory under noeviction, eviction under allkeys-lru, a value over the
server's proto-max-bulk-len, a cluster node killed), MOVED / ASK redirections from a real slot migration,
TTLs, events, and config validation."""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

import pytest
import torch
from pydantic import ValidationError

from kvx.store import codec, resp
from kvx.store.errors import ChunkError, StoreClosedError, StoreFullError, StoreUnavailableError
from kvx.store.redis import _SNDBUF_UNIX, RedisTier, RedisTierConfig, _ChunkSink, redact
from kvx.store.resp import ConnectionLost, RespConnection, ValueTooLarge
from kvx.store.tier import REMOVED, STORED, parse_tier_config
from kvx.testing.redis_server import RedisClusterServers, RedisServer
from tests.helpers import assert_same_bytes, need_redis, wait_for
from tests.store.conftest import (
    MVS,
    SLACK_S,
    assert_fails_at_once,
    commands,
    encoded_size,
    new_key,
    poisoned,
    random_chunk,
    shape_for,
    works,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
SIZES = ["odd", "below", "equal", "above", "multi", "5d"]
TRANSPORTS = ["tcp", "unix", "cluster"]


def start_server(**kwargs) -> RedisServer:
    """A RedisServer (skips where redis-server is not installed; fails in CI)."""
    need_redis()
    return RedisServer(**kwargs)


def start_cluster(nodes: int = 3) -> RedisClusterServers:
    need_redis()
    return RedisClusterServers(nodes)


def n_parts(x: torch.Tensor, key: str) -> int:
    """Redis values of a chunk stored with max_value_size=MVS (1: a single value)."""
    total = encoded_size(x.numel(), x.dtype, key)
    return 1 if total <= MVS else -(-total // MVS)


def part_keys(client, key: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"kvx:1:{{{key}}}:*"))


def url_of(transport: str, request) -> str:
    if transport == "cluster":
        return request.getfixturevalue("redis_cluster").url
    server = request.getfixturevalue("redis_server")
    return server.url if transport == "tcp" else server.unix_url


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_round_trip_is_bit_exact(transport, dtype, size, request, open_tier):
    tier = open_tier(url_of(transport, request), cluster=transport == "cluster")
    key = new_key()
    x = random_chunk(shape_for(size, dtype, key), dtype, seed=zlib.crc32(f"{transport}/{dtype}/{size}".encode()))
    assert tier.put(key, x) is True
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert tier.contains_many([key]) == [True]
    st = tier.stats()
    assert (st["gets"], st["puts"], st["get_bytes"], st["errors"]) == (1, 1, x.numel() * x.element_size(), 0)
    assert tier.delete(key) and tier.contains_many([key]) == [False]


def test_value_layout_single_and_parts(redis_server, open_tier):
    """A chunk of max_value_size bytes is one key (its header rides along); one byte more is split into
    parts under a manifest."""
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    k1, k2 = new_key(), new_key()
    assert tier.put(k1, random_chunk((MVS,), torch.uint8, 1))
    assert MVS < c.strlen(f"kvx:1:{{{k1}}}") < MVS + 1024 and part_keys(c, k1) == []
    assert tier.put(k2, random_chunk((MVS + 1,), torch.uint8, 2))
    manifest = c.get(f"kvx:1:{{{k2}}}")
    assert manifest.startswith(b"kvxparts:1:") and len(manifest) < 128
    parts = part_keys(c, k2)
    sizes = sorted(c.strlen(p) for p in parts)
    assert len(sizes) == 2 and sizes[1] - sizes[0] <= 1 and sum(sizes) > MVS + 1  # equal parts, header included
    assert all(c.pttl(p) == -1 for p in parts)  # published: persistent, like the chunk
    with pytest.raises(ChunkError, match="kvx header"):
        codec.header_length(manifest)  # a manifest never reads as a codec header


def test_large_chunk_default_part_size(redis_server, open_tier):
    """A 9 MiB chunk with the default 4 MiB parts (3 parts) over the unix socket."""
    tier = open_tier(redis_server.unix_url, max_value_size="4MiB")
    x = random_chunk((9 << 20,), torch.uint8, 3)
    key = new_key()
    assert tier.put(key, x)
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert len(part_keys(redis_server.client(), key)) == 3


@pytest.mark.parametrize("size", ["odd", "multi"])
def test_put_of_an_existing_key_returns_false(size, redis_server, open_tier):
    tier = open_tier(redis_server.url)
    key = new_key()
    shape = shape_for(size, torch.float16, key)
    x, y = random_chunk(shape, torch.float16, 4), random_chunk(shape, torch.float16, 5)
    assert tier.put(key, x) is True
    assert tier.put(key, y) is False
    other = open_tier(redis_server.url)  # another engine: SET NX / the publish script refuse too
    assert other.put(key, y) is False
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert tier.stats()["puts"] == 1
    n = n_parts(x, key)
    assert len(part_keys(redis_server.client(), key)) == (0 if n == 1 else n)  # the losers' parts are gone


# ------------------------------------------------------------------------------------------ verification
@pytest.mark.parametrize("size", ["odd", "multi"])
def test_get_errors(size, redis_server, open_tier):
    tier = open_tier(redis_server.url)
    key = new_key()
    x = random_chunk(shape_for(size, torch.float32, key), torch.float32, 6)
    assert tier.put(key, x)
    with pytest.raises(ChunkError, match="not in redis"):
        tier.get_into(new_key(), poisoned(x))
    assert tier.stats()["misses"] == 1
    with pytest.raises(ChunkError, match="fingerprint"):
        open_tier(redis_server.url, fingerprint="another-model").get_into(key, poisoned(x))
    with pytest.raises(ChunkError, match="shape"):
        tier.get_into(key, torch.empty(x.numel() + 1, dtype=torch.float32))
    with pytest.raises(ChunkError, match="dtype"):
        tier.get_into(key, torch.empty(x.shape, dtype=torch.int32))
    # a mismatch is not damage: the chunk stays for the readers it fits
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    with pytest.raises(ValueError, match="out: expected a contiguous CPU tensor"):
        tier.get_into(key, torch.empty(2 * x.numel(), dtype=torch.float32)[::2])
    with pytest.raises(ValueError, match="key: expected a lowercase hex"):
        tier.get_into("NOT-HEX", out)


@pytest.mark.parametrize("damage", ["delete_part", "grow_part", "flip_byte", "garbage_value"])
def test_torn_or_corrupt_chunk_is_a_miss_and_dropped(damage, redis_server, open_tier):
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    key = new_key()
    x = random_chunk(shape_for("multi", torch.bfloat16, key), torch.bfloat16, 7)
    assert tier.put(key, x)
    parts = part_keys(c, key)
    assert len(parts) == n_parts(x, key) == 3
    if damage == "delete_part":
        c.delete(parts[1])
    elif damage == "grow_part":
        c.append(parts[1], b"x")
    elif damage == "flip_byte":
        v = c.getrange(parts[2], 10, 10)
        c.setrange(parts[2], 10, bytes([v[0] ^ 0xFF]))
    else:
        c.set(f"kvx:1:{{{key}}}", b"\x00" * 64)
    out = poisoned(x)
    with pytest.raises(ChunkError):
        tier.get_into(key, out)
    assert tier.contains_many([key]) == [False]  # dropped: lookups stop reporting it
    if damage != "garbage_value":
        assert part_keys(c, key) == []
    assert tier.put(key, x) is True  # the recomputed chunk can be stored again
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert tier.stats()["errors"] == 1


def test_single_value_corrupt_byte(redis_server, open_tier):
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    key = new_key()
    x = random_chunk((1000,), torch.float16, 8)
    assert tier.put(key, x)
    ck = f"kvx:1:{{{key}}}"
    v = c.getrange(ck, c.strlen(ck) - 5, c.strlen(ck) - 5)
    c.setrange(ck, c.strlen(ck) - 5, bytes([v[0] ^ 1]))
    with pytest.raises(ChunkError, match="checksum"):
        tier.get_into(key, poisoned(x))
    assert not c.exists(ck)


@pytest.mark.parametrize("size", ["odd", "multi"])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("piece", [4099, None], ids=["odd-pieces", "uncapped"])
def test_payload_received_in_pieces(piece, size, transport, redis_server, open_tier):
    """The payload is checksummed receive by receive, each receive capped at ``piece`` bytes (or not):
    receives that straddle parts and end mid-value are bit-exact, and a flipped byte anywhere fails the
    checksum."""
    tier = open_tier(redis_server.url if transport == "tcp" else redis_server.unix_url)
    tier.piece = piece
    c = redis_server.client()
    key = new_key()
    x = random_chunk(shape_for(size, torch.float16, key), torch.float16, 9)
    assert tier.put(key, x)
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    last = (part_keys(c, key) or [f"kvx:1:{{{key}}}".encode()])[-1]
    at = c.strlen(last) - 3
    c.setrange(last, at, bytes([c.getrange(last, at, at)[0] ^ 0x10]))
    with pytest.raises(ChunkError, match="checksum"):
        tier.get_into(key, poisoned(x))


def test_part_gets_go_out_one_ahead(redis_server):
    """``RespConnection.get_into`` sends the GET of value i+1 once reply i's length line is in, before
    value i's bytes (all at once, redis-server builds every reply before writing the first byte); values
    land whole and in order, and the connection is reusable after. ``ready`` runs once, after the first GET
    is out and before its reply is read (the caller prepares while the server does)."""
    c = redis_server.client()
    values = [bytes([i]) * ((1 << 20) + 3 * i) for i in range(4)]
    for i, v in enumerate(values):
        c.set(f"kvx:part:{i}", v)
    conn = RespConnection("127.0.0.1", redis_server.port, deadline=time.monotonic() + 5)
    log: list[tuple] = []
    send = conn._send
    conn._send = lambda bufs, deadline: (
        log.append(("send", b"".join(bytes(b) for b in bufs).count(b"GET"))),
        send(bufs, deadline),
    )[1]

    class Sink:
        def __init__(self):
            self.got = [bytearray(len(v)) for v in values]
            self.i = self.pos = 0

        def begin(self, i, length):
            assert length == len(values[i])
            log.append(("begin", i))
            self.i, self.pos = i, 0

        def buffer(self):
            return memoryview(self.got[self.i])[self.pos :]

        def advance(self, n):
            if self.pos == 0:
                log.append(("bytes", self.i))
            self.pos += n

    sink = Sink()
    conn.get_into([f"kvx:part:{i}" for i in range(4)], sink, time.monotonic() + 5, ready=lambda: log.append(("ready",)))
    assert [bytes(g) for g in sink.got] == values
    assert log == [
        ("send", 1),
        ("ready",),
        ("begin", 0),
        ("send", 1),
        ("bytes", 0),
        ("begin", 1),
        ("send", 1),
        ("bytes", 1),
        ("begin", 2),
        ("send", 1),
        ("bytes", 2),
        ("begin", 3),
        ("bytes", 3),
    ]
    assert not conn.closed and conn.command("PING", deadline=time.monotonic() + 5) == "PONG"

    def fails():
        raise RuntimeError("the caller's preparation failed")

    with pytest.raises(RuntimeError, match="preparation failed"):
        conn.get_into(["kvx:part:0"], Sink(), time.monotonic() + 5, ready=fails)
    assert conn.closed  # the GET's reply was never read: the connection is not reused


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_data_connections_get_the_transports_send_buffer(transport, redis_server, open_tier):
    """Unix-socket data connections ask for a larger SO_SNDBUF (the kernel doubles it, capped by
    net.core.wmem_max); TCP ones keep the kernel's autotuned one. Chunks put through either read back."""
    unix = transport == "unix"
    tier = open_tier(redis_server.unix_url if unix else redis_server.url)
    assert tier.send_buffer == (_SNDBUF_UNIX if unix else None)
    x = random_chunk(shape_for("multi", torch.bfloat16, "k"), torch.bfloat16, 3)
    key = new_key()
    assert tier.put(key, x)
    conn, _ = tier._node.acquire(time.monotonic() + 5)
    try:
        got = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        tier._node.release(conn)
    if unix:
        with open("/proc/sys/net/core/wmem_max") as f:
            cap = int(f.read())
        assert got == 2 * min(_SNDBUF_UNIX, cap), got
    else:
        fresh = socket.socket()
        try:
            assert got >= fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # not pinned below the default
        finally:
            fresh.close()
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


def test_put_whose_encoding_fails_leaves_the_connection_clean(redis_server, open_tier, monkeypatch):
    """A put encodes the chunk while the server answers its EXISTS: if encoding fails in that window, the
    connection (its reply unread) is closed, not returned to the pool to answer the next command wrongly."""
    tier = open_tier(redis_server.url, connections=1)
    key, other = new_key(), new_key()
    x = random_chunk((3000,), torch.float16, 10)
    real = codec.encode

    def broken(*a, **k):
        raise RuntimeError("encoding failed")

    monkeypatch.setattr(codec, "encode", broken)
    # the pool's own check (unread bytes) depends on the reply having arrived: take it away
    monkeypatch.setattr(RespConnection, "stale", lambda self: self.closed)
    with pytest.raises(RuntimeError, match="encoding failed"):
        tier.put(key, x)
    monkeypatch.setattr(codec, "encode", real)
    assert tier.contains_many([key]) == [False]
    assert tier.put(other, x) is True and tier.put(other, x) is False
    out = poisoned(x)
    tier.get_into(other, out)
    assert_same_bytes(out, x)


# ------------------------------------------------------------------------------------------ lookups
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


def test_contains_many_cluster_spread(redis_cluster, open_tier):
    tier = open_tier(redis_cluster.url, cluster=True, lookup_wait_ms=1000)
    keys = [new_key() for _ in range(60)]
    x = random_chunk((16,), torch.uint8, 11)
    for k in keys[::2]:
        assert tier.put(k, x)
    ports = {redis_cluster.node_of(f"kvx:1:{{{k}}}").port for k in keys[::2]}
    assert len(ports) == 3  # the stored chunks live on every node
    assert tier.contains_many(keys) == [i % 2 == 0 for i in range(60)]


# ------------------------------------------------------------------------------------------ faults
def test_sigstop_mid_get_fails_within_the_deadline(redis_server, open_tier):
    timeout_ms = 300
    tier = open_tier(redis_server.url, timeout_ms=timeout_ms, retry_s=0.2)
    key = new_key()
    x = random_chunk(shape_for("multi", torch.float32, key), torch.float32, 12)
    assert tier.put(key, x)
    redis_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkError, match="did not answer within 300 ms"):
            tier.get_into(key, poisoned(x))
        took = time.monotonic() - t0
        print(f"\nSIGSTOP: get_into failed after {1e3 * took:.0f} ms (timeout_ms={timeout_ms})")
        assert timeout_ms / 1e3 - 0.05 <= took <= timeout_ms / 1e3 + SLACK_S
        # a timeout alone may be this client stalling: the maintenance thread's PING (another timeout_ms)
        # decides that the server is down
        wait_for(lambda: tier.stats()["nodes_down"] == 1, timeout_ms / 1e3 + 2, "the node to be marked down")
        t0 = time.monotonic()  # known down: everything answers at once
        with pytest.raises(ChunkError):
            tier.get_into(key, poisoned(x))
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        assert tier.contains_many([key]) == [False]
        assert time.monotonic() - t0 < 0.1
        assert tier.stats()["timeouts"] == 1
    finally:
        redis_server.resume()
    wait_for(lambda: works(tier), 5, "the tier to be back after SIGCONT")
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_short_deadline_after_long_ones_still_bounds_each_call(transport, redis_server):
    """A connection sets its socket timeout again only when it is more than ``_REARM_S`` off the time
    left. After calls with 30 s deadlines, a receive and a send (a value larger than the socket buffers)
    with a 200 ms deadline on a stopped server still fail as timeouts at about 200 ms, and the connection
    is closed."""
    where = (
        dict(unix_path=redis_server.unix_path)
        if transport == "unix"
        else dict(host="127.0.0.1", port=redis_server.port)
    )
    conns = [RespConnection(**where, deadline=time.monotonic() + 5) for _ in range(2)]
    for conn in conns:
        assert conn.command("PING", deadline=time.monotonic() + 30) == "PONG"
    redis_server.pause()
    try:
        for conn, call in zip(
            conns,
            [lambda c, d: c.command("PING", deadline=d), lambda c, d: c.set_value("kvx:big", [bytes(64 << 20)], [], d)],
        ):
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost) as e:
                call(conn, t0 + 0.2)
            took = time.monotonic() - t0
            assert e.value.timeout, e.value
            assert 0.2 - resp._REARM_S - 0.01 <= took <= 0.2 + SLACK_S, took
            assert conn.closed
    finally:
        redis_server.resume()
        for conn in conns:
            conn.close()


def test_lookup_on_a_stopped_server_never_blocks(redis_server, open_tier):
    """SIGSTOP before a lookup: the caller gets None at once (the lookup thread waits out the deadline),
    then all False once the server is known to be down."""
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2, lookup_wait_ms=5)
    keys = [new_key() for _ in range(3)]
    assert tier.put(keys[0], torch.zeros(4))
    redis_server.pause()
    try:
        t0 = time.monotonic()
        assert tier.contains_many(keys) is None
        assert time.monotonic() - t0 < 0.1
        assert wait_for(lambda: tier.contains_many(keys), 0.3 + SLACK_S + 0.5, "an answer") == [False] * 3
    finally:
        redis_server.resume()
    assert wait_for(lambda: tier.contains_many(keys) == [True, False, False], 5, "the server to be back")


def test_sigstop_mid_put_fails_within_the_deadline(redis_server, open_tier):
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2)
    x = random_chunk((300_000,), torch.uint8, 13)  # 5 parts
    redis_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        took = time.monotonic() - t0
        print(f"\nSIGSTOP: put failed after {1e3 * took:.0f} ms")
        assert took <= 0.3 + SLACK_S
    finally:
        redis_server.resume()
    wait_for(lambda: works(tier), 5, "the tier to be back after SIGCONT")


def test_sigkill_then_restart_reconnects(redis_server, open_tier):
    tier = open_tier(redis_server.url, timeout_ms=500, retry_s=0.1, connections=2)
    key = new_key()
    x = random_chunk(shape_for("multi", torch.float16, key), torch.float16, 14)
    assert tier.put(key, x)
    redis_server.kill()
    t0 = time.monotonic()
    with pytest.raises(ChunkError):
        tier.get_into(key, poisoned(x))
    with pytest.raises(StoreUnavailableError):
        tier.put(key, x)
    assert tier.contains_many([key]) == [False]
    assert time.monotonic() - t0 < 0.5
    redis_server.restart()  # same port, data lost
    wait_for(lambda: works(tier), 5, "the tier to reconnect after the restart")
    with pytest.raises(ChunkError, match="not in redis"):
        tier.get_into(key, poisoned(x))  # the restart lost it: a miss, not an error
    assert tier.put(key, x) is True
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert tier.stats()["reconnects"] >= 1


def test_restart_while_idle_needs_no_downtime(redis_server, open_tier):
    """Idle pooled connections to a restarted server are seen to be closed and replaced, not used."""
    tier = open_tier(redis_server.url, retry_s=60)
    assert works(tier)
    redis_server.restart()
    assert works(tier)  # retry_s=60: had the node been marked down, this would fail


def test_restart_while_idle_tls(tmp_path, open_tier):
    """TLS connections cannot be checked while idle (session tickets make them readable): a dead one is
    found on use and the operation is run again on a fresh connection."""
    cert, key_file, tls_port = _tls_files(tmp_path)
    with start_server(extra_args=_tls_args(tls_port, cert, key_file)) as server:
        tier = open_tier(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}", retry_s=60)
        assert works(tier)
        server.restart()
        assert works(tier)


def test_down_at_open_then_up(caplog, open_tier):
    server = start_server()
    try:
        server.stop()
        caplog.set_level(logging.WARNING, logger="kvx")
        tier = open_tier(server.url, retry_s=0.1, lookup_wait_ms=1000)
        assert any("cannot reach" in r.getMessage() for r in caplog.records)
        assert_fails_at_once(tier, 0.1)
        server.start()
        wait_for(lambda: works(tier), 5, "the tier to connect once the server is up")
    finally:
        server.cleanup()


def test_wrong_password_is_down_with_a_clear_redacted_error(caplog, open_tier):
    with start_server(password="s3cret") as server:
        caplog.set_level(logging.WARNING, logger="kvx")
        bad = server.url.replace("s3cret", "wrong-pw")
        tier = open_tier(bad, retry_s=0.1)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "WRONGPASS" in text and "redis://:***@127.0.0.1" in text and "wrong-pw" not in text
        assert tier.contains_many([new_key()]) == [False]
        with pytest.raises(ChunkError):
            tier.get_into(new_key(), torch.empty(4))
        noauth = open_tier(f"redis://127.0.0.1:{server.port}/0")
        assert noauth.contains_many([new_key()]) == [False]
        assert works(open_tier(server.url))
        assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"


@pytest.mark.parametrize("size", ["odd", "multi"])
def test_noeviction_oom_raises_full_and_leaves_nothing(size, open_tier):
    with start_server(maxmemory="4mb", policy="noeviction") as server:
        c = server.client()
        tier = open_tier(server.url)
        shape = (40_000,) if size == "odd" else (150_000,)  # one value / 3 parts of 64 KiB
        stored, failed = [], None
        for i in range(200):
            k = new_key()
            try:
                assert tier.put(k, random_chunk(shape, torch.uint8, i))
                stored.append(k)
            except StoreFullError:
                failed = k
                break
        assert failed is not None and stored, "the server never ran out of memory"
        assert tier.stats()["full"] == 1
        assert tier.contains_many([failed]) == [False]
        with pytest.raises(ChunkError, match="not in redis"):
            tier.get_into(failed, torch.empty(shape, dtype=torch.uint8))
        assert part_keys(c, failed) == []  # no part of the refused chunk is left
        out = torch.empty(shape, dtype=torch.uint8)
        tier.get_into(stored[0], out)
        assert_same_bytes(out, random_chunk(shape, torch.uint8, 0))
        assert tier.capacity() == 4 << 20 and tier.usage() > 0


def test_allkeys_lru_soak_never_serves_wrong_bytes(open_tier):
    """Many multi-part chunks through 4 MiB of allkeys-lru: the server evicts parts and manifests in any
    order; every get either returns the exact bytes or raises ChunkError."""
    with start_server(maxmemory="4mb", policy="allkeys-lru") as server:
        tier = open_tier(server.url, max_value_size="256KiB")
        shape = (700_000,)  # 3 parts
        keys = [new_key() for _ in range(40)]
        stored = []
        ok = torn = full = 0
        for i, k in enumerate(keys):
            try:
                if tier.put(k, random_chunk(shape, torch.uint8, i)):
                    stored.append((i, k))
            except StoreFullError:
                full += 1
            for j, kk in stored[-6:]:  # read recent and older chunks while writing
                out = poisoned(torch.empty(shape, dtype=torch.uint8))
                try:
                    tier.get_into(kk, out)
                except ChunkError:
                    torn += 1
                    continue
                assert_same_bytes(out, random_chunk(shape, torch.uint8, j), f"chunk {j}")
                ok += 1
        print(f"\nallkeys-lru soak: {len(stored)} stored, {full} puts refused, {ok} exact gets, {torn} misses")
        assert ok > 0 and torn > 0 and len(stored) > 10
        assert server.client().info("stats")["evicted_keys"] > 0


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_server_stops_or_dies_in_the_middle_of_a_transfer(fault, redis_server, open_tier, monkeypatch):
    """The fault strikes once the first payload bytes of a 64 MiB chunk (16 parts) have landed in ``out``,
    the rest still on the server. SIGSTOP: the get fails at its deadline; SIGKILL: at once (the connection
    ends, and the server refuses the retry). Either way a ChunkError, which the connector reports as a load
    error (vLLM recomputes the chunk), and the tier comes back."""
    timeout_ms = 500
    tier = open_tier(redis_server.url, timeout_ms=timeout_ms, retry_s=0.1, max_value_size="4MiB")
    key = new_key()
    x = random_chunk((64 << 20,), torch.uint8, 21)
    assert tier.put(key, x)
    advance = _ChunkSink.advance
    struck: list[int] = []  # payload bytes received when the fault struck

    def advance_then_fault(self, n):
        advance(self, n)
        if self.phase in (_ChunkSink._PAYLOAD, _ChunkSink._DONE) and not struck:
            struck.append(self.pos)
            redis_server.pause() if fault == "sigstop" else redis_server.kill()

    monkeypatch.setattr(_ChunkSink, "advance", advance_then_fault)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkError) as e:
            tier.get_into(key, poisoned(x))
        took = time.monotonic() - t0
        print(
            f"\n{fault} after {struck[0]} of {x.nbytes} payload bytes: get_into failed after "
            f"{1e3 * took:.0f} ms (timeout_ms={timeout_ms}): {e.value}"
        )
        assert 0 < struck[0] < x.nbytes, "the fault did not strike in the middle of the transfer"
        if fault == "sigstop":
            assert f"did not answer within {timeout_ms} ms" in str(e.value)
            assert timeout_ms / 1e3 - 0.05 <= took <= timeout_ms / 1e3 + SLACK_S
            assert tier.stats()["timeouts"] == 1
        else:
            assert took <= SLACK_S
            assert tier.stats()["timeouts"] == 0
    finally:
        redis_server.resume() if fault == "sigstop" else redis_server.restart()
    wait_for(lambda: works(tier), 5, "the tier to be back")
    if fault == "sigstop":  # the server kept the chunk: read whole this time
        out = poisoned(x)
        tier.get_into(key, out)
        assert_same_bytes(out, x)


# ------------------------------------------------------------------------------------------ oversized values
@pytest.mark.parametrize("size", [(1 << 20) + 4096, 64 << 20])
def test_a_value_over_proto_max_bulk_len_is_refused_by_name(size):
    """The server answers the length line of a value over its proto-max-bulk-len with an error and closes
    the connection: a small value is sent whole before that (the error is the reply), a large one's send
    fails (EPIPE / ECONNRESET) and the error is read after it. Both: ValueTooLarge naming the size, the
    connection closed; set_many (parts) the same."""
    with start_server(extra_args=["--proto-max-bulk-len", "1mb"]) as server:
        for call in ("set_value", "set_many"):
            conn = RespConnection("127.0.0.1", server.port, deadline=time.monotonic() + 5)
            value = bytes(size)
            with pytest.raises(ValueTooLarge) as e:
                if call == "set_value":
                    conn.set_value("kvx:big", [value], ["NX"], time.monotonic() + 5)
                else:
                    conn.set_many([("kvx:a", [b"x" * 100]), ("kvx:b", [value])], [], time.monotonic() + 5)
            assert e.value.size == size and f"value of {size} bytes refused" in str(e.value)
            assert "proto-max-bulk-len" in str(e.value) and conn.closed


@pytest.mark.parametrize("config", ["allowed", "disabled"])
def test_chunks_over_the_servers_value_limit_go_in_parts(config, caplog, open_tier):
    """A server that takes smaller values than max_value_size (proto-max-bulk-len 1mb; managed services
    also disable CONFIG): the first put of a larger value is refused, the tier lowers its value size (to
    the limit CONFIG GET reports; without CONFIG by halves, never below 1 MiB) and stores the chunk in parts
    at once. Nothing is marked down, no put fails, every later chunk goes in parts, all read back exact."""
    args = ["--proto-max-bulk-len", "1mb"]
    if config == "disabled":
        args += ["--rename-command", "CONFIG", '""']
    with start_server(extra_args=args) as server:
        caplog.set_level(logging.WARNING, logger="kvx")
        tier = open_tier(server.url, max_value_size="4MiB", retry_s=60)
        chunks = {
            new_key(): random_chunk((n,), torch.uint8, i)
            for i, n in enumerate([1000, 3 << 20, (2 << 20) + 7, 5 << 20, 1 << 20])
        }
        for k, x in chunks.items():
            assert tier.put(k, x) is True
        for k, x in chunks.items():
            out = poisoned(x)
            tier.get_into(k, out)
            assert_same_bytes(out, x)
        st = tier.stats()
        assert (st["nodes_down"], st["errors"], st["puts"]) == (0, 0, len(chunks))
        assert st["refused"] == (1 if config == "allowed" else 2)  # 3 MiB, then 1.5 MiB parts
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "proto-max-bulk-len" in text
        assert ("1048576" in text) if config == "allowed" else ("CONFIG GET not allowed" in text)
        c = server.client()
        assert max(c.strlen(k) for k in c.scan_iter(match="kvx:*")) <= 1 << 20
        assert works(tier)  # retry_s=60: had the node been marked down, this would fail


# ------------------------------------------------------------------------------------------ cluster
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


# ------------------------------------------------------------------------------------------ the rest
def test_scripts_flushed_on_the_server(redis_server, open_tier):
    """NOSCRIPT (SCRIPT FLUSH, or a restart the pool did not notice): the script is sent again."""
    tier = open_tier(redis_server.url)
    redis_server.client().script_flush()
    key = new_key()
    x = random_chunk(shape_for("multi", torch.uint8, key), torch.uint8, 21)
    assert tier.put(key, x)
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    redis_server.client().script_flush()
    assert tier.delete(key)


def _tls_files(tmp_path):
    """(certificate, key, a free port) for a TLS server on 127.0.0.1; skips without openssl."""
    import shutil
    import socket
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key_file),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return cert, key_file, s.getsockname()[1]


def _tls_args(port, cert, key_file) -> list:
    return [
        "--tls-port",
        port,
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key_file,
        "--tls-ca-cert-file",
        cert,
        "--tls-auth-clients",
        "no",
    ]


@pytest.mark.parametrize("verify", ["ca", "none"])
def test_tls(verify, tmp_path, open_tier):
    cert, key_file, tls_port = _tls_files(tmp_path)
    with start_server(password="pw", extra_args=_tls_args(tls_port, cert, key_file)):
        query = f"ssl_ca_certs={cert}" if verify == "ca" else "ssl_cert_reqs=none"
        tier = open_tier(f"rediss://:pw@127.0.0.1:{tls_port}/0?{query}")
        key = new_key()
        x = random_chunk(shape_for("multi", torch.float32, key), torch.float32, 22)
        assert tier.put(key, x) and tier.contains_many([key]) == [True]
        for _ in range(3):  # pooled TLS connections are reused
            out = poisoned(x)
            tier.get_into(key, out)
            assert_same_bytes(out, x)
        assert tier.usage() > 0
    if verify == "ca":  # a certificate nobody vouches for: refused, tier down
        with start_server(extra_args=_tls_args(tls_port, cert, key_file)):
            tier = open_tier(f"rediss://127.0.0.1:{tls_port}/0")
            assert tier.contains_many([new_key()]) == [False]


def test_ttl_applies_to_chunks_and_parts(redis_server, open_tier):
    tier = open_tier(redis_server.url, ttl_s=0.4)
    c = redis_server.client()
    k1, k2 = new_key(), new_key()
    x1 = random_chunk((10,), torch.uint8, 18)
    x2 = random_chunk(shape_for("multi", torch.uint8, k2), torch.uint8, 19)
    assert tier.put(k1, x1) and tier.put(k2, x2)
    for k in (f"kvx:1:{{{k1}}}", f"kvx:1:{{{k2}}}", *part_keys(c, k2)):
        assert 0 < c.pttl(k) <= 400
    time.sleep(0.6)
    assert tier.contains_many([k1, k2]) == [False, False]
    assert part_keys(c, k2) == []


def test_events_and_delete(redis_server, open_tier):
    tier = open_tier(redis_server.url)
    events = []
    tier.subscribe(lambda name, ev, keys: events.append((ev, keys)))
    k1, k2 = new_key(), new_key()
    x2 = random_chunk(shape_for("multi", torch.uint8, k2), torch.uint8, 20)
    assert tier.put(k1, torch.zeros(3)) and tier.put(k2, x2)
    assert not tier.put(k1, torch.zeros(3))
    assert tier.delete(k1) and tier.delete(k2) and not tier.delete(k2)
    assert events == [(STORED, [k1]), (STORED, [k2]), (REMOVED, [k1]), (REMOVED, [k2])]
    assert part_keys(redis_server.client(), k2) == []
    assert tier.contains_many([k1, k2]) == [False, False]


def test_close_is_idempotent_and_final(redis_server, open_tier):
    tier = open_tier(redis_server.url)
    assert works(tier)
    tier.close()
    tier.close()
    assert not tier._maint.is_alive()
    for op in (
        lambda: tier.put(new_key(), torch.zeros(1)),
        lambda: tier.get_into(new_key(), torch.zeros(1)),
        lambda: tier.contains_many([new_key()]),
        lambda: tier.delete(new_key()),
        tier.usage,
    ):
        with pytest.raises(StoreClosedError):
            op()


def test_concurrent_gets_and_puts(redis_server, open_tier):
    tier = open_tier(redis_server.url, connections=2)
    items = [(new_key(), random_chunk((50_000 + i,), torch.uint8, i)) for i in range(24)]
    errors = []

    def work(part):
        try:
            for k, x in part:
                assert tier.put(k, x)
                out = poisoned(x)
                tier.get_into(k, out)
                assert_same_bytes(out, x)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(items[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_config_accepts_sizes_and_registry(redis_server):
    cfg = parse_tier_config({"type": "redis", "url": redis_server.url, "max_value_size": "4MiB"})
    assert isinstance(cfg, RedisTierConfig) and cfg.max_value_size == 4 << 20
    assert RedisTierConfig(type="redis", url="rediss://:pw@h:6380/0?ssl_cert_reqs=none").url.startswith("rediss")


def test_check_config_names_missing_tls_files(tmp_path):
    cfg = RedisTierConfig(type="redis", url=f"rediss://:pw@h:6380/0?ssl_ca_certs={tmp_path}/ca.pem")
    problems = RedisTier.check_config(cfg, "tiers.1", writes=True)
    assert len(problems) == 1 and "tiers.1.url" in problems[0] and "ssl_ca_certs" in problems[0]
    assert "pw@" not in problems[0]
    (tmp_path / "ca.pem").write_text("x")
    assert RedisTier.check_config(cfg, "tiers.1", writes=True) == []
    assert RedisTier.check_config(RedisTierConfig(type="redis", url="redis://h:1/0"), "tiers.1", True) == []


BAD_CONFIG = [
    ({"url": "http://127.0.0.1:6379"}, "url"),
    ({"url": "redis://:pw@"}, "url"),
    ({"url": "unix://"}, "url"),
    ({"url": 6379}, "url"),
    ({"cluster": True, "url": "unix:///tmp/x.sock"}, "cluster"),
    ({"cluster": True, "url": "redis://h:1/3"}, "cluster"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"timeout_ms": True}, "timeout_ms"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"ttl_s": float("nan")}, "ttl_s"),
    ({"connections": 0}, "connections"),
    ({"connections": 1000}, "connections"),
    ({"max_value_size": "1KiB"}, "max_value_size"),
    ({"max_value_size": "1GB"}, "max_value_size"),
    ({"max_value_size": "lots"}, "max_value_size"),
    ({"lookup_wait_ms": -1}, "lookup_wait_ms"),
    ({"retry_s": 0}, "retry_s"),
    ({"pool": 3}, "pool"),
]


@pytest.mark.parametrize("bad,name", BAD_CONFIG, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_CONFIG)])
def test_bad_config_names_the_key(bad, name):
    raw = {"type": "redis", "url": "redis://127.0.0.1:6379/0", **bad}
    with pytest.raises(ValidationError, match=name) as e:
        RedisTierConfig.model_validate(raw)
    assert "pw@" not in str(e.value)


def test_a_stalled_client_does_not_mark_a_live_server_down(redis_server, open_tier, monkeypatch):
    """A put that runs out of time because its own thread was kept off the CPU (writers run at idle
    priority) is a failed put, not a dead server: the maintenance thread's PING answers, the node stays up,
    and loads keep being served."""
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2)
    key = new_key()
    x = random_chunk((1000,), torch.float32, 5)
    assert tier.put(key, x)
    real = resp.RespConnection.set_value

    def stalled(self, *a, **k):
        time.sleep(0.35)  # past the deadline, with the server answering all along
        raise resp.ConnectionLost("no answer in time (SET)", timeout=True)

    monkeypatch.setattr(resp.RespConnection, "set_value", stalled)
    with redis_server.client() as c:
        pings = commands(c, "ping")
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        monkeypatch.setattr(resp.RespConnection, "set_value", real)
        assert tier.stats()["nodes_down"] == 0  # the timed-out put alone marks nothing down
        wait_for(lambda: commands(c, "ping") > pings, 10, "the maintenance thread's PING of the suspect node")
    # the PING answered: the node stays up (one that itself timed out on a loaded machine would mark the node
    # down until the next probe, retry_s later)
    wait_for(lambda: tier.stats()["nodes_down"] == 0, 10, lambda: f"the node to be up: {tier.stats()}")
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


def test_cluster_slots_are_the_ones_redis_computes():
    """kvx's shortcut for a key's cluster slot agrees with redis-py's (and so with the servers)."""
    from redis.crc import key_slot

    from kvx.store.redis import _chunk_key, _part_key, _slot

    for i in range(500):
        ck = _chunk_key(f"{i:08x}{'ab' * 8}")
        assert _slot(ck) == key_slot(ck.encode()) == key_slot(_part_key(ck, "0a1b2c", i).encode())
