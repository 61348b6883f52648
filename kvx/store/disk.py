"""Disk tier: one safetensors file per chunk, safe to share between engines on one path.

Layout: ``<path>/<key[:2]>/<key>.safetensors`` holding one tensor ``"kv"`` (the chunk) and metadata
``{"kvx_format", "key", "fingerprint", "crc32", ...}``. Reads check the format version, key,
fingerprint, dtype/shape and the CRC32 of the bytes; any mismatch is a :class:`ChunkError` (the
connector reports it to vLLM, which recomputes). A corrupt file (unreadable, bad checksum, wrong key
inside) is deleted, so the recomputed chunk is saved again rather than failing on every request.

Writes. kvx writes the safetensors file itself (8-byte little-endian header length, the JSON header
padded with spaces to a multiple of 8, then the chunk's bytes straight from the tensor's memory, 1 MiB
per write call) to ``.<key>.<host>.<pid>.<random>.tmp`` next to the final name, and renames it into
place: a reader never sees a partial file, and two engines writing the same key both produce a
complete file (the last rename wins; both are identical chunks). Reads go through the safetensors
library. ``safetensors.torch.save_file`` (0.8) wrote to its own ``.tmpXXXXXX`` name first, which a
``kill -9`` leaked where kvx could not recognise it. put() time, median of 20, old -> new (2-core VM,
kernel 6.18): tmpfs 4 MiB 4.2 -> 4.1 ms, 16 MiB 15.7 -> 15.5 ms; ext4 4 MiB 3.8-11 -> 3.0-4.0 ms,
16 MiB 48-53 -> 11-12 ms while single large writes are slow (see ``_WRITE_PIECE`` and
benchmarks/bench_disk_put.py). Neither copies the chunk (safetensors 0.8 writes from
the tensor's pointer too: no growth of peak RSS for a 64 MiB put with either).

Temporary files. A crash can leave a temporary file behind. Every scan of the directory (store
start-up, the periodic re-count, eviction, :meth:`DiskStore.usage`, :meth:`DiskStore.clear`) sorts
them with :func:`survey`:

- in flight, kept: written by a live process of this host (same host name and pid namespace, the pid
  exists), or by another host (only its age can tell) and younger than ``_TMP_MAX_AGE_S``;
- stale, removed: its writer is dead (this host), or it is older than ``_TMP_MAX_AGE_S``.

Until they are removed, temporary files count against the capacity and show in ``kvx store
inspect/verify``. Names of older kvx versions (``.<key>.<pid>.<random>.tmp``, safetensors'
``.tmpXXXXXX``) are recognised and removed by age only.

Capacity. A put reserves its file's size before writing: if this engine's count of the directory plus
the reservation would exceed ``capacity_bytes``, it first deletes the least recently used files (mtime;
a read touches it) down to ``low_watermark * capacity`` (the new chunk included). So one engine never
exceeds the capacity, however many writer threads it runs. Other engines on the path are seen when
the directory is re-counted (at most ``rescan_s`` apart, and at every eviction); see
:class:`DiskStore` for the bound with several engines. Other engines may delete files at any time: a
missing file is a miss.

Full disk. A write that fails with ENOSPC or EDQUOT evicts the least recently used files (at least 10%
of the chunk bytes, see ``_FULL_EVICT_FRACTION``) and retries once. If that fails too, the put raises
:class:`StoreFullError`, and puts for a back-off period (1 s, doubling to 60 s, reset by a successful
put) raise it at once without touching the disk.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import struct
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..log import Throttle, get_logger

log = get_logger(__name__)

FORMAT_VERSION = "kvx-1"
_SUFFIX = ".safetensors"
_TMP_MAX_AGE_S = 3600.0  # a write takes milliseconds: a temporary file this old has no live writer
_RESERVED_META = ("kvx_format", "key", "fingerprint", "crc32", "created")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# On ENOSPC/EDQUOT: evict this fraction of the store's chunk bytes (LRU), at least the chunk being
# written. The store cannot know how much room the rest of the file system needs; 10% makes room for
# many chunks (a 100 GiB store frees 10 GiB: 2560 chunks of 4 MiB), so a full disk costs one scan per
# 10% of the store rather than one per chunk, and keeps 90% of the cached chunks.
_FULL_EVICT_FRACTION = 0.1
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 1.0, 60.0
# Bytes per write call. On ext4 here (kernel 6.18 VM), a 16 MiB file written with one 16 MiB write call
# took 38-57 ms for seconds at a time, against ~5 ms in 1 MiB calls; safetensors' save_file writes the
# tensor in one call. The cause is not identified (no writeback or reclaim was seen during the slow
# spells). benchmarks/bench_disk_put.py measures both writers in one run: kvx/save_file 0.22-0.24 at
# 16 MiB on ext4 with files kept, 0.95-1.03 elsewhere at 4-16 MiB, 0.85-0.94 at 1 MiB.
_WRITE_PIECE = 1 << 20
_WAIT_S = 0.05  # a put waiting for its own engine's in-flight writes re-checks at least this often
# torch dtype -> safetensors dtype name: the library's own table (safetensors.torch._TYPES, 0.8), less the
# dtypes this torch lacks
_ST_DTYPES = {getattr(torch, t): name for t, name in (
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int64", "I64"),
    ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("complex64", "C64"), ("uint64", "U64"), ("uint32", "U32"),
    ("uint16", "U16")) if hasattr(torch, t)}


class StoreError(RuntimeError):
    """Base of the disk store's errors."""


