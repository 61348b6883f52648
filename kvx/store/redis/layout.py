"""What kvx stores where in Redis: chunk and part key names, the cluster slot of a key, the manifest of a
chunk stored in parts, and the Lua scripts that publish and drop a chunk (layout: see :mod:`kvx.store.redis`).

Constants and pure functions: used from any thread.
"""

from __future__ import annotations

from binascii import crc_hqx
from hashlib import sha1

_PREFIX = "kvx:1:"
_MAGIC = b"kvxparts"  # first 8 bytes of a manifest (a codec header starts with a length < 2**20)
_MANIFEST_MAX = 128  # bytes: a manifest is ~50
_SLOTS = 16384

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
_SCRIPTS = {name: (src, sha1(src.encode()).hexdigest()) for name, src in (("publish", _PUBLISH), ("drop", _DROP))}


def _slot(chunk_key: str) -> int:
    """Cluster slot of a kvx key: CRC16 of its hash tag (the chunk key between the braces), as Redis
    computes it (redis.crc.key_slot, without its general-case parsing: 1 us instead of 4 per key)."""
    lo = chunk_key.find("{")
    if lo < 0:
        return crc_hqx(chunk_key.encode(), 0) & 16383
    return crc_hqx(chunk_key[lo + 1 : chunk_key.index("}", lo)].encode(), 0) & 16383


def _kid_suffix(kid: str | None) -> str:
    """What a sealed chunk's name adds to the name in the clear: ``-<kid>`` (one name per tenant; outside the
    hash tag, so every tenant's copy and its parts stay in the chunk's slot)."""
    return f"-{kid}" if kid else ""


def _chunk_key(key: str, kid: str | None = None) -> str:
    """The Redis key of chunk ``key``: in the clear, or sealed with the secret of key id ``kid``."""
    return f"{_PREFIX}{{{key}}}-{kid}" if kid else f"{_PREFIX}{{{key}}}"


def _part_key(chunk_key: str, nonce: str, i: int) -> str:
    return f"{chunk_key}:{nonce}:{i}"
