"""``kvx node``'s daemon: one KV-chunk pool per host in shared memory, its index, and the control socket.

Every vLLM engine on the host connects to the unix socket (:mod:`.protocol`'s frames), asks for slots
(``allocate`` / ``commit`` / ``pin`` ...) and copies chunk bytes into or out of the mapped pool file itself:
no chunk byte crosses the socket. The daemon writes only the pool's header and slot table. The pool file is made
at start, its slots ``--slot-size`` (64 KiB by default) the allocation unit: a chunk takes a run of the fewest
slots that hold it (:mod:`kvx.store.runs`), so the chunks of every model on the host share one pool; with ``--slot-size
auto``, at the first engine's hello, its slots as large as that engine's chunks. Below, a "slot" is a chunk's run.

Slot life cycle (the slot tiers' one allocator, :class:`kvx.store.alloc.Allocator`, as for
:class:`kvx.store.cpu.CPUIndex`; per namespace, its pins leases held by connections)::

    FREE --allocate(key)--> PENDING --commit(key)--> READY --evict (LRU, no pins)--> FREE
                               \\--abort(key) or the allocating connection closes--> FREE

- Only READY slots are hits. A PENDING slot is never evicted nor served.
- A *lease* (``pin``, ``hold``) is held by one connection and released by ``unpin`` or when that connection
  closes (an engine killed with SIGKILL included: the kernel closes its socket). An *admin pin*
  (``pin_prefix``) is held by the daemon until ``unpin_prefix`` or ``evict``. A slot with either is never
  evicted to make room.
- ``evict`` (the operator's explicit request) of a leased chunk *dooms* it: it leaves the index at once (lookups
  miss it) and its slot is freed when the last lease goes, so a reader never sees its bytes change under it.
- A namespace (an engine's model, KV dtype and chunk format: :func:`kvx.keys.namespace_digest`) may
  have a quota in bytes (every chunk takes one whole slot): an allocation that would exceed it evicts the
  namespace's own least recently used chunks, and only those; ``pin_prefix`` never pins past it.

**The daemon starts empty.** On start an existing pool file is unlinked and a fresh one created: the index (which
key is in which slot, namespaces, recency, pins, quotas) lives only in the daemon's memory, and a slot's bytes
may be half-written by an engine killed in the middle of a save, so rebuilding the index from the file would need
per-chunk checksums that kvx does not keep in the pool. Starting empty is always correct; engines that mapped the
old file keep their mapping until they reconnect, see a new epoch and map the new file.

**Across hosts** (``--listen``, ``--peers`` or ``--membership``, ``--secret-file``): the node is a member of a
cluster, pulling the chunks its engines miss from peers and pushing a P/D producer's chunks to its consumer's node
(:mod:`.peers`); the cluster's threads ask the loop for every change of the index (:meth:`NodeServer.call`). A
namespace an engine says is sealed (its byte tiers seal their chunks) crosses between nodes only encrypted: over kvx's
TCP channel its chunks move as AES-256-GCM ciphertext under per-connection keys derived from the cluster secret and
the handshake's nonces (no key crosses: :mod:`.wire_seal`); over NIXL they stay on the host: no pull, push or peer
read moves them (:attr:`NodeState.seal_transit`, :meth:`NodeState.pull`).

Threads: :class:`NodeState` is owned by the event-loop thread (no locks). :class:`NodeServer` runs that loop;
the other threads are the optional Prometheus endpoint, which reads a snapshot of :meth:`NodeState.stats` that
the loop publishes under a lock, and a cluster member's (:mod:`.peers`), which change the index only through
:meth:`NodeServer.call`.
"""

from .index import BadRequest, NodeState, Refused
from .server import NodeServer, StartError, default_pool_path

__all__ = ["BadRequest", "NodeServer", "NodeState", "Refused", "StartError", "default_pool_path"]
