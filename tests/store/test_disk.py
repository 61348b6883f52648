"""DiskStore: bit-exact round trips, verification on read, atomic writes, LRU capacity, sharing a path
between engines, stale temporary files, closed stores and bad input."""

import hashlib
import os
import threading
import time
import zlib

import pytest
import torch
from safetensors.torch import save_file

import kvx.store.disk as disk_mod
from kvx.store.disk import FORMAT_VERSION, ChunkError, DiskStore, StoreClosedError, checksum

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 17, 2, 8), (4, 1, 16, 2, 8)]  # odd sizes; the last two: [L, P, T, H, D]
FLIP_AT = ["first", "middle", "last"]
TRUNCATE_TO = [0, 7, 8, 40, "half", "minus_one"]
BAD_KEYS = ["", "abc", "0123456", "ABCDEF0123456789", "0123456789abcdeG", "01234567/../../x", "0123 4567",
            12345678, None, b"0123456789abcdef"]
KEY_OPS = ["file_of", "contains", "lookup", "put", "get", "delete"]
CLOSED_OPS = ["put", "get", "contains", "lookup", "delete", "scan", "usage", "evict", "clear"]
BAD_CTOR = [
    (dict(path=""), "path"),
    (dict(path=None), "path"),
    (dict(path=5), "path"),
    (dict(path=b"/tmp/kvx"), "path"),
    (dict(capacity_bytes=0), "capacity_bytes"),
    (dict(capacity_bytes=-1), "capacity_bytes"),
    (dict(capacity_bytes=1.5e9), "capacity_bytes"),
    (dict(capacity_bytes="1GiB"), "capacity_bytes"),
    (dict(capacity_bytes=True), "capacity_bytes"),
    (dict(low_watermark=0.0), "low_watermark"),
    (dict(low_watermark=-0.5), "low_watermark"),
    (dict(low_watermark=1.01), "low_watermark"),
    (dict(low_watermark=float("nan")), "low_watermark"),
    (dict(low_watermark="0.5"), "low_watermark"),
    (dict(low_watermark=None), "low_watermark"),
    (dict(low_watermark=True), "low_watermark"),
    (dict(rescan_s=-1), "rescan_s"),
    (dict(rescan_s=float("nan")), "rescan_s"),
    (dict(rescan_s="5"), "rescan_s"),
    (dict(rescan_s=True), "rescan_s"),
    (dict(fingerprint=None), "fingerprint"),
    (dict(fingerprint=3), "fingerprint"),
]
BAD_CHUNKS = [
    ("meta device", lambda: torch.empty(4, device="meta")),
    ("list", lambda: [1, 2, 3]),
    ("numpy", lambda: torch.arange(4).numpy()),
    ("None", lambda: None),
]
BAD_EXTRA = [
    ("not a dict", [("tokens", "16")]),
    ("int value", {"tokens": 16}),
    ("int key", {1: "x"}),
    ("reserved key", {"key": "0" * 32}),
    ("reserved fingerprint", {"fingerprint": "other"}),
    ("reserved crc32", {"crc32": "00000000"}),
]
SEEDS = [0, 1]


def key_of(i) -> str:
    """A 32-digit lowercase hex key like the connector's (spread over many two-digit subdirectories)."""
    return hashlib.md5(str(i).encode()).hexdigest()


def rand_chunk(shape, dtype, seed) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (NaN/inf bit patterns included: the store is byte-exact)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(as_bytes(a), as_bytes(b))


