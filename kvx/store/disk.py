"""Disk tier: one safetensors file per chunk, safe to share between engines on one path.

Layout: ``<path>/<key[:2]>/<key>.safetensors`` holding one tensor ``"kv"`` (the chunk) and metadata
``{"kvx_format", "key", "fingerprint", "length", "crc32c", ...}`` (:mod:`kvx.store.codec`). Reads check
the format version, key, fingerprint, dtype/shape and the checksum of the bytes; any mismatch is a
:class:`ChunkError` (the connector reports it to vLLM, which recomputes). A corrupt file (unreadable, bad
checksum, wrong key inside) is deleted, so the recomputed chunk is saved again rather than failing on every
request.

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
start-up, the periodic re-count, eviction, :meth:`DiskTier.usage`, :meth:`DiskTier.clear`) sorts
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
:class:`DiskTier` for the bound with several engines. Other engines may delete files at any time: a
missing file is a miss.

Full disk. A write that fails with ENOSPC or EDQUOT evicts the least recently used files (at least 10%
of the chunk bytes, see ``_FULL_EVICT_FRACTION``) and retries once. If that fails too, the put raises
:class:`StoreFullError`, and puts for a back-off period (1 s, doubling to 60 s, reset by a successful
put) raise it at once without touching the disk.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, field_validator

from ..log import Throttle, get_logger
from . import codec
from .errors import ChunkError, StoreClosedError, StoreFullError
from .seal import EncryptionConfig, Sealer, check_encryption
from .tier import REMOVED, STORED, Tier, TierConfig, TierContext, check_key, parse_size, register_tier

log = get_logger(__name__)

_SUFFIX = ".safetensors"
_TMP_MAX_AGE_S = 3600.0  # a write takes milliseconds: a temporary file this old has no live writer
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


class DiskTierConfig(TierConfig):
    """One chunk file per chunk under ``path`` (may be shared by several engines)."""

    type: Literal["disk"]
    path: str
    size: int | None = Field(default=None, description="capacity in bytes, e.g. '100GiB'; none = unbounded")
    fsync: bool = False
    rescan_s: float = Field(
        default=5.0,
        ge=0,
        description="with a size: re-count the (shared) directory at most "
        "this many seconds apart when writing; engines sharing a path overshoot size by at "
        "most what the others write in that time",
    )
    encryption: EncryptionConfig | None = Field(
        default=None,
        description='{"key_file": PATH} or {"key_files": [newest, ..., oldest]}: seal every chunk with '
        "AES-256-GCM (kvx.store.seal); read only chunks sealed with one of these secrets",
    )

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str):
        if not v.strip():
            raise ValueError("expected a directory path, got an empty string")
        return v


def check_path(config: DiskTierConfig, where: str, writes: bool) -> list[str]:
    """``config.path`` is a directory, or can be created as one, and is writable if this engine saves."""
    where = f"{where}.path"
    path = os.path.abspath(os.path.expanduser(config.path))
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = "a file" if os.path.isfile(path) else "not a directory"
        return [
            f"{where}: expected a directory (or a path where one can be created), got {config.path!r}, which is {kind}"
        ]
    probe = path
    while not os.path.isdir(probe):  # the nearest existing ancestor decides what can be created
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return [
                f"{where}: expected a directory (or a path where one can be created), "
                f"got {config.path!r}, whose parent {parent!r} is not a directory"
            ]
        probe = parent
    if os.access(probe, os.W_OK | os.X_OK):
        return []
    if probe != path:
        return [
            f"{where}: expected a directory that exists or can be created, got {config.path!r} "
            f"(it does not exist, and {probe!r} is not writable)"
        ]
    if writes:
        return [
            f"{where}: expected a writable directory (this engine saves chunks: kv_role "
            f"kv_producer or kv_both), got {config.path!r}, which this process cannot write"
        ]
    return []


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
    reason: str  # why it is stale or in flight, for people ("writer pid 123 is gone")


@dataclass
class Survey:
    """One pass over a store directory (:func:`survey`)."""

    chunks: list[ChunkInfo] = field(default_factory=list)
    temps: list[TempInfo] = field(default_factory=list)  # still on disk (stale ones: removal failed or not asked)
    removed: list[TempInfo] = field(default_factory=list)  # stale temporary files this pass deleted

    @property
    def chunk_bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def temp_bytes(self) -> int:
        return sum(t.bytes for t in self.temps)


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
# Temporary files this process is writing (every DiskTier in it): one named with this process's pid
# but not listed here is the leftover of an earlier process that had the same pid (a restarted
# container often reuses its pids).
_LIVE_TMP: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
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
    parts = name[1 : -len(".tmp")].split(".") if name.endswith(".tmp") else []
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
    except OSError:  # deleted under us, or not readable: nothing to count
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
                        continue  # renamed into place or removed by another engine meanwhile
                    except OSError:
                        pass  # read-only: still there, still counted
                out.temps.append(info)
            elif e.name.endswith(_SUFFIX):
                out.chunks.append(ChunkInfo(e.name[: -len(_SUFFIX)], e.path, st.st_size, st.st_mtime))
    return out


# ------------------------------------------------------------------------------------------ file format
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


def _check_args(path, capacity_bytes, fingerprint, low_watermark, rescan_s, clock) -> None:
    """ValueError naming the first of a disk tier's arguments that is not what it must be."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
        raise ValueError(f"path: expected a directory path, got {path!r}")
    if capacity_bytes is not None and (
        isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0
    ):
        raise ValueError(f"capacity_bytes: expected a positive int or None, got {capacity_bytes!r}")
    if isinstance(low_watermark, bool) or not isinstance(low_watermark, (int, float)) or not 0.0 < low_watermark <= 1.0:
        raise ValueError(f"low_watermark: expected a fraction in (0, 1], got {low_watermark!r}")
    if isinstance(rescan_s, bool) or not isinstance(rescan_s, (int, float)) or not rescan_s >= 0:
        raise ValueError(f"rescan_s: expected seconds >= 0, got {rescan_s!r}")
    if not isinstance(fingerprint, str):
        raise ValueError(f"fingerprint: expected a str, got {type(fingerprint).__name__}")
    if not callable(clock):
        raise ValueError(f"clock: expected a callable returning seconds, got {clock!r}")


