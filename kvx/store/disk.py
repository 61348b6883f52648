"""Disk tier: one safetensors file per chunk, safe to share between engines on one path.

Layout: ``<path>/<key[:2]>/<key>.safetensors`` holding one tensor ``"kv"`` (the chunk) and metadata
``{"kvx_format", "key", "fingerprint", "crc32", ...}``. Writes go to a temporary name in the same
directory and are renamed into place, so a reader never sees a partial file, and two engines writing
the same key both produce a complete file (the last rename wins; both are identical chunks). Reads
check the format version, key, fingerprint, dtype/shape and the CRC32 of the bytes; any mismatch is a
:class:`ChunkError` (the connector reports it to vLLM, which recomputes). A corrupt file (unreadable, bad
checksum, wrong key inside) is deleted, so the recomputed chunk is saved again rather than failing on
every request.

Capacity: when the bytes this process believes are on disk exceed ``capacity_bytes``, the directory
is scanned and the least recently used files (mtime; a read touches it) are deleted down to
``low_watermark * capacity``. Other engines may delete files at any time: a missing file is a miss.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = "kvx-1"
_SUFFIX = ".safetensors"
_TMP_MAX_AGE_S = 3600.0  # temporary files older than this are leftovers of a crashed writer
_RESERVED_META = ("kvx_format", "key", "fingerprint", "crc32", "created")


class ChunkError(RuntimeError):
    """A chunk could not be read back correctly (missing, corrupt, or not what was asked for)."""


class StoreClosedError(RuntimeError):
    """An operation on a store after :meth:`close`."""


@dataclass(frozen=True)
class ChunkInfo:
    key: str
    path: str
    bytes: int
    mtime: float


def checksum(t: torch.Tensor) -> str:
    """CRC32 of a contiguous CPU tensor's bytes, as 8 hex digits (zlib runs at ~6 GB/s here)."""
    return f"{zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()):08x}"


def _valid_key(key: str) -> str:
    if not isinstance(key, str) or len(key) < 8 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"key: expected a lowercase hex string of >= 8 digits, got {key!r}")
    return key


class DiskStore:
    """Chunks as safetensors files under ``path`` (see the module docstring).

    Args:
        path: directory (created if missing); may be shared by several engines.
        capacity_bytes: size budget for the directory; ``None`` = unbounded.
        fingerprint: what the chunks' bytes mean (layout/format); a file with another fingerprint is
            never served.
        fsync: fsync each file before the rename (durability across power loss; slower).
        rescan_s: capacity only: how stale this process's count of the directory's size may get. Other
            engines on a shared path write too, so a put re-counts the directory when the last count is
            older than this (0: at every put). Without it, N engines could together fill N times the
            budget before each one's own count reached it.
    Thread-safe: ``put``/``get`` may run on several I/O threads.
    """

    def __init__(self, path: str, capacity_bytes: int | None = None, fingerprint: str = "",
                 fsync: bool = False, low_watermark: float = 0.9, rescan_s: float = 5.0):
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
        self.path = os.path.abspath(os.fspath(path))
        os.makedirs(self.path, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.low_watermark = low_watermark
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._closed = False
        self._used, self._counted_at = 0, 0.0
        self._recount()
        self.stats = {"puts": 0, "put_bytes": 0, "gets": 0, "get_bytes": 0, "evicted": 0, "errors": 0}

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

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys present on disk."""
        self._check_open()
        n = 0
        for key in keys:
            if not os.path.exists(self.file_of(key)):
                break
            n += 1
        return n

    # ---------------------------------------------------------------- put / get
    def put(self, key: str, chunk: torch.Tensor, extra: dict[str, str] | None = None) -> bool:
        """Write ``chunk`` (a contiguous CPU tensor) under ``key``. Returns False if already present."""
        self._check_open()
        final = self.file_of(key)
        # Validate before the presence check: a bad call must fail the same way whether or not the key
        # happens to be on disk already.
        if not isinstance(chunk, torch.Tensor) or chunk.device.type != "cpu":
            raise ValueError(f"chunk: expected a CPU tensor, got {type(chunk).__name__} "
                             f"{getattr(chunk, 'device', '')}")
        if extra is not None and (not isinstance(extra, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in extra.items())):
            raise ValueError(f"extra: expected a dict of str -> str, got {extra!r}")
        if extra and any(k in _RESERVED_META for k in extra):
            # would overwrite the fields get() verifies (key, fingerprint, checksum, ...)
            raise ValueError(f"extra: keys {sorted(set(extra) & set(_RESERVED_META))} are reserved")
        if os.path.exists(final):
            try:
                os.utime(final)
                return False
            except FileNotFoundError:
                pass  # another engine evicted it just now: write it again
        chunk = chunk.contiguous()
        meta = {**(extra or {}), "kvx_format": FORMAT_VERSION, "key": key, "fingerprint": self.fingerprint,
                "crc32": checksum(chunk), "created": f"{time.time():.3f}"}
        d = os.path.dirname(final)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            save_file({"kv": chunk}, tmp, metadata=meta)
            if self.fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        size = os.path.getsize(final)
        with self._lock:
            self._used += size
            self.stats["puts"] += 1
            self.stats["put_bytes"] += size
            stale = time.monotonic() - self._counted_at >= self.rescan_s
        if self.capacity_bytes is None:
            return True
        if stale:
            self._recount()
        if self._used > self.capacity_bytes:
            self.evict()
        return True

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
        self._check_open()  # here, not in the generator: a closed store fails at the call
        return self._scan()

    def _scan(self) -> Iterator[ChunkInfo]:
        now = time.time()
        try:
            subdirs = list(os.scandir(self.path))
        except FileNotFoundError:
            return
        for d in subdirs:
            if not d.is_dir(follow_symlinks=False) or len(d.name) != 2:
                continue
            try:
                entries = list(os.scandir(d.path))
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > _TMP_MAX_AGE_S:
                        try:
                            os.unlink(e.path)
                        except OSError:
                            pass
                    continue
                if e.name.endswith(_SUFFIX):
                    yield ChunkInfo(e.name[: -len(_SUFFIX)], e.path, st.st_size, st.st_mtime)

    def _recount(self) -> None:
        """Count what every engine on this path has written (a directory scan)."""
        used = sum(c.bytes for c in self.scan())
        with self._lock:
            self._used, self._counted_at = used, time.monotonic()

    def usage(self) -> int:
        """Bytes of chunk files under the path right now (a directory scan)."""
        self._check_open()
        return sum(c.bytes for c in self.scan())

    def evict(self) -> int:
        """Delete least recently used files until usage <= low_watermark * capacity. Returns count."""
        self._check_open()
        if self.capacity_bytes is None:
            return 0
        chunks = sorted(self.scan(), key=lambda c: c.mtime)
        used = sum(c.bytes for c in chunks)
        target = int(self.capacity_bytes * self.low_watermark)
        removed = 0
        for c in chunks:
            if used <= target:
                break
            try:
                os.unlink(c.path)
                removed += 1
            except FileNotFoundError:
                pass  # another engine evicted it first
            used -= c.bytes
        with self._lock:
            self._used, self._counted_at = used, time.monotonic()
            self.stats["evicted"] += removed
        return removed

    def clear(self) -> int:
        """Delete every chunk file. Returns the count."""
        self._check_open()
        n = 0
        for c in list(self.scan()):
            try:
                os.unlink(c.path)
                n += 1
            except FileNotFoundError:
                pass
        with self._lock:
            self._used = 0
        return n

    def close(self) -> None:
        self._closed = True