def files_in(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def set_mtime(store: DiskStore, key: str, t: float):
    os.utime(store.file_of(key), (t, t))


def one_file_bytes(tmp_path, shape=(2, 8), dtype=torch.float16) -> int:
    """Size of one chunk file of ``shape`` (every test chunk of a shape has the same file size)."""
    probe = DiskStore(tmp_path / "probe")
    probe.put(key_of("probe"), torch.zeros(shape, dtype=dtype))
    return os.path.getsize(probe.file_of(key_of("probe")))


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path / "kv", fingerprint="fp-test")
    yield s
    s.close()


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact(store, dtype, shape):
    seed = zlib.crc32(f"{dtype}{shape}".encode())
    chunk = rand_chunk(shape, dtype, seed)
    key = key_of(seed)
    assert not store.contains(key)
    assert store.put(key, chunk) is True
    assert store.contains(key)
    assert os.path.isfile(store.file_of(key))
    assert store.file_of(key) == os.path.join(store.path, key[:2], key + ".safetensors")
    out = store.get(key, shape, dtype)
    assert_bit_equal(out, chunk)
    assert_bit_equal(store.get(key), chunk)  # shape/dtype checks are optional
    assert store.stats["puts"] == 1 and store.stats["gets"] == 2 and store.stats["errors"] == 0
    assert store.stats["get_bytes"] == 2 * chunk.numel() * chunk.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_non_contiguous_view(store, dtype):
    base = rand_chunk((5, 3, 9), dtype, 7)
    view = base.transpose(0, 2)[1:]          # [8, 3, 5], not contiguous
    assert not view.is_contiguous()
    store.put(key_of("nc"), view)
    assert_bit_equal(store.get(key_of("nc"), view.shape, dtype), view)


def test_round_trip_of_views_into_a_pool(store):
    """What the worker writes: a pool slot (contiguous, at an offset) or a narrowed part of one."""
    pool = rand_chunk((3, 2, 4, 8, 2), torch.bfloat16, 8)       # [slots, L, T, H, D]
    slot = pool[2]
    assert slot.is_contiguous() and slot.storage_offset() > 0
    part = slot.narrow(1, 1, 2)                                  # tokens 1..2 of every layer
    store.put(key_of("slot"), slot)
    store.put(key_of("part"), part)
    assert_bit_equal(store.get(key_of("slot"), slot.shape, slot.dtype), slot)
    assert_bit_equal(store.get(key_of("part"), part.shape, part.dtype), part)


def test_round_trip_keeps_chunks_apart(store):
    chunks = {key_of(i): rand_chunk((3, 5), torch.float16, i) for i in range(20)}
    for k, c in chunks.items():
        store.put(k, c)
    for k, c in chunks.items():
        assert_bit_equal(store.get(k, (3, 5), torch.float16), c)


def test_round_trip_with_fsync(tmp_path):
    s = DiskStore(tmp_path, fsync=True)
    c = rand_chunk((4, 4), torch.bfloat16, 3)
    assert s.put(key_of(1), c)
    assert_bit_equal(s.get(key_of(1)), c)


def test_extra_metadata_is_stored_next_to_the_verified_fields(store):
    from safetensors import safe_open

    key = key_of("extra")
    store.put(key, torch.ones(4), {"tokens": "16", "format": "canonical"})
    with safe_open(store.file_of(key), framework="pt") as f:
        meta = f.metadata()
    assert meta["tokens"] == "16" and meta["format"] == "canonical"
    assert meta["key"] == key and meta["fingerprint"] == "fp-test" and meta["kvx_format"] == FORMAT_VERSION
    assert meta["crc32"] == checksum(torch.ones(4))


def test_checksum_is_crc32_of_the_bytes():
    # "123456789" is the CRC-32 check string: its CRC is 0xcbf43926
    assert checksum(torch.tensor(list(b"123456789"), dtype=torch.uint8)) == "cbf43926"
    assert checksum(torch.empty(0, dtype=torch.uint8)) == "00000000"
    t = torch.arange(6, dtype=torch.float32)
    assert checksum(t) == f"{zlib.crc32(t.numpy().tobytes()):08x}"


# ------------------------------------------------------------------------------------------ verification
def test_get_missing_is_chunk_error_not_counted_as_corruption(store):
    with pytest.raises(ChunkError, match="not on disk"):
        store.get(key_of("missing"))
    assert store.stats["errors"] == 0


