"""RedisTier against a server's limits: out of memory under noeviction (a failed save that leaves nothing),
eviction under allkeys-lru (never wrong bytes), and a value over the server's proto-max-bulk-len (refused by
name; the tier lowers its part size, with or without CONFIG)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvx.store.errors import ChunkError, StoreFullError
from kvx.store.resp import RespConnection, ValueTooLarge
from tests.helpers import assert_same_bytes
from tests.store.conftest import new_key, poisoned, random_chunk, works
from tests.store.redis_helpers import part_keys, start_server


# ------------------------------------------------------------------------------------------ memory
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
