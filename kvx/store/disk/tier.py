"""The disk tier itself (:class:`DiskTier`, registered as ``"disk"``): opening it, lookups, puts (the file
writes), gets (the file reads, verified), deletes, stats and the full-disk back-off. What is in the
directory is :mod:`kvx.store.disk.directory`'s, the capacity :mod:`kvx.store.disk.budget`'s.

Every operation may be called from several threads at once (the connector's reader and writer threads, the
scheduler's lookups). ``_lock`` guards ``counters`` and the back-off (``_backoff_s``, ``_full_until``): held for a
few instructions, never across I/O.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from pydantic import ValidationError

from ...log import Throttle, get_logger
from .. import codec
from ..errors import ChunkError, StoreClosedError, StoreFullError
from ..seal import EncryptionConfig, Sealer, check_encryption
from ..tier import REMOVED, STORED, Tier, TierContext, check_key, register_tier
from .budget import Budget, Reservation
from .config import DiskTierConfig, check_path
from .directory import _LIVE_TMP, ChunkInfo, Survey, TempInfo, chunk_file, name_end, survey, temp_name

log = get_logger("kvx.store.disk")  # one logger for the whole tier, named as before the split

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 1.0, 60.0
# Bytes per write call. On ext4 a file written with one large write call (as safetensors' save_file writes the
# tensor) was several times slower than in 1 MiB calls for seconds at a time, with no writeback or reclaim seen
# (the cause is not identified); smaller calls cost nothing elsewhere. benchmarks/bench_disk_put.py measures both
# writers in one run: benchmarks/results/disk_put_cpu.md.
_WRITE_PIECE = 1 << 20
# DiskTier.at's arguments, by the config field each one sets (its errors name the argument)
_AT_ARGS = {"path": "path", "size": "capacity_bytes", "fsync": "fsync", "rescan_s": "rescan_s"}


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


@register_tier
class DiskTier(Tier):
    """Chunks as safetensors files under ``config.path`` (see :mod:`kvx.store.disk`): the ``"disk"`` tier.

    Opened as every tier is, from its config and the context (:meth:`open`, or ``DiskTier(config, ctx)``);
    :meth:`at` builds that config from plain arguments (the CLI, tests, benchmarks).

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
            ``encryption``: seal every chunk (:mod:`kvx.store.seal`).
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
        if not isinstance(ctx.fingerprint, str):
            raise ValueError(f"fingerprint: expected a str, got {type(ctx.fingerprint).__name__}")
        if (
            isinstance(low_watermark, bool)
            or not isinstance(low_watermark, (int, float))
            or not 0.0 < low_watermark <= 1.0
        ):
            raise ValueError(f"low_watermark: expected a fraction in (0, 1], got {low_watermark!r}")
        if not callable(clock):
            raise ValueError(f"clock: expected a callable returning seconds, got {clock!r}")
        self.config = config
        # None: chunks in the clear; else every put seals and every get reads only sealed chunks it can open
        self.sealer = Sealer.of(getattr(config, "encryption", None), ctx.fingerprint)
        # the names this tier reads a chunk under, newest secret first (it writes the first): its secrets' key
        # ids, or None for the name in the clear (kvx.store.seal, "Names")
        self._kids: tuple[str | None, ...] = (None,) if self.sealer is None else tuple(self.sealer.kids)
        # how each of those names ends: the lookup formats names itself (file_of and os.path.join per name were a
        # quarter of a lookup's time: benchmarks/bench_tenant_lookup.py, benchmarks/results/tenant_lookup_cpu.md)
        self._ends = tuple(name_end(kid) for kid in self._kids)
        self.path = os.path.abspath(config.path)
        os.makedirs(self.path, exist_ok=True)
        self.fingerprint = ctx.fingerprint
        self.fsync = config.fsync
        self._clock = clock
        self._closed = False
        self._throttle = Throttle(log)
        self._lock = threading.Lock()
        self._backoff_s = 0.0  # current full-disk back-off; 0 = none
        self._full_until = -math.inf  # clock() until which puts fail at once
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
        self.budget = Budget(self.path, config.size, low_watermark, config.rescan_s, clock, self._survey, self._removed)
        self.budget.recount()  # also removes what crashed writers left behind

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
        """A disk tier at ``path`` from plain arguments: the :class:`DiskTierConfig` they make (``capacity_bytes``:
        its ``size``), validated as a config in a file is, then opened as every tier is. Errors (ValueError)
        name the argument; Python arguments take their own types only (no ``"1GiB"`` or ``"5"`` here)."""
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise ValueError(f"path: expected a directory path (str or os.PathLike), got {path!r}")
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)):
            raise ValueError(f"capacity_bytes: expected a positive int or None, got {capacity_bytes!r}")
        if isinstance(rescan_s, bool) or not isinstance(rescan_s, (int, float)):
            raise ValueError(f"rescan_s: expected seconds >= 0, got {rescan_s!r}")
        fields = dict(path=os.fspath(path), size=capacity_bytes, fsync=fsync, rescan_s=rescan_s, encryption=encryption)
        try:
            config = DiskTierConfig(type="disk", **fields)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "config"
            msg = err["msg"].removeprefix("Value error, ")
            given = "" if "got " in msg else f", got {err['input']!r}"
            raise ValueError(f"{_AT_ARGS.get(field, field)}: {msg}{given}") from None
        return cls(config, TierContext(fingerprint), low_watermark=low_watermark, clock=clock)

    @classmethod
    def check_config(cls, config: DiskTierConfig, where: str, writes: bool) -> list[str]:
        return check_path(config, where, writes) + check_encryption(getattr(config, "encryption", None), where)

    # ---------------------------------------------------------------- settings (the budget's)
    @property
    def capacity_bytes(self) -> int | None:
        return self.budget.capacity

    @capacity_bytes.setter
    def capacity_bytes(self, value: int | None) -> None:  # may be set while puts run (the next ones see it)
        self.budget.capacity = value

    @property
    def low_watermark(self) -> float:
        return self.budget.low_watermark

    @property
    def rescan_s(self) -> float:
        return self.budget.rescan_s

    def capacity(self) -> int | None:
        return self.budget.capacity

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # ---------------------------------------------------------------- paths
    def file_of(self, key: str) -> str:
        """The file this tier writes chunk ``key`` to (sealed: named by its newest secret's key id)."""
        return chunk_file(self.path, check_key(key), self._kids[0])

    def files_of(self, key: str) -> list[str]:
        """Every file this tier reads chunk ``key`` from, newest secret first: one, or one per secret of a
        rotation (``key_files``)."""
        key = check_key(key)
        return [chunk_file(self.path, key, kid) for kid in self._kids]

    def _check_open(self):
        if self._closed:
            raise StoreClosedError(f"disk store at {self.path} is closed")

    # ---------------------------------------------------------------- lookups
    def contains(self, key: str) -> bool:
        self._check_open()
        return any(os.path.exists(f) for f in self.files_of(key))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a file of it is there under a name this tier reads: a stat per key, and per
        secret of a rotation for the keys not found under the newer ones."""
        self._check_open()
        path, exists, ends = self.path, os.path.exists, self._ends
        if len(ends) == 1:
            end = ends[0]
            return [exists(f"{path}/{k[:2]}/{k}{end}") for k in map(check_key, keys)]
        return [any(exists(f"{path}/{k[:2]}/{k}{e}") for e in ends) for k in map(check_key, keys)]

    # ---------------------------------------------------------------- put
    def put(self, key: str, chunk: torch.Tensor, extra: dict[str, str] | None = None) -> bool:
        """Write ``chunk`` (a CPU tensor) under ``key``. Returns False if already present.

        Raises:
            StoreFullError: no room (see :mod:`kvx.store.disk`); nothing was written.
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
            self._count("full")
            raise StoreFullError(
                f"disk store {self.path}: no space left on device; puts refused during a "
                f"back-off ({self._backoff_s:.0f} s, {full_for:.1f} s left)"
            )
        for present in self.files_of(key) if len(self._kids) > 1 else (final,):  # sealed with any secret held
            if os.path.exists(present):
                try:
                    os.utime(present)
                    return False
                except FileNotFoundError:
                    pass  # another engine evicted it just now: write it again
        if self.sealer is not None:
            header, data = self.sealer.seal(chunk, key, extra, created=time.time())
        else:
            header, data = codec.encode(chunk, key, self.fingerprint, extra, created=time.time())
        size = len(header) + data.nbytes
        try:
            r = self.budget.reserve(key, size, final)
        except StoreFullError:
            self._count("full")
            raise
        try:
            relief = self.budget.relief
            try:
                self._write(key, final, (header, data), r)
            except OSError as e:
                if e.errno not in _FULL_ERRNOS:
                    raise
                freed = self._relieve(relief, size)
                try:
                    self._write(key, final, (header, data), r)
                except OSError as e2:
                    if e2.errno not in _FULL_ERRNOS:
                        raise
                    raise self._full(key, freed) from e2
        except BaseException as e:
            self.budget.end(r, written=False)
            if isinstance(e, OSError) and e.errno is not None:  # say which store and chunk, not the temp name
                raise OSError(e.errno, f"disk store {self.path}: cannot write chunk {key}: {e.strerror}", final) from e
            raise
        self.budget.end(r, written=True)
        with self._lock:
            self.counters["puts"] += 1
            self.counters["put_bytes"] += size
            self._backoff_s, self._full_until = 0.0, -math.inf  # there was room: the disk is not full
        self._emit(STORED, [key])
        return True

    def _write(self, key: str, final: str, bufs, r: Reservation) -> None:
        """Write ``bufs`` to a temporary file next to ``final`` and rename it into place; on any failure
        (or interrupt) remove the temporary file and re-raise. Its bytes are ``r``'s (counted once)."""
        tmp = temp_name(final)
        # registered before the file exists: a scan that sees it must see it as in flight
        _LIVE_TMP.add(tmp)
        self.budget.track(r, tmp)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(tmp, flags, 0o666)
            except FileNotFoundError:  # first chunk of this subdirectory, or the store was deleted
                os.makedirs(os.path.dirname(final), exist_ok=True)
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
            self.budget.untrack(r, tmp)

    def _relieve(self, relief: int, size: int) -> int:
        """The disk is full: the budget evicts, unless another put did since ``relief`` was read; warn.
        Returns the count of files deleted."""
        done = self.budget.relieve(relief, size)
        if done is None:
            return 0  # another writer just made room: only retry
        removed, freed = done
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

    # ---------------------------------------------------------------- get
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
        opened = None
        for path, kid in zip(self.files_of(key), self._kids):  # newest secret first
            try:
                opened = open(path, "rb", buffering=0), path, kid
                break
            except FileNotFoundError:
                continue
            except OSError as e:
                self._count_error()
                raise ChunkError(f"chunk {key}: cannot open {path}: {e}") from None
        if opened is None:
            raise ChunkError(f"chunk {key}: not on disk ({self.file_of(key)})")
        f, path, kid = opened
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
                problems = self.sealer.problems(h, key, shape, dtype, kid)
            else:
                problems = codec.check(h, key, self.fingerprint, shape, dtype)
            if problems:
                # A file under the wrong name (another key, or another secret's key id, inside; or mangled
                # metadata) can never be served: drop it. A file that is merely not what this reader expects
                # (fingerprint, format version, shape) may be valid for another engine: keep it.
                if Sealer.misplaced(h, key, kid):
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
        """Remove chunk ``key`` (every file of it this tier reads); False if there was none."""
        self._check_open()
        found = False
        for path in self.files_of(key):
            try:
                size = os.path.getsize(path)
                os.unlink(path)
            except FileNotFoundError:
                continue
            self.budget.freed(size)
            found = True
        if found:
            self._emit(REMOVED, [key])
        return found

    def _drop_bad(self, path: str) -> None:
        """A file that failed to read or verify can never be served: remove it, so the chunk becomes a
        miss and the recomputation saves a good copy (instead of failing on every request)."""
        self._count_error()
        try:
            os.unlink(path)
        except OSError:
            pass

    def _count_error(self):
        self._count("errors")

    # ---------------------------------------------------------------- the directory and its capacity
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
        """One pass over the directory, removing (and counting, and logging) stale temporary files."""
        sv = survey(self.path, remove_stale=True)
        if sv.removed:
            self._count("tmp_removed", len(sv.removed))
            log.info(
                "kvx: disk store %s: removed %d stale temporary files (%.1f MiB) left by crashed writers",
                self.path,
                len(sv.removed),
                sum(t.bytes for t in sv.removed) / 2**20,
            )
        return sv

    def _removed(self, chunks: list[ChunkInfo], evicted: bool) -> None:
        """The budget deleted these chunk files (``evicted``: to make room): every file counts, the removal
        events name only the chunks this tier could read (another tenant's are not this engine's)."""
        if evicted:
            self._count("evicted", len(chunks))
        readable = {kid or "" for kid in self._kids}
        keys = [c.key for c in chunks if c.kid in readable]
        if keys:
            self._emit(REMOVED, keys)

    def usage(self) -> int:
        """Bytes of chunk files and temporary files (other writes in flight; stale ones are removed first)
        under the path right now (a directory scan)."""
        self._check_open()
        sv = self._survey()
        return sv.chunk_bytes + sv.temp_bytes

    def evict(self) -> int:
        """Delete least recently used files until usage <= low_watermark * capacity. Returns count."""
        self._check_open()
        return self.budget.evict()

    def clear(self) -> int:
        """Delete every chunk file (and stale temporary files). Returns the count of chunk files."""
        self._check_open()
        return self.budget.clear()

    def close(self) -> None:
        self._closed = True
