"""What ``kvx node`` and its clients agree on: the socket's frames and the pool file's layout.

**Frames.** Every message on the control socket (a unix stream socket) is one frame: a 12-byte header
``MAGIC`` (4 bytes), ``VERSION`` (u16), 2 reserved zero bytes, the body's length (u32), all little-endian,
then the body: one JSON object, UTF-8, at most :data:`MAX_BODY` bytes. A request carries ``"op"`` and an
``"id"`` (an int the reply echoes); the reply carries ``"id"``, ``"ok"`` (bool) and, when ``ok`` is false,
``"error"`` (a sentence naming what was expected and what was given). A request's ``"keys"`` is a list of keys or
one string of keys end to end (engines send the string: cheaper to encode and decode). A frame with another magic
or version, a body that is not a JSON object, or a body over :data:`MAX_BODY` gets an error reply and the
connection is closed; an unknown op or bad arguments get an error reply and the connection stays open.

**Pool file.** One file (on ``/dev/shm``, or a hugetlbfs mount), mapped by the daemon and by every engine's
workers (read and write), laid out as::

    [0, 4096)                  header: POOL_HEADER (magic, version, num_slots, slot_bytes, table_offset,
                               data_offset, epoch)
    [table_offset, +32 * n)    slot table: per slot SLOT_ENTRY (key 16 bytes, generation u64, state u32, pad)
    [dir_offset, +32 * d)      directory: the READY chunks' keys, a hash table of d (a power of two, >= 2n)
                               DIR_ENTRY (key 16 bytes, slot + 1 u32: 0 empty), linear probing from the key's
                               home, :func:`dir_home`: a keyed hash of the whole key (the epoch the key)
    [data_offset, +slot_bytes * n)  the slots' bytes (data_offset a multiple of 2 MiB; slot_bytes of 4 KiB)
                               a chunk: a run of consecutive slots (:mod:`.runs`), named by its first: its
                               table and directory entries are that slot's, its bytes start there

Only the daemon writes the header, the table and the directory. A slot's entry changes as ``allocate`` (state
PENDING, then the key, then the generation bumped), ``commit`` (state READY), ``free`` (state FREE, generation
bumped). A worker reading a slot checks the entry before and after it copies (:func:`slot_entry`): same
generation, state READY, the key it expected; anything else fails the load (vLLM recomputes), so a slot reused or
freed under a reader is never served.

The directory lets an engine look chunks up without a round trip to the daemon (:class:`Directory`): it holds a
key from its commit until it leaves READY (an entry's key is written before its slot, and its slot cleared before
its key; removal shifts later entries back, so a lookup racing a change may miss a chunk, never find a wrong one);
a key found there counts only if the slot table says that slot holds it, READY.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"KVXN"
VERSION = 2  # 2: chunks of runs of slots, sealed namespaces (a node of v1 would mistake both)
HEADER = struct.Struct("<4sHHI")  # magic, version, reserved, body length
MAX_BODY = 4 << 20  # bytes: a lookup of 4096 keys is ~150 KiB
MAX_PULLS = 4  # pulls one engine's puller connection may have in flight (each a request's lookup that missed)

POOL_MAGIC = b"KVXPOOL\0"
POOL_VERSION = 3  # 3: a home is a keyed fmix64 of each half (2: a multiply-add a crafted key set collides in)
POOL_HEADER = struct.Struct("<8sIIQQQQ16s")  # magic, version, reserved, num_slots, slot_bytes, table, data, epoch
SLOT_ENTRY = struct.Struct("<16sQI4x")  # key, generation, state
DIR_ENTRY = struct.Struct("<16sI12x")  # key, slot + 1 (0: empty)
LOW32 = np.uint64(0xFFFFFFFF)  # a directory entry's slot, a table entry's state: the low half of a uint64 (LE)
_F1, _F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # MurmurHash3's fmix64 multipliers (the directory's homes)
_F1_64, _F2_64, _S33 = np.uint64(_F1), np.uint64(_F2), np.uint64(33)
KEY_HALVES = struct.Struct("<QQ")  # a key as the directory compares it: two little-endian halves
TABLE_OFFSET = 4096
DATA_ALIGN = 2 << 20
SLOT_ALIGN = 4096

FREE, PENDING, READY = 0, 1, 2  # a slot's state in the table

KEY_RE = re.compile(r"[0-9a-f]{32}")  # a chunk key (kvx.keys): 16 bytes as hex
KEYS_RE = re.compile(r"(?:[0-9a-f]{32})*")  # keys end to end: how a request's "keys" may travel as one string
NAMESPACE_RE = re.compile(r"[0-9a-f]{8,128}")  # an engine's namespace digest, as hex


class ProtocolError(ValueError):
    """A frame the peer should not have sent (bad magic, version, length or body)."""


def encode(msg: dict) -> bytes:
    """One frame of ``msg``."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ProtocolError(f"body: expected at most {MAX_BODY} bytes, got {len(body)}")
    return HEADER.pack(MAGIC, VERSION, 0, len(body)) + body


def body_length(header: bytes) -> int:
    """The body length a frame's header announces; :class:`ProtocolError` for a header kvx did not write."""
    magic, version, _, n = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"frame: expected magic {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"frame: expected protocol version {VERSION}, got {version}")
    if n > MAX_BODY:
        raise ProtocolError(f"frame: expected a body of at most {MAX_BODY} bytes, got {n}")
    return n


