"""What Redis holds per chunk (issue 46, item 7): values sized for Redis's allocator (jemalloc's size classes), so
that ``used_memory`` grows by the chunk's bytes within 3% (a chunk of head parts of 4 MiB + a header grew it by
1.25x); chunks stored in the layout before are still read, and a manifest of an unknown version is a miss.
``benchmarks/bench_redis_memory.py`` measures the shapes of ``bench_tp_share.py``."""

from __future__ import annotations

import time

import pytest
import torch

from kvx.store import codec
from kvx.store.errors import ChunkError
from kvx.store.redis.layout import VALUE_OVERHEAD, alloc_size, value_split
from tests.helpers import assert_same_bytes
from tests.store.conftest import FP, MVS, new_key, poisoned, random_chunk

MiB = 1 << 20


def test_alloc_size_is_jemallocs_size_class():
    assert [alloc_size(n) for n in (1, 9, 128, 129, 4096, 4097)] == [8, 16, 128, 160, 4096, 5120]
    assert alloc_size(4 * MiB) == 4 * MiB and alloc_size(4 * MiB + 1) == 5 * MiB
    assert alloc_size(33 * MiB) == 40 * MiB


def test_small_encodings_stay_one_value():
    """Records and small chunks: one value (a split would save a few KiB for a key and a round trip)."""
    for total in (1, 300, 4300, 40_000, (64 << 10) - 1):
        assert value_split(total, 64 << 10) == (1, total)


@pytest.mark.parametrize("limit", [64 << 10, 1 * MiB, 4 * MiB, 64 * MiB])
def test_split_fills_size_classes(limit):
    """Every value at most ``limit`` bytes, all but the last a full size class, the whole within 2% of the
    chunk's bytes (a sweep of sizes from 64 KiB to 70 MiB, headers of any length)."""
    for total in range(64 << 10, 70 * MiB, 1_000_003):
        n, size = value_split(total, limit)
        last = total - (n - 1) * size
        assert 0 < last <= size <= limit and (n == 1 or size <= total)
        if n > 1:
            assert alloc_size(size + VALUE_OVERHEAD) == size + VALUE_OVERHEAD
        held = (n - 1) * (size + VALUE_OVERHEAD) + alloc_size(last + VALUE_OVERHEAD)
        assert held <= 1.02 * total, (total, limit, n, size)
    # a KV head's part (4 MiB + a header): 4 MiB - 12 bytes and the rest, whatever the value limit above 4 MiB
    if limit >= 4 * MiB:
        assert value_split(4 * MiB + 300, limit) == (2, 4 * MiB - 12)


@pytest.mark.parametrize("part_size", ["4MiB", "64MiB"])
def test_used_memory_per_chunk_within_3_percent(part_size, redis_server, open_tier):
    """Chunks of 1 MiB (a size class: before, 1 MiB + a header took 1.25 MiB) grow used_memory by their bytes
    within 3% (each as a value of 1 MiB - 12 bytes and one of the rest)."""
    tier = open_tier(redis_server.url, max_value_size=part_size)
    c = redis_server.client()
    shape, n = (MiB,), 8
    assert tier.put(new_key(), random_chunk(shape, torch.uint8, 99))  # warm: connections and server buffers
    before = int(c.info("memory")["used_memory"])
    keys = [new_key() for _ in range(n)]
    for i, k in enumerate(keys):
        assert tier.put(k, random_chunk(shape, torch.uint8, i))
    grown = (int(c.info("memory")["used_memory"]) - before) / n
    print(f"\nused_memory per {MiB}-byte chunk ({part_size} values): {grown:.0f} ({grown / MiB:.4f}x)")
    assert 0 < grown <= 1.03 * MiB
    for i, k in enumerate(keys[:2]):
        out = poisoned(random_chunk(shape, torch.uint8, i))
        tier.get_into(k, out)
        assert_same_bytes(out, random_chunk(shape, torch.uint8, i))


def _manifest(nonce: str, n: int, total: int, psize: int, version: int = 1) -> bytes:
    return b"kvxparts:%d:%s:%d:%d:%d" % (version, nonce.encode(), n, total, psize)


@pytest.mark.parametrize("layout", ["one value", "equal parts"])
def test_chunks_in_the_layout_before_are_read(layout, redis_server, open_tier):
    """Chunks written before values were sized for the allocator: one value of max_value_size + the header, or
    equal parts under a manifest of the same version (1): read bit-exact (the manifest's format is unchanged)."""
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    key = new_key()
    x = random_chunk((MVS if layout == "one value" else 2 * MVS + 5,), torch.uint8, 5)
    header, payload = codec.encode(x, key, FP, created=time.time())
    value = bytes(header) + payload.tobytes()
    ck = f"kvx:1:{{{key}}}"
    if layout == "one value":
        c.set(ck, value)
    else:
        n = 3
        psize = -(-len(value) // n)
        for i in range(n):
            c.set(f"{ck}:a1b2c3:{i}", value[i * psize : (i + 1) * psize])
        c.set(ck, _manifest("a1b2c3", n, len(value), psize))
    assert tier.contains_many([key]) == [True]
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


def test_unknown_manifest_version_is_a_miss(redis_server, open_tier):
    """A manifest of a version this reader does not know is a ChunkError (a miss: the blocks are recomputed),
    never bytes read under another layout's rules."""
    tier = open_tier(redis_server.url)
    c = redis_server.client()
    key = new_key()
    x = random_chunk((2 * MVS,), torch.uint8, 6)
    header, payload = codec.encode(x, key, FP, created=time.time())
    value = bytes(header) + payload.tobytes()
    ck = f"kvx:1:{{{key}}}"
    c.set(f"{ck}:a1b2c3:0", value)
    c.set(ck, _manifest("a1b2c3", 1, len(value), len(value), version=2))
    out = poisoned(x)
    with pytest.raises(ChunkError, match="manifest"):
        tier.get_into(key, out)
    assert tier.stats()["gets"] == 0


def test_bench_redis_memory_quick_run(monkeypatch, tmp_path):
    """benchmarks/bench_redis_memory.py --quick: every case of both layouts, table and CSV agree; the layout before
    holds 1.25x a chunk's bytes (a head's part of 512 KiB + a header in a 640 KiB class), this one within 3%."""
    import csv

    from tests.helpers import load_benchmark, need_redis

    need_redis()
    bench = load_benchmark(monkeypatch, "bench_redis_memory")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "redis_memory_cpu.csv")))
    assert [(r["layout"], r["max_value_size"], r["case"]) for r in rows] == [
        (layout, size, case) for layout in bench.LAYOUTS for size in bench.PART_SIZES for case in bench.CASES
    ]
    md = (tmp_path / "redis_memory_cpu.md").read_text()
    for r in rows:
        ratio = float(r["ratio"])
        assert (ratio > 1.2) if r["layout"] == "before" else (0.97 < ratio <= 1.0 + bench.TARGET), r
        assert f"| {r['case']} | " in md and f" | {ratio:.4f} | " in md
