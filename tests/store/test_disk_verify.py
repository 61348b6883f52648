"""DiskTier verification on read: a missing file (a miss, not corruption), truncated, garbage and damaged files
(flipped bytes fail the checksum and are dropped), a file under another key's name, another fingerprint or format
version, and a wrong shape or dtype asked for."""

import os

import pytest
import torch
from safetensors.torch import save_file

from kvx.store.codec import FORMAT_VERSION
from kvx.store.codec import crc32c as checksum
from kvx.store.disk import ChunkError, DiskTier
from tests.helpers import assert_same_bytes
from tests.store.disk_helpers import key_of, rand_chunk

FLIP_AT = ["first", "middle", "last"]


TRUNCATE_TO = [0, 7, 8, 40, "half", "minus_one"]


SEEDS = [0, 1]


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