@pytest.mark.parametrize("cut", TRUNCATE_TO)
def test_get_truncated_file(store, cut):
    key = key_of("trunc")
    store.put(key, rand_chunk((16, 16), torch.float32, 1))
    path = store.file_of(key)
    size = os.path.getsize(path)
    n = {"half": size // 2, "minus_one": size - 1}.get(cut, cut)
    with open(path, "r+b") as f:
        f.truncate(n)
    with pytest.raises(ChunkError, match="unreadable"):
        store.get(key)
    assert store.stats["errors"] == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_get_garbage_file(store, seed):
    key = key_of("garbage")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g).numpy().tobytes())
    assert store.contains(key)  # presence is only the file name ...
    with pytest.raises(ChunkError, match="unreadable"):
        store.get(key)            # ... serving it needs a valid file


def test_get_file_without_kv_tensor(store):
    key = key_of("nokv")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path))
    save_file({"other": torch.ones(3)}, path, metadata={"kvx_format": FORMAT_VERSION, "key": key,
                                                        "fingerprint": "fp-test"})
    with pytest.raises(ChunkError, match="unreadable"):
        store.get(key)


@pytest.mark.parametrize("where", FLIP_AT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_get_flipped_byte_in_data_is_checksum_error(store, where, dtype):
    key = key_of("flip")
    chunk = rand_chunk((8, 33), dtype, 5)
    store.put(key, chunk)
    path = store.file_of(key)
    nbytes = chunk.numel() * chunk.element_size()
    data_start = os.path.getsize(path) - nbytes          # safetensors: header, then the data
    off = data_start + {"first": 0, "middle": nbytes // 2, "last": nbytes - 1}[where]
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChunkError, match="checksum"):
        store.get(key, chunk.shape, dtype)
    assert store.stats["errors"] == 1
    # a corrupt file is dropped: the chunk is now a miss, and the next save writes a good copy
    assert not store.contains(key)
    assert store.put(key, chunk)
    assert_bit_equal(store.get(key, chunk.shape, dtype), chunk)


def test_get_file_under_another_keys_name(store):
    a, b = key_of("a"), key_of("b")
    store.put(a, torch.zeros(4))
    store.put(b, torch.ones(4))
    os.replace(store.file_of(a), store.file_of(b))   # b's name, a's content
    with pytest.raises(ChunkError, match=f"key '{a}'"):
        store.get(b)
    assert not store.contains(a)
    assert not store.contains(b)          # mangled: dropped


def test_get_with_another_fingerprint(tmp_path):
    writer = DiskStore(tmp_path, fingerprint="layout=LBNHC")
    reader = DiskStore(tmp_path, fingerprint="layout=BLNHC")
    writer.put(key_of(1), torch.ones(4))
    with pytest.raises(ChunkError, match="fingerprint 'layout=LBNHC' != 'layout=BLNHC'"):
        reader.get(key_of(1))
    assert reader.stats["errors"] == 1
    assert_bit_equal(writer.get(key_of(1)), torch.ones(4))   # valid for its own engine: kept


def test_get_with_another_format_version(store):
    key = key_of("old")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path))
    t = torch.ones(4)
    save_file({"kv": t}, path, metadata={"kvx_format": "kvx-0", "key": key, "fingerprint": "fp-test",
                                         "crc32": checksum(t)})
    with pytest.raises(ChunkError, match="format 'kvx-0'"):
        store.get(key)


@pytest.mark.parametrize("ask", [
    dict(shape=(4, 8)), dict(shape=(8, 4)), dict(shape=(32,)), dict(shape=(1, 4, 8)),
    dict(dtype=torch.bfloat16), dict(dtype=torch.float32), dict(shape=(4, 8), dtype=torch.uint8),
], ids=str)
def test_get_wrong_shape_or_dtype(store, ask):
    key = key_of("sd")
    store.put(key, rand_chunk((4, 4, 2), torch.float16, 2))
    with pytest.raises(ChunkError, match="shape" if "shape" in ask else "dtype"):
        store.get(key, ask.get("shape"), ask.get("dtype"))


