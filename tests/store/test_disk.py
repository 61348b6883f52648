"""DiskTier: bit-exact round trips, the file format, verification on read, atomic writes, LRU capacity
(also under concurrent writers: measured on the directory itself), sharing a path between engines, a
full disk (simulated, and a real 8 MiB tmpfs when root), read-only and vanishing directories,
temporary files (in flight or left by a killed writer), closed stores and bad input."""

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store import StoreError, StoreFullError
from kvx.store.codec import FORMAT_VERSION, ST_DTYPES, crc32
from kvx.store.codec import crc32c as checksum
from kvx.store.disk import ChunkError, DiskTier, StoreClosedError, directory, survey
from tests.helpers import assert_same_bytes, dir_bytes, mount_tmpfs, remount, umount

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 17, 2, 8), (4, 1, 16, 2, 8)]  # odd sizes; the last two: [L, P, T, H, D]
FLIP_AT = ["first", "middle", "last"]
TRUNCATE_TO = [0, 7, 8, 40, "half", "minus_one"]
BAD_KEYS = [
    "",
    "abc",
    "0123456",
    "ABCDEF0123456789",
    "0123456789abcdeG",
    "0123456789abcdef\n",
    "01234567/../../x",
    "0123 4567",
    12345678,
    None,
    b"0123456789abcdef",
]
KEY_OPS = ["file_of", "contains", "put", "get", "delete"]
CLOSED_OPS = ["put", "get", "contains", "delete", "scan", "usage", "evict", "clear", "temp_files"]
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
BAD_CHUNKS = [  # (case, make it, what the error says)
    ("meta device", lambda: torch.empty(4, device="meta"), "a CPU tensor"),
    ("list", lambda: [1, 2, 3], "a CPU tensor"),
    ("numpy", lambda: torch.arange(4).numpy(), "a CPU tensor"),
    ("None", lambda: None, "a CPU tensor"),
    ("complex128", lambda: torch.zeros(2, dtype=torch.complex128), r"a dtype in \[.*'torch.bfloat16'"),
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


def files_in(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def set_mtime(store: DiskTier, key: str, t: float):
    os.utime(store.file_of(key), (t, t))


def one_file_bytes(tmp_path, shape=(2, 8), dtype=torch.float16) -> int:
    """Size of one chunk file of ``shape`` (every test chunk of a shape has the same file size)."""
    probe = DiskTier.at(tmp_path / f"probe{'x'.join(map(str, shape))}")
    probe.put(key_of("probe"), torch.zeros(shape, dtype=dtype))
    return os.path.getsize(probe.file_of(key_of("probe")))


@pytest.fixture
def store(tmp_path):
    s = DiskTier.at(tmp_path / "kv", fingerprint="fp-test")
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
    assert_same_bytes(out, chunk)
    assert_same_bytes(store.get(key), chunk)  # shape/dtype checks are optional
    assert store.stats()["puts"] == 1 and store.stats()["gets"] == 2 and store.stats()["errors"] == 0
    assert store.stats()["get_bytes"] == 2 * chunk.numel() * chunk.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_non_contiguous_view(store, dtype):
    base = rand_chunk((5, 3, 9), dtype, 7)
    view = base.transpose(0, 2)[1:]  # [8, 3, 5], not contiguous
    assert not view.is_contiguous()
    store.put(key_of("nc"), view)
    assert_same_bytes(store.get(key_of("nc"), view.shape, dtype), view)


def test_round_trip_of_views_into_a_pool(store):
    """What the worker writes: a pool slot (contiguous, at an offset) or a narrowed part of one."""
    pool = rand_chunk((3, 2, 4, 8, 2), torch.bfloat16, 8)  # [slots, L, T, H, D]
    slot = pool[2]
    assert slot.is_contiguous() and slot.storage_offset() > 0
    part = slot.narrow(1, 1, 2)  # tokens 1..2 of every layer
    store.put(key_of("slot"), slot)
    store.put(key_of("part"), part)
    assert_same_bytes(store.get(key_of("slot"), slot.shape, slot.dtype), slot)
    assert_same_bytes(store.get(key_of("part"), part.shape, part.dtype), part)


def test_round_trip_keeps_chunks_apart(store):
    chunks = {key_of(i): rand_chunk((3, 5), torch.float16, i) for i in range(20)}
    for k, c in chunks.items():
        store.put(k, c)
    for k, c in chunks.items():
        assert_same_bytes(store.get(k, (3, 5), torch.float16), c)


def test_round_trip_with_fsync(tmp_path):
    s = DiskTier.at(tmp_path, fsync=True)
    c = rand_chunk((4, 4), torch.bfloat16, 3)
    assert s.put(key_of(1), c)
    assert_same_bytes(s.get(key_of(1)), c)


def test_extra_metadata_is_stored_next_to_the_verified_fields(store):
    key = key_of("extra")
    store.put(key, torch.ones(4), {"tokens": "16", "format": "canonical"})
    with safe_open(store.file_of(key), framework="pt") as f:
        meta = f.metadata()
    assert meta["tokens"] == "16" and meta["format"] == "canonical"
    assert meta["key"] == key and meta["fingerprint"] == "fp-test" and meta["kvx_format"] == FORMAT_VERSION
    assert meta["crc32c"] == checksum(torch.ones(4))


FILE_DTYPES = sorted(ST_DTYPES, key=str)
FILE_SHAPES = [(), (0, 3), (7,), (2, 3, 17, 2, 8)]


@pytest.mark.parametrize("shape", FILE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FILE_DTYPES, ids=str)
def test_file_is_a_standard_safetensors_file(tmp_path, dtype, shape):
    """kvx writes the file itself: the safetensors library must read it as one of its own, with the data
    8-byte aligned after the header as the library's writer leaves it."""
    s = DiskTier.at(tmp_path / "kv", fingerprint="fp")
    chunk = rand_chunk(shape, dtype, zlib.crc32(f"{dtype}{shape}".encode()))
    key = key_of(f"{dtype}{shape}")
    extra = {"tokens": "16", "note": "ünïcode ✓"}
    s.put(key, chunk, extra)
    path = s.file_of(key)
    assert_same_bytes(load_file(path)["kv"], chunk)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["kv"]
    assert meta == {
        **extra,
        "kvx_format": FORMAT_VERSION,
        "key": key,
        "fingerprint": "fp",
        "crc32c": checksum(chunk),
        "created": meta["created"],
        "length": str(chunk.numel() * chunk.element_size()),
    }
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    nbytes = chunk.numel() * chunk.element_size()
    assert n % 8 == 0 and len(raw) == 8 + n + nbytes
    assert json.loads(raw[8 : 8 + n])["kv"] == {
        "dtype": ST_DTYPES[dtype],
        "shape": list(shape),
        "data_offsets": [0, nbytes],
    }
    # the library's own file of the same chunk holds the same tensor and metadata
    ref = str(tmp_path / "ref.safetensors")
    save_file({"kv": chunk}, ref, metadata=meta)
    with safe_open(ref, framework="pt") as f:
        assert f.metadata() == meta
        assert_same_bytes(f.get_tensor("kv"), chunk)


def test_put_writes_the_chunk_from_its_own_memory(store, monkeypatch):
    """No copy of the chunk is made on the way to the file: the data buffer handed to the writes is the
    tensor's memory (a pool slot, here)."""
    pool = rand_chunk((3, 64, 64), torch.bfloat16, 2)
    real = disk_mod._write_all
    seen = []

    def spy(fd, bufs):
        seen.extend(bufs)
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", spy)
    store.put(key_of("slot"), pool[1])
    header, data = seen
    assert isinstance(header, bytes)
    assert data.__array_interface__["data"][0] == pool[1].data_ptr() and data.nbytes == pool[1].nbytes


def test_checksum_is_crc32c_of_the_bytes():
    # "123456789" is the CRC check string: its CRC-32C is 0xe3069283, its zlib CRC-32 0xcbf43926 (kvx-1)
    assert checksum(torch.tensor(list(b"123456789"), dtype=torch.uint8)) == "e3069283"
    assert crc32(torch.tensor(list(b"123456789"), dtype=torch.uint8)) == "cbf43926"
    assert checksum(torch.empty(0, dtype=torch.uint8)) == "00000000"


@pytest.mark.parametrize("damaged", [False, True])
def test_chunks_of_format_kvx_1_are_still_read(store, damaged):
    """kvx-1 files (zlib CRC32) written by earlier versions stay hits; a damaged one is still caught."""
    key = key_of("v1")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path))
    t = torch.arange(64, dtype=torch.float32)
    crc = crc32(t) if not damaged else crc32(t + 1)
    save_file({"kv": t}, path, metadata={"kvx_format": "kvx-1", "key": key, "fingerprint": "fp-test", "crc32": crc})
    if damaged:
        with pytest.raises(ChunkError, match="checksum mismatch"):
            store.get(key)
    else:
        assert_same_bytes(store.get(key, t.shape, t.dtype), t)


