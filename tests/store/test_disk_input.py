"""DiskTier misuse: every operation of a closed store raises (close is idempotent), and bad constructor
arguments, keys, chunks and extra metadata are refused by name, leaving nothing on disk."""

import os

import pytest
import torch

from kvx.store.disk import DiskTier, StoreClosedError
from tests.store.disk_helpers import files_in, key_of

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
