"""RedisTier round trips against real redis-server processes (no mocks): bit-exact over TCP, a unix socket and a
3-node cluster (single values, values exactly at the part size, multi-part chunks, every dtype), the value layout
(one key, or parts under a manifest), NX semantics of a put, scripts flushed on the server, TTLs, events and
deletes, closing, and concurrent gets and puts."""

from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch

from kvx.store import codec
from kvx.store.errors import ChunkError, StoreClosedError
from kvx.store.tier import REMOVED, STORED
from tests.helpers import assert_same_bytes
from tests.store.conftest import MVS, new_key, poisoned, random_chunk, shape_for, works
from tests.store.redis_helpers import n_parts, part_keys

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


SIZES = ["odd", "below", "equal", "above", "multi", "5d"]


TRANSPORTS = ["tcp", "unix", "cluster"]


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
    """A chunk whose encoding fits a size class of Redis's allocator is one key (its header rides along); one of
    max_value_size bytes, whose header would take the value past its class (64 KiB + ~300 B: an 80 KiB
    allocation), is a manifest and parts: 64 KiB - 12 bytes (a full 64 KiB class), then the rest (issue 46)."""
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    k1, k2 = new_key(), new_key()
    assert tier.put(k1, random_chunk((MVS - 1024,), torch.uint8, 1))
    assert MVS - 1024 < c.strlen(f"kvx:1:{{{k1}}}") <= MVS - 12 and part_keys(c, k1) == []
    assert tier.put(k2, random_chunk((MVS,), torch.uint8, 2))
    manifest = c.get(f"kvx:1:{{{k2}}}")
    assert manifest.startswith(b"kvxparts:1:") and len(manifest) < 128
    nonce = manifest.split(b":")[2].decode()
    sizes = [c.strlen(f"kvx:1:{{{k2}}}:{nonce}:{i}") for i in range(len(part_keys(c, k2)))]
    assert len(sizes) == 2 and sizes[0] == MVS - 12 and 0 < sizes[1] < 1024  # the second: the header's bytes
    assert all(c.pttl(p) == -1 for p in part_keys(c, k2))  # published: persistent, like the chunk
    with pytest.raises(ChunkError, match="kvx header"):
        codec.header_length(manifest)  # a manifest never reads as a codec header


def test_large_chunk_default_part_size(redis_server, open_tier):
    """A 9 MiB chunk with the default 4 MiB parts over the unix socket: 3 MiB - 12 bytes each (a full 3 MiB class;
    3 of 4 MiB - 12 would leave 1 MiB + ~300 B for a 1.25 MiB allocation), the last one 1 MiB + the header."""
    tier = open_tier(redis_server.unix_url, max_value_size="4MiB")
    x = random_chunk((9 << 20,), torch.uint8, 3)
    key = new_key()
    assert tier.put(key, x)
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    c = redis_server.client()
    assert len(part_keys(c, key)) == 4
    assert sorted(c.strlen(k) for k in part_keys(c, key))[1:] == [(3 << 20) - 12] * 3


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
