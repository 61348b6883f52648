"""The data connections of one Redis server (:class:`RedisNode`): a pool of raw RESP connections
(:mod:`kvx.store.resp`), opened on demand, and the node's up/down state.

Any thread: the callers of the tier's operations, its lookup threads and its maintenance thread take and
return connections (the pool has its own lock). Only the maintenance thread (or :meth:`RedisTier.open`)
marks a node up; any thread that sees it fail marks it down (:mod:`kvx.store.redis.topology`).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from ..errors import StoreUnavailableError
from ..resp import RespConnection
from .config import RedisTarget, RedisTierConfig, SentinelSpec


class _PoolOwner(Protocol):
    """What a node reads of the tier that owns it (:class:`kvx.store.redis.RedisTier`): how to open a data
    connection and how many. Named here so that this module does not import the tier's (which imports it)."""

    config: RedisTierConfig
    target: RedisTarget
    send_buffer: int | None
    sentinel_spec: SentinelSpec | None


class PoolBusy(StoreUnavailableError):
    """Every connection to a node stayed busy until the deadline (not a sign that the node is down)."""


class NotMaster(StoreUnavailableError):
    """Sentinel: the server kvx knew as the master answers ROLE as a replica (demoted by a failover)."""


class RedisNode:
    """One server: a pool of up to ``connections`` raw connections (a semaphore counts those in use, a
    LIFO list keeps the idle ones) and its up/down state. Used from any thread."""

    def __init__(self, tier: _PoolOwner, host: str | None, port: int | None, unix_path: str | None = None):
        self.tier = tier
        self.host, self.port, self.unix_path = host, port, unix_path
        self.name = unix_path or f"{host}:{port}"
        self._idle: list[RespConnection] = []
        self._slots = threading.BoundedSemaphore(tier.config.connections)
        self._lock = threading.Lock()
        self.up = False  # only the maintenance thread (or open) sets it True
        self.retry_at = 0.0
        self.error = "not connected yet"
        self.closed = False

    def connect(self, deadline: float) -> RespConnection:
        t = self.tier.target
        conn = RespConnection(
            self.host,
            self.port,
            unix_path=self.unix_path,
            ssl_context=t.ssl_context,
            username=t.username,
            password=t.password,
            db=t.db,
            deadline=deadline,
            send_buffer=self.tier.send_buffer,
        )
        if self.tier.sentinel_spec is not None:
            # writes must never reach a replica: an old master that came back is one until the sentinels
            # say otherwise (one round trip per new connection; connections are pooled)
            try:
                role = conn.pipeline([("ROLE",)], deadline)[0]
            except BaseException:
                conn.close()
                raise
            if not isinstance(role, list) or not role or role[0] != b"master":
                conn.close()
                raise NotMaster(
                    f"redis {self.name}: not the master of {self.tier.sentinel_spec.service!r} (ROLE "
                    f"answered {role[0] if isinstance(role, list) and role else role!r})"
                )
        return conn

    def acquire(self, deadline: float) -> tuple[RespConnection, bool]:
        """(a connection, whether it was pooled: used before)."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise PoolBusy(
                f"redis {self.name}: all {self.tier.config.connections} connections stayed busy "
                f"for {self.tier.config.timeout_ms} ms"
            )
        try:
            while True:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    return self.connect(deadline), False
                if not conn.stale():  # a restarted server leaves closed connections behind
                    return conn, True
                conn.close()
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: RespConnection) -> None:
        if conn.closed or self.closed:
            conn.close()
        else:
            with self._lock:
                self._idle.append(conn)
        self._slots.release()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
