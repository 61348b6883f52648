"""The tier interface's contract, run against every tier: disk, Redis standalone, Redis Cluster (real
servers, kvx.testing.redis_server), and the parts that apply to the CPU pool's index.

A third-party tier passes this file by adding a factory to TIERS."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from kvx.store import REMOVED, STORED, ChunkError, CPUIndex, DiskTier, Tier, TierContext, tier_class
from kvx.store.errors import StoreClosedError
from kvx.store.redis import RedisTier, RedisTierConfig
from kvx.testing import random_fill_
from tests.helpers import assert_same_bytes, wait_for


def _disk(request, tmp_path, fp):
    return DiskTier.open(DiskTier.config_model(type="disk", path=str(tmp_path / "kv")), TierContext(fp))


def _redis(request, tmp_path, fp, **kw):
    server = request.getfixturevalue("redis_server")
    return RedisTier.open(
        RedisTierConfig(type="redis", url=server.url, max_value_size=256 * 1024, **kw), TierContext(fp)
    )


def _redis_unix(request, tmp_path, fp):
    server = request.getfixturevalue("redis_server")
    return RedisTier.open(
        RedisTierConfig(type="redis", url=server.unix_url, max_value_size=256 * 1024), TierContext(fp)
    )


def _cluster(request, tmp_path, fp):
    cluster = request.getfixturevalue("redis_cluster")
    return RedisTier.open(
        RedisTierConfig(type="redis", url=cluster.url, cluster=True, max_value_size=256 * 1024), TierContext(fp)
    )


def _key_file(tmp_path) -> dict:
    """The ``encryption`` of a sealed tier: one secret file per test (every tier a test opens shares it)."""
    p = tmp_path / "seal.key"
    if not p.exists():
        p.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    return {"key_file": str(p)}


def _disk_sealed(request, tmp_path, fp):
    cfg = DiskTier.config_model(type="disk", path=str(tmp_path / "kv"), encryption=_key_file(tmp_path))
    return DiskTier.open(cfg, TierContext(fp))


def _redis_sealed(request, tmp_path, fp):
    return _redis(request, tmp_path, fp, encryption=_key_file(tmp_path))


TIERS = {
    "disk": _disk,
    "redis": _redis,
    "redis-unix": _redis_unix,
    "redis-cluster": _cluster,
    "disk-sealed": _disk_sealed,
    "redis-sealed": _redis_sealed,
}


@pytest.fixture(params=list(TIERS))
def open_tier(request, tmp_path):
    opened = []

    def open_(fp="fp-contract"):
        t = TIERS[request.param](request, tmp_path, fp)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.close()


def contains(tier: Tier, keys, timeout_s=5.0) -> list[bool]:
    """contains_many, asked again while the tier answers None (not known yet), as vLLM's scheduler does."""

    def answer():  # boxed: the answer to no keys, [], is an answer too
        got = tier.contains_many(keys)
        return None if got is None else [got]

    return wait_for(answer, timeout_s, "an answer of contains_many (it kept answering None)", interval=0.002)[0]


def chunk(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    return random_fill_(torch.empty(shape, dtype=dtype), torch.Generator().manual_seed(seed))


_SALT = [""]


@pytest.fixture(autouse=True)
def _fresh_keys():
    """Keys of each test are its own: the cluster is shared by the whole module."""
    _SALT[0] = uuid.uuid4().hex[:16]


def key_of(i) -> str:
    return f"{_SALT[0]}{i:08x}"


SHAPES = [
    ((2, 2, 16, 2, 8), torch.bfloat16),
    ((3, 1, 7, 1, 5), torch.float32),
    ((2, 2, 64, 4, 64), torch.float16),  # 256 KiB: more than one Redis part
    ((2, 2, 33, 3, 64), torch.float8_e4m3fn),
    ((1, 4, 1000), torch.uint8),
]


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=[f"{d}-{'x'.join(map(str, s))}" for s, d in SHAPES])
def test_put_get_round_trip_is_bit_exact(open_tier, shape, dtype):
    tier = open_tier()
    data = chunk(shape, dtype, seed=1)
    key = key_of(1)
    assert contains(tier, [key]) == [False]
    assert tier.put(key, data) is True
    assert contains(tier, [key]) == [True]
    out = torch.empty(shape, dtype=dtype)
    tier.get_into(key, out)
    assert_same_bytes(out, data)
    assert tier.put(key, chunk(shape, dtype, seed=2)) is False  # never overwritten
    tier.get_into(key, out)
    assert_same_bytes(out, data)


def test_contains_many_keeps_the_order_of_its_keys(open_tier):
    tier = open_tier()
    keys = [key_of(i) for i in range(12)]
    for i in (0, 3, 4, 11):
        tier.put(keys[i], chunk((4, 16), seed=i))
    assert contains(tier, keys) == [i in (0, 3, 4, 11) for i in range(12)]
    assert contains(tier, []) == []


