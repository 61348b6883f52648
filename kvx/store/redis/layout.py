"""What kvx stores where in Redis: chunk and part key names, the cluster slot of a key, the manifest of a
chunk stored in parts, and the Lua scripts that publish and drop a chunk (layout: see :mod:`kvx.store.redis`).

Constants and pure functions: used from any thread.
"""

from __future__ import annotations

from binascii import crc_hqx
from functools import lru_cache
from hashlib import sha1

_PREFIX = "kvx:1:"
PARTS_MAGIC = b"kvxparts"  # first 8 bytes of a manifest (a codec header starts with a length < 2**20)
MANIFEST_MAX = 128  # bytes: a manifest is ~50
CLUSTER_SLOTS = 16384

# KEYS[1]: chunk key, KEYS[2..]: this writer's parts. ARGV[1]: manifest, ARGV[2]: ttl in ms (0: none).
# Returns 1 published, 0 the chunk exists (parts deleted), -1 a part is gone (parts deleted).
_PUBLISH = """
local n = #KEYS
if redis.call('EXISTS', KEYS[1]) == 1 then
  for i = 2, n do redis.call('DEL', KEYS[i]) end
  return 0
end
for i = 2, n do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    for j = 2, n do redis.call('DEL', KEYS[j]) end
    return -1
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
  for i = 2, n do redis.call('PEXPIRE', KEYS[i], ttl) end
else
  redis.call('SET', KEYS[1], ARGV[1])
  for i = 2, n do redis.call('PERSIST', KEYS[i]) end
end
return 1
"""
# KEYS[1]: chunk key. ARGV[1]: the value expected there ('' = any). Deletes the chunk and, for a manifest,
# its parts (same slot as the chunk key). Returns 1 if something was deleted.
_DROP = """
local v = redis.call('GETRANGE', KEYS[1], 0, 127)
if v == '' then return 0 end
if ARGV[1] ~= '' and v ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local nonce, n = string.match(v, '^kvxparts:1:(%x+):(%d+):')
if nonce then
  for i = 0, tonumber(n) - 1 do redis.call('DEL', KEYS[1] .. ':' .. nonce .. ':' .. i) end
end
return 1
"""
SCRIPTS = {name: (src, sha1(src.encode()).hexdigest()) for name, src in (("publish", _PUBLISH), ("drop", _DROP))}


def cluster_slot(chunk_key: str) -> int:
    """Cluster slot of a kvx key: CRC16 of its hash tag (the chunk key between the braces), as Redis
    computes it (redis.crc.key_slot, without its general-case parsing: a lookup computes it for every key)."""
    lo = chunk_key.find("{")
    if lo < 0:
        return crc_hqx(chunk_key.encode(), 0) & 16383
    return crc_hqx(chunk_key[lo + 1 : chunk_key.index("}", lo)].encode(), 0) & 16383


def kid_suffix(kid: str | None) -> str:
    """What a sealed chunk's name adds to the name in the clear: ``-<kid>`` (one name per tenant; outside the
    hash tag, so every tenant's copy and its parts stay in the chunk's slot)."""
    return f"-{kid}" if kid else ""


def redis_chunk_key(key: str, kid: str | None = None) -> str:
    """The Redis key of chunk ``key``: in the clear, or sealed with the secret of key id ``kid``."""
    return f"{_PREFIX}{{{key}}}-{kid}" if kid else f"{_PREFIX}{{{key}}}"


def redis_part_key(chunk_key: str, nonce: str, i: int) -> str:
    return f"{chunk_key}:{nonce}:{i}"


# ------------------------------------------------------------------------------------------ value sizes
# Redis's allocator (jemalloc) hands out memory in size classes, four per doubling above 64 bytes (5, 6, 7 and
# 8 MiB after 4 MiB): a value one byte over a class takes the next one, up to 25% more memory than its bytes. A
# value of L bytes costs Redis an allocation of L + VALUE_OVERHEAD (its sds header and terminator, and the \r\n
# a large argument is received with in place): on Redis 7.0.15 / jemalloc 5.3.0 a value of 4 MiB - 12 bytes
# grows used_memory by 4 MiB + 104 (key and entry), one of 4 MiB - 8 by over 5 MiB.
VALUE_OVERHEAD = 12
_KEY_COST = 128  # bytes of a key of its own beyond its value (name, dict entry, object): a part's price
_FEWER_VALUES_SLACK = 0.01  # fewer values (round trips, keys) are worth up to 1% more memory
_MIN_CLASS = 4 << 10  # smallest value size the split considers (besides the last, shorter value)
# smaller encodings stay one value (records, small chunks: a few KiB saved is not worth a key and a round trip;
# Redis also copies arguments under 32 KiB, with less overhead than VALUE_OVERHEAD)
_MIN_SPLIT = 64 << 10
_MAX_PARTS = 4096


def alloc_size(n: int) -> int:
    """The jemalloc size class an allocation of ``n`` bytes takes (8, 16 .. 128 by 16, then four per doubling)."""
    if n <= 8:
        return 8
    if n <= 128:
        return -(-n // 16) * 16
    step = 1 << ((n - 1).bit_length() - 3)  # a quarter of the power of two below n
    return -(-n // step) * step


@lru_cache(maxsize=16)
def _class_sizes(limit: int) -> tuple[int, ...]:
    """Value sizes that fill a size class exactly (class - overhead), largest first, at most ``limit``."""
    out = []
    k = _MIN_CLASS.bit_length() - 1
    while (1 << k) - VALUE_OVERHEAD <= limit:
        for i in range(4, 0, -1):
            c = (1 << k) + i * (1 << (k - 2))
            if c - VALUE_OVERHEAD <= limit:
                out.append(c - VALUE_OVERHEAD)
        k += 1
    out.append(_MIN_CLASS - VALUE_OVERHEAD)
    return tuple(sorted(set(out), reverse=True))


@lru_cache(maxsize=1024)  # a deployment's chunks come in a few sizes: each split is computed once
def value_split(total: int, limit: int) -> tuple[int, int]:
    """(values, bytes per value but the last) for a chunk whose encoding is ``total`` bytes, in values of at most
    ``limit`` bytes: the split Redis stores in the least memory (every value but the last fills a size class; the
    last takes what is left), the one with fewest values among those within 1% of it. One value: ``(1, total)``,
    always under 64 KiB."""
    if total < _MIN_SPLIT and total <= limit:
        return 1, total
    options = []  # (memory, values, size)
    if total <= limit:
        options.append((alloc_size(total + VALUE_OVERHEAD), 1, total))
    for size in _class_sizes(limit):
        n = -(-total // size)
        if n > _MAX_PARTS or n < 2:
            continue
        last = total - (n - 1) * size
        cost = (n - 1) * (size + VALUE_OVERHEAD) + alloc_size(last + VALUE_OVERHEAD) + n * _KEY_COST
        options.append((cost, n, size))
    if not options:  # more than _MAX_PARTS values of the largest size: plain equal parts
        n = -(-total // limit)
        return n, -(-total // n)
    best = min(o[0] for o in options)
    n, _, size = min((o[1], o[0], o[2]) for o in options if o[0] <= best * (1 + _FEWER_VALUES_SLACK))
    return n, size