# ------------------------------------------------------------------------------------------ atomic writes
def test_crash_in_save_leaves_no_file(store, monkeypatch):
    key = key_of("crash")
    seen = {}

    def save_half_then_crash(tensors, filename, metadata=None):
        seen["tmp"] = filename
        with open(filename, "wb") as f:          # a partial file under the temporary name
            f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
        raise OSError("disk full")

    monkeypatch.setattr(disk_mod, "save_file", save_half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        store.put(key, torch.ones(8))
    tmp = seen["tmp"]
    assert tmp != store.file_of(key)
    assert os.path.dirname(tmp) == os.path.dirname(store.file_of(key))   # same fs: the rename is atomic
    assert not os.path.exists(tmp)
    assert not store.contains(key)
    assert files_in(store.path) == []
    assert store.usage() == 0 and store.stats["puts"] == 0
    monkeypatch.undo()
    assert store.put(key, torch.ones(8))      # a later put works
    assert_bit_equal(store.get(key), torch.ones(8))


@pytest.mark.parametrize("exc", [OSError("EXDEV"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_crash_in_rename_leaves_no_file(store, monkeypatch, exc):
    key = key_of("rename")
    calls = []

    def replace_crash(src, dst):
        calls.append((src, dst))
        assert os.path.getsize(src) > 0          # the complete file exists under the temporary name only
        assert not os.path.exists(dst)
        raise exc

    monkeypatch.setattr(disk_mod.os, "replace", replace_crash)
    with pytest.raises(type(exc)):
        store.put(key, torch.ones(8))
    monkeypatch.undo()
    assert calls and calls[0][1] == store.file_of(key)
    assert not os.path.exists(calls[0][0])
    assert files_in(store.path) == []


def test_reader_never_sees_a_partial_file(store):
    """While one thread writes large chunks, another polls: a present file must always verify."""
    keys = [key_of(f"big{i}") for i in range(6)]
    chunk = rand_chunk((1024, 1024), torch.uint8, 11)   # 1 MiB
    done = threading.Event()
    bad = []

    def reader():
        while not done.is_set():
            for k in keys:
                try:
                    store.get(k, chunk.shape, chunk.dtype)
                except ChunkError as e:
                    if "not on disk" not in str(e):
                        bad.append(str(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for k in keys:
            store.put(k, chunk)
    finally:
        done.set()
        t.join()
    assert bad == []
    assert store.lookup(keys) == len(keys)


# ------------------------------------------------------------------------------------------ put / lookup
def test_put_existing_returns_false_touches_mtime_and_keeps_bytes(store):
    key = key_of("dup")
    first, second = torch.zeros(6), torch.ones(6)
    assert store.put(key, first)
    old = time.time() - 1000
    set_mtime(store, key, old)
    assert store.put(key, second) is False
    assert os.path.getmtime(store.file_of(key)) > old + 900
    assert_bit_equal(store.get(key), first)
    assert store.stats["puts"] == 1
    assert store.usage() == os.path.getsize(store.file_of(key))


@pytest.mark.parametrize("present, expected", [
    ([], 0), ([0], 1), ([1, 2, 3], 0), ([0, 1, 3, 4], 2), ([0, 1, 2, 3, 4], 5), ([0, 2, 4], 1),
], ids=str)
def test_lookup_counts_leading_present_keys(store, present, expected):
    keys = [key_of(f"l{i}") for i in range(5)]
    for i in present:
        store.put(keys[i], torch.full((2,), i))
    assert store.lookup(keys) == expected
    assert store.lookup([]) == 0
    assert store.lookup(keys[:expected]) == expected
    assert [store.contains(k) for k in keys] == [i in present for i in range(5)]


def test_delete(store):
    key = key_of("del")
    store.put(key, torch.ones(4))
    assert store.delete(key) is True
    assert not store.contains(key) and store.usage() == 0
    assert store.delete(key) is False


def test_clear(store):
    for i in range(5):
        store.put(key_of(i), torch.ones(4))
    assert store.clear() == 5
    assert store.lookup([key_of(i) for i in range(5)]) == 0
    assert store.usage() == 0 and store.clear() == 0


def test_usage_is_the_sum_of_file_sizes(store):
    for i in range(4):
        store.put(key_of(i), torch.ones(i + 1, 8))
    assert store.usage() == sum(os.path.getsize(store.file_of(key_of(i))) for i in range(4))
    assert sorted(c.key for c in store.scan()) == sorted(key_of(i) for i in range(4))


# ------------------------------------------------------------------------------------------ capacity / LRU
# mtimes are set explicitly (an hour apart, in the past) so the LRU order does not depend on the clock
MTIME_ORDERS = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]]


@pytest.mark.parametrize("order", MTIME_ORDERS, ids=str)
def test_eviction_removes_least_recently_used_down_to_low_watermark(tmp_path, order):
    size = one_file_bytes(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=5 * size, low_watermark=0.6)   # target: 3 files
    keys = [key_of(i) for i in range(5)]
    for k in keys:
        assert s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    assert s.stats["evicted"] == 0          # at capacity, not over
    base = time.time() - 10 * 3600
    for rank, i in enumerate(order):        # order[0] is the oldest
        set_mtime(s, keys[i], base + rank * 3600)
    new = key_of("new")
    s.put(new, torch.zeros(2, 8, dtype=torch.float16))   # 6 files > 5: evict down to 3
    survivors = {keys[order[3]], keys[order[4]], new}
    assert {c.key for c in s.scan()} == survivors
    assert s.stats["evicted"] == 3
    assert s.usage() == 3 * size


def test_get_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
    keys = [key_of(i) for i in range(3)]
    for k in keys:
        s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    base = time.time() - 3600
    for i, k in enumerate(keys):
        set_mtime(s, k, base + i)            # keys[0] oldest
    s.get(keys[0])                           # now the most recent
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {keys[0], keys[2], key_of("new")}


def test_put_of_existing_key_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
    keys = [key_of(i) for i in range(3)]
    for i, k in enumerate(keys):
        s.put(k, torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, k, time.time() - 3600 + i)
    assert s.put(keys[0], torch.zeros(2, 8, dtype=torch.float16)) is False
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {keys[0], keys[2], key_of("new")}


def test_capacity_counts_files_already_on_disk(tmp_path):
    """A store opened on a full directory (a restart) evicts on its first put."""
    size = one_file_bytes(tmp_path)
    first = DiskStore(tmp_path / "kv")
    for i in range(4):
        first.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(first, key_of(i), time.time() - 3600 + i)
    s = DiskStore(tmp_path / "kv", capacity_bytes=4 * size + size // 2, low_watermark=0.5)
    assert s.usage() == 4 * size
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {key_of(3), key_of("new")}


def test_unbounded_store_never_evicts(tmp_path):
    s = DiskStore(tmp_path)
    for i in range(10):
        s.put(key_of(i), torch.zeros(64))
    assert s.evict() == 0 and s.lookup([key_of(i) for i in range(10)]) == 10


def test_evict_with_nothing_to_do(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=10 * size)
    s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16))
    assert s.evict() == 0 and s.contains(key_of(0))


# ------------------------------------------------------------------------------------------ two engines
def test_two_stores_on_one_path_share_chunks(tmp_path):
    a, b = DiskStore(tmp_path, fingerprint="f"), DiskStore(tmp_path, fingerprint="f")
    chunk = rand_chunk((4, 4), torch.bfloat16, 9)
    assert a.put(key_of(1), chunk)
    assert b.contains(key_of(1)) and b.lookup([key_of(1)]) == 1
    assert_bit_equal(b.get(key_of(1)), chunk)
    assert b.put(key_of(1), chunk) is False


@pytest.mark.parametrize("rescan_s", [0, 3600])
def test_engines_sharing_a_path_keep_it_within_its_budget(tmp_path, rescan_s):
    """Each engine re-counts the directory (after rescan_s), so together they stay within the budget."""
    size = one_file_bytes(tmp_path)
    stores = [DiskStore(tmp_path / "kv", capacity_bytes=6 * size, low_watermark=1.0, rescan_s=rescan_s)
              for _ in range(3)]
    peak = 0
    for i in range(30):
        stores[i % 3].put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        peak = max(peak, stores[0].usage())
    if rescan_s == 0:
        assert peak <= 6 * size
    else:                         # counts go stale for an hour: each engine sees only its own writes
        assert peak > 6 * size


def test_eviction_by_one_engine_is_a_miss_for_the_other(tmp_path):
    size = one_file_bytes(tmp_path)
    a = DiskStore(tmp_path / "kv", capacity_bytes=2 * size, low_watermark=1.0)
    b = DiskStore(tmp_path / "kv")
    b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16))
    set_mtime(b, key_of("b"), time.time() - 3600)
    a.put(key_of("a1"), torch.zeros(2, 8, dtype=torch.float16))
    a.put(key_of("a2"), torch.zeros(2, 8, dtype=torch.float16))
    # a counts only its own writes (2 files: not over); its next eviction scans the whole directory
    assert a.evict() == 1
    assert a.lookup([key_of("a1"), key_of("a2")]) == 2
    assert not b.contains(key_of("b"))
    assert b.lookup([key_of("b")]) == 0
    with pytest.raises(ChunkError, match="not on disk"):
        b.get(key_of("b"))
    assert b.stats["errors"] == 0
    assert b.delete(key_of("b")) is False
    assert b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16)) is True