# ------------------------------------------------------------------------------------------ verification
def test_get_missing_is_chunk_error_not_counted_as_corruption(store):
    with pytest.raises(ChunkError, match="not on disk"):
        store.get(key_of("missing"))
    assert store.stats()["errors"] == 0


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
    assert store.stats()["errors"] == 1


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
        store.get(key)  # ... serving it needs a valid file


def test_get_file_without_kv_tensor(store):
    key = key_of("nokv")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path))
    save_file(
        {"other": torch.ones(3)}, path, metadata={"kvx_format": FORMAT_VERSION, "key": key, "fingerprint": "fp-test"}
    )
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
    data_start = os.path.getsize(path) - nbytes  # safetensors: header, then the data
    off = data_start + {"first": 0, "middle": nbytes // 2, "last": nbytes - 1}[where]
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChunkError, match="checksum"):
        store.get(key, chunk.shape, dtype)
    assert store.stats()["errors"] == 1
    # a corrupt file is dropped: the chunk is now a miss, and the next save writes a good copy
    assert not store.contains(key)
    assert store.put(key, chunk)
    assert_same_bytes(store.get(key, chunk.shape, dtype), chunk)


def test_get_file_under_another_keys_name(store):
    a, b = key_of("a"), key_of("b")
    store.put(a, torch.zeros(4))
    store.put(b, torch.ones(4))
    os.replace(store.file_of(a), store.file_of(b))  # b's name, a's content
    with pytest.raises(ChunkError, match=f"key '{a}'"):
        store.get(b)
    assert not store.contains(a)
    assert not store.contains(b)  # mangled: dropped


def test_get_with_another_fingerprint(tmp_path):
    writer = DiskTier.at(tmp_path, fingerprint="layout=LBNHC")
    reader = DiskTier.at(tmp_path, fingerprint="layout=BLNHC")
    writer.put(key_of(1), torch.ones(4))
    with pytest.raises(ChunkError, match="fingerprint 'layout=LBNHC' != 'layout=BLNHC'"):
        reader.get(key_of(1))
    assert reader.stats()["errors"] == 1
    assert_same_bytes(writer.get(key_of(1)), torch.ones(4))  # valid for its own engine: kept


def test_get_with_another_format_version(store):
    key = key_of("old")
    path = store.file_of(key)
    os.makedirs(os.path.dirname(path))
    t = torch.ones(4)
    save_file(
        {"kv": t}, path, metadata={"kvx_format": "kvx-0", "key": key, "fingerprint": "fp-test", "crc32": checksum(t)}
    )
    with pytest.raises(ChunkError, match="format 'kvx-0' not in"):
        store.get(key)


@pytest.mark.parametrize(
    "ask",
    [
        dict(shape=(4, 8)),
        dict(shape=(8, 4)),
        dict(shape=(32,)),
        dict(shape=(1, 4, 8)),
        dict(dtype=torch.bfloat16),
        dict(dtype=torch.float32),
        dict(shape=(4, 8), dtype=torch.uint8),
    ],
    ids=str,
)
def test_get_wrong_shape_or_dtype(store, ask):
    key = key_of("sd")
    store.put(key, rand_chunk((4, 4, 2), torch.float16, 2))
    with pytest.raises(ChunkError, match="shape" if "shape" in ask else "dtype"):
        store.get(key, ask.get("shape"), ask.get("dtype"))