class ChunkError(StoreError):
    """A chunk could not be read back correctly (missing, corrupt, or not what was asked for)."""


class StoreClosedError(StoreError):
    """An operation on a store after :meth:`DiskStore.close`."""


class StoreFullError(StoreError):
    """A put found no room: the disk is full (ENOSPC/EDQUOT even after an eviction, or during the
    back-off that follows), or the chunk cannot fit in ``capacity_bytes``. Nothing was written; the
    chunk stays uncached (vLLM recomputes it when needed)."""


@dataclass(frozen=True)
class ChunkInfo:
    """A chunk file: its key, path, size and mtime (the LRU clock: a read or a repeated put touches it)."""
    key: str
    path: str
    bytes: int
    mtime: float


@dataclass(frozen=True)
class TempInfo:
    """A temporary file under the store: a write in flight, or the leftover of a crashed writer."""
    path: str
    bytes: int
    mtime: float
    stale: bool
    reason: str   # why it is stale or in flight, for people ("writer pid 123 is gone")


@dataclass
class Survey:
    """One pass over a store directory (:func:`survey`)."""
    chunks: list[ChunkInfo] = field(default_factory=list)
    temps: list[TempInfo] = field(default_factory=list)     # still on disk (stale ones: removal failed or not asked)
    removed: list[TempInfo] = field(default_factory=list)   # stale temporary files this pass deleted

    @property
    def chunk_bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def temp_bytes(self) -> int:
        return sum(t.bytes for t in self.temps)


def checksum(t: torch.Tensor) -> str:
    """CRC32 of a contiguous CPU tensor's bytes, as 8 hex digits (zlib runs at ~6 GB/s here)."""
    return f"{zlib.crc32(_byte_view(t)):08x}"


def _byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array sharing its memory (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _valid_key(key: str) -> str:
    if not isinstance(key, str) or len(key) < 8 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"key: expected a lowercase hex string of >= 8 digits, got {key!r}")
    return key