def test_evict_tolerates_files_deleted_by_another_engine(tmp_path, monkeypatch):
    size = one_file_bytes(tmp_path)
    s = DiskStore(tmp_path / "kv", capacity_bytes=4 * size, low_watermark=0.5)
    for i in range(4):
        s.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, key_of(i), time.time() - 3600 + i)
    real_unlink = os.unlink

    def other_engine_was_faster(path, *args, **kw):
        real_unlink(path)                        # another engine removes it between scan and unlink
        return real_unlink(path, *args, **kw)    # -> FileNotFoundError

    monkeypatch.setattr(disk_mod.os, "unlink", other_engine_was_faster)
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))   # 5 > 4: evict down to 2
    monkeypatch.undo()
    assert {c.key for c in s.scan()} == {key_of(3), key_of("new")}


def test_put_when_another_engine_evicts_the_existing_file(store, monkeypatch):
    """The file is there at the presence check and gone at the touch: the chunk must be written again."""
    key = key_of("race")
    store.put(key, torch.zeros(4))
    real_utime = os.utime

    def evicted_first(path, *args, **kw):
        os.unlink(path)
        return real_utime(path, *args, **kw)

    monkeypatch.setattr(disk_mod.os, "utime", evicted_first)
    assert store.put(key, torch.ones(4)) is True
    monkeypatch.undo()
    assert_bit_equal(store.get(key), torch.ones(4))