# ------------------------------------------------------------------------------------------ atomic writes
@pytest.mark.parametrize(
    "exc", [OSError(errno.EIO, "I/O error"), KeyboardInterrupt()], ids=["EIO", "KeyboardInterrupt"]
)
def test_crash_in_write_leaves_no_file(store, monkeypatch, exc):
    key = key_of("crash")
    seen = {}
    real_write = disk_mod._write_all

    def write_half_then_crash(fd, bufs):
        seen["tmp"] = os.readlink(f"/proc/self/fd/{fd}")
        real_write(fd, bufs[:1])  # the header only: a partial file under the temporary name
        raise exc

    monkeypatch.setattr(disk_mod, "_write_all", write_half_then_crash)
    with pytest.raises(type(exc)):
        store.put(key, torch.ones(8))
    tmp = seen["tmp"]
    assert tmp != store.file_of(key)
    assert os.path.dirname(tmp) == os.path.dirname(store.file_of(key))  # same fs: the rename is atomic
    assert not os.path.exists(tmp)
    assert not store.contains(key)
    assert files_in(store.path) == []
    assert store.usage() == 0 and store.stats()["puts"] == 0
    monkeypatch.undo()
    assert store.put(key, torch.ones(8))  # a later put works
    assert_same_bytes(store.get(key), torch.ones(8))


@pytest.mark.parametrize("exc", [OSError("EXDEV"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_crash_in_rename_leaves_no_file(store, monkeypatch, exc):
    key = key_of("rename")
    calls = []

    def replace_crash(src, dst):
        calls.append((src, dst))
        assert os.path.getsize(src) > 0  # the complete file exists under the temporary name only
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
    chunk = rand_chunk((1024, 1024), torch.uint8, 11)  # 1 MiB
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
    assert all(store.contains(k) for k in keys)


# ------------------------------------------------------------------------------------------ put / lookup
def test_put_existing_returns_false_touches_mtime_and_keeps_bytes(store):
    key = key_of("dup")
    first, second = torch.zeros(6), torch.ones(6)
    assert store.put(key, first)
    old = time.time() - 1000
    set_mtime(store, key, old)
    assert store.put(key, second) is False
    assert os.path.getmtime(store.file_of(key)) > old + 900
    assert_same_bytes(store.get(key), first)
    assert store.stats()["puts"] == 1
    assert store.usage() == os.path.getsize(store.file_of(key))


@pytest.mark.parametrize("present", [[], [0], [1, 3], [0, 1, 2, 3, 4]], ids=str)
def test_contains_is_per_key(store, present):
    keys = [key_of(f"l{i}") for i in range(5)]
    for i in present:
        store.put(keys[i], torch.full((2,), i))
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
    assert not any(store.contains(key_of(i)) for i in range(5))
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
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=5 * size, low_watermark=0.6)  # target: 3 files
    keys = [key_of(i) for i in range(5)]
    for k in keys:
        assert s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    assert s.stats()["evicted"] == 0  # at capacity, not over
    base = time.time() - 10 * 3600
    for rank, i in enumerate(order):  # order[0] is the oldest
        set_mtime(s, keys[i], base + rank * 3600)
    new = key_of("new")
    s.put(new, torch.zeros(2, 8, dtype=torch.float16))  # 6 files > 5: evict down to 3
    survivors = {keys[order[3]], keys[order[4]], new}
    assert {c.key for c in s.scan()} == survivors
    assert s.stats()["evicted"] == 3
    assert s.usage() == 3 * size


def test_get_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
    keys = [key_of(i) for i in range(3)]
    for k in keys:
        s.put(k, torch.zeros(2, 8, dtype=torch.float16))
    base = time.time() - 3600
    for i, k in enumerate(keys):
        set_mtime(s, k, base + i)  # keys[0] oldest
    s.get(keys[0])  # now the most recent
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {keys[0], keys[2], key_of("new")}


def test_put_of_existing_key_refreshes_recency(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size, low_watermark=1.0)
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
    first = DiskTier.at(tmp_path / "kv")
    for i in range(4):
        first.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(first, key_of(i), time.time() - 3600 + i)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=4 * size + size // 2, low_watermark=0.5)
    assert s.usage() == 4 * size
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))
    assert {c.key for c in s.scan()} == {key_of(3), key_of("new")}


def test_unbounded_store_never_evicts(tmp_path):
    s = DiskTier.at(tmp_path)
    for i in range(10):
        s.put(key_of(i), torch.zeros(64))
    assert s.evict() == 0 and all(s.contains(key_of(i)) for i in range(10))


def test_evict_with_nothing_to_do(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=10 * size)
    s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16))
    assert s.evict() == 0 and s.contains(key_of(0))


# ------------------------------------------------------------------------------------------ two engines
def test_two_stores_on_one_path_share_chunks(tmp_path):
    a, b = DiskTier.at(tmp_path, fingerprint="f"), DiskTier.at(tmp_path, fingerprint="f")
    chunk = rand_chunk((4, 4), torch.bfloat16, 9)
    assert a.put(key_of(1), chunk)
    assert b.contains(key_of(1))
    assert_same_bytes(b.get(key_of(1)), chunk)
    assert b.put(key_of(1), chunk) is False


@pytest.mark.parametrize("rescan_s", [0, 3600])
def test_engines_sharing_a_path_keep_it_within_its_budget(tmp_path, rescan_s):
    """Each engine re-counts the directory (after rescan_s), so together they stay within the budget."""
    size = one_file_bytes(tmp_path)
    stores = [
        DiskTier.at(tmp_path / "kv", capacity_bytes=6 * size, low_watermark=1.0, rescan_s=rescan_s) for _ in range(3)
    ]
    peak = 0
    for i in range(30):
        stores[i % 3].put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        peak = max(peak, stores[0].usage())
    if rescan_s == 0:
        assert peak <= 6 * size
    else:  # counts go stale for an hour: each engine sees only its own writes
        assert peak > 6 * size


def test_eviction_by_one_engine_is_a_miss_for_the_other(tmp_path):
    size = one_file_bytes(tmp_path)
    a = DiskTier.at(tmp_path / "kv", capacity_bytes=2 * size, low_watermark=1.0)
    b = DiskTier.at(tmp_path / "kv")
    b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16))
    set_mtime(b, key_of("b"), time.time() - 3600)
    a.put(key_of("a1"), torch.zeros(2, 8, dtype=torch.float16))
    a.put(key_of("a2"), torch.zeros(2, 8, dtype=torch.float16))
    # a counts only its own writes (2 files: not over); its next eviction scans the whole directory
    assert a.evict() == 1
    assert a.contains(key_of("a1")) and a.contains(key_of("a2"))
    assert not b.contains(key_of("b"))
    with pytest.raises(ChunkError, match="not on disk"):
        b.get(key_of("b"))
    assert b.stats()["errors"] == 0
    assert b.delete(key_of("b")) is False
    assert b.put(key_of("b"), torch.zeros(2, 8, dtype=torch.float16)) is True


