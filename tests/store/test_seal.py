"""Sealed tiers (``"encryption"``, kvx.store.seal) on a real disk and a real redis-server: round trips; the tenant
is part of a chunk's name: a chunk written in the clear or with another tenant's secret is a miss at lookup, and
two tenants each store and hit their own copy of one chunk key; a chunk for another fingerprint, tampered
(payload, header, tag), replayed under another chunk key or moved under another secret's name is a miss
(ChunkError: the connector recomputes), never loaded; key rotation (written with the newest, found and read with
any); the config's errors at check time; TLS + an ACL user."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tempfile

import pytest
import torch

from kvx.connector.config import ConfigError, KVXConfig, check_paths
from kvx.store import ChunkError, codec
from kvx.store.disk import DiskTier
from kvx.store.redis import RedisTier, RedisTierConfig
from kvx.store.seal import SEALED_VERSION, EncryptionConfig, Sealer, check_encryption, key_id
from kvx.store.tier import TierContext
from kvx.testing.redis_server import RedisServer
from tests.helpers import assert_same_bytes, need_redis
from tests.store.conftest import new_key, random_chunk

FP = "fp-seal"
KINDS = ["disk", "redis"]


def secret_file(tmp_path, name: str, secret: bytes | None = None) -> str:
    p = tmp_path / name
    p.write_bytes(secret if secret is not None else os.urandom(32).hex().encode() + b"\n")
    return str(p)


@pytest.fixture
def keys(tmp_path):
    """Three secret files (tenant A's current and previous secrets, tenant B's)."""
    return {n: secret_file(tmp_path, n) for n in ("a", "a_old", "b")}


class Store:
    """Tiers of one kind on one shared store (a directory, or a redis-server), raw access to stored values."""

    def __init__(self, kind: str, tmp_path, server: RedisServer | None):
        self.kind, self.path, self.server = kind, str(tmp_path / "store"), server
        self.tiers = []

    def tier(self, encryption=None, fingerprint: str = FP, **cfg):
        if self.kind == "disk":
            t = DiskTier.at(self.path, fingerprint=fingerprint, encryption=encryption)
        else:
            cfg.setdefault("max_value_size", 64 << 10)
            t = RedisTier.open(
                RedisTierConfig(type="redis", url=self.server.url, encryption=encryption, lookup_wait_ms=1000, **cfg),
                TierContext(fingerprint),
            )
        self.tiers.append(t)
        return t

    def name(self, key: str, kid: str | None = None) -> str:
        """Where chunk ``key`` is stored: in the clear, or sealed with the secret of key id ``kid`` (the layout,
        spelled out here rather than asked of the tier)."""
        if self.kind == "disk":
            return os.path.join(self.path, key[:2], f"{key}-{kid}.safetensors" if kid else f"{key}.safetensors")
        return f"kvx:1:{{{key}}}-{kid}" if kid else f"kvx:1:{{{key}}}"

    def raw(self, key: str, kid: str | None = None) -> bytes | None:
        if self.kind == "disk":
            try:
                with open(self.name(key, kid), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        return self.server.client().get(self.name(key, kid))

    def set_raw(self, key: str, value: bytes, kid: str | None = None) -> None:
        if self.kind == "disk":
            os.makedirs(os.path.join(self.path, key[:2]), exist_ok=True)
            with open(self.name(key, kid), "wb") as f:
                f.write(value)
        else:
            self.server.client().set(self.name(key, kid), value)

    def names(self) -> list[str]:
        """Every chunk name in the store (a disk file's path; a Redis key other than a part)."""
        if self.kind == "disk":
            return sorted(os.path.join(d, f) for d, _, fs in os.walk(self.path) for f in fs)
        return sorted(k.decode() for k in self.server.client().keys("kvx:1:*") if k.count(b":") == 2)

    def close(self):
        for t in self.tiers:
            t.close()


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    server = None
    if request.param == "redis":
        need_redis()
        server = RedisServer()
    s = Store(request.param, tmp_path, server)
    yield s
    s.close()
    if server is not None:
        server.stop()


def enc(*paths: str) -> dict:
    """A tier's ``encryption``: one key file, or several (newest first)."""
    return {"key_file": paths[0]} if len(paths) == 1 else {"key_files": list(paths)}


def kid(path: str) -> str:
    """The key id of the secret in key file ``path`` (its trailing newline is not part of it)."""
    return key_id(open(path, "rb").read()[:-1])


NOT_THERE = "not on disk|not in redis"  # a miss: nothing under any name the tier reads


def miss(tier, key: str, like: torch.Tensor, match: str) -> torch.Tensor:
    """``get_into`` of ``key`` fails with a ChunkError matching ``match``; returns the buffer it was given."""
    out = torch.zeros_like(like)
    with pytest.raises(ChunkError, match=match):
        tier.get_into(key, out)
    return out


def header_of(value: bytes) -> dict:
    (n,) = struct.unpack("<Q", value[:8])
    return json.loads(value[8 : 8 + n])


def with_header(value: bytes, edit) -> bytes:
    """``value`` with its JSON header edited by ``edit(doc)`` (padded back to the same length if it fits)."""
    (n,) = struct.unpack("<Q", value[:8])
    doc = json.loads(value[8 : 8 + n])
    edit(doc)
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + value[8 + n :]


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize(
    "shape,dtype",
    [((7,), torch.uint8), ((3, 5), torch.bfloat16), ((2, 3, 17, 2, 8), torch.float32), ((40000,), torch.float16)],
)
def test_round_trip_and_nothing_in_the_clear(store, keys, shape, dtype):
    tier = store.tier(enc(keys["a"]))
    key = new_key()
    x = random_chunk(shape, dtype, 1)
    assert tier.put(key, x) and tier.contains_many([key]) == [True]
    assert not tier.put(key, x)  # present: not written again
    out = torch.full_like(x, 0) if dtype != torch.uint8 else torch.zeros_like(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    if store.kind == "redis" and x.nbytes > (64 << 10):
        return  # stored in parts: the raw value is a manifest
    assert store.raw(key) is None  # nothing under the name in the clear: the name carries the secret's key id
    value = store.raw(key, kid(keys["a"]))
    meta = header_of(value)["__metadata__"]
    assert meta["kvx_format"] == SEALED_VERSION and meta["seal"] == "aes-256-gcm"
    assert meta["kid"] == kid(keys["a"]) and "crc32c" not in meta
    payload = value[-x.nbytes :]
    assert len(payload) == x.nbytes and payload != codec.byte_view(x).tobytes()
    if x.nbytes >= 64:  # no 16-byte run of the plaintext survives
        plain = codec.byte_view(x).tobytes()
        assert all(plain[i : i + 16] not in payload for i in range(0, len(plain) - 16, max(1, len(plain) // 64)))


def test_round_trip_in_parts_redis(tmp_path, keys):
    """A chunk larger than max_value_size: its sealed encoding in parts, decrypted as the parts arrive."""
    need_redis()
    with RedisServer() as server:
        s = Store("redis", tmp_path, server)
        try:
            tier = s.tier(enc(keys["a"]))
            key = new_key()
            x = random_chunk((5, 70001), torch.uint8, 2)
            assert tier.put(key, x)
            assert s.raw(key, kid(keys["a"])).startswith(b"kvxparts")
            out = torch.zeros_like(x)
            tier.get_into(key, out)
            assert_same_bytes(out, x)
            # a part altered: the tag fails, the chunk is dropped
            c = server.client()
            part = sorted(k for k in c.keys(f"{s.name(key, kid(keys['a']))}:*"))[2]
            v = bytearray(c.get(part))
            v[len(v) // 2] ^= 1
            c.set(part, bytes(v))
            miss(tier, key, x, "failed authentication")
            assert tier.contains_many([key]) == [False]
        finally:
            s.close()


# ------------------------------------------------------------------------------------------ misses
def test_plaintext_chunk_is_a_miss_at_lookup(store, keys):
    plain, sealed = store.tier(), store.tier(enc(keys["a"]))
    key, x, y = new_key(), random_chunk((64, 33), torch.float16, 3), random_chunk((64, 33), torch.float16, 33)
    assert plain.put(key, x)
    assert sealed.contains_many([key]) == [False]
    out = miss(sealed, key, x, NOT_THERE)
    assert not torch.equal(out, x)
    assert sealed.put(key, y)  # the sealed tier stores its own, next to the chunk in the clear
    for tier, want in ((plain, x), (sealed, y)):
        out = torch.zeros_like(want)
        tier.get_into(key, out)
        assert_same_bytes(out, want)
    # a chunk in the clear moved under the sealed name: read, refused, dropped (misplaced), never served
    store.set_raw(key, store.raw(key), kid(keys["a"]))
    miss(sealed, key, x, "not sealed")
    assert store.raw(key, kid(keys["a"])) is None and store.raw(key) is not None


def test_sealed_chunk_is_never_served_in_the_clear(store, keys):
    plain, sealed = store.tier(), store.tier(enc(keys["a"]))
    key, x = new_key(), random_chunk((64, 33), torch.float16, 4)
    assert sealed.put(key, x)
    assert plain.contains_many([key]) == [False]
    miss(plain, key, x, NOT_THERE)
    # copied under the name in the clear: a format the clear tier does not read
    store.set_raw(key, store.raw(key, kid(keys["a"])))
    miss(plain, key, x, "kvx-sealed-1.*no encryption key")


def test_another_tenants_secret_is_a_miss_at_lookup(store, keys):
    a, b = store.tier(enc(keys["a"])), store.tier(enc(keys["b"]))
    key, x = new_key(), random_chunk((128, 8), torch.bfloat16, 5)
    assert b.put(key, x)
    assert a.contains_many([key]) == [False]
    miss(a, key, x, NOT_THERE)
    assert store.raw(key, kid(keys["b"])) is not None  # another tenant's chunk: never touched
    assert a.stats()["errors"] == 0
    # B's chunk moved under A's name, as is: its header names B's secret, not the name's: dropped
    store.set_raw(key, store.raw(key, kid(keys["b"])), kid(keys["a"]))
    miss(a, key, x, "stored under the name of key id")
    assert store.raw(key, kid(keys["a"])) is None
    # and with its header edited to name A's secret (a forgery): it fails at the tag
    forged = with_header(store.raw(key, kid(keys["b"])), lambda d: d["__metadata__"].update(kid=kid(keys["a"])))
    store.set_raw(key, forged, kid(keys["a"]))
    miss(a, key, x, "failed authentication")


def test_two_tenants_store_and_hit_their_own_chunks_of_one_prompt(store, keys, caplog, tmp_path):
    """The same chunk key (the same prompt, no cache_salt) for tenants with different secrets and one in the clear:
    each stores its own copy and hits it; a tenant holding none of their secrets misses all of them at lookup.
    No load error, no warning."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvx")
    keys = {**keys, "c": secret_file(tmp_path, "c")}
    for p in keys.values():
        os.chmod(p, 0o600)  # no warning about the key files either
    tenants = {"a": store.tier(enc(keys["a"])), "b": store.tier(enc(keys["b"])), "clear": store.tier()}
    key = new_key()
    chunks = {name: random_chunk((32, 64), torch.float16, 40 + i) for i, name in enumerate(tenants)}
    for name, tier in tenants.items():
        assert tier.contains_many([key]) == [False]  # the others' copies are not this tenant's
        assert tier.put(key, chunks[name])
    for name, tier in tenants.items():
        assert tier.contains_many([key]) == [True]
        assert not tier.put(key, chunks[name])  # present: not written again
        out = torch.zeros_like(chunks[name])
        tier.get_into(key, out)
        assert_same_bytes(out, chunks[name])
        assert tier.stats()["errors"] == 0
    assert len(store.names()) == 3  # one copy per tenant
    c = store.tier(enc(keys["c"]))
    assert c.contains_many([key]) == [False]
    miss(c, key, chunks["a"], NOT_THERE)
    assert c.stats()["errors"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_another_fingerprint_is_a_miss(store, keys):
    mine, other = store.tier(enc(keys["a"])), store.tier(enc(keys["a"]), fingerprint="fp-other")
    key, x = new_key(), random_chunk((100,), torch.float32, 6)
    assert other.put(key, x)
    miss(mine, key, x, "fingerprint")
    # its header edited to claim this engine's fingerprint: the tag (the AES key too) says otherwise
    ka = kid(keys["a"])
    store.set_raw(key, with_header(store.raw(key, ka), lambda d: d["__metadata__"].update(fingerprint=FP)), ka)
    miss(mine, key, x, "failed authentication")


@pytest.mark.parametrize("where", ["payload_first", "payload_last", "tag", "nonce", "length_field", "extra_field"])
def test_tampered_chunk_is_a_miss_and_dropped(store, keys, where):
    tier = store.tier(enc(keys["a"]))
    key, x = new_key(), random_chunk((16, 256), torch.float16, 7)
    assert tier.put(key, x, {"tokens": "256"})
    ka = kid(keys["a"])
    value = store.raw(key, ka)

    def flip_hex(d, field):
        v = d["__metadata__"][field]
        d["__metadata__"][field] = ("1" if v[0] == "0" else "0") + v[1:]

    if where == "payload_first":
        b = bytearray(value)
        b[len(value) - x.nbytes] ^= 0x80
        value = bytes(b)
    elif where == "payload_last":
        value = value[:-1] + bytes([value[-1] ^ 1])
    elif where in ("tag", "nonce"):
        value = with_header(value, lambda d: flip_hex(d, where))
    elif where == "length_field":  # consistent with the tensor, but not what was sealed
        value = with_header(value, lambda d: d["kv"].update(shape=[256, 16]))
    else:
        value = with_header(value, lambda d: d["__metadata__"].update(tokens="255"))
    store.set_raw(key, value, ka)
    out = torch.zeros(16, 256, dtype=torch.float16)
    with pytest.raises(ChunkError):
        tier.get_into(key, out)
    if where == "length_field":
        return  # another shape: not what this reader asked for (kept, as any chunk of another shape)
    assert store.raw(key, ka) is None  # sealed with this tier's secret yet not authentic: dropped
    assert tier.put(key, x)  # the recomputed chunk is stored again, and served
    tier.get_into(key, out)
    assert_same_bytes(out, x)


def test_chunk_replayed_under_another_key_is_a_miss(store, keys):
    tier = store.tier(enc(keys["a"]))
    ka, kb = new_key(), new_key()
    x = random_chunk((300,), torch.float32, 8)
    assert tier.put(ka, x)
    k = kid(keys["a"])
    store.set_raw(kb, store.raw(ka, k), k)  # as it is: its header names ka
    miss(tier, kb, x, f"key '{ka}'")
    # with its header rewritten to name kb: the tag binds ka (and kb's AES key is another)
    store.set_raw(kb, with_header(store.raw(ka, k), lambda d: d["__metadata__"].update(key=kb)), k)
    miss(tier, kb, x, "failed authentication")
    out = torch.zeros_like(x)
    tier.get_into(ka, out)  # the original is untouched
    assert_same_bytes(out, x)


# ------------------------------------------------------------------------------------------ rotation
def test_key_rotation(store, keys):
    old = store.tier(enc(keys["a_old"]))
    k_old, k_new = new_key(), new_key()
    x, y = random_chunk((999,), torch.uint8, 9), random_chunk((999,), torch.uint8, 10)
    assert old.put(k_old, x)
    rotated = store.tier(enc(keys["a"], keys["a_old"]))  # newest first
    assert rotated.contains_many([k_old, k_new]) == [True, False]  # found under the older secret's name
    assert not rotated.put(k_old, x)  # present (sealed with a secret it holds): not written again
    assert rotated.put(k_new, y)
    assert store.raw(k_new, kid(keys["a_old"])) is None  # written with the newest
    assert header_of(store.raw(k_new, kid(keys["a"])))["__metadata__"]["kid"] == rotated.sealer.write_kid
    assert rotated.sealer.write_kid != old.sealer.write_kid
    assert rotated.contains_many([k_old, k_new]) == [True, True]
    for k, v in ((k_old, x), (k_new, y)):  # read with any
        out = torch.zeros_like(v)
        rotated.get_into(k, out)
        assert_same_bytes(out, v)
    assert rotated.stats()["errors"] == 0
    assert old.contains_many([k_new]) == [False]  # not yet rotated: the new key's chunks are misses at lookup
    miss(old, k_new, y, NOT_THERE)
    retired = store.tier(enc(keys["a"]))  # the old secret dropped: its chunks are misses at lookup, not errors
    assert retired.contains_many([k_old, k_new]) == [False, True]
    miss(retired, k_old, x, NOT_THERE)
    assert store.raw(k_old, kid(keys["a_old"])) is not None
    assert retired.stats()["errors"] == old.stats()["errors"] == 0
    assert rotated.delete(k_old) and store.raw(k_old, kid(keys["a_old"])) is None  # under every name it reads


def test_two_tenants_and_a_rotation_on_a_redis_cluster(redis_cluster, open_tier, keys):
    """On a cluster every name of a chunk is in its slot: a rotating tier asks for all of them with one EXISTS per
    chunk, on the chunk's node, and reads the older secret's copy; tenants keep their own copies."""
    old = open_tier(redis_cluster.url, cluster=True, encryption=enc(keys["a_old"]))
    rotated = open_tier(redis_cluster.url, cluster=True, encryption=enc(keys["a"], keys["a_old"]))
    other = open_tier(redis_cluster.url, cluster=True, encryption=enc(keys["b"]))
    ks = [new_key() for _ in range(24)]  # over the 3 nodes
    x = random_chunk((4, 300), torch.float16, 50)
    for k in ks[::2]:
        assert old.put(k, x)
    assert rotated.contains_many(ks) == [i % 2 == 0 for i in range(len(ks))]
    assert other.contains_many(ks) == [False] * len(ks)
    for k in ks[::2]:
        assert other.put(k, x)  # its own copy, next to the old secret's
        out = torch.zeros_like(x)
        rotated.get_into(k, out)
        assert_same_bytes(out, x)
    assert other.contains_many(ks) == [i % 2 == 0 for i in range(len(ks))]
    assert rotated.stats()["errors"] == other.stats()["errors"] == 0


def test_disk_evictions_report_only_the_tenants_own_chunks(tmp_path, keys):
    """Tenants share one directory's capacity: an eviction deletes the least recently used files whoever wrote
    them (all counted), and tells this engine (REMOVED) only of its own chunks (the others' are not its)."""
    from kvx.store.tier import REMOVED

    path = str(tmp_path / "store")
    b = DiskTier.at(path, fingerprint=FP, encryption=enc(keys["b"]))
    theirs = [new_key() for _ in range(3)]
    x = random_chunk((256,), torch.float16, 60)
    for k in theirs:
        assert b.put(k, x)
    size = os.path.getsize(b.file_of(theirs[0]))
    a = DiskTier.at(path, 4 * size, FP, encryption=enc(keys["a"]), low_watermark=0.5)
    events = []
    a.subscribe(lambda tier, event, ks: events.append((event, list(ks))))
    old = os.path.getmtime(b.file_of(theirs[0])) - 3600
    for k in theirs:
        os.utime(b.file_of(k), (old, old))  # least recently used
    mine = [new_key() for _ in range(2)]
    for k in mine:
        assert a.put(k, x)
    a.evict()  # down to 2 files: B's 3 go first (least recently used)
    assert a.stats()["evicted"] == 3 and all(a.contains(k) for k in mine)
    assert [e for e in events if e[0] == REMOVED] == []
    os.utime(a.file_of(mine[0]), (old, old))
    a.capacity_bytes = 2 * size
    a.evict()  # down to 1 file: its own least recently used one
    assert a.stats()["evicted"] == 4 and [e for e in events if e[0] == REMOVED] == [(REMOVED, [mine[0]])]


def test_aes_keys_differ_per_chunk_key_and_secret(keys):
    """Per-namespace keys: a chunk key folds the request's namespace in (cache_salt, kvx_namespace), and the AES
    key is derived from the chunk key, so two namespaces never share an AES key (nor two secrets)."""
    from kvx.keys import chunk_keys, request_root

    ns = b"engine-namespace"
    ka = chunk_keys(request_root(ns, cache_salt="tenant-a"), list(range(16)), 16)[0]
    kb = chunk_keys(request_root(ns, cache_salt="tenant-b"), list(range(16)), 16)[0]
    kn = chunk_keys(request_root(ns, kvx_namespace="n1"), list(range(16)), 16)[0]
    s = Sealer([open(keys["a"], "rb").read()[:-1]], FP)
    t = Sealer([open(keys["b"], "rb").read()[:-1]], FP)
    aes = {s._aes_key(s.write_kid, k) for k in (ka, kb, kn)} | {t._aes_key(t.write_kid, ka)}
    assert len({ka, kb, kn}) == 3 and len(aes) == 4


# ------------------------------------------------------------------------------------------ config errors
def _cfg(encryption, kind="disk", tmp_path=None):
    tier = (
        {"type": "disk", "path": str(tmp_path / "store")}
        if kind == "disk"
        else {"type": "redis", "url": "redis://127.0.0.1:1/0"}
    )
    return KVXConfig.from_extra_config({"tiers": [{"type": "cpu", "size": "1GiB"}, {**tier, "encryption": encryption}]})


def _check_error(encryption, tmp_path, kind="disk") -> str:
    with pytest.raises(ConfigError) as e:
        check_paths(_cfg(encryption, kind, tmp_path), writes=True)
    return str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_config_accepts_and_opens(tmp_path, keys, kind):
    cfg = _cfg(enc(keys["a"], keys["b"]), kind, tmp_path)
    check_paths(cfg, writes=True)
    assert cfg.tiers[1].encryption.paths == [keys["a"], keys["b"]]
    assert open(keys["a"]).read().strip() not in repr(cfg)  # the secret is never in the config


@pytest.mark.parametrize("kind", KINDS)
def test_config_missing_key_file(tmp_path, kind):
    msg = _check_error({"key_file": str(tmp_path / "nope")}, tmp_path, kind)
    assert "tiers.1.encryption.key_file: expected a readable file holding the secret" in msg
    assert f"got '{tmp_path / 'nope'}', which does not exist" in msg


def test_config_key_file_is_a_directory(tmp_path):
    msg = _check_error({"key_file": str(tmp_path)}, tmp_path)
    assert "tiers.1.encryption.key_file: expected a regular file holding the secret" in msg


def test_config_unreadable_key_file(tmp_path):
    """Checked by a process that cannot read the file (root reads any file: a forked child checks as nobody)."""
    d = tempfile.mkdtemp(prefix="kvx-seal-")
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, "key")
        with open(path, "wb") as f:
            f.write(os.urandom(32).hex().encode())
        os.chmod(path, 0o000 if os.getuid() else 0o600)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop to nobody, check, report through the pipe
            try:
                if os.getuid() == 0:
                    os.setgroups([])
                    os.setresgid(65534, 65534, 65534)
                    os.setresuid(65534, 65534, 65534)
                out = "\n".join(check_encryption(EncryptionConfig(key_file=path), "tiers.1"))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = f"child failed: {e!r}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            out = f.read().decode()
        os.waitpid(pid, 0)
        assert f"tiers.1.encryption.key_file: expected a readable file holding the secret, got '{path}'" in out, out
        assert "which this process cannot read (Permission denied)" in out
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_config_short_secret(tmp_path, kind):
    p = secret_file(tmp_path, "short", b"x" * 31 + b"\n")  # 31 bytes: the newline is not part of it
    msg = _check_error({"key_files": [p]}, tmp_path, kind)
    assert "tiers.1.encryption.key_files[0]: expected a secret of at least 32 bytes" in msg
    assert f"got 31 bytes in '{p}'" in msg


def test_config_same_secret_twice(tmp_path):
    p = secret_file(tmp_path, "k1", b"y" * 40)
    q = secret_file(tmp_path, "k2", b"y" * 40 + b"\n")
    msg = _check_error({"key_files": [p, q]}, tmp_path)
    assert "tiers.1.encryption.key_files[1]: expected a secret other than key_files[0]'s" in msg


@pytest.mark.parametrize(
    "encryption,expected",
    [
        (
            {"key_file": "a", "key_files": ["b"]},
            "tiers.1.disk.encryption: encryption: expected either key_file or key_files (newest first), got both",
        ),
        ({"key_files": []}, "tiers.1.disk.encryption.key_files: key_files: expected a non-empty list of paths"),
        (
            {},
            "tiers.1.disk.encryption: encryption: expected key_file (a path) or key_files (paths, newest first), "
            "got neither",
        ),
        ({"key_file": ""}, "tiers.1.disk.encryption.key_file: key_file: expected the path of a file"),
        (
            {"key_file": "k", "cipher": "des"},
            "tiers.1.disk.encryption.cipher: unknown key (known: key_file, key_files)",
        ),
        ("k", "tiers.1.disk.encryption: Input should be a valid dictionary"),
    ],
)
def test_config_shape_errors(tmp_path, encryption, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(encryption, "disk", tmp_path)
    assert expected in str(e.value), str(e.value)


def test_tier_open_refuses_a_bad_key_file(tmp_path):
    """A tier opened without the config check (a library user): the same error, not a tier in the clear."""
    with pytest.raises(ValueError, match="encryption.key_file: expected a readable file"):
        DiskTier.at(str(tmp_path / "s"), fingerprint=FP, encryption={"key_file": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="expected a secret of at least 32 bytes"):
        RedisTier.open(
            RedisTierConfig(
                type="redis",
                url="redis://127.0.0.1:1/0",
                encryption=EncryptionConfig(key_file=secret_file(tmp_path, "s", b"z" * 8)),
            ),
            TierContext(FP),
        )


# ------------------------------------------------------------------------------------------ TLS + ACL
def _self_signed(tmp_path) -> tuple[str, str]:
    """(certificate, key) for 127.0.0.1, made with ``cryptography`` (no openssl binary needed)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def _tls_supported() -> bool:
    from kvx.testing.redis_server import binary_env, redis_server_binary

    out = subprocess.run(
        [redis_server_binary(), "--tls-port", "1", "--port", "0", "--tls-cert-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=10,
        env=binary_env(),
    )
    return (
        "not supported" not in (out.stdout + out.stderr).lower()
        and "bad directive" not in (out.stdout + out.stderr).lower()
    )


def test_sealed_tier_over_tls_with_an_acl_user(tmp_path, keys):
    """End to end: a real TLS redis-server (a certificate made here), an ACL user allowed only kvx's keys and the
    commands the tier sends (the default user off), a sealed tier on ``rediss://tenant:pw@...`` verifying the
    server's certificate. Another ACL user's tier (another key prefix) sees nothing; a wrong password is a down
    tier (misses), never an error of the engine."""
    import socket

    need_redis()
    if not _tls_supported():
        pytest.skip("this redis-server is built without TLS")
    cert, key = _self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        tls_port = s.getsockname()[1]
    args = ["--tls-port", tls_port, "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert]
    args += ["--tls-auth-clients", "no"]
    with RedisServer(extra_args=args) as server:
        c = server.client()
        allowed = "+get +set +exists +del +pexpire +persist +getrange +evalsha +eval +script|load +ping +info"
        allowed += " +config|get +hello +select +auth"
        c.execute_command("ACL", "SETUSER", "tenant", "on", ">tenant-pw", "~kvx:1:*", *allowed.split())
        c.execute_command("ACL", "SETUSER", "other", "on", ">other-pw", "~other:*", *allowed.split())
        c.execute_command("ACL", "SETUSER", "default", "off")  # from now on only the ACL users get in
        url = f"rediss://tenant:tenant-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        cfg = KVXConfig.from_extra_config(
            {
                "tiers": [
                    {"type": "cpu", "size": "1GiB"},
                    {"type": "redis", "url": url, "encryption": enc(keys["a"]), "max_value_size": "128KiB"},
                ]
            }
        )
        check_paths(cfg, writes=True)
        tiers = []
        try:
            tier = RedisTier.open(cfg.tiers[1], TierContext(FP))
            tiers.append(tier)
            kk, x = new_key(), random_chunk((3, 70001), torch.bfloat16, 11)  # in parts: scripts over TLS too
            assert tier.put(kk, x) and tier.contains_many([kk]) == [True]
            for _ in range(3):  # pooled TLS connections are reused
                out = torch.zeros_like(x)
                tier.get_into(kk, out)
                assert_same_bytes(out, x)
            assert tier.stats()["errors"] == 0
            # what the server holds is sealed (read back as the tenant over TLS with redis-py)
            import redis

            r = redis.Redis.from_url(url)
            name = f"kvx:1:{{{kk}}}-{kid(keys['a'])}"  # the sealed chunk's name carries its secret's key id
            manifest = r.get(name)
            assert manifest.startswith(b"kvxparts")  # in parts; the first part starts with the sealed header
            first = f"{name}:{manifest.split(b':')[2].decode()}:0"
            assert header_of(r.get(first))["__metadata__"]["kvx_format"] == SEALED_VERSION
            r.close()
            # another ACL user: kvx's keys are not its keys (NOPERM: answered as misses)
            other = RedisTier.open(
                RedisTierConfig(
                    type="redis",
                    url=f"rediss://other:other-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}",
                    encryption=EncryptionConfig(key_file=keys["a"]),
                    lookup_wait_ms=1000,
                    retry_s=60,
                ),
                TierContext(FP),
            )
            tiers.append(other)
            assert other.contains_many([kk]) == [False]
            with pytest.raises(ChunkError):
                other.get_into(kk, torch.zeros_like(x))
            # a wrong password: the tier opens, answers misses
            bad = RedisTier.open(
                RedisTierConfig(
                    type="redis",
                    url=f"rediss://tenant:wrong@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}",
                    encryption=EncryptionConfig(key_file=keys["a"]),
                    retry_s=60,
                ),
                TierContext(FP),
            )
            tiers.append(bad)
            assert bad.contains_many([kk]) == [False]
        finally:
            for t in tiers:
                t.close()


# ------------------------------------------------------------------------------------------ kvx store verify
def test_store_verify_sealed_chunks(tmp_path, keys, capsys):
    """``kvx store verify``: sealed chunks pass on their header alone (never deleted by --delete-bad for want of
    the key); with --key-file they are authenticated, and an altered one is bad."""
    from kvx.store import cli as store_cli

    path = str(tmp_path / "store")
    tier = DiskTier.at(path, fingerprint=FP, encryption=enc(keys["a"]))
    ka, kb = new_key(), new_key()
    x = random_chunk((4, 999), torch.float16, 12)
    assert tier.put(ka, x) and tier.put(kb, x)
    assert store_cli.main(["inspect", path]) == 0
    assert f"sealed with key id {kid(keys['a'])} (in the file names): 2 chunks" in capsys.readouterr().out
    assert store_cli.main(["verify", path, "--delete-bad"]) == 0
    assert "2 good, 0 bad" in capsys.readouterr().out
    assert store_cli.main(["verify", path, "--key-file", keys["b"], "--key-file", keys["a"]]) == 0
    assert "2 good, 0 bad" in capsys.readouterr().out
    assert store_cli.main(["verify", path, "--key-file", keys["b"]]) == 1  # not a secret of these chunks
    assert "does not hold" in capsys.readouterr().out
    f = tier.file_of(kb)
    with open(f, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([b[0] ^ 4]))
    assert store_cli.main(["verify", path]) == 0  # without the key: the header is sound
    capsys.readouterr()
    assert store_cli.main(["verify", path, "--key-file", keys["a"]]) == 1
    out = capsys.readouterr().out
    assert f"BAD {f}" in out and "failed authentication" in out and "1 good, 1 bad" in out


def test_a_key_file_others_can_read_is_warned_about_once(tmp_path):
    import logging

    from kvx.store import seal

    p = secret_file(tmp_path, "open.key")
    os.chmod(p, 0o644)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    seal.log.addHandler(handler)
    try:
        for _ in range(2):
            check_encryption(EncryptionConfig(key_file=p), "tiers.1")
        os.chmod(p, 0o600)
        q = secret_file(tmp_path, "closed.key")
        os.chmod(q, 0o600)
        check_encryption(EncryptionConfig(key_file=q), "tiers.1")
    finally:
        seal.log.removeHandler(handler)
    msgs = [r.getMessage() for r in records]
    assert len(msgs) == 1 and "readable by its group or others (mode 644); chmod 600 it" in msgs[0], msgs
