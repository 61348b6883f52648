"""Helpers of the DiskTier test modules (tests/store/test_disk_*.py): connector-like keys, random chunks,
the files under a store's directory, and the size of one chunk file. The ``store`` fixture (a DiskTier at
``tmp_path / "kv"``) is in tests/store/conftest.py."""

import hashlib
import os

import torch

from kvx.store.disk import DiskTier


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