def test_missing_and_mismatched_chunks_are_chunk_errors(open_tier):
    tier = open_tier()
    key = key_of(2)
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ChunkError):
        tier.get_into(key, out)
    tier.put(key, chunk((4, 16), seed=3))
    with pytest.raises(ChunkError, match="shape"):
        tier.get_into(key, torch.empty(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ChunkError, match="dtype"):
        tier.get_into(key, torch.empty(4, 16, dtype=torch.float16))
    other = open_tier(fp="another-model")  # same store, chunks of another meaning
    with pytest.raises(ChunkError, match="fingerprint"):
        other.get_into(key, out)
    tier.get_into(key, out)  # still served to the right reader


def test_delete(open_tier):
    tier = open_tier()
    key = key_of(3)
    tier.put(key, chunk((4, 16)))
    assert tier.delete(key) is True
    assert contains(tier, [key]) == [False]
    with pytest.raises(ChunkError):
        tier.get_into(key, torch.empty(4, 16, dtype=torch.bfloat16))
    assert tier.delete(key) is False
    assert tier.put(key, chunk((4, 16))) is True  # and can be stored again


def test_events_name_the_tier_and_the_keys(open_tier):
    tier = open_tier()
    seen = []
    tier.subscribe(lambda name, event, keys: seen.append((name, event, list(keys))))
    key = key_of(4)
    tier.put(key, chunk((4, 16)))
    tier.put(key, chunk((4, 16)))  # present: no second event
    tier.delete(key)
    assert seen == [(tier.name, STORED, [key]), (tier.name, REMOVED, [key])]


def test_usage_capacity_and_stats(open_tier):
    tier = open_tier()
    before = tier.usage()
    data = chunk((64, 1024), torch.uint8)
    tier.put(key_of(5), data)
    assert tier.usage() >= before + data.numel() // 2  # a server may compress or round; not lose it
    cap = tier.capacity()
    assert cap is None or (isinstance(cap, int) and cap > 0)
    stats = tier.stats()
    assert isinstance(stats, dict) and all(isinstance(v, int) for v in stats.values())


def test_out_must_be_a_contiguous_cpu_tensor(open_tier):
    tier = open_tier()
    key = key_of(6)
    tier.put(key, chunk((4, 16)))
    with pytest.raises(ValueError, match="out"):
        tier.get_into(key, torch.empty(16, 4, dtype=torch.bfloat16).t())


BAD_KEYS = [
    "",
    "0123456",
    "ABCDEF0123456789",
    "0123456789abcdeg",
    "0123456789abcdef\n",
    "01234567/../x",
    12345678,
    None,
    b"0123456789abcdef",
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_are_refused_by_every_operation(open_tier, key):
    tier = open_tier()
    data = chunk((4, 16))
    calls = {
        "put": lambda: tier.put(key, data),
        "get_into": lambda: tier.get_into(key, torch.empty_like(data)),
        "delete": lambda: tier.delete(key),
        "contains_many": lambda: tier.contains_many([key_of(7), key]),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match="^key: expected a lowercase hex string"):
            call()
            pytest.fail(f"{op} took {key!r}")
    assert contains(tier, [key_of(7)]) == [False]


def test_concurrent_puts_and_gets_are_bit_exact(open_tier):
    tier = open_tier()
    n, errors = 24, []
    datas = [chunk((2, 2, 16, 2, 64), seed=100 + i) for i in range(n)]

    def work(lo):
        try:
            for i in range(lo, n, 4):
                tier.put(key_of(100 + i), datas[i])
            for i in range(lo, n, 4):
                out = torch.empty_like(datas[i])
                tier.get_into(key_of(100 + i), out)
                assert_same_bytes(out, datas[i], f"chunk {i}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(lo,)) for lo in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_close_is_idempotent_and_final(open_tier):
    tier = open_tier()
    key = uuid.uuid4().hex
    assert tier.put(key, torch.ones(8))
    tier.close()
    tier.close()
    for op in (lambda: tier.put(uuid.uuid4().hex, torch.ones(8)), lambda: tier.get_into(key, torch.empty(8))):
        with pytest.raises(StoreClosedError):
            op()


def test_every_tier_type_is_registered():
    assert tier_class("disk") is DiskTier and tier_class("redis") is RedisTier
    assert tier_class("kvx.store.redis:RedisTier") is RedisTier  # a third-party tier: by import path
    with pytest.raises(ValueError, match="'cpu', 'node', 'disk'"):
        tier_class("nope")


# ------------------------------------------------------------------------------------------ the CPU pool
def test_cpu_index_lookups_and_events_follow_the_contract():
    """The CPU pool's index (scheduler side) answers lookups and emits the same events; its bytes live in
    each worker's CPUPool, read and written by the kernels rather than through get_into/put."""
    idx, seen = CPUIndex(2), []
    idx.subscribe(lambda name, event, keys: seen.append((name, event, list(keys))))
    idx.allocate("a")
    assert idx.contains_many(["a", "b"]) == [False, False]  # PENDING is not a hit
    idx.commit("a")
    idx.allocate("b")
    idx.commit("b")
    idx.allocate("c")  # evicts "a" (LRU)
    idx.abort("b")  # a committed chunk dropped
    idx.clear()
    assert seen == [("cpu", STORED, ["a"]), ("cpu", STORED, ["b"]), ("cpu", REMOVED, ["a"]), ("cpu", REMOVED, ["b"])]