def test_evict_tolerates_files_deleted_by_another_engine(tmp_path, monkeypatch):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=4 * size, low_watermark=0.5)
    for i in range(4):
        s.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, key_of(i), time.time() - 3600 + i)
    real_unlink = os.unlink

    def other_engine_was_faster(path, *args, **kw):
        real_unlink(path)  # another engine removes it between scan and unlink
        return real_unlink(path, *args, **kw)  # -> FileNotFoundError

    monkeypatch.setattr(disk_mod.os, "unlink", other_engine_was_faster)
    s.put(key_of("new"), torch.zeros(2, 8, dtype=torch.float16))  # 5 > 4: evict down to 2
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
    assert_same_bytes(store.get(key), torch.ones(4))


@pytest.mark.parametrize("threads", [2, 8])
def test_concurrent_puts_of_one_key(tmp_path, threads):
    stores = [DiskTier.at(tmp_path, fingerprint="f") for _ in range(2)]  # two engines, several threads
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
    assert files_in(tmp_path) == [os.path.relpath(stores[0].file_of(key), tmp_path)]  # no tmp left over
    for s in stores:
        assert_same_bytes(s.get(key, chunk.shape, chunk.dtype), chunk)


def test_concurrent_puts_and_gets_of_many_keys(store):
    chunks = {key_of(i): rand_chunk((8, 8), torch.float32, i) for i in range(32)}
    items = list(chunks.items())
    errors = []

    def worker(part):
        try:
            for k, c in part:
                store.put(k, c)
                assert_same_bytes(store.get(k), c)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert store.stats()["puts"] == 32 and store.stats()["gets"] == 32
    assert all(store.contains(k) for k in chunks)


# ------------------------------------------------------------------------------------------ capacity under load
class DirMeter:
    """The real bytes under a directory (chunk and temporary files), measured after every rename and by a
    sampling thread. Renames and unlinks take the meter's lock, so a measurement never sees a file under
    two names or half-way through an eviction; a temporary file being written counts with what it holds
    so far (never more than the bytes its put reserved)."""

    def __init__(self, path, monkeypatch):
        self.path, self.lock, self.peak, self.samples, self.at_peak = str(path), threading.RLock(), 0, 0, []
        real_replace, real_unlink = os.replace, os.unlink

        def replace(src, dst, *args, **kwargs):
            with self.lock:
                real_replace(src, dst, *args, **kwargs)
                self.measure()

        def unlink(p, *args, **kwargs):
            with self.lock:
                return real_unlink(p, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)

    def measure(self) -> int:
        with self.lock:
            total = dir_bytes(self.path)
            if total > self.peak:  # what was there, for the failure message
                self.peak, self.at_peak = total, files_in(self.path)
            self.samples += 1
            return total

    def sampling(self, done: threading.Event) -> threading.Thread:
        def run():
            while not done.is_set():
                self.measure()
                time.sleep(0.001)  # let the writers at the lock between samples

        t = threading.Thread(target=run)
        t.start()
        return t


def put_from_threads(stores, threads: int, per_thread: int, shape, meter: DirMeter) -> list:
    """``threads`` writer threads per store, each putting ``per_thread`` distinct chunks at once."""
    jobs = [(s, f"{i}-{t}") for i, s in enumerate(stores) for t in range(threads)]
    barrier = threading.Barrier(len(jobs))
    results, errors = [], []

    def worker(s, tag):
        barrier.wait()
        try:
            for j in range(per_thread):
                results.append(s.put(key_of(f"{tag}-{j}"), rand_chunk(shape, torch.float16, j)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    done = threading.Event()
    sampler = meter.sampling(done)
    ts = [threading.Thread(target=worker, args=job) for job in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.set()
    sampler.join()
    assert errors == []
    return results


LOAD_SHAPE = (64, 256)  # 32 KiB chunks: a write takes long enough for the threads to overlap
# (writer threads, capacity in chunks, low watermark): 8 threads into 2 chunks wait for each other
LOADS = [(1, 3, 0.9), (4, 3, 1.0), (8, 5, 0.6), (8, 2, 0.9)]


@pytest.mark.parametrize("threads, chunks, low_watermark", LOADS, ids=str)
def test_concurrent_puts_never_exceed_the_capacity(tmp_path, monkeypatch, threads, chunks, low_watermark):
    """Each put reserves its bytes and evicts before writing: the directory never holds more than the
    capacity, not even for a moment (the old store counted after the write and evicted afterwards:
    one chunk over per writer thread)."""
    size = one_file_bytes(tmp_path, LOAD_SHAPE)
    path = tmp_path / "kv"
    s = DiskTier.at(path, capacity_bytes=chunks * size, low_watermark=low_watermark)
    meter = DirMeter(path, monkeypatch)
    results = put_from_threads([s], threads, 10, LOAD_SHAPE, meter)
    assert results == [True] * threads * 10
    assert meter.peak <= chunks * size, f"{meter.peak} bytes of {chunks * size}: {meter.at_peak}"
    assert meter.peak >= (chunks - 1) * size and s.stats()["evicted"] > 0  # the test did reach the limit
    assert s.usage() <= chunks * size


def test_engines_sharing_a_path_overshoot_at_most_the_others_writes_in_flight(tmp_path, monkeypatch):
    """With rescan_s=0 every put re-counts the directory: N engines with T writer threads each stay within
    capacity + (N-1) x (T+1) chunks (what the others have in flight or reserve during one count)."""
    n, threads, chunks = 2, 3, 4
    size = one_file_bytes(tmp_path, LOAD_SHAPE)
    path = tmp_path / "kv"
    stores = [DiskTier.at(path, capacity_bytes=chunks * size, low_watermark=0.9, rescan_s=0) for _ in range(n)]
    meter = DirMeter(path, monkeypatch)
    put_from_threads(stores, threads, 8, LOAD_SHAPE, meter)
    assert meter.peak <= chunks * size + (n - 1) * (threads + 1) * size
    assert sum(s.stats()["evicted"] for s in stores) > 0


def test_chunk_larger_than_the_capacity_is_refused(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=size - 1)
    with pytest.raises(StoreFullError, match=f"a file of {size} bytes cannot fit in capacity_bytes={size - 1}"):
        s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16))
    assert files_in(s.path) == [] and s.stats()["full"] == 1


def test_put_waits_for_its_own_writes_in_flight_when_they_fill_the_capacity(tmp_path, monkeypatch):
    """Capacity for one chunk, two puts at once: the second waits until the first is on disk, then
    evicts it (LRU) rather than fail or overshoot."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=size)
    real = disk_mod._write_all
    writing, release = threading.Event(), threading.Event()
    second = {}

    def slow_first_write(fd, bufs):
        if not writing.is_set():
            writing.set()
            release.wait(10)
        real(fd, bufs)

    def put_second():
        second["result"] = s.put(key_of(2), torch.ones(2, 8, dtype=torch.float16))

    monkeypatch.setattr(disk_mod, "_write_all", slow_first_write)
    first = threading.Thread(target=lambda: s.put(key_of(1), torch.zeros(2, 8, dtype=torch.float16)))
    first.start()
    assert writing.wait(10)
    t = threading.Thread(target=put_second)
    t.start()
    t.join(0.2)
    assert t.is_alive() and "result" not in second  # no room while the first write is in flight
    release.set()
    first.join()
    t.join()
    assert second["result"] is True
    assert [c.key for c in s.scan()] == [key_of(2)] and s.stats()["evicted"] == 1


def test_capacity_set_while_a_put_writes_keeps_the_count_exact(tmp_path, monkeypatch):
    """A put that began without a capacity (reserving nothing) and ends after ``capacity_bytes`` was set
    must not settle as a reservation: the store once counted it as a negative reservation from then on,
    one chunk under the truth, and held capacity + 1 chunks (tests/faults/test_soak.py sets the capacity
    while the engine writes)."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv")
    real = disk_mod._write_all
    writing, release = threading.Event(), threading.Event()

    def slow_first_write(fd, bufs):
        if not writing.is_set():
            writing.set()
            release.wait(10)
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", slow_first_write)
    first = threading.Thread(target=lambda: s.put(key_of(0), torch.zeros(2, 8, dtype=torch.float16)))
    first.start()
    assert writing.wait(10)
    s.capacity_bytes = 3 * size
    release.set()
    first.join()
    for i in range(1, 8):
        assert s.put(key_of(i), torch.full((2, 8), i, dtype=torch.float16))
    assert len(files_in(s.path)) <= 3 and s.usage() <= 3 * size
    assert s.usage() == sum(os.path.getsize(os.path.join(s.path, f)) for f in files_in(s.path))


