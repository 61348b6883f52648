"""What is in a disk store's directory (:func:`survey`): chunk files, and temporary files sorted into writes
in flight and leftovers of dead writers; the names kvx gives both.

Names. A chunk file is ``<path>/<key[:2]>/<key>.safetensors``, or ``<key>-<kid>.safetensors`` when sealed
(:mod:`kvx.store.seal`; ``kid``: the key id of the secret that sealed it, so tenants with different secrets
never share a file name, and a tier looks up only the names of the secrets it holds). A write goes to the
temporary file ``.<key>[-<kid>].<host>.<pid>.<random>.tmp`` next to it (:func:`temp_name`), renamed into
place when complete.

Temporary files (the rule of :func:`survey`):

- in flight, kept: written by a live process of this host (same host name and pid namespace, the pid
  exists), or by another host (only its age can tell) and younger than ``_TMP_MAX_AGE_S``;
- stale: its writer is dead (this host), or it is older than ``_TMP_MAX_AGE_S``.

Names of older kvx versions (``.<key>.<pid>.<random>.tmp``, safetensors' ``.tmpXXXXXX``) are recognised and
judged by age only.

Functions of the file system and the process table, plus ``_LIVE_TMP`` (this process's temporary files being
written): any thread. Writer threads add to and discard from ``_LIVE_TMP`` one path at a time (single set
operations, atomic under the GIL); :func:`survey` only tests membership.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
import zlib
from dataclasses import dataclass, field

SUFFIX = ".safetensors"
_TMP_MAX_AGE_S = 3600.0  # a write takes milliseconds: a temporary file this old has no live writer


@dataclass(frozen=True)
class ChunkInfo:
    """A chunk file: its key, path, size and mtime (the LRU clock: a read or a repeated put touches it), and
    the key id of the secret that sealed it, from its name ("": in the clear, or sealed by a kvx that did
    not name files by key id)."""

    key: str
    path: str
    bytes: int
    mtime: float
    kid: str = ""


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


def name_end(kid: str | None) -> str:
    """What follows the chunk key in a chunk file's name: ``.safetensors`` in the clear, ``-<kid>.safetensors``
    sealed with the secret of key id ``kid``."""
    return f"-{kid}{SUFFIX}" if kid else SUFFIX


def chunk_file(root: str, key: str, kid: str | None = None) -> str:
    """Where chunk ``key`` (a checked key) lives under the store directory ``root``: in the clear, or sealed
    with the secret of key id ``kid``."""
    return os.path.join(root, key[:2], key + name_end(kid))


def temp_name(final: str) -> str:
    """A new temporary file for a write to the chunk file ``final``: in its directory, named after it and by
    this host and process (so a survey can tell whether its writer is alive)."""
    stem = os.path.basename(final)[: -len(SUFFIX)]
    return os.path.join(os.path.dirname(final), f".{stem}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True


def is_temp_name(name: str) -> bool:
    """kvx's ``.<key>....tmp``, or safetensors' ``.tmpXXXXXX`` (left by kvx versions that wrote with
    save_file)."""
    return name.startswith(".") and (name.endswith(".tmp") or (name.startswith(".tmp") and len(name) == 10))


def classify_temp(path: str, name: str, mtime: float, now: float) -> tuple[bool, str]:
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
            if is_temp_name(e.name):
                stale, reason = classify_temp(e.path, e.name, st.st_mtime, now)
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
            elif e.name.endswith(SUFFIX):
                key, _, kid = e.name[: -len(SUFFIX)].partition("-")
                out.chunks.append(ChunkInfo(key, e.path, st.st_size, st.st_mtime, kid))
    return out
