"""Disk tier: one safetensors file per chunk, safe to share between engines on one path.

Layout: ``<path>/<key[:2]>/<key>.safetensors`` holding one tensor ``"kv"`` (the chunk) and metadata
``{"kvx_format", "key", "fingerprint", "length", "crc32c", ...}`` (:mod:`kvx.store.codec`). A sealed chunk
(``encryption``, :mod:`kvx.store.seal`) is ``<key>-<kid>.safetensors``: its name carries the key id of the
secret that sealed it, and a sealed tier looks up only the names of the secrets it holds (another tenant's
chunk is a miss at lookup; tenants with different secrets each keep their own copy). Reads check
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
16 MiB 48-53 -> 11-12 ms while single large writes are slow (see ``tier._WRITE_PIECE`` and
benchmarks/bench_disk_put.py). Neither copies the chunk (safetensors 0.8 writes from
the tensor's pointer too: no growth of peak RSS for a 64 MiB put with either).

Temporary files. A crash can leave a temporary file behind. Every scan of the directory (store
start-up, the periodic re-count, eviction, :meth:`DiskTier.usage`, :meth:`DiskTier.clear`) sorts
them with :func:`survey` into writes in flight (kept) and leftovers of dead writers (removed): see
:mod:`.directory`. Until they are removed, temporary files count against the capacity and show in ``kvx
store inspect/verify``.

Capacity. A put reserves its file's size before writing: if this engine's count of the directory plus
the reservation would exceed ``capacity_bytes``, it first deletes the least recently used files (mtime;
a read touches it) down to ``low_watermark * capacity`` (the new chunk included). So one engine never
exceeds the capacity, however many writer threads it runs. Other engines on the path are seen when
the directory is re-counted (at most ``rescan_s`` apart, and at every eviction); see
:class:`DiskTier` for the bound with several engines. Other engines may delete files at any time: a
missing file is a miss.

Full disk. A write that fails with ENOSPC or EDQUOT evicts the least recently used files (at least 10%
of the chunk bytes, see ``budget.FULL_EVICT_FRACTION``) and retries once. If that fails too, the put raises
:class:`StoreFullError`, and puts for a back-off period (1 s, doubling to 60 s, reset by a successful
put) raise it at once without touching the disk.

Modules (what each owns; threads: see each module's docstring):

- :mod:`.config`: :class:`DiskTierConfig` and its check on this machine (:func:`check_path`);
- :mod:`.directory`: what is in the directory (:func:`survey`: chunk files; temporary files in flight or
  stale) and the names of both;
- :mod:`.budget`: :class:`Budget`, the capacity: the count of the directory, reservations, LRU eviction (one
  lock);
- :mod:`.tier`: :class:`DiskTier`: open, lookups, puts (file writes), gets (file reads, verified), deletes,
  stats, the full-disk back-off.
"""

from ..errors import ChunkError, StoreClosedError, StoreFullError  # noqa: F401 - as kvx.store.disk names them
from .budget import Budget, Reservation
from .config import DiskTierConfig, check_path
from .directory import _HOST, _TMP_MAX_AGE_S, ChunkInfo, Survey, TempInfo, survey  # noqa: F401
from .tier import DiskTier, log  # noqa: F401 - registers "disk"; the tier's logger

__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "check_path",
    "Budget",
    "Reservation",
    "ChunkInfo",
    "TempInfo",
    "Survey",
    "survey",
]