# ------------------------------------------------------------------------------------------ full disk
FULL_ERRNOS = [errno.ENOSPC, errno.EDQUOT]
BACKOFFS = [1, 2, 4, 8, 16, 32, 60, 60]  # seconds: doubling from 1, at most 60


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def fill(s: DiskTier, n: int, shape=(2, 8)) -> list[str]:
    """``n`` chunks, least recently used first (mtimes an hour apart, in the past)."""
    keys = [key_of(f"fill{i}") for i in range(n)]
    base = time.time() - (n + 1) * 3600
    for i, k in enumerate(keys):
        s.put(k, torch.zeros(shape, dtype=torch.float16))
        set_mtime(s, k, base + i * 3600)
    return keys


def temps_in(path) -> list[str]:
    return [f for f in files_in(path) if not f.endswith(".safetensors")]


@pytest.mark.parametrize("capacity", [None, 1000], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("err", FULL_ERRNOS, ids=errno.errorcode.get)
def test_full_disk_evicts_least_recently_used_and_retries_once(tmp_path, monkeypatch, err, capacity):
    """A full disk is not the store's capacity: eviction there never ran, and every later put failed."""
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=capacity and capacity * size)
    keys = fill(s, 20)
    real = disk_mod._write_all
    calls = []

    def full_once(fd, bufs):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(err, os.strerror(err))
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", full_once)
    assert s.put(key_of("new"), torch.ones(2, 8, dtype=torch.float16)) is True
    assert len(calls) == 2
    # 10% of the bytes of 20 equal chunks: the 2 least recently used
    assert {c.key for c in s.scan()} == set(keys[2:]) | {key_of("new")}
    assert s.stats()["evicted"] == 2 and s.stats()["full"] == 0
    assert temps_in(s.path) == []


