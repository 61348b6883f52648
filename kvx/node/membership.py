"""A cluster's members as a Redis keeps them (``kvx node --membership URL``): nodes announce themselves with a
heartbeat and leave by expiry, so a node started or stopped anywhere is seen by the others within seconds, with no
list to edit.

All of a cluster's members live in one Redis hash, ``kvx:{members-<digest>}`` (``<digest>``: of the cluster secret,
so that clusters sharing a Redis never mix and the secret is not shown), one field per node: its id -> ``{"addr":
"HOST:PORT", "until": unix time}``. Every ``beat_s`` a node writes its own field (``until`` = now + ``ttl_s``),
reads the hash and hands the live addresses to the cluster (:meth:`kvx.node.peers.Cluster.set_peers`); fields
expired for longer than ``ttl_s`` are removed by whoever sees them. A node that stops removes its own field. One
key (a hash tag in its name): the same commands on a single server, a Sentinel's master or a Redis Cluster. A
Redis that is down leaves the members as they were last seen (and says so once) until it is back.

Anyone who can write to that Redis can announce an address; it is the handshake (:mod:`.handshake`) that admits
a peer, so an address announced without the secret costs a refused connection, never a chunk.

Threads: :class:`RedisMembership` runs its own (``kvx-node-members``); the redis-py client is its alone.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable

from ..log import Throttle, get_logger

log = get_logger(__name__)


def members_key(secret: bytes) -> str:
    return "kvx:{members-" + hashlib.sha256(b"kvx-members\0" + secret).hexdigest()[:16] + "}"


def redis_client(url: str, cluster: bool, timeout: float):
    """A redis-py client of ``url`` as kvx's Redis tier takes it: ``redis://``, ``rediss://``, ``unix://``, or
    ``redis+sentinel://`` (the master the sentinels name); ``cluster``: a Redis Cluster. ValueError naming
    ``--membership`` for an url it cannot use."""
    import redis
    from redis.sentinel import Sentinel

    from ..store.redis.config import is_sentinel_url, parse_sentinel_url

    kw = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    try:
        if is_sentinel_url(url):
            spec = parse_sentinel_url(url)
            sentinel = Sentinel(list(spec.sentinels), **kw)
            return sentinel.master_for(spec.service, db=spec.db, username=spec.username, password=spec.password, **kw)
        if cluster:
            return redis.RedisCluster.from_url(url, require_full_coverage=False, **kw)
        return redis.Redis.from_url(url, **kw)
    except (ValueError, redis.RedisError) as e:
        raise ValueError(
            f"--membership: expected a redis://, rediss://, unix:// or redis+sentinel:// url, got {url!r} ({e})"
        ) from None


class RedisMembership:
    """This node's heartbeat in the members hash, and the other members it reads there (module docstring)."""

    def __init__(
        self,
        client,
        secret: bytes,
        node_id: str,
        address: str,
        on_members: Callable[[list[str]], None],
        ttl_s: float = 10.0,
        beat_s: float | None = None,
    ):
        self.client, self.key, self.node_id, self.address = client, members_key(secret), node_id, address
        self.on_members = on_members
        self.ttl_s = ttl_s
        self.beat_s = beat_s if beat_s is not None else max(0.2, ttl_s / 4)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._throttle = Throttle(log)
        self.members: list[str] = []  # the live addresses last read (the thread's; a list replaced whole)

    def start(self) -> None:
        self.beat()  # the first one now: a node that cannot reach its Redis starts all the same (logged)
        self._thread = threading.Thread(target=self._run, name="kvx-node-members", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self.beat()

    def beat(self) -> None:
        """Announce this node, read the members, prune the long expired, hand the live ones to the cluster."""
        import redis

        now = time.time()
        try:
            me = json.dumps({"addr": self.address, "until": now + self.ttl_s})
            self.client.hset(self.key, self.node_id, me)
            fields = self.client.hgetall(self.key)
        except redis.RedisError as e:
            self._throttle.warning("members", "kvx node: the membership Redis is unavailable (%s); peers unchanged", e)
            return
        live, stale = [], []
        for node, raw in fields.items():
            node = node.decode() if isinstance(node, bytes) else node
            try:
                entry = json.loads(raw)
                addr, until = str(entry["addr"]), float(entry["until"])
            except (ValueError, KeyError, TypeError):
                stale.append(node)
                continue
            if until < now - self.ttl_s:
                stale.append(node)
            elif until >= now and node != self.node_id:
                live.append(addr)
        if stale:
            try:
                self.client.hdel(self.key, *stale)
            except redis.RedisError:
                pass
        self.members = sorted(set(live))
        self.on_members(self.members)

    def stop(self) -> None:
        """Stop the heartbeat and leave the hash (the others drop this node at once)."""
        import redis

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat_s + 5)
        try:
            self.client.hdel(self.key, self.node_id)
        except redis.RedisError:
            pass