# ------------------------------------------------------------------------------------------ the store
@register_tier
class DiskTier(Tier):
    """Chunks as safetensors files under ``config.path`` (see the module docstring): the ``"disk"`` tier.

    Opened as every tier is, from its config and the context (:meth:`open`, or ``DiskTier(config, ctx)``);
    :meth:`at` opens one from plain arguments (the CLI, tests, benchmarks).

    Args:
        config: ``path``: directory (created if missing); may be shared by several engines. ``size``: size
            budget for the directory (chunk and temporary files; ``capacity_bytes``); ``None`` = unbounded.
            ``fsync``: fsync each file before the rename (durability across power loss; slower).
            ``rescan_s``: capacity only: how stale this process's count of the directory's size may get.
            Other engines on a shared path write too, so a put re-counts the directory when the last count
            is older than this (0: at every put; an eviction always re-counts). One engine alone never
            exceeds ``capacity_bytes``, whatever its number of writer threads: each put reserves its
            bytes, evicting first, before it writes. N engines on one path, each with T writer threads
            writing at most W bytes/s, use at most
            ``capacity_bytes + (N-1) * min(capacity_bytes, W * rescan_s + (T+1) * chunk_file_bytes)``:
            what the others add between one engine's counts (they re-count too before writing more).
        ctx: ``fingerprint``: what the chunks' bytes mean (layout/format); a file with another fingerprint
            is never served.
        low_watermark: an eviction deletes down to this fraction of ``capacity_bytes``.
        clock: monotonic seconds, for ``rescan_s`` and the full-disk back-off (injectable for tests).
    Thread-safe: ``put``/``get`` may run on several I/O threads.
    """

    type = "disk"
    config_model = DiskTierConfig
    hit_source = "disk"
    event_medium = "STORAGE"
    event_locality = "LOCAL"
    local_lookup = True

    def __init__(
        self,
        config: DiskTierConfig,
        ctx: TierContext,
        *,
        low_watermark: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        path, capacity_bytes, fingerprint = config.path, config.size, ctx.fingerprint
        fsync, rescan_s = config.fsync, config.rescan_s
        _check_args(path, capacity_bytes, fingerprint, low_watermark, rescan_s, clock)
        # None: chunks in the clear; else every put seals and every get reads only sealed chunks it can open
        self.sealer = Sealer.of(getattr(config, "encryption", None), fingerprint)
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
        self._used = 0  # bytes under path at the last count + this store's reservations since
        self._reserved = 0  # this store's puts being written (inside _used)
        self._mine: set[str] = set()  # their temporary files (counted as reservations, not as files)
        self._ended: list | None = None  # during a count: (final path or None if failed, size) of puts ending
        self._waiting = 0  # puts waiting in _reserve for this store's writes to finish
        self._counted_at = -math.inf
        self._relief = 0  # evictions for a full disk so far (a put that fails after one retries)
        self._backoff_s = 0.0  # current full-disk back-off; 0 = none
        self._full_until = -math.inf
        self.counters = {
            "puts": 0,
            "put_bytes": 0,
            "gets": 0,
            "get_bytes": 0,
            "evicted": 0,
            "errors": 0,
            "full": 0,
            "tmp_removed": 0,
        }
        with self._room:
            self._recount_locked()  # also removes what crashed writers left behind

    @classmethod
    def open(cls, config: DiskTierConfig, ctx: TierContext) -> DiskTier:
        return cls(config, ctx)

    @classmethod
    def at(
        cls,
        path: str | os.PathLike,
        capacity_bytes: int | None = None,
        fingerprint: str = "",
        fsync: bool = False,
        low_watermark: float = 0.9,
        rescan_s: float = 5.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        encryption: EncryptionConfig | dict | None = None,
    ) -> DiskTier:
        """A disk tier at ``path`` from plain arguments (``capacity_bytes``: the config's ``size``), checked
        as the constructor checks them (ValueError naming the argument)."""
        _check_args(path, capacity_bytes, fingerprint, low_watermark, rescan_s, clock)
        if isinstance(encryption, dict):
            encryption = EncryptionConfig.model_validate(encryption)
        # checked above, by the rules of these arguments (a path object, any fsync value); not the config's
        config = DiskTierConfig.model_construct(
            type="disk", path=path, size=capacity_bytes, fsync=fsync, rescan_s=rescan_s, encryption=encryption
        )
        return cls(config, TierContext(fingerprint), low_watermark=low_watermark, clock=clock)

    @classmethod
    def check_config(cls, config: DiskTierConfig, where: str, writes: bool) -> list[str]:
        return check_path(config, where, writes) + check_encryption(getattr(config, "encryption", None), where)

    def capacity(self) -> int | None:
        return self.capacity_bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    # ---------------------------------------------------------------- paths
    def file_of(self, key: str) -> str:
        key = check_key(key)
        return os.path.join(self.path, key[:2], key + _SUFFIX)

    def _check_open(self):
        if self._closed:
            raise StoreClosedError(f"disk store at {self.path} is closed")

    # ---------------------------------------------------------------- lookups
    def contains(self, key: str) -> bool:
        self._check_open()
        return os.path.exists(self.file_of(key))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return [os.path.exists(self.file_of(k)) for k in keys]

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
        codec.check_chunk(chunk)
        codec.check_extra(extra)
        full_for = self._full_until - self._clock()
        if full_for > 0:  # a full disk: fail at once rather than write (and evict) for every chunk
            with self._lock:
                self.counters["full"] += 1
            raise StoreFullError(
                f"disk store {self.path}: no space left on device; puts refused during a "
                f"back-off ({self._backoff_s:.0f} s, {full_for:.1f} s left)"
            )
        if os.path.exists(final):
            try:
                os.utime(final)
                return False
            except FileNotFoundError:
                pass  # another engine evicted it just now: write it again
        if self.sealer is not None:
            header, data = self.sealer.seal(chunk, key, extra, created=time.time())
        else:
            header, data = codec.encode(chunk, key, self.fingerprint, extra, created=time.time())
        size = len(header) + data.nbytes
        # whether this put reserved its bytes is decided once: capacity_bytes may be set while it writes
        reserved = self.capacity_bytes is not None
        if reserved:
            self._reserve(key, size)
        try:
            relief = self._relief
            try:
                self._write(key, final, (header, data), reserved)
            except OSError as e:
                if e.errno not in _FULL_ERRNOS:
                    raise
                freed = self._relieve(relief, size)
                try:
                    self._write(key, final, (header, data), reserved)
                except OSError as e2:
                    if e2.errno not in _FULL_ERRNOS:
                        raise
                    raise self._full(key, freed) from e2
        except BaseException as e:
            self._end_reservation(size, False, final, reserved)
            if isinstance(e, OSError) and e.errno is not None:  # say which store and chunk, not the temp name
                raise OSError(e.errno, f"disk store {self.path}: cannot write chunk {key}: {e.strerror}", final) from e
            raise
        self._end_reservation(size, True, final, reserved)
        self._emit(STORED, [key])
        return True

    def _write(self, key: str, final: str, bufs, reserved: bool) -> None:
        """Write ``bufs`` to a temporary file next to ``final`` and rename it into place; on any failure
        (or interrupt) remove the temporary file and re-raise. ``reserved``: its bytes are counted as a
        reservation (its temporary file is not counted again)."""
        d = os.path.dirname(final)
        tmp = os.path.join(d, f".{key}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        # registered before the file exists: a scan that sees it must see it as in flight
        _LIVE_TMP.add(tmp)
        if reserved:
            with self._lock:
                self._mine.add(tmp)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(tmp, flags, 0o666)
            except FileNotFoundError:  # first chunk of this subdirectory, or the store was deleted
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
                self.counters["full"] += 1
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
                        self.counters["full"] += 1
                    raise StoreFullError(
                        f"chunk {key}: no room under {self.path} ({self._used} of {cap} bytes used by files "
                        f"this store cannot evict, {size} needed)"
                    )
                if self._reserved:  # this store's own writes fill the budget: wait for one to end
                    self._waiting += 1
                    try:
                        self._room.wait(_WAIT_S)
                    finally:
                        self._waiting -= 1
                # then count again: the files they wrote can be evicted now
            with self._lock:
                self._used += size
                self._reserved += size

    def _end_reservation(self, size: int, written: bool, final: str, reserved: bool) -> None:
        """A put's write is over: its reservation becomes a file on disk, or is returned (``reserved``: the
        put reserved, whatever ``capacity_bytes`` says now)."""
        with self._lock:
            if reserved:
                self._reserved -= size
                if self._ended is not None:
                    self._ended.append((final if written else None, size))
                if not written:
                    self._used -= size
            elif written:
                self._used += size
            if written:
                self.counters["puts"] += 1
                self.counters["put_bytes"] += size
                self._backoff_s, self._full_until = 0.0, -math.inf  # there was room: the disk is not full
            waiting = self._waiting
        if waiting:
            with self._room:
                self._room.notify_all()

    def _relieve(self, relief: int, size: int) -> int:
        """The disk is full: delete the least recently used files (``_FULL_EVICT_FRACTION`` of the chunk
        bytes, at least ``size``) unless another put did so since ``relief`` was read. Returns the count."""
        with self._room:
            if self._relief != relief:
                return 0  # another writer just made room: only retry
            self._relief += 1
            sv, used, _ = self._count_locked()
            goal = max(int(sv.chunk_bytes * _FULL_EVICT_FRACTION), size)
            removed, freed = self._unlink_lru(sv.chunks, lambda freed: freed >= goal)
            self._set_count(used - freed, evicted=removed)
        self._throttle.warning(
            "full",
            "kvx: disk store %s: no space left on device; evicted %d least recently "
            "used chunks (%.1f MiB) and retrying",
            self.path,
            removed,
            freed / 2**20,
        )
        return removed

    def _full(self, key: str, evicted: int) -> StoreFullError:
        """Still no space after an eviction: start (or keep) the back-off; the error to raise."""
        with self._lock:
            now = self._clock()
            if now >= self._full_until:  # one doubling per episode, not one per failing thread
                self._backoff_s = min(max(2 * self._backoff_s, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
                self._full_until = now + self._backoff_s
            backoff = self._backoff_s
            self.counters["full"] += 1
        self._throttle.warning(
            "full-backoff",
            "kvx: disk store %s: still no space left on device after evicting %d chunks; refusing writes for %.0f s",
            self.path,
            evicted,
            backoff,
        )
        return StoreFullError(
            f"disk store {self.path}: no space left on device for chunk {key} even after "
            f"evicting ({evicted} chunks); puts refused for a back-off ({backoff:.0f} s)"
        )

    def get(self, key: str, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read and verify chunk ``key`` into a new tensor (of ``shape`` / ``dtype`` if given, else the
        file's).

        Raises:
            ChunkError: missing, unreadable, wrong format/key/fingerprint/shape/dtype, or bad checksum.
        """
        return self._read(key, None, shape, dtype)

    def get_into(self, key: str, out: torch.Tensor) -> None:
        """Read and verify chunk ``key`` straight into ``out`` (one copy: the page cache to ``out``)."""
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"out: expected a contiguous CPU tensor, got {type(out).__name__} {getattr(out, 'device', '')}"
            )
        self._read(key, out, tuple(out.shape), out.dtype)

    def _read(self, key: str, out: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        self._check_open()
        path = self.file_of(key)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise ChunkError(f"chunk {key}: not on disk ({path})") from None
        except OSError as e:
            self._count_error()
            raise ChunkError(f"chunk {key}: cannot open {path}: {e}") from None
        with f:
            try:
                prefix = f.read(codec.PREFIX_BYTES)
                h = codec.decode_header(prefix + f.read(codec.header_length(prefix)))
                if h.dtype is None:
                    raise ChunkError(f"dtype not supported by this torch: {h}")
            except (ChunkError, OSError) as e:
                self._drop_bad(path)
                raise ChunkError(f"chunk {key}: unreadable file {path}: {e}") from None
            if self.sealer is not None:
                problems = self.sealer.problems(h, key, shape, dtype)
            else:
                problems = codec.check(h, key, self.fingerprint, shape, dtype)
            if problems:
                # A file under the wrong name (or with mangled metadata) can never be served: drop it. A file
                # that is merely not what this reader expects (fingerprint, format version, shape, sealed or
                # not, another secret's seal) may be valid for another engine: keep it.
                if h.key != key:
                    self._drop_bad(path)
                else:
                    self._count_error()
                raise ChunkError(f"chunk {key}: {path} failed verification: {'; '.join(problems)}")
            if out is None:
                out = torch.empty(h.shape, dtype=h.dtype)
            dst = memoryview(codec.byte_view(out))
            got = 0
            opening = None if self.sealer is None else self.sealer.opening(h, key, out, f"chunk {key}: {path}")
            try:
                while got < h.nbytes:
                    if opening is None:
                        n = f.readinto(dst[got:])
                    else:  # ciphertext into the thread's staging buffer, decrypted from there into out
                        n = f.readinto(opening.buffer())
                        if n:
                            opening.advance(n)
                    if not n:
                        break
                    got += n
            except OSError as e:
                self._count_error()
                raise ChunkError(f"chunk {key}: cannot read {path}: {e}") from None
        if got != h.nbytes:
            self._drop_bad(path)
            raise ChunkError(f"chunk {key}: unreadable file {path}: truncated ({got} of {h.nbytes} payload bytes)")
        if opening is not None:
            try:
                opening.finish()  # the GCM tag: every byte of the header and payload, for this key
            except ChunkError:
                self._drop_bad(path)  # sealed with this tier's secret yet not authentic: altered or misplaced
                raise
        elif not codec.check_crc(h, out):
            self._drop_bad(path)
            raise ChunkError(f"chunk {key}: {path} failed verification: checksum mismatch (corrupt bytes)")
        try:
            os.utime(path)  # LRU: a read makes the file recent
        except OSError:
            pass
        with self._lock:
            self.counters["gets"] += 1
            self.counters["get_bytes"] += h.nbytes
        return out

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
        self._emit(REMOVED, [key])
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
            self.counters["errors"] += 1

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
                self.counters["tmp_removed"] += len(sv.removed)
            log.info(
                "kvx: disk store %s: removed %d stale temporary files (%.1f MiB) left by crashed writers",
                self.path,
                len(sv.removed),
                sum(t.bytes for t in sv.removed) / 2**20,
            )
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
                mine |= self._mine  # a reserved put that created its temporary file during the scan
                ended, self._ended = self._ended, None
        seen = {c.path for c in sv.chunks}
        reserved -= sum(size for final, size in ended if final is None or final in seen)
        return sv, sv.chunk_bytes + sum(t.bytes for t in sv.temps if t.path not in mine) + reserved, reserved

    def _set_count(self, used: int, evicted: int = 0) -> None:
        with self._lock:
            self._used = used
            self._counted_at = self._clock()
            self.counters["evicted"] += evicted

    def _recount_locked(self) -> None:
        """Under ``_room``: count what every engine on this path has written (a directory scan)."""
        self._set_count(self._count_locked()[1])

    def _unlink_lru(self, chunks: list[ChunkInfo], done: Callable[[int], bool]) -> tuple[int, int]:
        """Delete chunk files, least recently used first, until ``done(bytes freed)``. Returns (files
        deleted, bytes freed); a file another engine deleted first counts as freed, not as deleted."""
        removed, freed, keys = 0, 0, []
        for c in sorted(chunks, key=lambda c: c.mtime):
            if done(freed):
                break
            try:
                os.unlink(c.path)
                removed += 1
                keys.append(c.key)
            except FileNotFoundError:
                pass  # another engine evicted it first
            except OSError:
                continue  # cannot be deleted (read-only): still there
            freed += c.bytes
        if keys:
            self._emit(REMOVED, keys)
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