def test_full_disk_backs_off_then_recovers(tmp_path, monkeypatch):
    clock = FakeClock()
    path = tmp_path / "kv"
    s = DiskTier.at(path, clock=clock)
    fill(s, 30)
    real = disk_mod._write_all
    disk = {"full": True, "writes": 0}

    def write(fd, bufs):
        disk["writes"] += 1
        if disk["full"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, bufs)

    touched = []
    for name in ("open", "stat", "utime", "scandir", "mkdir"):  # every way put reaches the store's files
        real_fn = getattr(os, name)

        def spy(p, *args, _real=real_fn, **kwargs):
            if str(p).startswith(str(path)):
                touched.append(p)
            return _real(p, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    monkeypatch.setattr(disk_mod, "_write_all", write)
    chunk = torch.ones(2, 8, dtype=torch.float16)
    with pytest.raises(StoreFullError, match=r"no space left on device .* back-off \(1 s\)") as e:
        s.put(key_of("first"), chunk)
    assert isinstance(e.value, StoreError) and isinstance(e.value.__cause__, OSError)
    assert disk["writes"] == 2 and s.stats()["evicted"] == 3  # one eviction (10%), one retry
    assert temps_in(path) == []
    for backoff, following in zip(BACKOFFS, BACKOFFS[1:]):
        failed_at = clock.t
        clock.t = failed_at + backoff - 0.01  # still backing off: no disk access at all
        touched.clear()
        writes = disk["writes"]
        with pytest.raises(StoreFullError, match=rf"back-off \({backoff} s, 0.0 s left\)"):
            s.put(key_of(f"fast{backoff}"), chunk)
        assert disk["writes"] == writes and touched == []
        clock.t = failed_at + backoff  # over: try again, fail, back off longer
        with pytest.raises(StoreFullError, match=rf"back-off \({following} s\)"):
            s.put(key_of(f"again{backoff}"), chunk)
        assert disk["writes"] == writes + 2
    disk["full"] = False
    clock.t += 60
    assert s.put(key_of("recovered"), chunk) is True  # a success resets the back-off
    disk["full"] = True
    with pytest.raises(StoreFullError, match=r"back-off \(1 s\)"):
        s.put(key_of("full again"), chunk)
    assert temps_in(path) == []


def test_writers_hitting_a_full_disk_together_evict_once(tmp_path, monkeypatch):
    """Two puts fail on the full disk at once: the second retries in the room the first one made
    instead of evicting another 10%."""
    s = DiskTier.at(tmp_path / "kv")
    keys = fill(s, 20)
    real = disk_mod._write_all
    n = {"writes": 0}

    def write(fd, bufs):
        n["writes"] += 1
        if n["writes"] == 1:  # put A's write fails; put B started meanwhile fails, evicts, retries
            assert s.put(key_of("b"), torch.ones(2, 8, dtype=torch.float16))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if n["writes"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, bufs)

    monkeypatch.setattr(disk_mod, "_write_all", write)
    assert s.put(key_of("a"), torch.ones(2, 8, dtype=torch.float16))
    assert n["writes"] == 4 and s.stats()["evicted"] == 2
    assert {c.key for c in s.scan()} == set(keys[2:]) | {key_of("a"), key_of("b")}


def test_full_tmpfs_is_relieved_by_eviction_and_backs_off_when_nothing_is_left(tmpfs):
    disk = tmpfs("8m")  # 8 MiB: a disk that really fills up
    clock = FakeClock()
    s = DiskTier.at(disk / "kv", clock=clock)
    chunk = rand_chunk((1 << 20,), torch.uint8, 1)  # 1 MiB: 7 fit in 8 MiB with their headers
    base = time.time() - 3600
    for i in range(20):
        assert s.put(key_of(i), chunk) is True
        set_mtime(s, key_of(i), base + i)
    kept = sorted(c.key for c in s.scan())
    assert 5 <= len(kept) <= 7 and kept == sorted(key_of(i) for i in range(20 - len(kept), 20))  # the newest
    assert s.stats()["evicted"] >= 20 - 7 and s.stats()["full"] == 0
    assert temps_in(s.path) == []
    # Now something the store cannot evict takes the whole disk: puts fail, leave nothing, back off.
    s.clear()
    fd = os.open(disk / "other", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError) as full:
        while True:
            os.write(fd, b"\0" * 65536)
    os.close(fd)
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(StoreFullError, match=r"back-off \(1 s\)"):
        s.put(key_of("x"), chunk)
    assert temps_in(s.path) == []
    with pytest.raises(StoreFullError, match=r"0.5 s left"):
        clock.t += 0.5
        s.put(key_of("x"), chunk)
    os.unlink(disk / "other")
    clock.t += 0.5
    assert s.put(key_of("x"), chunk) is True
    assert_same_bytes(s.get(key_of("x")), chunk)


# ------------------------------------------------------------------------------------------ failures
@pytest.fixture(params=["EROFS", "chmod", "read-only mount"])
def read_only_store(request, tmp_path, monkeypatch):
    """A store holding one chunk (key_of("old")) on a directory that refuses writes."""
    how = request.param
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    path = tmp_path / "kv"
    if how == "read-only mount":
        mount_tmpfs(path, "1m")
    s = DiskTier.at(path, capacity_bytes=1 << 20)
    s.put(key_of("old"), torch.ones(4))
    if how == "EROFS":
        real_open = os.open

        def read_only(p, *args, **kwargs):
            if str(p).startswith(str(path)) and len(args) and args[0] & os.O_CREAT:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), p)
            return real_open(p, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    elif how == "chmod":
        (path / key_of("new")[:2]).mkdir(exist_ok=True)
        for d in (*path.iterdir(), path):
            d.chmod(0o555)
    else:
        remount(path, "ro")
    try:
        yield s
    finally:
        if how == "chmod":
            for d in path.iterdir():
                d.chmod(0o755)
            path.chmod(0o755)
        elif how == "read-only mount":
            umount(path)


def test_put_to_a_read_only_directory_fails_clearly_and_leaves_nothing(read_only_store):
    s = read_only_store
    before = files_in(s.path)
    key = key_of("new")
    with pytest.raises(OSError, match=rf"disk store {re.escape(s.path)}: cannot write chunk {key}") as e:
        s.put(key, torch.ones(4))
    assert e.value.errno in (errno.EROFS, errno.EACCES) and e.value.filename == s.file_of(key)
    assert not isinstance(e.value, StoreFullError)
    assert files_in(s.path) == before and s.stats()["puts"] == 1
    assert_same_bytes(s.get(key_of("old")), torch.ones(4))  # reads still work
    assert s.usage() == os.path.getsize(s.file_of(key_of("old")))
    assert s.evict() == 0


def test_store_directory_deleted_while_serving(tmp_path):
    size = one_file_bytes(tmp_path)
    s = DiskTier.at(tmp_path / "kv", capacity_bytes=3 * size)
    chunk = torch.zeros(2, 8, dtype=torch.float16)
    for i in range(3):
        s.put(key_of(i), chunk)
    shutil.rmtree(s.path)
    assert not s.contains(key_of(0))
    with pytest.raises(ChunkError, match="not on disk"):
        s.get(key_of(0))
    assert list(s.scan()) == [] and s.temp_files() == [] and s.usage() == 0
    assert s.evict() == 0 and s.clear() == 0 and s.delete(key_of(0)) is False
    assert s.stats()["errors"] == 0
    assert s.put(key_of(0), chunk) is True  # recreates the directory
    assert_same_bytes(s.get(key_of(0)), chunk)
    for i in range(1, 5):  # and the count starts from what is there
        s.put(key_of(i), chunk)
    assert s.usage() <= 3 * size


def test_file_deleted_between_contains_and_get_is_a_miss(store, monkeypatch):
    key = key_of("gone")
    store.put(key, torch.ones(4))
    assert store.contains(key)
    real = open

    def evicted_first(path, *args, **kwargs):
        os.unlink(path)  # another engine evicts it just now
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_mod, "open", evicted_first, raising=False)
    with pytest.raises(ChunkError, match="not on disk"):
        store.get(key)
    assert store.stats()["errors"] == 0


