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
library. Why not ``safetensors.torch.save_file`` (0.8): it wrote to its own ``.tmpXXXXXX`` name first, which
a ``kill -9`` leaked where kvx could not recognise it, and it writes the tensor in one call, which some file
systems serve slowly for large chunks (``tier._WRITE_PIECE``). Neither copies the chunk (both write from the
tensor's memory). The two writers side by side: benchmarks/bench_disk_put.py, results in
benchmarks/results/disk_put_cpu.md.

Temporary files. A crash can leave a temporary file behind. Every scan of the directory (store
start-up, the periodic re-count, eviction, :meth:`DiskTier.usage`, :meth:`DiskTier.clear`) sorts
them with :func:`survey` into writes in flight (kept) and leftovers of dead writers (removed): see
:mod:`.directory`. Until they are removed, temporary files count against the capacity and show in ``kvx
store inspect/verify``.

Capacity. ``capacity_bytes`` bounds what one engine lets the directory hold: a put reserves its file's size
and evicts the least recently used files first where needed (:mod:`.budget` states the rule; :class:`DiskTier`
the bound with several engines on one path). Other engines may delete files at any time: a missing file is a
miss.

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