# ------------------------------------------------------------------------------------------ temp files
def _host_tag() -> str:
    """Names this host and pid namespace: a pid in a temporary file's name can only be checked by a
    process that sees the same pids (containers on one host share the host name but not the pids)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{zlib.crc32(f'{socket.gethostname()}/{ns}'.encode()):08x}"


_HOST = _host_tag()
# Temporary files this process is writing (every DiskStore in it): one named with this process's pid
# but not listed here is the leftover of an earlier process that had the same pid (a restarted
# container often reuses its pids).
_LIVE_TMP: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # EPERM: it exists, as another user
        return True
    return True


def _is_temp_name(name: str) -> bool:
    # kvx's ".<key>....tmp", or safetensors' ".tmpXXXXXX" (left by kvx versions that wrote with save_file)
    return name.startswith(".") and (name.endswith(".tmp") or (name.startswith(".tmp") and len(name) == 10))


def _classify_temp(path: str, name: str, mtime: float, now: float) -> tuple[bool, str]:
    """(stale, reason) of a temporary file (see the module docstring)."""
    age = now - mtime
    if age > _TMP_MAX_AGE_S:
        return True, f"{age:.0f} s old, more than {_TMP_MAX_AGE_S:.0f} s"
    parts = name[1:-len(".tmp")].split(".") if name.endswith(".tmp") else []
    if len(parts) != 4 or parts[1] != _HOST or not parts[2].isdigit() or int(parts[2]) <= 0:
        return False, f"written by another host or an older kvx, {age:.0f} s old"
    pid = int(parts[2])
    if pid == os.getpid():
        if path in _LIVE_TMP:
            return False, "being written by this process"
        return True, f"left by an earlier process with pid {pid}"
    if _pid_alive(pid):
        return False, f"being written by pid {pid}"
    return True, f"writer pid {pid} is gone"


def survey(path: str, remove_stale: bool = False) -> Survey:
    """Every chunk file and temporary file under a store directory, sorting temporary files into in
    flight and stale (removing the stale ones if ``remove_stale``). Tolerates files and directories that
    other engines delete meanwhile, and a missing or unreadable directory (an empty survey)."""
    out = Survey()
    now = time.time()
    try:
        subdirs = list(os.scandir(path))
    except OSError:          # deleted under us, or not readable: nothing to count
        return out
    for d in subdirs:
        try:
            if not d.is_dir(follow_symlinks=False) or len(d.name) != 2:
                continue
            entries = list(os.scandir(d.path))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if _is_temp_name(e.name):
                stale, reason = _classify_temp(e.path, e.name, st.st_mtime, now)
                info = TempInfo(e.path, st.st_size, st.st_mtime, stale, reason)
                if stale and remove_stale:
                    try:
                        os.unlink(e.path)
                        out.removed.append(info)
                        continue
                    except FileNotFoundError:
                        continue     # renamed into place or removed by another engine meanwhile
                    except OSError:
                        pass         # read-only: still there, still counted
                out.temps.append(info)
            elif e.name.endswith(_SUFFIX):
                out.chunks.append(ChunkInfo(e.name[: -len(_SUFFIX)], e.path, st.st_size, st.st_mtime))
    return out


# ------------------------------------------------------------------------------------------ file format
def _header(chunk: torch.Tensor, meta: dict[str, str]) -> bytes:
    """safetensors header of a file holding ``chunk`` as ``"kv"``: u64 length (little-endian), then JSON
    padded with spaces to a multiple of 8 (so the data starts aligned, as the library writes it)."""
    nbytes = chunk.numel() * chunk.element_size()
    head = json.dumps({"__metadata__": meta, "kv": {"dtype": _ST_DTYPES[chunk.dtype], "shape": list(chunk.shape),
                                                    "data_offsets": [0, nbytes]}},
                      separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def _write_all(fd: int, bufs: Sequence) -> None:
    """Write every byte of ``bufs`` (bytes-like objects, not copied) at the file's position, at most
    ``_WRITE_PIECE`` bytes per call; a signal or a nearly full disk may cut a write short."""
    for b in bufs:
        v = memoryview(b).cast("B")
        while len(v):
            n = os.write(fd, v[:_WRITE_PIECE])
            if n <= 0:
                raise OSError(errno.EIO, "write wrote nothing")
            v = v[n:]


# ------------------------------------------------------------------------------------------ the store
class DiskStore:
    """Chunks as safetensors files under ``path`` (see the module docstring).

    Args:
        path: directory (created if missing); may be shared by several engines.
        capacity_bytes: size budget for the directory (chunk and temporary files); ``None`` = unbounded.
        fingerprint: what the chunks' bytes mean (layout/format); a file with another fingerprint is
            never served.
        fsync: fsync each file before the rename (durability across power loss; slower).
        low_watermark: an eviction deletes down to this fraction of ``capacity_bytes``.
        rescan_s: capacity only: how stale this process's count of the directory's size may get. Other
            engines on a shared path write too, so a put re-counts the directory when the last count is
            older than this (0: at every put; an eviction always re-counts). One engine alone never
            exceeds ``capacity_bytes``, whatever its number of writer threads: each put reserves its
            bytes, evicting first, before it writes. N engines on one path, each with T writer threads
            writing at most W bytes/s, use at most
            ``capacity_bytes + (N-1) * min(capacity_bytes, W * rescan_s + (T+1) * chunk_file_bytes)``:
            what the others add between one engine's counts (they re-count too before writing more).
        clock: monotonic seconds, for ``rescan_s`` and the full-disk back-off (injectable for tests).
    Thread-safe: ``put``/``get`` may run on several I/O threads.
    """

    def __init__(self, path: str, capacity_bytes: int | None = None, fingerprint: str = "",
                 fsync: bool = False, low_watermark: float = 0.9, rescan_s: float = 5.0, *,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
            raise ValueError(f"path: expected a directory path, got {path!r}")
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                           or capacity_bytes <= 0):
            raise ValueError(f"capacity_bytes: expected a positive int or None, got {capacity_bytes!r}")
        if (isinstance(low_watermark, bool) or not isinstance(low_watermark, (int, float))
                or not 0.0 < low_watermark <= 1.0):
            raise ValueError(f"low_watermark: expected a fraction in (0, 1], got {low_watermark!r}")
        if isinstance(rescan_s, bool) or not isinstance(rescan_s, (int, float)) or not rescan_s >= 0:
            raise ValueError(f"rescan_s: expected seconds >= 0, got {rescan_s!r}")
        if not isinstance(fingerprint, str):
            raise ValueError(f"fingerprint: expected a str, got {type(fingerprint).__name__}")
        if not callable(clock):
            raise ValueError(f"clock: expected a callable returning seconds, got {clock!r}")
        if sys.byteorder != "little":  # the raw bytes are written as they lie in memory
            raise RuntimeError("kvx disk store: safetensors files are little-endian; this host is big-endian")
        self.path = os.path.abspath(os.fspath(path))
        os.makedirs(self.path, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.low_watermark = low_watermark
        self.rescan_s = rescan_s
        self._clock = clock
        self._closed = False
        self._throttle = Throttle(log)
        # _lock: the counters below and stats; held for a few instructions, never across I/O.
        self._lock = threading.Lock()
        # _room: one re-count, eviction or reservation at a time (they read and set _used from a scan);
        # puts waiting for room sleep on it. Held across directory scans, never across a chunk write.
        self._room = threading.Condition(threading.Lock())
        self._used = 0             # bytes under path at the last count + this store's reservations since
        self._reserved = 0         # this store's puts being written (inside _used)
        self._mine: set[str] = set()   # their temporary files (counted as reservations, not as files)
        self._ended: list | None = None    # during a count: (final path or None if failed, size) of puts ending
        self._waiting = 0          # puts waiting in _reserve for this store's writes to finish
        self._counted_at = -math.inf
        self._relief = 0           # evictions for a full disk so far (a put that fails after one retries)
        self._backoff_s = 0.0      # current full-disk back-off; 0 = none
        self._full_until = -math.inf
        self.stats = {"puts": 0, "put_bytes": 0, "gets": 0, "get_bytes": 0, "evicted": 0, "errors": 0,
                      "full": 0, "tmp_removed": 0}
        with self._room:
            self._recount_locked()     # also removes what crashed writers left behind

    # ---------------------------------------------------------------- paths
    def file_of(self, key: str) -> str:
        key = _valid_key(key)
        return os.path.join(self.path, key[:2], key + _SUFFIX)

    def _check_open(self):
        if self._closed:
            raise StoreClosedError(f"disk store at {self.path} is closed")

    # ---------------------------------------------------------------- lookups
    def contains(self, key: str) -> bool:
        self._check_open()
        return os.path.exists(self.file_of(key))

    # ---------------------------------------------------------------- put / get
    def put(self, key: str, chunk: torch.Tensor, extra: dict[str, str] | None = None) -> bool:
        """Write ``chunk`` (a CPU tensor) under ``key``. Returns False if already present.

        Raises:
            StoreFullError: no room (see the module docstring); nothing was written.
            OSError: the write failed otherwise (read-only directory, I/O error); nothing was left behind.
        """
        self._check_open()
        final = self.file_of(key)
        # Validate before the presence check: a bad call must fail the same way whether or not the key
        # happens to be on disk already.
        if not isinstance(chunk, torch.Tensor) or chunk.device.type != "cpu":
            raise ValueError(f"chunk: expected a CPU tensor, got {type(chunk).__name__} "
                             f"{getattr(chunk, 'device', '')}")
        if chunk.dtype not in _ST_DTYPES:
            raise ValueError(f"chunk: expected a dtype in {sorted(str(d) for d in _ST_DTYPES)}, got {chunk.dtype}")
        if extra is not None and (not isinstance(extra, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in extra.items())):
            raise ValueError(f"extra: expected a dict of str -> str, got {extra!r}")
        if extra and any(k in _RESERVED_META for k in extra):
            # would overwrite the fields get() verifies (key, fingerprint, checksum, ...)
            raise ValueError(f"extra: keys {sorted(set(extra) & set(_RESERVED_META))} are reserved")
        full_for = self._full_until - self._clock()
        if full_for > 0:   # a full disk: fail at once rather than write (and evict) for every chunk
            with self._lock:
                self.stats["full"] += 1
            raise StoreFullError(f"disk store {self.path}: no space left on device; puts refused during a "
                                 f"back-off ({self._backoff_s:.0f} s, {full_for:.1f} s left)")
        if os.path.exists(final):
            try:
                os.utime(final)
                return False
            except FileNotFoundError:
                pass  # another engine evicted it just now: write it again
        chunk = chunk.contiguous()
        data = _byte_view(chunk)
        meta = {**(extra or {}), "kvx_format": FORMAT_VERSION, "key": key, "fingerprint": self.fingerprint,
                "crc32": checksum(chunk), "created": f"{time.time():.3f}"}
        header = _header(chunk, meta)
        size = len(header) + data.nbytes
        if self.capacity_bytes is not None:
            self._reserve(key, size)
        try:
            relief = self._relief
            try:
                self._write(key, final, (header, data))
            except OSError as e:
                if e.errno not in _FULL_ERRNOS:
                    raise
                freed = self._relieve(relief, size)
                try:
                    self._write(key, final, (header, data))
                except OSError as e2:
                    if e2.errno not in _FULL_ERRNOS:
                        raise
                    raise self._full(key, freed) from e2
        except BaseException as e:
            self._settle(size, False, final)
            if isinstance(e, OSError) and e.errno is not None:   # say which store and chunk, not the temp name
                raise OSError(e.errno, f"disk store {self.path}: cannot write chunk {key}: {e.strerror}",
                              final) from e
            raise
        self._settle(size, True, final)
        return True

    def _write(self, key: str, final: str, bufs) -> None:
        """Write ``bufs`` to a temporary file next to ``final`` and rename it into place; on any failure
        (or interrupt) remove the temporary file and re-raise."""
        d = os.path.dirname(final)
        tmp = os.path.join(d, f".{key}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        # registered before the file exists: a scan that sees it must see it as in flight
        _LIVE_TMP.add(tmp)
        with self._lock:
            self._mine.add(tmp)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(tmp, flags, 0o666)
            except FileNotFoundError:        # first chunk of this subdirectory, or the store was deleted
                os.makedirs(d, exist_ok=True)
                fd = os.open(tmp, flags, 0o666)
            try:
                _write_all(fd, bufs)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            _LIVE_TMP.discard(tmp)
            with self._lock:
                self._mine.discard(tmp)

    def _reserve(self, key: str, size: int) -> None:
        """Count ``size`` bytes against the capacity before writing them, evicting first if they would
        not fit; wait for this store's own writes in flight when only they fill the budget."""
        cap = self.capacity_bytes
        if size > cap:
            with self._lock:
                self.stats["full"] += 1
            raise StoreFullError(f"chunk {key}: a file of {size} bytes cannot fit in capacity_bytes={cap}")
        with self._room:
            while True:
                if self._clock() - self._counted_at >= self.rescan_s:
                    self._recount_locked()
                if self._used + size <= cap:
                    break
                _, inflight = self._evict_locked(max(int(cap * self.low_watermark) - size, 0))
                if self._used + size <= cap:
                    break
                if not inflight:
                    # what is left is other writers' files in flight, or files that cannot be deleted
                    with self._lock:
                        self.stats["full"] += 1
                    raise StoreFullError(
                        f"chunk {key}: no room under {self.path} ({self._used} of {cap} bytes used by files "
                        f"this store cannot evict, {size} needed)")
                if self._reserved:     # this store's own writes fill the budget: wait for one to end
                    self._waiting += 1
                    try:
                        self._room.wait(_WAIT_S)
                    finally:
                        self._waiting -= 1
                # then count again: the files they wrote can be evicted now
            with self._lock:
                self._used += size
                self._reserved += size

    def _settle(self, size: int, written: bool, final: str) -> None:
        """A put's write is over: its reservation becomes a file on disk, or is returned."""
        with self._lock:
            if self.capacity_bytes is not None:
                self._reserved -= size
                if self._ended is not None:
                    self._ended.append((final if written else None, size))
                if not written:
                    self._used -= size
            elif written:
                self._used += size
            if written:
                self.stats["puts"] += 1
                self.stats["put_bytes"] += size
                self._backoff_s, self._full_until = 0.0, -math.inf   # there was room: the disk is not full
            waiting = self._waiting
        if waiting:
            with self._room:
                self._room.notify_all()

    def _relieve(self, relief: int, size: int) -> int:
        """The disk is full: delete the least recently used files (``_FULL_EVICT_FRACTION`` of the chunk
        bytes, at least ``size``) unless another put did so since ``relief`` was read. Returns the count."""
        with self._room:
            if self._relief != relief:
                return 0                        # another writer just made room: only retry
            self._relief += 1
            sv, used, _ = self._count_locked()
            goal = max(int(sv.chunk_bytes * _FULL_EVICT_FRACTION), size)
            removed, freed = self._unlink_lru(sv.chunks, lambda freed: freed >= goal)
            self._set_count(used - freed, evicted=removed)
        self._throttle.warning("full", "kvx: disk store %s: no space left on device; evicted %d least recently "
                               "used chunks (%.1f MiB) and retrying", self.path, removed, freed / 2**20)
        return removed

    def _full(self, key: str, evicted: int) -> StoreFullError:
        """Still no space after an eviction: start (or keep) the back-off; the error to raise."""
        with self._lock:
            now = self._clock()
            if now >= self._full_until:       # one doubling per episode, not one per failing thread
                self._backoff_s = min(max(2 * self._backoff_s, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
                self._full_until = now + self._backoff_s
            backoff = self._backoff_s
            self.stats["full"] += 1
        self._throttle.warning("full-backoff", "kvx: disk store %s: still no space left on device after evicting "
                               "%d chunks; refusing writes for %.0f s", self.path, evicted, backoff)
        return StoreFullError(f"disk store {self.path}: no space left on device for chunk {key} even after "
                              f"evicting ({evicted} chunks); puts refused for a back-off ({backoff:.0f} s)")

    def get(self, key: str, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read and verify chunk ``key``. The result is backed by the file's page cache (mmap).

        Raises:
            ChunkError: missing, unreadable, wrong format/key/fingerprint/shape/dtype, or bad checksum.
        """
        self._check_open()
        path = self.file_of(key)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                t = f.get_tensor("kv")
        except FileNotFoundError:
            raise ChunkError(f"chunk {key}: not on disk ({path})") from None
        except Exception as e:  # noqa: BLE001 - any unreadable file (SafetensorError, OSError, bad dtype...)
            self._drop_bad(path)
            raise ChunkError(f"chunk {key}: unreadable file {path}: {e}") from None
        problems = []
        if meta.get("kvx_format") != FORMAT_VERSION:
            problems.append(f"format {meta.get('kvx_format')!r} != {FORMAT_VERSION!r}")
        if meta.get("key") != key:
            problems.append(f"key {meta.get('key')!r}")
        if meta.get("fingerprint") != self.fingerprint:
            problems.append(f"fingerprint {meta.get('fingerprint')!r} != {self.fingerprint!r}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            problems.append(f"shape {tuple(t.shape)} != {tuple(shape)}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"dtype {t.dtype} != {dtype}")
        corrupt = meta.get("key") != key      # a file under the wrong name, or mangled metadata
        if not problems and meta.get("crc32") != checksum(t):
            problems.append("checksum mismatch (corrupt bytes)")
            corrupt = True
        if problems:
            # A corrupt file can never be served: drop it. A file that is merely not what this reader
            # expects (fingerprint, format version, shape) may be valid for another engine: keep it.
            if corrupt:
                self._drop_bad(path)
            else:
                self._count_error()
            raise ChunkError(f"chunk {key}: {path} failed verification: {'; '.join(problems)}")
        try:
            os.utime(path)  # LRU: a read makes the file recent
        except OSError:
            pass
        with self._lock:
            self.stats["gets"] += 1
            self.stats["get_bytes"] += t.numel() * t.element_size()
        return t

    def delete(self, key: str) -> bool:
        self._check_open()
        path = self.file_of(key)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
        except FileNotFoundError:
            return False
        with self._lock:
            self._used = max(0, self._used - size)
        return True

    def _drop_bad(self, path: str) -> None:
        """A file that failed to read or verify can never be served: remove it, so the chunk becomes a
        miss and the recomputation saves a good copy (instead of failing on every request)."""
        self._count_error()
        try:
            os.unlink(path)
        except OSError:
            pass

    def _count_error(self):
        with self._lock:
            self.stats["errors"] += 1

    # ---------------------------------------------------------------- capacity
    def scan(self) -> Iterator[ChunkInfo]:
        """Every chunk file under the path (and removes stale temporary files)."""
        self._check_open()
        return iter(self._survey().chunks)

    def temp_files(self) -> list[TempInfo]:
        """Temporary files under the path after removing the stale ones: other writes in flight (and stale
        files that could not be removed)."""
        self._check_open()
        return self._survey().temps

    def _survey(self) -> Survey:
        sv = survey(self.path, remove_stale=True)
        if sv.removed:
            with self._lock:
                self.stats["tmp_removed"] += len(sv.removed)
            log.info("kvx: disk store %s: removed %d stale temporary files (%.1f MiB) left by crashed writers",
                     self.path, len(sv.removed), sum(t.bytes for t in sv.removed) / 2**20)
        return sv

    def _count_locked(self) -> tuple[Survey, int, int]:
        """Under ``_room``: survey the directory and count it. Returns (survey, bytes, of which this
        store's writes in flight): chunk files, other writers' temporary files, and this store's
        reservations.

        No reservation starts while ``_room`` is held, but puts end during the scan. One that ends
        with its file renamed into place before the scan reaches its directory would count twice (file
        and reservation), and one that fails would count for nothing on disk; both are taken out after
        the scan. Counting the reservations after the scan instead would miss a put whose temporary
        file the scan saw half-written and which ended before the count: an under-count that overshot
        the capacity by up to a chunk per writer thread (test_concurrent_puts_never_exceed_the_capacity)."""
        with self._lock:
            reserved, mine = self._reserved, set(self._mine)
            self._ended = []
        try:
            sv = self._survey()
        finally:
            with self._lock:
                mine |= self._mine     # a reserved put that created its temporary file during the scan
                ended, self._ended = self._ended, None
        seen = {c.path for c in sv.chunks}
        reserved -= sum(size for final, size in ended if final is None or final in seen)
        return sv, sv.chunk_bytes + sum(t.bytes for t in sv.temps if t.path not in mine) + reserved, reserved

    def _set_count(self, used: int, evicted: int = 0) -> None:
        with self._lock:
            self._used = used
            self._counted_at = self._clock()
            self.stats["evicted"] += evicted

    def _recount_locked(self) -> None:
        """Under ``_room``: count what every engine on this path has written (a directory scan)."""
        self._set_count(self._count_locked()[1])

    def _unlink_lru(self, chunks: list[ChunkInfo], done: Callable[[int], bool]) -> tuple[int, int]:
        """Delete chunk files, least recently used first, until ``done(bytes freed)``. Returns (files
        deleted, bytes freed); a file another engine deleted first counts as freed, not as deleted."""
        removed = freed = 0
        for c in sorted(chunks, key=lambda c: c.mtime):
            if done(freed):
                break
            try:
                os.unlink(c.path)
                removed += 1
            except FileNotFoundError:
                pass               # another engine evicted it first
            except OSError:
                continue           # cannot be deleted (read-only): still there
            freed += c.bytes
        return removed, freed

    def _evict_locked(self, target: int) -> tuple[int, int]:
        """Under ``_room``: delete least recently used files until the count is <= ``target``. Returns
        (files deleted, bytes of this store's writes that were in flight during the scan)."""
        sv, used, inflight = self._count_locked()
        removed, freed = self._unlink_lru(sv.chunks, lambda freed: used - freed <= target)
        self._set_count(used - freed, evicted=removed)
        return removed, inflight

    def usage(self) -> int:
        """Bytes of chunk files and temporary files (other writes in flight; stale ones are removed first)
        under the path right now (a directory scan)."""
        self._check_open()
        sv = self._survey()
        return sv.chunk_bytes + sv.temp_bytes

    def evict(self) -> int:
        """Delete least recently used files until usage <= low_watermark * capacity. Returns count."""
        self._check_open()
        if self.capacity_bytes is None:
            return 0
        with self._room:
            return self._evict_locked(int(self.capacity_bytes * self.low_watermark))[0]

    def clear(self) -> int:
        """Delete every chunk file (and stale temporary files). Returns the count of chunk files."""
        self._check_open()
        with self._room:
            sv, used, _ = self._count_locked()
            n, freed = self._unlink_lru(sv.chunks, lambda freed: False)
            self._set_count(used - freed)
        return n

    def close(self) -> None:
        self._closed = True