def test_file_deleted_while_being_read_is_still_served(store, monkeypatch):
    """Once open, the bytes stay readable (the open file holds them) and verify."""
    key = key_of("reading")
    chunk = rand_chunk((16, 16), torch.bfloat16, 3)
    store.put(key, chunk)
    real = open

    def open_then_evicted(path, *args, **kwargs):
        f = real(path, *args, **kwargs)
        os.unlink(path)  # another engine evicts it once it is open
        return f

    monkeypatch.setattr(disk_mod, "open", open_then_evicted, raising=False)
    assert_same_bytes(store.get(key, chunk.shape, chunk.dtype), chunk)
    assert not store.contains(key) and store.stats()["errors"] == 0


# ------------------------------------------------------------------------------------------ temporary files
OTHER_HOST = f"{(int(directory._HOST, 16) + 1) % 2**32:08x}"
OLD = directory._TMP_MAX_AGE_S + 60
TEMP_NAME = re.compile(r"\.(?P<key>[0-9a-f]+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")
# (case, name of the temporary file given the pids, age in seconds, stale?)
TEMP_CASES = [
    ("writer dead", lambda k, p: f".{k}.{directory._HOST}.{p['dead']}.deadbeef.tmp", 0, True),
    ("writer alive", lambda k, p: f".{k}.{directory._HOST}.{p['live']}.deadbeef.tmp", 0, False),
    ("writer alive, too old", lambda k, p: f".{k}.{directory._HOST}.{p['live']}.deadbeef.tmp", OLD, True),
    ("this pid, not written by it", lambda k, p: f".{k}.{directory._HOST}.{os.getpid()}.deadbeef.tmp", 0, True),
    ("other host", lambda k, p: f".{k}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", 0, False),
    ("other host, old", lambda k, p: f".{k}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", OLD, True),
    ("older kvx name", lambda k, p: f".{k}.{p['dead']}.deadbeef.tmp", 0, False),
    ("older kvx name, old", lambda k, p: f".{k}.{p['dead']}.deadbeef.tmp", OLD, True),
    ("safetensors name", lambda k, p: ".tmpAb12Cd", 0, False),
    ("safetensors name, old", lambda k, p: ".tmpAb12Cd", OLD, True),
]