@pytest.mark.parametrize("threads", [2, 8])
def test_concurrent_puts_of_one_key(tmp_path, threads):
    stores = [DiskStore(tmp_path, fingerprint="f") for _ in range(2)]   # two engines, several threads
    chunk = rand_chunk((64, 64), torch.float16, 4)
    key = key_of("same")
    barrier = threading.Barrier(threads)
    results, errors = [], []

    def worker(i):
        barrier.wait()
        try:
            results.append(stores[i % 2].put(key, chunk))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and any(results)
    assert files_in(tmp_path) == [os.path.relpath(stores[0].file_of(key), tmp_path)]   # no tmp left over
    for s in stores:
        assert_bit_equal(s.get(key, chunk.shape, chunk.dtype), chunk)


def test_concurrent_puts_and_gets_of_many_keys(store):
    chunks = {key_of(i): rand_chunk((8, 8), torch.float32, i) for i in range(32)}
    items = list(chunks.items())
    errors = []

    def worker(part):
        try:
            for k, c in part:
                store.put(k, c)
                assert_bit_equal(store.get(k), c)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert store.stats["puts"] == 32 and store.stats["gets"] == 32
    assert store.lookup(list(chunks)) == 32


# ------------------------------------------------------------------------------------------ stale temp files
def test_scan_removes_stale_tmp_files_only(store):
    key = key_of("t")
    store.put(key, torch.ones(4))
    d = os.path.dirname(store.file_of(key))
    stale = os.path.join(d, f".{key}.123.deadbeef.tmp")
    fresh = os.path.join(d, f".{key}.456.cafebabe.tmp")
    for p in (stale, fresh):
        with open(p, "wb") as f:
            f.write(b"partial")
    old = time.time() - disk_mod._TMP_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    chunks = list(store.scan())
    assert [c.key for c in chunks] == [key]        # temporary files are never chunks
    assert not os.path.exists(stale)
    assert os.path.exists(fresh)                   # may be a live write of another engine
    assert store.usage() == os.path.getsize(store.file_of(key))


