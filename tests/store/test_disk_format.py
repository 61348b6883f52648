"""DiskTier round trips and the file format: bit-exact chunks of every dtype and odd shapes (non-contiguous
views, pool slots), file names (``<path>/<key[:2]>/<key>.safetensors``), fsync, extra metadata, files that the
safetensors library reads as its own, no copy of the chunk on the way to the file, the CRC32C checksum, and files
of the earlier kvx-1 format."""

import json
import os
import struct
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store.codec import FORMAT_VERSION, ST_DTYPES, crc32
from kvx.store.codec import crc32c as checksum
from kvx.store.disk import ChunkError, DiskTier
from tests.helpers import assert_same_bytes
from tests.store.disk_helpers import key_of, rand_chunk

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


SHAPES = [(1,), (7,), (3, 5), (2, 3, 17, 2, 8), (4, 1, 16, 2, 8)]  # odd sizes; the last two: [L, P, T, H, D]


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


# ------------------------------------------------------------------------------------------ the file
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
