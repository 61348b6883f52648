"""Fixtures of the store tests: real ``redis-server`` processes (kvx.testing.redis_server), stopped at teardown
whatever the test did to them; the helpers the Redis tests share (chunks, keys, checks of a tier); the ``store``
of the disk tests (test_disk_*.py; a module with a ``store`` fixture of its own, as test_seal.py, overrides it);
and the pids of a live and a dead process the disk tests name temporary files after."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import uuid

import pytest
import torch

from kvx.store import codec
from kvx.store.disk import DiskTier
from kvx.store.errors import ChunkError, StoreUnavailableError
from kvx.store.redis import RedisTier, RedisTierConfig
from kvx.store.tier import TierContext
from kvx.testing.redis_server import RedisClusterServers, RedisServer
from tests.helpers import need_redis, same_bytes

FP = "fp-test-1"  # the fingerprint of the Redis tests' tiers
MVS = 64 << 10  # max_value_size of most Redis tests: small, so multi-part is cheap to exercise
SLACK_S = 0.5  # timing bounds are generous: a busy 2-core CI box


@pytest.fixture
def redis_server():
    """A fresh standalone server (TCP and a unix socket, noeviction) for one test: tests may kill it."""
    need_redis()
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-node cluster shared by a test module (starting one takes ~2 s): tests must leave it serving."""
    need_redis()
    with RedisClusterServers(3) as cluster:
        yield cluster


@pytest.fixture
def open_tier():
    """``open_tier(url, fingerprint=FP, **config) -> RedisTier``, closed at teardown."""
    tiers = []

    def make(url: str, fingerprint: str = FP, **cfg) -> RedisTier:
        cfg.setdefault("max_value_size", MVS)
        cfg.setdefault("lookup_wait_ms", 1000)  # tests want answers; test_contains_many_none_then_answer sets 0
        t = RedisTier.open(RedisTierConfig(type="redis", url=url, **cfg), TierContext(fingerprint=fingerprint))
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


# ------------------------------------------------------------------------------------------ Redis helpers
def new_key() -> str:
    return uuid.uuid4().hex


def random_chunk(shape, dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    es = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    return torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def encoded_size(numel: int, dtype, key: str) -> int:
    header, payload = codec.encode(torch.zeros(numel, dtype=dtype), key, FP, created=time.time())
    return len(header) + payload.nbytes


def numel_for_total(total: int, dtype, key: str) -> int:
    """Elements of a 1-D chunk whose encoding (header + payload) is exactly ``total`` bytes."""
    es = torch.empty((), dtype=dtype).element_size()
    n = total // es
    for _ in range(10):
        h = encoded_size(n, dtype, key) - n * es
        n = (total - h) // es
    assert encoded_size(n, dtype, key) == total
    return n


def shape_for(size: str, dtype, key: str) -> tuple[int, ...]:
    if size == "odd":
        return (7,)
    if size == "5d":
        return (2, 3, 17, 2, 8)  # [L, P, T, H, D]
    n = numel_for_total(MVS, dtype, key)
    return {"below": (n - 1,), "equal": (n,), "above": (n + 1,), "multi": (3 * n + 5,)}[size]


def poisoned(like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    codec.byte_view(out)[:] = 0xA5
    return out


def works(tier: RedisTier) -> bool:
    """A put and a get round trip succeed now."""
    x = random_chunk((100,), torch.float32, 0)
    k = new_key()
    try:
        assert tier.put(k, x)
        out = poisoned(x)
        tier.get_into(k, out)
        return same_bytes(out, x)
    except (ChunkError, StoreUnavailableError):
        return False


def commands(client, name: str) -> int:
    """How many ``name`` commands (lower case: ``"ping"``) the server of ``client`` has run."""
    return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)


def assert_fails_at_once(tier: RedisTier, within_s: float) -> None:
    """A tier whose server is down answers at once: lookups miss, gets and puts fail (no timeout waited)."""
    t0 = time.monotonic()
    assert tier.contains_many([new_key(), new_key()]) == [False, False]
    with pytest.raises(ChunkError):
        tier.get_into(new_key(), torch.empty(4))
    with pytest.raises(StoreUnavailableError):
        tier.put(new_key(), torch.zeros(4))
    assert time.monotonic() - t0 < within_s


# ------------------------------------------------------------------------------------------ disk fixtures
@pytest.fixture
def store(tmp_path):
    """A DiskTier at ``tmp_path / "kv"`` (fingerprint "fp-test"), closed at teardown."""
    s = DiskTier.at(tmp_path / "kv", fingerprint="fp-test")
    yield s
    s.close()


@pytest.fixture
def pids():
    """A pid alive for the whole test (another engine's writer on this host) and one that is not."""
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    yield {"live": live.pid, "dead": dead.pid}
    live.stdin.close()
    live.wait()
