"""Where each command goes and what happens when a server fails: the redis-py client (cluster slot map,
INFO), the Sentinel master, probing and marking nodes up and down, the maintenance thread, and running
one command on the right node (following MOVED / ASK, retrying a dead pooled connection once).

:class:`RedisTopology` is the half of :class:`kvx.store.redis.RedisTier` that does this (a mixin: its state is
set up in ``RedisTier.__init__``). Threads: ``_maintain`` runs on the tier's maintenance thread
(``kvx-redis-reconnect``), the only one that brings a node back up, reloads the slot map after open, or
follows a failover (``_follow_master``; also :meth:`RedisTier.open`); ``_op``, ``_script``, ``_route``,
``_node_failed`` and ``_suspect`` run on any thread calling the tier, and on its lookup threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...log import get_logger
from ..errors import StoreClosedError, StoreError, StoreUnavailableError
from ..resp import AuthError, ConnectionLost, NoScriptError, RedirectError, RespConnection, RespError
from .layout import CLUSTER_SLOTS, SCRIPTS, cluster_slot
from .pool import NotMaster, PoolBusy, RedisNode

log = get_logger("kvx.store.redis")  # one logger for the whole tier, named as before the split

_SENTINEL_CHECK_S = 5.0  # sentinels asked this often while the master is up (a missed failover)


class RedisTopology:
    """Topology, health and command routing of a :class:`RedisTier` (see the module docstring)."""

    # ---------------------------------------------------------------- topology and health
    def _redis_kwargs(self) -> dict:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside redis-py: a down server must cost one timeout, not three with back-off
        return dict(socket_timeout=self._timeout, socket_connect_timeout=self._timeout, retry=Retry(NoBackoff(), 0))

    def _client(self):
        """The redis-py client (created on first use; a failed cluster discovery raises StoreUnavailableError).
        Sentinel: a client of the master in use now (StoreUnavailableError if none is known yet)."""
        with self._rc_lock:  # the maintenance thread and usage() callers: one client, not two
            if self.sentinel_spec is not None:
                return self._master_client()
            if self._rc is not None:
                return self._rc
            import redis

            try:
                if self.config.cluster:
                    self._rc = redis.RedisCluster.from_url(
                        self.config.url, require_full_coverage=False, **self._redis_kwargs()
                    )
                else:
                    self._rc = redis.Redis.from_url(self.config.url, **self._redis_kwargs())
            except redis.RedisError as e:
                raise StoreUnavailableError(f"redis tier {self.url}: {_redis_error(e)}") from None
            return self._rc

    def _master_client(self):
        """Sentinel (under ``_rc_lock``): the redis-py client of the current master, replaced after a failover."""
        import redis

        node = self._node
        if node is None:
            raise StoreUnavailableError(f"redis tier {self.url}: no master known yet (sentinels not reached)")
        if self._rc is None or self._rc_node is not node:
            old, self._rc = self._rc, None
            if old is not None:
                old.close()
            t = self.target
            self._rc = redis.Redis(
                host=node.host,
                port=node.port,
                db=t.db,
                username=t.username,
                password=t.password,
                **self._redis_kwargs(),
            )
            self._rc_node = node
        return self._rc

    def _follow_master(self) -> None:
        """Sentinel (``open``, then only the maintenance thread): ask the sentinels which server is the
        service's master now and, if that is not the node in use, move the node there (a failover: the old
        node's connections are closed, its operations fail at once). StoreUnavailableError if no sentinel
        names a master (the node in use, if any, stays and is probed as before: ROLE keeps a replica out)."""
        import redis
        from redis.sentinel import Sentinel

        spec, node = self.sentinel_spec, self._node
        up = node is not None and node.up
        self._ask_at = time.monotonic() + (max(self.config.retry_s, _SENTINEL_CHECK_S) if up else self.config.retry_s)
        sentinels = self._sentinels
        if sentinels is None:
            kw = self._redis_kwargs()
            if self.config.sentinel_password is not None:
                kw["password"] = self.config.sentinel_password
            self._sentinels = sentinels = Sentinel(list(spec.sentinels), sentinel_kwargs=kw)
        try:
            host, port = sentinels.discover_master(spec.service)
            port = int(port)
        except (redis.RedisError, OSError, ValueError) as e:
            # MasterNotFoundError's text lists each sentinel's error (addresses, never passwords)
            raise StoreUnavailableError(
                f"redis tier {self.url}: no sentinel names a master of {spec.service!r} ({_redis_error(e)})"
            ) from None
        if node is not None and (node.host, node.port) == (host, port):
            return
        new = RedisNode(self, host, port)
        with self._lock:
            self._node, self._nodes = new, {new.name: new}
        self._wake.set()
        if node is None:
            log.info("kvx: redis tier %s: the sentinels name %s as the master of %r", self.url, new.name, spec.service)
            return
        with node._lock:
            node.up, node.closed = False, True
            node.error = f"no longer the master of {spec.service!r} (now {new.name})"
        node.clear()
        self._memory.pop(node.name, None)
        self._count(failovers=1)
        log.warning(
            "kvx: redis tier %s: failover: the sentinels name %s as the master of %r (was %s); chunks "
            "the old master had not replicated are misses",
            self.url,
            new.name,
            spec.service,
            node.name,
        )

    def _load_topology(self) -> None:
        """Cluster: (re)read the slot map with redis-py and point every slot at its primary's node."""
        import redis

        rc = self._client()
        try:
            if self._topology_ok:
                rc.nodes_manager.initialize()
            cache = rc.nodes_manager.slots_cache
        except redis.RedisError as e:
            raise StoreUnavailableError(f"redis tier {self.url}: cluster slot map: {_redis_error(e)}") from None
        slots: list[RedisNode | None] = [None] * CLUSTER_SLOTS
        for slot, nodes in list(cache.items()):
            if nodes:
                slots[slot] = self._node_at(nodes[0].host, nodes[0].port)
        self._slots = slots
        self._topology_ok = True

    def _node_at(self, host: str, port: int) -> RedisNode:
        """The node of ``host:port`` (created on first sight: down until probed)."""
        name = f"{host}:{port}"
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                node = self._nodes[name] = RedisNode(self, host, int(port))
                self._wake.set()
        return node

    def _probe(self, node: RedisNode) -> None:
        """Connect, PING and load the scripts; on success the node is up (raises StoreError if not)."""
        deadline = time.monotonic() + self._timeout
        try:
            conn = node.connect(deadline)
            try:
                conn.pipeline([("PING",)] + [("SCRIPT", "LOAD", src) for src, _ in SCRIPTS.values()], deadline)
            except BaseException:
                conn.close()
                raise
        except AuthError as e:
            node.error = f"{e} (check the password in {self.url})"
            node.retry_at = time.monotonic() + self.config.retry_s
            raise StoreUnavailableError(f"redis tier {self.url}: node {node.name}: {node.error}") from None
        except StoreError as e:
            node.error = str(e)
            node.retry_at = time.monotonic() + self.config.retry_s
            raise StoreUnavailableError(f"redis tier {self.url}: node {node.name}: {e}") from None
        node.clear()
        with node._lock:
            node._idle.append(conn)
        was_down = node.error != "not connected yet"
        node.up, node.error = True, ""
        if was_down:
            with self._lock:
                self._stats["reconnects"] += 1
            log.info("kvx: redis tier %s: node %s is back", self.url, node.name)

    def _node_failed(self, node: RedisNode, err: BaseException) -> None:
        """Mark ``node`` down (operations on it fail at once) until the maintenance thread reaches it."""
        with node._lock:
            was_up = node.up
            node.up = False
            node.error = str(err)
            node.retry_at = time.monotonic() + self.config.retry_s
        node.clear()
        if was_up:
            self._throttle.warning(
                f"down:{node.name}",
                "kvx: redis tier %s: node %s failed (%s); answering misses for its chunks, retrying every %.1f s",
                self.url,
                node.name,
                err,
                self.config.retry_s,
            )
        if self.sentinel_spec is not None:
            self._ask_at = 0.0  # a demoted master: the sentinels already name the new one
        self._wake.set()

    def _suspect(self, node: RedisNode) -> None:
        with self._lock:
            self._suspects.add(node)
        self._wake.set()

    def _check_suspects(self) -> None:
        """PING every node an operation timed out on, on a fresh connection: no answer within
        ``timeout_ms`` marks it down."""
        with self._lock:
            suspects, self._suspects = self._suspects, set()
        for node in suspects:
            if not node.up or self._closed:
                continue
            deadline = time.monotonic() + self._timeout
            try:
                conn = node.connect(deadline)
                try:
                    conn.pipeline([("PING",)], deadline)
                finally:
                    conn.close()
            except StoreError as e:
                self._node_failed(node, e)

    def _maintain(self) -> None:
        """Background: check nodes an operation timed out on; probe down nodes every ``retry_s``; reload the
        cluster slot map when asked; Sentinel: ask the sentinels for the master before probing a down one,
        and every 5 s while it is up."""
        while not self._closed:
            self._wake.clear()
            self._check_suspects()
            now = time.monotonic()
            if self.sentinel_spec is not None:
                node = self._node
                if now >= self._ask_at or (node is not None and not node.up and node.retry_at <= now):
                    try:
                        self._follow_master()
                    except StoreError as e:
                        # while the master is down the sentinels name none until they have failed it over: the
                        # node's failure was the warning then; otherwise (none known, sentinels gone) warn
                        quiet = node is not None and not node.up
                        self._throttle.log(
                            logging.INFO if quiet else logging.WARNING, f"sentinel:{quiet}", "kvx: %s", e
                        )  # e names the tier
            due = [n for n in list(self._nodes.values()) if not n.up and n.retry_at <= now]
            if self.config.cluster and (not self._topology_ok or self._refresh.is_set() or due):
                self._refresh.clear()
                try:
                    self._load_topology()
                except StoreError as e:
                    self._throttle.warning("topology", "kvx: redis tier %s: %s", self.url, e)
            for node in due:
                if self._closed:
                    return
                try:
                    self._probe(node)
                except StoreError as e:
                    self._throttle.warning(f"down:{node.name}", "kvx: redis tier %s: still down (%s)", self.url, e)
            waits = [n.retry_at - time.monotonic() for n in list(self._nodes.values()) if not n.up]
            if self.config.cluster and not self._topology_ok:
                waits.append(self.config.retry_s)
            if self.sentinel_spec is not None:
                waits.append(self._ask_at - time.monotonic())
            self._wake.wait(max(0.01, min(waits)) if waits else None)

    def _route(self, chunk_key: str) -> RedisNode | None:
        if not self.config.cluster:
            return self._node
        if not self._topology_ok:
            return None
        return self._slots[cluster_slot(chunk_key)]

    # ---------------------------------------------------------------- running commands
    def _op(
        self, chunk_key: str, fn: Callable[[RespConnection, bool], Any], deadline: float, node: RedisNode | None = None
    ) -> Any:
        """Run ``fn(conn, asking)`` on the node of ``chunk_key``, following one MOVED / ASK. Raises
        StoreUnavailableError at once if that node is down; a lost connection marks it down.

        ``fn`` may run twice: after a redirection, and when a pooled connection turns out to be dead
        (reset or closed, not timed out: the server restarted since it was last used, so nothing of
        the first try was applied) it is run once more on a fresh connection."""
        node = node or self._route(chunk_key)
        asking = redirected = refreshed = False
        while True:
            if self._closed:
                raise StoreClosedError(f"redis tier {self.url} is closed")
            if node is None:
                if self.sentinel_spec is not None:
                    raise StoreUnavailableError(f"redis tier {self.url}: no master known yet (no sentinel named one)")
                raise StoreUnavailableError(
                    f"redis tier {self.url}: no node serves {chunk_key} (slot map not loaded yet)"
                )
            if not node.up:
                raise StoreUnavailableError(f"redis tier {self.url}: node {node.name} is down ({node.error})")
            try:
                conn, reused = node.acquire(deadline)
            except PoolBusy:
                raise  # busy, not down
            except StoreError as e:  # refused, timed out, or AUTH refused: down until the probe succeeds
                self._node_failed(node, e)
                raise
            used = node
            try:
                return fn(conn, asking)
            except RedirectError as e:
                if redirected:
                    raise StoreUnavailableError(
                        f"redis tier {self.url}: redirected twice for {chunk_key} ({e})"
                    ) from None
                redirected = True
                with self._lock:
                    self._stats["redirects"] += 1
                target = self._node_at(e.host, e.port)
                if not e.ask:
                    if self._slots:
                        self._slots[e.slot] = target
                    self._refresh.set()
                    self._wake.set()
                    if not target.up and target.error == "not connected yet":
                        self._probe(target)  # a node we never used: connect now, once
                node, asking = target, e.ask
            except ConnectionLost as e:
                if reused and not e.timeout and not refreshed and time.monotonic() < deadline:
                    refreshed = True
                    node.clear()  # its idle siblings are as dead as it was
                    continue
                if e.timeout:
                    # Out of time: the server, or this thread, was stalled (a writer runs at idle priority and
                    # a busy host can keep it off the CPU past the deadline). The maintenance thread (normal
                    # priority) asks the node; only if it does not answer either is the node down.
                    self._suspect(node)
                else:
                    self._node_failed(node, e)
                raise
            except RespError as e:
                if self.sentinel_spec is None or not str(e).startswith("redis: READONLY"):
                    raise
                # the master was demoted to a replica under an open connection: down until the sentinels
                # name the new one (the maintenance thread asks them now)
                self._node_failed(node, e)
                raise NotMaster(f"redis tier {self.url}: node {node.name} is a replica now ({e})") from None
            finally:
                used.release(conn)

    def _script(
        self, conn: RespConnection, name: str, keys: Sequence[str], args: Sequence, deadline: float, asking: bool
    ):
        src, digest = SCRIPTS[name]
        ask = [("ASKING",)] if asking else []
        try:
            return conn.pipeline(ask + [("EVALSHA", digest, len(keys), *keys, *args)], deadline)[-1]
        except NoScriptError:  # flushed or restarted since the node was probed: EVAL caches it again
            return conn.pipeline(ask + [("EVAL", src, len(keys), *keys, *args)], deadline)[-1]


def _redis_error(e: BaseException) -> str:
    """redis-py's error as one line (its messages name hosts and ports, never the password)."""
    return f"{type(e).__name__}: {e}"
