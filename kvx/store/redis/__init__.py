"""Redis tier: chunks as Redis values (a standalone server, a unix socket, TLS, a Redis Cluster, or the
master of a Redis Sentinel deployment).

Layout. Chunk ``<key>`` lives at ``kvx:1:{<key>}`` (the hash tag puts a chunk's parts in its slot, so
one Lua script can publish them on a cluster); a sealed one at ``kvx:1:{<key>}-<kid>`` (the key id of the
secret that sealed it, :mod:`kvx.store.seal`: a sealed tier looks up only the names of the secrets it holds,
during a rotation with one ``EXISTS`` of all of them per chunk, which share the chunk's slot). Its value
is the codec's encoding (:mod:`kvx.store.codec`: header + payload). An encoding larger than ``max_value_size``,
or one whose single value would waste memory in Redis's allocator, is split into parts
``<chunk's name>:<nonce>:<i>`` of one size (the last holds the rest), and the chunk key holds a manifest instead
(``kvxparts:1:<nonce>:<parts>:<total bytes>:<part size>``; its first 8 bytes read as a header length of ~8e18,
which no codec header has, so the two cannot be confused).

Value sizes (issue 46). Redis's allocator (jemalloc) holds a value in the smallest of its size classes that fits
(four per doubling: 4, 5, 6, 7, 8 MiB ...): a KV head's part of 4 MiB + a header as one value takes 5 MiB. So
:func:`.layout.value_split` picks the split Redis holds in the least memory (within 1%, the fewest values):
parts of a class size less 12 bytes (what Redis adds to a value), the rest in the last one; a head's part is
4 MiB - 12 bytes and ~320 B. ``used_memory`` per chunk of ``bench_tp_share.py``'s shape: 1.25x the chunk's
bytes before, 1.0000x now (``benchmarks/bench_redis_memory.py``, ``results/redis_memory_cpu.md``). The manifest is
the same version (1): chunks in either layout are read by readers of both.

Atomic puts. A single value is written with ``SET NX [PX ttl]``: an existing chunk is never
overwritten. Parts are written first, each expiring in 60 s (a writer that dies mid-put leaves
nothing for long), then one script publishes them: if the chunk key exists it deletes this writer's
parts and answers 0; if a part is gone (evicted) it deletes the rest and answers -1; else it sets the
manifest (NX) and makes the parts persistent (or gives them the chunk's ``ttl_s``). Readers see all of
a chunk or nothing; a chunk whose parts were evicted later reads as torn (:class:`ChunkError`: a
miss), and the reader deletes its manifest so lookups stop reporting it.

Reads. :meth:`RedisTier.get_into` receives the value straight into ``out`` (:mod:`kvx.store.resp`):
the codec header lands in a small buffer and is verified (key, fingerprint, dtype, shape) before any
payload byte is received; the payload goes into ``out``'s memory; then lengths and the CRC32 are
checked. Part GETs go out on one connection, each as the reply before it starts. Each node has a pool
of ``connections`` raw connections, so gets and puts of different chunks overlap; redis-py does the rest
(cluster slot map, INFO for :meth:`RedisTier.usage` / :meth:`RedisTier.capacity`).

Lookups. :meth:`RedisTier.contains_many` pipelines EXISTS (per node on a cluster) on a background
thread and waits at most ``lookup_wait_ms`` for it: vLLM's scheduler is never blocked on the network
(it gets None and asks again at its next step; the finished answer is served once).

Faults. Every operation has a deadline of ``timeout_ms``. A server that refuses, resets or does not
answer in time is marked down: operations on it fail at once (gets: :class:`ChunkError`; lookups:
False; puts: :class:`StoreUnavailableError`) while a background thread probes it every ``retry_s``
and brings it back. Nothing a caller does waits on a server known to be down. On a cluster this is
per node, and MOVED / ASK redirections are followed once (MOVED also refreshes the slot map). A server
whose ``proto-max-bulk-len`` is below ``max_value_size`` refuses a large value and drops the connection;
that is not a down server: the tier lowers the size of the values it sends (to the limit ``CONFIG GET``
reports, or by halves where CONFIG is disabled) and stores the chunk, and every later one, in parts.

Sentinel. With a ``redis+sentinel://`` url the tier asks the sentinels (redis-py's
``Sentinel.discover_master``) which server is the service's master and uses it as a standalone server.
Every data connection checks ``ROLE`` when it opens, and a ``-READONLY`` reply marks the node down: writes
never go to a replica. When the master fails (down, a lost connection, demoted to a replica) the
maintenance thread asks the sentinels again, every ``retry_s`` until they name a master, and moves the
node to it (``failovers`` in the stats); callers meanwhile get misses / StoreUnavailableError at once.
While the master is up the sentinels are asked every 5 s as well (a failover kvx did not notice: a
network partition between the master and the sentinels).

Speed: ``benchmarks/bench_redis.py`` (results in ``benchmarks/results/redis_cpu.md``) times GET into a
slot and PUT against redis-py + hiredis doing the same work and against a plain socket moving the same
bytes, in one run. What kvx adds to the plain socket is one CRC32C pass over the payload per op: a GET
checksums what each receive brings while it is still in cache, a PUT encodes while the server answers the
EXISTS that precedes it. Over a unix socket the data connections ask for a larger send buffer
(``RedisTier.send_buffer``): a 4 MiB put fills the kernel's default one ~20 times over.

Modules (what each owns; threads: see each module's docstring):

- :mod:`.config`: :class:`RedisTierConfig` and url parsing (``redact``, Sentinel urls, the data connections'
  credentials and TLS context);
- :mod:`.layout`: key names, cluster slots, the parts manifest and the Lua scripts;
- :mod:`.pool`: one server's pool of data connections and its up/down state (``RedisNode``);
- :mod:`.sink`: receiving a GET's value (or parts) into the caller's tensor, verified (``ChunkSink``);
- :mod:`.topology`: the redis-py client, cluster slot map, Sentinel failover, the maintenance thread and
  running a command on the right node;
- :mod:`.tier`: :class:`RedisTier`: open, lookups, gets, puts, deletes, capacity, stats.
"""

# names tests and benchmarks use as kvx.store.redis.<name>
from .config import (
    RedisTierConfig,
    redact,
    sentinel_url,  # noqa: E402,F401
)
from .layout import cluster_slot, redis_chunk_key, redis_part_key  # noqa: E402,F401
from .sink import ChunkSink  # noqa: E402,F401
from .tier import (  # noqa: E402,F401
    LOOKUP_KEEP,
    SNDBUF_UNIX,
    RedisTier,  # registers "redis"
)

__all__ = ["RedisTierConfig", "RedisTier", "redact"]