def test_opening_a_store_removes_stale_tmp_files(tmp_path):
    d = tmp_path / "ab"
    d.mkdir()
    stale = d / ".ab000000.1.x.tmp"
    stale.write_bytes(b"x")
    old = time.time() - 2 * disk_mod._TMP_MAX_AGE_S
    os.utime(stale, (old, old))
    DiskStore(tmp_path)
    assert not stale.exists()


# ------------------------------------------------------------------------------------------ closed store
@pytest.mark.parametrize("op", CLOSED_OPS)
def test_closed_store_raises(tmp_path, op):
    s = DiskStore(tmp_path)
    k = key_of(0)
    s.put(k, torch.ones(4))
    s.close()
    s.close()   # idempotent
    calls = {
        "put": lambda: s.put(key_of(1), torch.ones(4)),
        "get": lambda: s.get(k),
        "contains": lambda: s.contains(k),
        "lookup": lambda: s.lookup([k]),
        "delete": lambda: s.delete(k),
        "scan": lambda: s.scan(),
        "usage": lambda: s.usage(),
        "evict": lambda: s.evict(),
        "clear": lambda: s.clear(),
    }
    with pytest.raises(StoreClosedError, match="closed"):
        calls[op]()
    assert os.path.exists(s.file_of(k)) and not os.path.exists(s.file_of(key_of(1)))


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, arg", BAD_CTOR, ids=[f"{a}={v[a]!r}" for v, a in BAD_CTOR])
def test_bad_constructor_args(tmp_path, kwargs, arg):
    kwargs = {"path": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=f"^{arg}: "):
        DiskStore(**kwargs)


def test_good_constructor_edge_values(tmp_path):
    s = DiskStore(str(tmp_path / "new" / "dir"), capacity_bytes=1, low_watermark=1.0)
    assert os.path.isdir(s.path) and os.path.isabs(s.path)
    assert DiskStore(tmp_path, low_watermark=1).low_watermark == 1


@pytest.mark.parametrize("op", KEY_OPS)
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys(store, key, op):
    calls = {
        "file_of": lambda: store.file_of(key),
        "contains": lambda: store.contains(key),
        "lookup": lambda: store.lookup([key]),
        "put": lambda: store.put(key, torch.ones(2)),
        "get": lambda: store.get(key),
        "delete": lambda: store.delete(key),
    }
    with pytest.raises(ValueError, match="^key: expected a lowercase hex string"):
        calls[op]()
    assert files_in(store.path) == []


@pytest.mark.parametrize("name, make", BAD_CHUNKS, ids=[n for n, _ in BAD_CHUNKS])
@pytest.mark.parametrize("exists", [False, True])
def test_bad_chunk(store, name, make, exists):
    key = key_of("bad")
    if exists:
        store.put(key, torch.ones(2))
    with pytest.raises(ValueError, match="^chunk: expected a CPU tensor"):
        store.put(key, make())
    assert store.stats["puts"] == int(exists)


@pytest.mark.parametrize("name, extra", BAD_EXTRA, ids=[n for n, _ in BAD_EXTRA])
def test_bad_extra(store, name, extra):
    with pytest.raises(ValueError, match="^extra: "):
        store.put(key_of("x"), torch.ones(2), extra)
    assert files_in(store.path) == []