def decode(body: bytes) -> dict:
    """A frame's body as a JSON object; :class:`ProtocolError` otherwise."""
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
        raise ProtocolError(f"body: expected a JSON object, got undecodable bytes ({e})") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"body: expected a JSON object, got {type(msg).__name__}")
    return msg


@dataclass(frozen=True)
class PoolGeometry:
    """Where things are in a pool file of ``num_slots`` slots of ``slot_bytes``."""

    num_slots: int
    slot_bytes: int

    @property
    def table_offset(self) -> int:
        return TABLE_OFFSET

    @property
    def dir_entries(self) -> int:
        return max(16, 1 << (2 * self.num_slots - 1).bit_length())  # a power of two, at least twice the slots

    @property
    def dir_offset(self) -> int:
        end = TABLE_OFFSET + SLOT_ENTRY.size * self.num_slots
        return -(-end // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def data_offset(self) -> int:
        end = self.dir_offset + DIR_ENTRY.size * self.dir_entries
        return -(-end // DATA_ALIGN) * DATA_ALIGN

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes

    def entry_offset(self, slot: int) -> int:
        return TABLE_OFFSET + SLOT_ENTRY.size * slot

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + self.slot_bytes * slot

    @classmethod
    def fit(cls, size: int, slot_bytes: int) -> PoolGeometry:
        """The most slots of ``slot_bytes`` (rounded up to :data:`SLOT_ALIGN`) a file of ``size`` bytes holds."""
        slot_bytes = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        n = max(0, (size - DATA_ALIGN) // (slot_bytes + SLOT_ENTRY.size + 4 * DIR_ENTRY.size))
        while n and cls(n, slot_bytes).file_bytes > size:
            n -= 1
        while cls(n + 1, slot_bytes).file_bytes <= size:  # the estimate counts the directory's largest share
            n += 1
        return cls(n, slot_bytes)


def pack_header(geom: PoolGeometry, epoch: bytes) -> bytes:
    return POOL_HEADER.pack(
        POOL_MAGIC, POOL_VERSION, 0, geom.num_slots, geom.slot_bytes, geom.table_offset, geom.data_offset, epoch
    )


def unpack_header(buf) -> tuple[PoolGeometry, bytes]:
    """A pool file's geometry and epoch from its first bytes; :class:`ProtocolError` if it is not one."""
    magic, version, _, n, slot_bytes, table, data, epoch = POOL_HEADER.unpack_from(buf, 0)
    geom = PoolGeometry(n, slot_bytes)
    if magic != POOL_MAGIC or version != POOL_VERSION or table != geom.table_offset or data != geom.data_offset:
        raise ProtocolError(f"pool file: expected a kvx pool of version {POOL_VERSION}, got magic {magic!r} v{version}")
    return geom, epoch


def slot_entry(buf, geom: PoolGeometry, slot: int) -> tuple[bytes, int, int]:
    """(key bytes, generation, state) of ``slot`` in a mapped pool file."""
    return SLOT_ENTRY.unpack_from(buf, geom.entry_offset(slot))


def write_entry(buf, geom: PoolGeometry, slot: int, key: bytes, generation: int, state: int) -> None:
    """Daemon only. Writes the state first and the generation last (see the module docstring)."""
    off = geom.entry_offset(slot)
    struct.pack_into("<I", buf, off + 24, state)
    buf[off : off + 16] = key
    struct.pack_into("<Q", buf, off + 16, generation)


_M64 = (1 << 64) - 1


def dir_seed(epoch: bytes) -> tuple[int, int]:
    """The directory's hash seed: the pool's epoch (16 random bytes) as two little-endian halves."""
    return KEY_HALVES.unpack(epoch)


def dir_shift(entries: int) -> int:
    """How far a mixed key is shifted down to a home in a directory of ``entries`` (a power of two)."""
    return 65 - entries.bit_length()


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = x * _F1 & _M64
    x ^= x >> 33
    x = x * _F2 & _M64
    return x ^ (x >> 33)


def home_of(a: int, b: int, seed: tuple[int, int], shift: int) -> int:
    """The home of the key whose little-endian halves are ``a``, ``b``: ``fmix(fmix(a ^ s0) ^ fmix(b ^ s1))``, its
    top bits (``s0``, ``s1``: the epoch's halves). Each half goes through a keyed non-linear bijection before they
    meet, so no key set collides for every epoch (a multiply-add of the halves had one: ``b = k * MIX^-1``, any
    ``a``: one home for all). Python ints here; :func:`homes_of` is the same on uint64 arrays."""
    return _fmix(_fmix(a ^ seed[0]) ^ _fmix(b ^ seed[1])) >> shift


def _fmix_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _S33)
    x = x * _F1_64  # uint64 arrays wrap
    x = x ^ (x >> _S33)
    x = x * _F2_64
    return x ^ (x >> _S33)


def homes_of(a: np.ndarray, b: np.ndarray, seed: tuple[int, int], shift: int) -> np.ndarray:
    """:func:`home_of` of uint64 arrays of halves (17 us for 256 keys here, a Python loop of blake2b 98 us)."""
    s0, s1 = np.uint64(seed[0]), np.uint64(seed[1])
    return _fmix_np(_fmix_np(a ^ s0) ^ _fmix_np(b ^ s1)) >> np.uint64(shift)


def dir_home(key: bytes, entries: int, seed: tuple[int, int]) -> int:
    """Where a lookup of ``key`` (16 bytes) starts in a directory of ``entries`` (a power of two)."""
    a, b = KEY_HALVES.unpack(key)
    return home_of(a, b, seed, dir_shift(entries))
