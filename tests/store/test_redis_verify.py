"""RedisTier verification on read and the transfer itself: missing chunks, wrong fingerprint / shape / dtype,
torn and corrupt parts (dropped, then stored again), a payload checksummed receive by receive, part GETs sent one
ahead of the replies, the send buffer of data connections, and a put whose encoding fails mid-command."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvx.store import codec
from kvx.store.errors import ChunkError
from kvx.store.redis import SNDBUF_UNIX
from kvx.store.resp import RespConnection
from tests.helpers import assert_same_bytes
from tests.store.conftest import new_key, poisoned, random_chunk, shape_for
from tests.store.redis_helpers import n_parts, part_keys


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
    assert tier.send_buffer == (SNDBUF_UNIX if unix else None)
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
        assert got == 2 * min(SNDBUF_UNIX, cap), got
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