def in_child(body) -> int:
    """Run ``body(report)`` in a forked process (another engine's writer, sharing this host's pids
    without re-importing torch); ``report(bytes)`` writes to the pipe the parent reads. Returns the pid;
    the caller reads with :func:`child_says`, then kills and reaps it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            body(lambda msg: os.write(w, msg))
        finally:
            os._exit(0)
    os.close(w)
    in_child.pipes[pid] = r
    return pid


in_child.pipes = {}


def child_says(pid: int) -> bytes:
    r = in_child.pipes.pop(pid)
    try:
        return os.read(r, 4096)  # b"" if it exited without a word
    finally:
        os.close(r)


def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)  # no cleanup of any kind, as after kill -9
    os.waitpid(pid, 0)


def make_temp(path, key: str, name: str, nbytes: int, age_s: float = 0.0) -> str:
    d = os.path.join(path, key[:2])
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(b"\x00" * nbytes)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


@pytest.mark.parametrize("case, name_of, age, stale", TEMP_CASES, ids=[c[0] for c in TEMP_CASES])
def test_temporary_files_are_removed_only_when_their_writer_is_gone(tmp_path, pids, case, name_of, age, stale):
    key = key_of(case)
    p = make_temp(tmp_path, key, name_of(key, pids), 1000, age)
    sv = survey(str(tmp_path))  # read-only
    assert [(t.path, t.bytes, t.stale) for t in sv.temps] == [(p, 1000, stale)] and sv.chunks == []
    assert os.path.exists(p)
    s = DiskTier.at(tmp_path)  # start-up removes the stale ones
    assert os.path.exists(p) is not stale
    assert s.stats()["tmp_removed"] == int(stale)
    assert s.usage() == (0 if stale else 1000)  # counted until removed
    assert [t.path for t in s.temp_files()] == ([] if stale else [p])


def test_a_live_writers_temporary_file_is_removed_once_it_dies(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    key = key_of("w")
    p = make_temp(tmp_path, key, f".{key}.{directory._HOST}.{writer.pid}.0badf00d.tmp", 100)
    s = DiskTier.at(tmp_path)
    assert [t.reason for t in s.temp_files()] == [f"being written by pid {writer.pid}"]
    writer.stdin.close()
    writer.wait()
    assert s.usage() == 0 and not os.path.exists(p)  # the next scan removes it
    assert s.stats()["tmp_removed"] == 1


def test_files_that_are_not_kvx_files_are_left_alone(tmp_path):
    s = DiskTier.at(tmp_path)
    s.put(key_of(1), torch.ones(4))
    others = [
        tmp_path / "README",
        tmp_path / "ab" / "notes.txt",
        tmp_path / "ab" / ".hidden",
        tmp_path / "abc" / ".x.tmp",
    ]  # not a two-character subdirectory
    for p in others:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x" * 10)
        os.utime(p, (1, 1))  # very old
    assert s.usage() == os.path.getsize(s.file_of(key_of(1)))
    s.clear()
    assert all(p.exists() for p in others)


def test_put_writes_only_names_kvx_recognises(tmp_path, monkeypatch):
    """Mid-write, the only new name in the directory is kvx's temporary file: safetensors' save_file
    used its own .tmpXXXXXX name, which a crash leaked. Another engine starting meanwhile (in this
    process, and in another one) counts it as a write in flight and leaves it alone."""
    path = tmp_path / "kv"
    s = DiskTier.at(path, capacity_bytes=1 << 20)
    key = key_of("inflight")
    chunk = rand_chunk((64, 64), torch.float16, 1)
    real = disk_mod._write_all
    seen = {}

    def other_process(report):
        other = DiskTier.at(path)
        report(f"{len(other.temp_files())} {other.usage()}".encode())

    def write_with_others_looking(fd, bufs):
        real(fd, bufs[:1])  # the header
        seen["tmp"] = os.readlink(f"/proc/self/fd/{fd}")
        seen["names"] = files_in(path)
        other = DiskTier.at(path)
        seen["other"] = [(t.path, t.stale, t.reason) for t in other.temp_files()], other.usage()
        pid = in_child(other_process)
        seen["child"] = child_says(pid).decode()
        os.waitpid(pid, 0)
        seen["kept"] = os.path.exists(seen["tmp"])
        real(fd, bufs[1:])

    monkeypatch.setattr(disk_mod, "_write_all", write_with_others_looking)
    assert s.put(key, chunk)
    tmp = seen["tmp"]
    assert seen["names"] == [os.path.relpath(tmp, path)]
    m = TEMP_NAME.fullmatch(os.path.basename(tmp))
    assert m and m["key"] == key and m["host"] == directory._HOST and int(m["pid"]) == os.getpid()
    header = os.path.getsize(s.file_of(key)) - chunk.numel() * 2
    assert seen["other"] == ([(tmp, False, "being written by this process")], header)
    assert seen["child"] == f"1 {header}"  # another pid: alive, so in flight
    assert seen["kept"]
    assert files_in(path) == [os.path.relpath(s.file_of(key), path)]


@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_9_leaves_only_a_temporary_file_that_the_next_start_removes(tmp_path, capsys, where):
    from kvx.store import cli as store_cli

    path = tmp_path / "kv"
    chunk = torch.ones(1 << 20, dtype=torch.uint8)

    def writer(report):
        def pause(*args, **kwargs):
            report(b"ready")
            time.sleep(120)

        if where == "write":  # killed with the header written, the data not
            real = getattr(disk_mod, "_write_all", None)

            def half(fd, bufs):
                real(fd, bufs[:1])
                pause()

            disk_mod._write_all = half
        else:  # killed with the whole file written, before the rename
            os.replace = pause
        DiskTier.at(path).put("ab" * 16, chunk)
        report(b"done")

    pid = in_child(writer)
    try:
        said = child_says(pid)
    finally:
        kill_and_reap(pid)
    assert said == b"ready"
    left = files_in(path)
    assert len(left) == 1
    m = TEMP_NAME.fullmatch(os.path.basename(left[0]))
    assert m and m["host"] == directory._HOST and int(m["pid"]) == pid, left
    sv = survey(str(path))
    assert [(t.stale, t.reason) for t in sv.temps] == [(True, f"writer pid {pid} is gone")]
    assert store_cli.main(["inspect", str(path)]) == 0
    assert "0 in flight (0.0 MiB), 1 stale" in capsys.readouterr().out
    s = DiskTier.at(path)
    assert files_in(path) == [] and s.stats()["tmp_removed"] == 1 and s.usage() == 0


def test_temporary_files_count_against_the_capacity(tmp_path):
    size = one_file_bytes(tmp_path)
    path = tmp_path / "kv"
    # another host's write in flight, as large as two chunks
    tmp = make_temp(path, key_of("x"), f".{key_of('x')}.{OTHER_HOST}.1.deadbeef.tmp", 2 * size)
    s = DiskTier.at(path, capacity_bytes=5 * size, low_watermark=1.0)
    assert s.usage() == 2 * size
    base = time.time() - 3600
    for i in range(4):
        assert s.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, key_of(i), base + i)
    assert {c.key for c in s.scan()} == {key_of(1), key_of(2), key_of(3)}  # 3 chunks + the temp = 5
    assert s.usage() == 5 * size and os.path.exists(tmp)
    assert s.stats()["evicted"] == 1


def test_removing_stale_files_is_logged_by_the_modules_logger(tmp_path, caplog):
    key = key_of("log")
    make_temp(tmp_path, key, f".{key}.{OTHER_HOST}.1.deadbeef.tmp", 10, OLD)
    caplog.set_level(logging.INFO, logger="kvx")
    DiskTier.at(tmp_path)
    assert [(r.name, r.levelno) for r in caplog.records] == [("kvx.store.disk", logging.INFO)]
    assert "removed 1 stale temporary files" in caplog.records[0].getMessage()


# ------------------------------------------------------------------------------------------ closed store
@pytest.mark.parametrize("op", CLOSED_OPS)
def test_closed_store_raises(tmp_path, op):
    s = DiskTier.at(tmp_path)
    k = key_of(0)
    s.put(k, torch.ones(4))
    s.close()
    s.close()  # idempotent
    calls = {
        "put": lambda: s.put(key_of(1), torch.ones(4)),
        "get": lambda: s.get(k),
        "contains": lambda: s.contains(k),
        "delete": lambda: s.delete(k),
        "scan": lambda: s.scan(),
        "usage": lambda: s.usage(),
        "evict": lambda: s.evict(),
        "clear": lambda: s.clear(),
        "temp_files": lambda: s.temp_files(),
    }
    with pytest.raises(StoreClosedError, match="closed"):
        calls[op]()
    assert os.path.exists(s.file_of(k)) and not os.path.exists(s.file_of(key_of(1)))


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, arg", BAD_CTOR, ids=[f"{a}={v[a]!r}" for v, a in BAD_CTOR])
def test_bad_constructor_args(tmp_path, kwargs, arg):
    kwargs = {"path": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=f"^{arg}: "):
        DiskTier.at(**kwargs)


def test_good_constructor_edge_values(tmp_path):
    s = DiskTier.at(str(tmp_path / "new" / "dir"), capacity_bytes=1, low_watermark=1.0)
    assert os.path.isdir(s.path) and os.path.isabs(s.path)
    assert DiskTier.at(tmp_path, low_watermark=1).low_watermark == 1


@pytest.mark.parametrize("op", KEY_OPS)
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys(store, key, op):
    calls = {
        "file_of": lambda: store.file_of(key),
        "contains": lambda: store.contains(key),
        "put": lambda: store.put(key, torch.ones(2)),
        "get": lambda: store.get(key),
        "delete": lambda: store.delete(key),
    }
    with pytest.raises(ValueError, match="^key: expected a lowercase hex string"):
        calls[op]()
    assert files_in(store.path) == []


@pytest.mark.parametrize("name, make, expected", BAD_CHUNKS, ids=[c[0] for c in BAD_CHUNKS])
@pytest.mark.parametrize("exists", [False, True])
def test_bad_chunk(store, name, make, expected, exists):
    key = key_of("bad")
    if exists:
        store.put(key, torch.ones(2))
    with pytest.raises(ValueError, match=f"^chunk: expected {expected}"):
        store.put(key, make())
    assert store.stats()["puts"] == int(exists)


@pytest.mark.parametrize("name, extra", BAD_EXTRA, ids=[n for n, _ in BAD_EXTRA])
def test_bad_extra(store, name, extra):
    with pytest.raises(ValueError, match="^extra: "):
        store.put(key_of("x"), torch.ones(2), extra)
    assert files_in(store.path) == []
