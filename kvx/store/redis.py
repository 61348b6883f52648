"""Redis tier: chunks as Redis values (a standalone server, a unix socket, TLS, a Redis Cluster, or the
master of a Redis Sentinel deployment).

Layout. Chunk ``<key>`` lives at ``kvx:1:{<key>}`` (the hash tag puts a chunk's parts in its slot, so
one Lua script can publish them on a cluster). Its value is the codec's encoding (:mod:`kvx.store.codec`:
header + payload). A value larger than ``max_value_size`` is split into parts
``kvx:1:{<key>}:<nonce>:<i>`` of equal size (at most ``max_value_size``), and the chunk key holds a
manifest instead (``kvxparts:1:<nonce>:<parts>:<total bytes>:<part size>``; its first 8 bytes read as
a header length of ~8e18, which no codec header has, so the two cannot be confused).

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
"""

from __future__ import annotations

import concurrent.futures as cf
from binascii import crc_hqx
import logging
import math
import os
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha1
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from ..log import Throttle, get_logger
from . import codec
from .errors import ChunkError, StoreClosedError, StoreError, StoreFullError, StoreUnavailableError
from .resp import (AuthError, ConnectionLost, NoScriptError, RedirectError, RespConnection, RespError,
                   ValueTooLarge)
from .tier import REMOVED, STORED, Tier, TierConfig, TierContext, check_key, register_tier

log = get_logger(__name__)

_PREFIX = "kvx:1:"
_MAGIC = b"kvxparts"              # first 8 bytes of a manifest (a codec header starts with a length < 2**20)
_MANIFEST_MAX = 128               # bytes: a manifest is ~50
_PIECE = 256 << 10                # most GET payload bytes one receive takes (then checksummed), TCP
# over a unix socket: no cap (a receive brings what the socket holds): 4 MiB GETs 1.03-1.05x faster than
# 1 MiB pieces in each of three runs of bench_redis.py's step sweep (15 of 15 sub-runs >= 1.00x)
_PIECE_UNIX = None
# PUT over a unix socket: SO_SNDBUF of 256 KiB (the kernel makes it 512 KiB; 416 KiB where wmem_max is the
# usual 208 KiB) against the 208 KiB default: a 4 MiB put 1.30-1.56x faster here (at the default the value
# fills the buffer ~20 times over); 512 KiB - 4 MiB gained less (1.27-1.43x). TCP keeps the kernel's
# autotuning (a fixed 1-4 MiB buffer: 0.93-0.95x). bench_redis.py, "PUT: socket send buffer"
_SNDBUF_UNIX = 256 << 10
_PENDING_MS = 60_000              # expiry of parts not yet published: a put takes milliseconds
_MIN_VALUE, _MAX_VALUE = 64 << 10, 512 * 10**6    # proto-max-bulk-len is 512 MB: a larger value resets us
_MIN_BULK = 1 << 20                # the smallest proto-max-bulk-len a server can be set to: always accepted
_LOOKUP_BATCH = 1024              # EXISTS per pipeline write
_LOOKUP_KEEP = 256                # unanswered lookups kept for the caller's next ask
_LOOKUP_MAX_AGE_S = 1.0           # a finished lookup older than this is not served (recomputed)
_SLOTS = 16384
_SENTINEL_SCHEME = "redis+sentinel"
_SENTINEL_PORT = 26379            # Sentinel's default port
_SENTINEL_CHECK_S = 5.0           # sentinels asked this often while the master is up (a missed failover)

# KEYS[1]: chunk key, KEYS[2..]: this writer's parts. ARGV[1]: manifest, ARGV[2]: ttl in ms (0: none).
# Returns 1 published, 0 the chunk exists (parts deleted), -1 a part is gone (parts deleted).
_PUBLISH = """
local n = #KEYS
if redis.call('EXISTS', KEYS[1]) == 1 then
  for i = 2, n do redis.call('DEL', KEYS[i]) end
  return 0
end
for i = 2, n do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    for j = 2, n do redis.call('DEL', KEYS[j]) end
    return -1
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
  for i = 2, n do redis.call('PEXPIRE', KEYS[i], ttl) end
else
  redis.call('SET', KEYS[1], ARGV[1])
  for i = 2, n do redis.call('PERSIST', KEYS[i]) end
end
return 1
"""
# KEYS[1]: chunk key. ARGV[1]: the value expected there ('' = any). Deletes the chunk and, for a manifest,
# its parts (same slot as the chunk key). Returns 1 if something was deleted.
_DROP = """
local v = redis.call('GETRANGE', KEYS[1], 0, 127)
if v == '' then return 0 end
if ARGV[1] ~= '' and v ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local nonce, n = string.match(v, '^kvxparts:1:(%x+):(%d+):')
if nonce then
  for i = 0, tonumber(n) - 1 do redis.call('DEL', KEYS[1] .. ':' .. nonce .. ':' .. i) end
end
return 1
"""
_SCRIPTS = {name: (src, sha1(src.encode()).hexdigest()) for name, src in (("publish", _PUBLISH), ("drop", _DROP))}


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _slot(chunk_key: str) -> int:
    """Cluster slot of a kvx key: CRC16 of its hash tag (the chunk key between the braces), as Redis
    computes it (redis.crc.key_slot, without its general-case parsing: 1 us instead of 4 per key)."""
    lo = chunk_key.find("{")
    if lo < 0:
        return crc_hqx(chunk_key.encode(), 0) & 16383
    return crc_hqx(chunk_key[lo + 1: chunk_key.index("}", lo)].encode(), 0) & 16383


def _chunk_key(key: str) -> str:
    return f"{_PREFIX}{{{key}}}"


def _part_key(chunk_key: str, nonce: str, i: int) -> str:
    return f"{chunk_key}:{nonce}:{i}"


def _no_bool(name: str, v: Any) -> Any:
    if isinstance(v, bool):      # pydantic's lax mode reads true as 1: a typo, not a value
        raise ValueError(f"{name}: expected a number, got {v!r}")
    return v


@dataclass(frozen=True)
class _SentinelSpec:
    """A ``redis+sentinel://`` url, parsed: where the sentinels are and what to open on the master."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None


def _is_sentinel(url: Any) -> bool:
    return isinstance(url, str) and url.lower().startswith(_SENTINEL_SCHEME + "://")


def _sentinel_url(url: str) -> _SentinelSpec:
    """Parse ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]`` (the
    password is the data servers', as in a redis:// url; a port left out is 26379). ValueError naming
    ``url`` if it is not one."""
    shown = redact(url)
    rest = url[len(_SENTINEL_SCHEME) + 3:]
    if "?" in rest or "#" in rest:
        raise ValueError(f"url: a redis+sentinel:// url takes no query or fragment, got {shown!r}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(pw) if colon else None)
    sentinels = []
    for item in hosts.split(","):
        if item.startswith("["):                        # [v6 address]:port
            host, close, port = item[1:].partition("]")
            if not close or (port and not port.startswith(":")):
                raise ValueError(f"url: expected sentinel addresses host[:port], got {item!r} in {shown!r}")
            port = port[1:]
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ValueError(f"url: expected one or more sentinels host[:port],host[:port],... before the "
                             f"service name, got {shown!r}")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"url: expected sentinel addresses host[:port] with a port in [1, 65535], got "
                             f"{item!r} in {shown!r}")
        sentinels.append((host, int(port) if port else _SENTINEL_PORT))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"url: expected the service name after the sentinels "
                         f"(redis+sentinel://host:26379/<service_name>/<db>), got {shown!r}")
    db = db.rstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"url: expected a db number after the service name, got {db!r} in {shown!r}")
    return _SentinelSpec(tuple(sentinels), unquote(service), int(db or 0), username, password)


# ------------------------------------------------------------------------------------------ config
class RedisConfig(TierConfig):
    """``{"type": "redis", "url": "redis://host:6379/0", ...}``: one Redis server, a cluster, or the master
    of a Sentinel deployment (``"url": "redis+sentinel://host1:26379,host2:26379/mymaster/0"``)."""

    # a url may carry a password: errors quote values themselves (redacted), never pydantic's raw input
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    type: Literal["redis"]
    url: str = Field(description="redis://[:password@]host:port/db, rediss:// (TLS; ssl_* query parameters as "
                                 "redis-py reads them), unix:///path/redis.sock?db=0, or "
                                 "redis+sentinel://[:password@]host:26379[,host:port...]/service_name/db (the "
                                 "master Redis Sentinel names; the password is the data servers')")
    cluster: bool = Field(default=False, description="the url names one node of a Redis Cluster")
    timeout_ms: int = Field(default=1000, description="deadline of one whole get / put / lookup (a 64 MiB chunk "
                                                      "moves in ~50 ms over loopback)")
    ttl_s: float | None = Field(default=None, description="expiry of stored chunks (None: none; eviction "
                                                          "by the server's maxmemory-policy)")
    connections: int = Field(default=4, description="data connections per server node")
    max_value_size: int = Field(default=4 << 20, description="chunk bytes per Redis value (the codec header "
                                "rides along); larger chunks are split into parts (1-4 MiB values moved fastest here)")
    lookup_wait_ms: float = Field(default=2.0, description="how long a lookup may block the caller before "
                                  "answering 'not known yet'")
    retry_s: float = Field(default=2.0, description="interval of reconnection attempts while a server is down")
    sentinel_password: str | None = Field(default=None, description="password of the sentinels themselves "
                                          "(their requirepass; redis-py's sentinel_kwargs), if they have one")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if _is_sentinel(v):
            _sentinel_url(v)
            return v
        scheme = urlsplit(v).scheme if isinstance(v, str) else None
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url: expected a redis://, rediss://, unix:// or redis+sentinel:// url, got "
                             f"{redact(v)!r}")
        try:
            from redis.connection import parse_url
            parsed = parse_url(v)
        except ValueError as e:
            raise ValueError(f"url: expected a valid redis url, got {redact(v)!r} ({e})") from None
        if scheme == "unix" and not parsed.get("path"):
            raise ValueError(f"url: expected a socket path in the unix:// url, got {redact(v)!r}")
        if scheme != "unix" and not parsed.get("host"):
            raise ValueError(f"url: expected a host in the url, got {redact(v)!r}")
        return v

    @field_validator("sentinel_password")
    @classmethod
    def _sentinel_password(cls, v):
        if v is not None and not v:
            raise ValueError("sentinel_password: expected a non-empty string or None (no AUTH), got ''")
        return v

    @field_validator("timeout_ms", mode="before")
    @classmethod
    def _timeout(cls, v):
        v = _no_bool("timeout_ms", v)
        if isinstance(v, (int, float)) and not (math.isfinite(v) and v > 0):
            raise ValueError(f"timeout_ms: expected a positive number of milliseconds, got {v!r}")
        return v

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _ttl(cls, v):
        v = _no_bool("ttl_s", v)
        if v is not None and isinstance(v, (int, float)) and not (math.isfinite(v) and v >= 0.001):
            raise ValueError(f"ttl_s: expected None or a number of seconds >= 0.001, got {v!r}")
        return v

    @field_validator("connections", mode="before")
    @classmethod
    def _connections(cls, v):
        v = _no_bool("connections", v)
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError(f"connections: expected an int in [1, 256], got {v!r}")
        return v

    @field_validator("max_value_size", mode="before")
    @classmethod
    def _max_value_size(cls, v):
        from .tier import parse_size  # the parser kvx.connector.config uses for every size

        try:
            n = parse_size(v)
        except ValueError as e:
            raise ValueError(f"max_value_size: {e}") from None
        if not _MIN_VALUE <= n <= _MAX_VALUE:
            raise ValueError(f"max_value_size: expected a size in [64KiB, 512MB] (Redis' proto-max-bulk-len), "
                             f"got {v!r} = {n} bytes")
        return n

    @field_validator("lookup_wait_ms", "retry_s", mode="before")
    @classmethod
    def _nonneg(cls, v, info):
        v = _no_bool(info.field_name, v)
        positive = info.field_name == "retry_s"
        if isinstance(v, (int, float)) and not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"{info.field_name}: expected a {'positive' if positive else 'non-negative'} "
                             f"number, got {v!r}")
        return v

    @model_validator(mode="after")
    def _cluster_url(self):
        if _is_sentinel(self.url):
            if self.cluster:
                raise ValueError(f"cluster: a Sentinel deployment has one master, not a Redis Cluster's slots, "
                                 f"got cluster=true with {redact(self.url)!r}")
            return self
        if self.sentinel_password is not None:
            raise ValueError(f"sentinel_password: only for a redis+sentinel:// url, got the url "
                             f"{redact(self.url)!r}")
        if self.cluster:
            from redis.connection import parse_url

            if urlsplit(self.url).scheme == "unix":
                raise ValueError(f"cluster: a Redis Cluster is reached over TCP, got cluster=true with the unix url "
                                 f"{redact(self.url)!r}")
            if parse_url(self.url).get("db", 0):
                raise ValueError(f"cluster: a Redis Cluster has only db 0, got {redact(self.url)!r}")
        return self


# ------------------------------------------------------------------------------------------ connections
@dataclass(frozen=True)
class _Target:
    """How to open a data connection (from the url): everything but the address."""

    username: str | None
    password: str | None
    db: int
    ssl_context: ssl.SSLContext | None


def _target(url: str) -> tuple[_Target, dict]:
    """(how to open a data connection, redis-py's parse of the url; {} for a Sentinel url)."""
    from redis.connection import parse_url

    if _is_sentinel(url):
        spec = _sentinel_url(url)
        return _Target(spec.username, spec.password, spec.db, None), {}
    p = parse_url(url)
    ctx = None
    if urlsplit(url).scheme == "rediss":
        try:
            ctx = _tls_context(p)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"url: cannot load the TLS files of {redact(url)} ({e})") from None
    return _Target(p.get("username"), p.get("password"), int(p.get("db", 0) or 0), ctx), p


def _tls_context(p: dict) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` url's ssl_* parameters, read as redis-py reads them."""
    reqs = str(p.get("ssl_cert_reqs", "required")).lower()
    ctx = ssl.create_default_context(cafile=p.get("ssl_ca_certs"), capath=p.get("ssl_ca_path"))
    if p.get("ssl_certfile"):
        ctx.load_cert_chain(p["ssl_certfile"], p.get("ssl_keyfile"))
    if reqs == "none":
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.check_hostname = str(p.get("ssl_check_hostname", "true")).lower() not in ("false", "0", "no")
        ctx.verify_mode = ssl.CERT_OPTIONAL if reqs == "optional" else ssl.CERT_REQUIRED
    return ctx


class _PoolBusy(StoreUnavailableError):
    """Every connection to a node stayed busy until the deadline (not a sign that the node is down)."""


class _NotMaster(StoreUnavailableError):
    """Sentinel: the server kvx knew as the master answers ROLE as a replica (demoted by a failover)."""


class _Node:
    """One server: a pool of up to ``connections`` raw connections (a semaphore counts those in use, a
    LIFO list keeps the idle ones) and its up/down state. Used from any thread."""

    def __init__(self, tier: RedisTier, host: str | None, port: int | None, unix_path: str | None = None):
        self.tier = tier
        self.host, self.port, self.unix_path = host, port, unix_path
        self.name = unix_path or f"{host}:{port}"
        self._idle: list[RespConnection] = []
        self._slots = threading.BoundedSemaphore(tier.config.connections)
        self._lock = threading.Lock()
        self.up = False              # only the maintenance thread (or open) sets it True
        self.retry_at = 0.0
        self.error = "not connected yet"
        self.closed = False

    def connect(self, deadline: float) -> RespConnection:
        t = self.tier.target
        conn = RespConnection(self.host, self.port, unix_path=self.unix_path, ssl_context=t.ssl_context,
                              username=t.username, password=t.password, db=t.db, deadline=deadline,
                              send_buffer=self.tier.send_buffer)
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
                raise _NotMaster(f"redis {self.name}: not the master of {self.tier.sentinel_spec.service!r} (ROLE "
                                 f"answered {role[0] if isinstance(role, list) and role else role!r})")
        return conn

    def acquire(self, deadline: float) -> tuple[RespConnection, bool]:
        """(a connection, whether it was pooled: used before)."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _PoolBusy(f"redis {self.name}: all {self.tier.config.connections} connections stayed busy "
                            f"for {self.tier.config.timeout_ms} ms")
        try:
            while True:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    return self.connect(deadline), False
                if not conn.stale():    # a restarted server leaves closed connections behind
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


class _ChunkSink:
    """Receives a chunk's encoded bytes (one value, or its parts in order) into ``out``: the header into
    a small buffer (verified before the payload arrives), the payload straight into ``out``'s memory."""

    _PREFIX, _MANIFEST, _HEADER, _PAYLOAD, _DONE = range(5)

    def __init__(self, key: str, fingerprint: str, out: torch.Tensor, where: str, piece: int | None = None):
        self.key, self.fingerprint, self.out, self.where, self.piece = key, fingerprint, out, where, piece
        self.payload: memoryview | None = None      # out's bytes: :meth:`prepare`
        self.used = False                           # handed to a GET (a second try takes a new sink)
        self.phase, self.pos, self.received = self._PREFIX, 0, 0
        self.buf = bytearray(codec.PREFIX_BYTES)
        self.header: codec.Header | None = None
        self.manifest: bytes | None = None
        self.missing = False
        self.parts: list[int] | None = None     # expected length of each part (None: a single value)
        self.value_len = 0
        self.torn = False

    def prepare(self) -> None:
        """View ``out``'s bytes (several torch calls: ~50 us with cold caches). Called once the GET is out
        (``RespConnection.get_into``'s ``ready``), while the server prepares the value: a 4 MiB value's first
        byte comes ~0.3 ms after the GET (bench_redis.py)."""
        if self.payload is None:
            self.payload = memoryview(codec.byte_view(self.out))

    def _error(self, what: str, torn: bool = False) -> ChunkError:
        self.torn = self.torn or torn
        return ChunkError(f"chunk {self.key}: {self.where}: {what}")

    def begin(self, index: int, length: int | None) -> None:
        if self.parts is None:
            if length is None:
                self.missing = True
                return
            if length < codec.PREFIX_BYTES:
                raise self._error(f"value of {length} bytes is not a chunk", torn=True)
            self.value_len = length
            self.prepare()
            return
        if length is None:
            raise self._error(f"part {index} of {len(self.parts)} is gone (evicted or expired): torn chunk", torn=True)
        if length != self.parts[index]:
            raise self._error(f"part {index} holds {length} bytes, its manifest says {self.parts[index]}", torn=True)

    def buffer(self) -> memoryview:
        if self.phase == self._PAYLOAD:
            # at most a piece per receive: each is checksummed (advance) while it is still in cache
            # (bench_redis.py, "bytes received per checksum step")
            return self.payload[self.pos:self.pos + self.piece] if self.piece else self.payload[self.pos:]
        if self.phase == self._DONE:
            raise self._error(f"value is longer than its header says ({self.header.total} bytes)", torn=True)
        return memoryview(self.buf)[self.pos:]

    def advance(self, n: int) -> None:
        self.pos += n
        self.received += n
        if self.phase == self._PAYLOAD:
            # each piece is checksummed as it lands, while the next one is on the wire (CRC32C runs at
            # ~25 GB/s: hidden behind the socket)
            self.crc.update(self.payload[self.pos - n: self.pos])
            if self.pos == len(self.payload):
                self.phase = self._DONE
            return
        if self.phase == self._PREFIX and self.pos == len(self.buf):
            prefix = bytes(self.buf)
            if prefix == _MAGIC and self.parts is None:
                if self.value_len > _MANIFEST_MAX:
                    raise self._error(f"manifest of {self.value_len} bytes is not a kvx manifest", torn=True)
                self.phase, self.buf = self._MANIFEST, bytearray(self.value_len)
                self.buf[:len(prefix)] = prefix
                if self.pos == self.value_len:
                    self._manifest_done()
                return
            try:
                n_head = codec.header_length(prefix)
            except ChunkError as e:       # neither a chunk nor a manifest at a kvx key: damage
                raise self._error(str(e), torn=True) from None
            self.phase, self.buf = self._HEADER, bytearray(codec.PREFIX_BYTES + n_head)
            self.buf[:len(prefix)] = prefix
        elif self.phase == self._MANIFEST and self.pos == len(self.buf):
            self._manifest_done()
        elif self.phase == self._HEADER and self.pos == len(self.buf):
            try:
                h = codec.decode_header(self.buf)
            except ChunkError as e:
                raise self._error(str(e), torn=True) from None
            problems = codec.check(h, self.key, self.fingerprint, tuple(self.out.shape), self.out.dtype)
            if problems:
                # another fingerprint, format or shape is not damage (another engine's chunk): kept;
                # another key inside is (a value written under the wrong name): dropped
                raise self._error(f"failed verification: {'; '.join(problems)}", torn=h.key != self.key)
            self.header = h
            self.crc = codec.RunningChecksum(h)
            if self.header.nbytes != len(self.payload):
                raise self._error(f"header says {self.header.nbytes} payload bytes, out holds {len(self.payload)}")
            self.phase, self.pos = (self._PAYLOAD, 0) if self.header.nbytes else (self._DONE, 0)

    def _manifest_done(self) -> None:
        self.manifest = bytes(self.buf)
        self.phase = self._DONE

    def expect_parts(self) -> tuple[str, int]:
        """After a manifest: (nonce, parts); the sink then takes the parts as one stream."""
        try:
            magic, version, nonce, n, total, psize = self.manifest.decode("ascii").split(":")
            n, total, psize = int(n), int(total), int(psize)
            int(nonce, 16)
            if magic != _MAGIC.decode() or version != "1" or not (n >= 1 and psize >= 1 and
                                                                   (n - 1) * psize < total <= n * psize):
                raise ValueError("inconsistent fields")
        except (UnicodeDecodeError, ValueError) as e:
            raise self._error(f"unreadable manifest {self.manifest[:_MANIFEST_MAX]!r} ({e})", torn=True) from None
        self.parts = [min(psize, total - i * psize) for i in range(n)]
        self.value_len = total
        self.phase, self.pos, self.received, self.buf = self._PREFIX, 0, 0, bytearray(codec.PREFIX_BYTES)
        return nonce, n

    def finish(self) -> codec.Header:
        """After the last value: the whole chunk arrived and its checksum matches (else ChunkError)."""
        if self.phase != self._DONE or self.header is None:
            raise self._error(f"value ended after {self.received} bytes, before the chunk did", torn=True)
        if self.received != self.header.total or self.received != self.value_len:
            raise self._error(f"{self.received} bytes received, header says {self.header.total}", torn=True)
        if not self.crc.matches():
            raise self._error("failed verification: checksum mismatch (corrupt bytes)", torn=True)
        return self.header


@dataclass
class _Lookup:
    future: cf.Future
    done_at: float | None = None


# ------------------------------------------------------------------------------------------ the tier
@register_tier
class RedisTier(Tier):
    """Chunks in Redis (see the module docstring). Open with :meth:`open`; every operation may be called
    from several threads at once."""

    type = "redis"
    config_model = RedisConfig
    hit_source = "external_unspecified"

    def __init__(self, config: RedisConfig, ctx: TierContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.url = redact(config.url)
        self.target, self._params = _target(config.url)
        self.sentinel_spec = _sentinel_url(config.url) if _is_sentinel(config.url) else None
        self._timeout = config.timeout_ms / 1000.0
        # GET: most bytes one receive takes before they are checksummed (measured per transport)
        self.piece: int | None = _PIECE_UNIX if self._params.get("path") else _PIECE
        # PUT: SO_SNDBUF of new data connections (None: the kernel's default; measured per transport)
        self.send_buffer: int | None = _SNDBUF_UNIX if self._params.get("path") else None
        self._ttl_ms = max(1, round(config.ttl_s * 1000)) if config.ttl_s is not None else 0
        # the largest value a server took: None until one refused a value (proto-max-bulk-len below
        # max_value_size + header), then puts split chunks into parts of at most this many bytes
        self._value_cap: int | None = None
        self._throttle = Throttle(log, 30.0)
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("gets", "get_bytes", "puts", "put_bytes", "misses", "errors", "timeouts",
                                     "full", "reconnects", "redirects", "dropped", "failovers", "refused"), 0)
        self._closed = False
        self._nodes: dict[str, _Node] = {}
        self._rc = None                        # redis-py client: slot map, INFO
        self._rc_lock = threading.Lock()
        self._rc_node: _Node | None = None    # Sentinel: the master self._rc talks to
        self._sentinels = None                 # Sentinel: redis-py's Sentinel (asked by the maintenance thread)
        self._ask_at = 0.0                     # Sentinel: when to ask the sentinels next
        self._slots: list[_Node | None] = []   # cluster: slot -> primary node
        self._topology_ok = False
        self._refresh = threading.Event()      # cluster: a MOVED asks for a new slot map
        self._memory: dict[str, tuple[int, int]] = {}   # node -> (used_memory, maxmemory), last known
        self._lookups: OrderedDict[tuple[str, ...], _Lookup] = OrderedDict()
        self._lookup_lock = threading.Lock()
        self._executor = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-redis-lookup")
        # a cluster lookup's per-node pipelines (separate from the lookups, which wait for them)
        self._fanout = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvx-redis-fanout")
        self._wake = threading.Event()
        self._suspects: set[_Node] = set()    # nodes an operation timed out on: the maintenance thread checks
        self._node: _Node | None = None       # Sentinel: the master (None until a sentinel named one)
        if not config.cluster and self.sentinel_spec is None:
            p = self._params
            node = (_Node(self, None, None, p["path"]) if p.get("path")
                    else _Node(self, p.get("host", "localhost"), int(p.get("port", 6379))))
            self._node = self._nodes[node.name] = node
        self._maint = threading.Thread(target=self._maintain, name="kvx-redis-reconnect", daemon=True)

    @classmethod
    def open(cls, config: TierConfig, ctx: TierContext) -> RedisTier:
        """Connect (a server that cannot be reached now: warn, answer misses, retry every ``retry_s``)."""
        if isinstance(config, dict):
            config = RedisConfig.model_validate(config)
        if not isinstance(config, RedisConfig):
            raise TypeError(f"config: expected a RedisConfig, got {type(config).__name__}")
        tier = cls(config, ctx)
        errors = []
        try:
            if config.cluster:
                tier._load_topology()
            elif tier.sentinel_spec is not None:
                tier._follow_master()
            for node in list(tier._nodes.values()):
                try:
                    tier._probe(node)
                except StoreError as e:
                    errors.append(e)
        except StoreError as e:
            errors.append(e)
        if errors:
            tier._throttle.warning("down", "kvx: redis tier %s: cannot reach the server (%s); answering misses and "
                                   "retrying every %.1f s", tier.url, "; ".join(map(str, errors)), config.retry_s)
        tier._maint.start()
        return tier

    @classmethod
    def check_config(cls, config: RedisConfig, where: str, writes: bool) -> list[str]:
        """The TLS files a ``rediss://`` url names must be readable here (a server that is down is not a
        config problem: the tier opens anyway and retries)."""
        from redis.connection import parse_url

        if urlsplit(config.url).scheme != "rediss":
            return []
        params = parse_url(config.url)
        problems = []
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            path = params.get(name)
            if path and not os.access(path, os.R_OK):
                problems.append(f"{where}.url: expected {name}={path!r} to be a readable file, it is "
                                f"{'unreadable' if os.path.exists(path) else 'missing'} ({redact(config.url)})")
        return problems

    # ---------------------------------------------------------------- topology and health
    def _redis_kwargs(self) -> dict:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside redis-py: a down server must cost one timeout, not three with back-off
        return dict(socket_timeout=self._timeout, socket_connect_timeout=self._timeout, retry=Retry(NoBackoff(), 0))

    def _client(self):
        """The redis-py client (created on first use; a failed cluster discovery raises StoreUnavailableError).
        Sentinel: a client of the master in use now (StoreUnavailableError if none is known yet)."""
        with self._rc_lock:     # the maintenance thread and usage() callers: one client, not two
            if self.sentinel_spec is not None:
                return self._master_client()
            if self._rc is not None:
                return self._rc
            import redis

            try:
                if self.config.cluster:
                    self._rc = redis.RedisCluster.from_url(self.config.url, require_full_coverage=False,
                                                           **self._redis_kwargs())
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
            self._rc = redis.Redis(host=node.host, port=node.port, db=t.db, username=t.username,
                                   password=t.password, **self._redis_kwargs())
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
            raise StoreUnavailableError(f"redis tier {self.url}: no sentinel names a master of {spec.service!r} "
                                        f"({_redis_error(e)})") from None
        if node is not None and (node.host, node.port) == (host, port):
            return
        new = _Node(self, host, port)
        with self._lock:
            self._node, self._nodes = new, {new.name: new}
        self._wake.set()
        if node is None:
            log.info("kvx: redis tier %s: the sentinels name %s as the master of %r", self.url, new.name,
                     spec.service)
            return
        with node._lock:
            node.up, node.closed = False, True
            node.error = f"no longer the master of {spec.service!r} (now {new.name})"
        node.clear()
        self._memory.pop(node.name, None)
        self._count(failovers=1)
        log.warning("kvx: redis tier %s: failover: the sentinels name %s as the master of %r (was %s); chunks "
                    "the old master had not replicated are misses", self.url, new.name, spec.service, node.name)

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
        slots: list[_Node | None] = [None] * _SLOTS
        for slot, nodes in list(cache.items()):
            if nodes:
                slots[slot] = self._node_at(nodes[0].host, nodes[0].port)
        self._slots = slots
        self._topology_ok = True

    def _node_at(self, host: str, port: int) -> _Node:
        """The node of ``host:port`` (created on first sight: down until probed)."""
        name = f"{host}:{port}"
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                node = self._nodes[name] = _Node(self, host, int(port))
                self._wake.set()
        return node

    def _probe(self, node: _Node) -> None:
        """Connect, PING and load the scripts; on success the node is up (raises StoreError if not)."""
        deadline = time.monotonic() + self._timeout
        try:
            conn = node.connect(deadline)
            try:
                conn.pipeline([("PING",)] + [("SCRIPT", "LOAD", src) for src, _ in _SCRIPTS.values()], deadline)
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

    def _node_failed(self, node: _Node, err: BaseException) -> None:
        """Mark ``node`` down (operations on it fail at once) until the maintenance thread reaches it."""
        with node._lock:
            was_up = node.up
            node.up = False
            node.error = str(err)
            node.retry_at = time.monotonic() + self.config.retry_s
        node.clear()
        if was_up:
            self._throttle.warning(f"down:{node.name}", "kvx: redis tier %s: node %s failed (%s); answering misses "
                                   "for its chunks, retrying every %.1f s", self.url, node.name, err,
                                   self.config.retry_s)
        if self.sentinel_spec is not None:
            self._ask_at = 0.0          # a demoted master: the sentinels already name the new one
        self._wake.set()

    def _suspect(self, node: _Node) -> None:
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
                        self._throttle.log(logging.INFO if quiet else logging.WARNING, f"sentinel:{quiet}",
                                           "kvx: %s", e)      # e names the tier
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

    def _route(self, chunk_key: str) -> _Node | None:
        if not self.config.cluster:
            return self._node
        if not self._topology_ok:
            return None
        return self._slots[_slot(chunk_key)]

    # ---------------------------------------------------------------- running commands
    def _op(self, chunk_key: str, fn: Callable[[RespConnection, bool], Any], deadline: float,
            node: _Node | None = None) -> Any:
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
                raise StoreUnavailableError(f"redis tier {self.url}: no node serves {chunk_key} (slot map not "
                                            f"loaded yet)")
            if not node.up:
                raise StoreUnavailableError(f"redis tier {self.url}: node {node.name} is down ({node.error})")
            try:
                conn, reused = node.acquire(deadline)
            except _PoolBusy:
                raise                   # busy, not down
            except StoreError as e:     # refused, timed out, or AUTH refused: down until the probe succeeds
                self._node_failed(node, e)
                raise
            used = node
            try:
                return fn(conn, asking)
            except RedirectError as e:
                if redirected:
                    raise StoreUnavailableError(f"redis tier {self.url}: redirected twice for {chunk_key} "
                                                f"({e})") from None
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
                        self._probe(target)      # a node we never used: connect now, once
                node, asking = target, e.ask
            except ConnectionLost as e:
                if reused and not e.timeout and not refreshed and time.monotonic() < deadline:
                    refreshed = True
                    node.clear()         # its idle siblings are as dead as it was
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
                raise _NotMaster(f"redis tier {self.url}: node {node.name} is a replica now ({e})") from None
            finally:
                used.release(conn)

    def _script(self, conn: RespConnection, name: str, keys: Sequence[str], args: Sequence, deadline: float,
                asking: bool):
        src, digest = _SCRIPTS[name]
        ask = [("ASKING",)] if asking else []
        try:
            return conn.pipeline(ask + [("EVALSHA", digest, len(keys), *keys, *args)], deadline)[-1]
        except NoScriptError:     # flushed or restarted since the node was probed: EVAL caches it again
            return conn.pipeline(ask + [("EVAL", src, len(keys), *keys, *args)], deadline)[-1]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"redis tier {self.url} is closed")

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    # ---------------------------------------------------------------- lookups
    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Pipelined EXISTS of the chunk keys (per node on a cluster), run on a background thread: waits
        at most ``lookup_wait_ms``, else answers None and keeps the lookup for the next ask with the same
        keys. Keys on a node known to be down are False at once."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        if not self.config.cluster and (self._node is None or not self._node.up):
            return [False] * len(keys)
        if self.config.cluster and (not self._topology_ok or not any(n.up for n in list(self._nodes.values()))):
            return [False] * len(keys)
        t = tuple(keys)
        now = time.monotonic()
        with self._lookup_lock:
            entry = self._lookups.get(t)
            if entry is not None and entry.done_at is not None and now - entry.done_at > _LOOKUP_MAX_AGE_S:
                del self._lookups[t]          # an answer nobody came for in time: ask again
                entry = None
            if entry is None:
                entry = _Lookup(self._executor.submit(self._lookup, keys))
                entry.future.add_done_callback(lambda f, e=entry: setattr(e, "done_at", time.monotonic()))
                self._lookups[t] = entry
                while len(self._lookups) > _LOOKUP_KEEP:
                    self._lookups.popitem(last=False)
        fut = entry.future
        if not fut.done() and self.config.lookup_wait_ms > 0:
            cf.wait([fut], timeout=self.config.lookup_wait_ms / 1000.0)
        if not fut.done():
            return None
        with self._lookup_lock:
            if self._lookups.get(t) is entry:
                del self._lookups[t]          # an answer is served once
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - a failed lookup is a miss
            return [False] * len(keys)

    def _lookup(self, keys: list[str]) -> list[bool]:
        """On a lookup thread: EXISTS for every key, grouped by node (errors: False)."""
        found = [False] * len(keys)
        cks = [_chunk_key(k) for k in keys]
        groups: dict[str, tuple[_Node, list[int]]] = {}
        for i, ck in enumerate(cks):
            node = self._route(ck)
            if node is not None and node.up:
                groups.setdefault(node.name, (node, []))[1].append(i)

        def ask_node(node: _Node, idx: list[int]) -> list[tuple[int, Any]]:
            out = []
            for lo in range(0, len(idx), _LOOKUP_BATCH):
                batch = idx[lo:lo + _LOOKUP_BATCH]
                deadline = time.monotonic() + self._timeout
                try:
                    replies = self._op(cks[batch[0]], lambda c, ask, b=batch, d=deadline: c.exists_each(
                        [cks[i] for i in b], d), deadline, node=node)
                except StoreError:
                    break               # node down or busy: its keys stay False
                out += zip(batch, replies)
            return out

        # the nodes of a cluster are asked at once: their round trips overlap (on loopback, with the EXISTS
        # fast path, 3 nodes at once and one after another both take ~1.7 ms; across hosts the round trips rule)
        if len(groups) > 1:
            answers = [a for part in self._fanout.map(lambda g: ask_node(*g), list(groups.values())) for a in part]
        else:
            answers = [a for g in groups.values() for a in ask_node(*g)]
        redirected: list[int] = []
        for i, r in answers:
            if isinstance(r, RedirectError):
                redirected.append(i)
            elif isinstance(r, int):
                found[i] = r > 0
        for i in redirected:          # a slot on the move: one key at a time, following the redirection
            deadline = time.monotonic() + self._timeout
            try:
                found[i] = self._op(cks[i], lambda c, ask, ck=cks[i], d=deadline: c.pipeline(
                    ([("ASKING",)] if ask else []) + [("EXISTS", ck)], d)[-1], deadline) > 0
            except StoreError:
                pass
        return found

    # ---------------------------------------------------------------- bytes
    def get_into(self, key: str, out: torch.Tensor) -> None:
        """Read chunk ``key`` straight into ``out`` (contiguous CPU tensor), verified. ChunkError on a
        miss, a torn or corrupt chunk, a mismatch, a down server or the ``timeout_ms`` deadline."""
        self._check_open()
        check_key(key)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: expected a contiguous CPU tensor, got {type(out).__name__}")
        if not out.is_cpu or not out.is_contiguous():       # is_cpu: no device object (~15 us less when cold)
            raise ValueError(f"out: expected a contiguous CPU tensor, got one on {out.device} with strides "
                             f"{tuple(out.stride())} for shape {tuple(out.shape)}")
        ck = _chunk_key(key)
        deadline = time.monotonic() + self._timeout
        sink = _ChunkSink(key, self.ctx.fingerprint, out, f"redis value {ck}", self.piece)
        manifest: list[bytes | None] = [None]

        def read(conn: RespConnection, asking: bool) -> None:
            nonlocal sink
            if sink.used:            # a second try (redirected, or a dead pooled connection) starts over
                sink = _ChunkSink(key, self.ctx.fingerprint, out, sink.where, self.piece)
            sink.used = True
            ask = [("ASKING",)] if asking else []
            conn.get_into([ck], sink, deadline, prefix=ask, ready=sink.prepare)
            if sink.missing:
                return
            if sink.manifest is not None:
                manifest[0] = sink.manifest
                nonce, n = sink.expect_parts()
                if asking:     # ASKING covers one command; parts of a slot in migration: a miss this time
                    raise StoreUnavailableError(f"{ck} is being migrated between cluster nodes")
                conn.get_into([_part_key(ck, nonce, i) for i in range(n)], sink, deadline)

        try:
            self._op(ck, read, deadline)
            if sink.missing:
                self._count(misses=1)
                raise ChunkError(f"chunk {key}: not in redis ({self.url})")
            sink.finish()
        except ChunkError:
            if sink.missing:
                raise
            self._count(errors=1)
            if sink.torn:
                self._drop(key, ck, manifest[0])
            raise
        except ConnectionLost as e:
            self._count(errors=1, timeouts=int(e.timeout))
            if e.timeout:
                raise ChunkError(f"chunk {key}: redis {self.url} did not answer within {self.config.timeout_ms} "
                                 f"ms ({e})") from None
            raise ChunkError(f"chunk {key}: redis {self.url}: {e}") from None
        except StoreClosedError:
            raise
        except StoreError as e:
            self._count(errors=1)
            raise ChunkError(f"chunk {key}: {e}") from None
        self._count(gets=1, get_bytes=sink.header.nbytes)

    def _drop(self, key: str, ck: str, manifest: bytes | None) -> None:
        """Best effort: delete a torn or corrupt chunk (only if its manifest is still the one read), so
        lookups stop reporting it and the recomputed chunk can be stored again."""
        deadline = time.monotonic() + self._timeout
        try:
            dropped = self._op(ck, lambda c, ask: self._script(c, "drop", [ck], [manifest or b""], deadline, ask),
                               deadline)
        except StoreError:
            return
        if dropped:
            self._count(dropped=1)
            self._emit(REMOVED, [key])

    def put(self, key: str, chunk: torch.Tensor, extra: dict[str, str] | None = None) -> bool:
        """Store ``chunk`` as ``key`` unless present (False). One ``SET NX`` up to ``max_value_size``;
        larger chunks as parts published by one script. StoreFullError on a server out of memory
        (nothing readable is left), StoreUnavailableError when down or out of time."""
        self._check_open()
        check_key(key)
        codec.check_chunk(chunk)
        codec.check_extra(extra)
        encoded: list = []

        def encode() -> tuple[bytes, object]:
            """(header, payload), computed once (the CRC pass) while the server answers the EXISTS."""
            if not encoded:
                encoded.extend(codec.encode(chunk, key, self.ctx.fingerprint, extra, created=time.time()))
            return encoded[0], encoded[1]

        ck = _chunk_key(key)
        deadline = time.monotonic() + self._timeout
        try:
            while True:
                try:
                    stored = self._op(ck, lambda c, ask: self._write(c, ask, ck, encode, deadline), deadline)
                    break
                except ValueTooLarge as e:      # the server takes smaller values than we sent: parts
                    if not self._lower_value_cap(ck, e, deadline):
                        raise
        except StoreFullError as e:
            self._count(full=1)
            self._throttle.warning("full", "kvx: redis tier %s: server out of memory, chunk not stored (%s)",
                                   self.url, e)
            raise StoreFullError(f"chunk {key}: redis {self.url}: {e}") from None
        except ConnectionLost as e:
            self._count(errors=1, timeouts=int(e.timeout))
            raise StoreUnavailableError(f"chunk {key}: redis {self.url}: {e}") from None
        except (StoreClosedError, StoreUnavailableError):
            raise
        except StoreError as e:
            self._count(errors=1)
            raise StoreError(f"chunk {key}: redis {self.url}: {e}") from None
        if stored:
            self._count(puts=1, put_bytes=len(encoded[1]))
            self._emit(STORED, [key])
        return stored

    @staticmethod
    def _lacks(conn, ask: list, ck: str, encode: Callable, deadline: float) -> tuple[bytes, object] | None:
        """``encode()`` if ``ck`` is not stored yet, else None. The EXISTS goes out first and the chunk is
        encoded while the server answers: a chunk already there costs a round trip, not the value's
        transfer, and a new one does not wait for that round trip (4 MiB PUT: 0.14 ms less here)."""
        cmds = ask + [("EXISTS", ck)]
        conn.send(cmds, deadline)
        try:
            encoded = encode()
        except BaseException:
            conn.close()            # its reply is unread
            raise
        return None if conn.replies(cmds, deadline)[-1] else encoded

    def _write(self, conn, asking, ck, encode, deadline) -> bool:
        """Store the chunk at ``ck`` unless present: one ``SET NX`` of its encoding, or parts when its
        payload is larger than ``max_value_size`` (the header rides along: a 4 MiB chunk is one 4 MiB value,
        not two of 2 MiB) or the encoding larger than the servers take (``_value_cap``)."""
        ask = [("ASKING",)] if asking else []
        encoded = self._lacks(conn, ask, ck, encode, deadline)
        if encoded is None:
            return False
        header, payload = encoded
        hv, pv = memoryview(header), memoryview(payload)
        total = len(hv) + len(pv)
        n = -(-len(pv) // self.config.max_value_size)
        cap = self._value_cap
        if cap is not None:
            n = max(n, -(-total // cap))
        if n == 1:
            opts = ["NX"] + (["PX", self._ttl_ms] if self._ttl_ms else [])
            return conn.set_value(ck, [header, payload], opts, deadline, prefix=ask) == "OK"
        return self._put_parts(conn, asking, ask, ck, hv, pv, n, deadline)

    def _put_parts(self, conn, asking: bool, ask: list, ck: str, hv: memoryview, pv: memoryview, n: int,
                   deadline: float) -> bool:
        """The chunk's encoding (``hv`` + ``pv``) as ``n`` or so parts, published by one script."""
        total = len(hv) + len(pv)
        # equal parts: a 32 MiB chunk (+ its header) is 9 parts of 3.6 MiB, not 8 of 4 MiB and one of 300 B
        psize = -(-total // n)
        n = -(-total // psize)          # every part non-empty, whatever the rounding
        nonce = os.urandom(6).hex()
        parts = []
        for i in range(n):
            lo, hi = i * psize, min(total, (i + 1) * psize)
            bufs = []
            if lo < len(hv):
                bufs.append(hv[lo:min(hi, len(hv))])
            if hi > len(hv):
                bufs.append(pv[max(lo, len(hv)) - len(hv):hi - len(hv)])
            parts.append((_part_key(ck, nonce, i), bufs))
        keys = [k for k, _ in parts]
        try:
            if asking:       # ASKING holds for one command: one SET at a time
                replies = [conn.set_value(k, b, ["PX", _PENDING_MS], deadline, prefix=ask) for k, b in parts]
            else:
                replies = conn.set_many(parts, ["PX", _PENDING_MS], deadline)
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            manifest = b"%s:1:%s:%d:%d:%d" % (_MAGIC, nonce.encode(), n, total, psize)
            r = self._script(conn, "publish", [ck, *keys], [manifest, self._ttl_ms], deadline, asking)
        except (StoreError, OSError):
            if not conn.closed:     # OOM or an error reply: take this writer's parts back now
                try:
                    conn.pipeline([c for k in keys for c in (*ask, ("DEL", k))], deadline, raise_errors=False)
                except StoreError:
                    pass
            raise
        if r == -1:
            raise StoreFullError(f"parts of {ck} were evicted before they could be published (maxmemory too "
                                 f"small for chunks of {total} bytes?)")
        return r == 1

    def _lower_value_cap(self, ck: str, e: ValueTooLarge, deadline: float) -> bool:
        """A server refused a value of ``e.size`` bytes (over its ``proto-max-bulk-len``): lower the largest
        value puts send to that limit (asked with ``CONFIG GET``; where CONFIG is disabled, as on managed
        Redis, half the refused size), never below 1 MiB, which every server takes. True if a retry now
        sends smaller values. The node is not marked down: it serves everything else."""
        size = e.size
        if size is None or size <= _MIN_BULK:
            return False
        limit = None
        try:
            r = self._op(ck, lambda c, ask: c.pipeline([("CONFIG", "GET", "proto-max-bulk-len")], deadline,
                                                       raise_errors=False)[0], deadline)
            if isinstance(r, list) and len(r) == 2:
                limit = int(r[1])
        except (StoreError, ValueError):
            pass
        cap = limit if limit is not None and _MIN_BULK <= limit < size else max(_MIN_BULK, size // 2)
        with self._lock:
            old = self._value_cap
            if old is not None and old <= cap:
                return old < size       # another put lowered it meanwhile
            self._value_cap = cap
            self._stats["refused"] += 1
        log.warning("kvx: redis tier %s: the server refused a value of %d bytes (over its proto-max-bulk-len, "
                    "%s): chunks are stored in values of at most %d bytes from now on", self.url, size,
                    limit if limit is not None else "CONFIG GET not allowed", cap)
        return True

    def delete(self, key: str) -> bool:
        """Remove chunk ``key`` (and its parts); False if it was not there."""
        self._check_open()
        check_key(key)
        ck = _chunk_key(key)
        deadline = time.monotonic() + self._timeout
        try:
            r = self._op(ck, lambda c, ask: self._script(c, "drop", [ck], [b""], deadline, ask), deadline)
        except ConnectionLost as e:
            raise StoreUnavailableError(f"chunk {key}: redis {self.url}: {e}") from None
        if r:
            self._emit(REMOVED, [key])
        return bool(r)

    # ---------------------------------------------------------------- capacity and stats
    def _memory_info(self) -> dict[str, tuple[int, int]]:
        """(used_memory, maxmemory) of every primary that answers INFO now; the last known values of the
        others (redis-py, ``timeout_ms`` per node; nodes known to be down are not asked)."""
        import redis

        if self._closed:
            return dict(self._memory)
        try:
            rc = self._client()
        except StoreError:
            return dict(self._memory)
        if self.config.cluster:
            targets = {n.name: n for n in self._slots if n is not None}
        else:
            node = self._rc_node if self.sentinel_spec is not None else self._node    # the one rc talks to
            targets = {node.name: node} if node is not None else {}
        for name, node in targets.items():
            if not node.up:
                continue
            try:
                if self.config.cluster:
                    cn = rc.get_node(host=node.host, port=node.port)
                    if cn is None:
                        continue
                    info = rc.info("memory", target_nodes=cn)
                else:
                    info = rc.info("memory")
                self._memory[name] = (int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))
            except (redis.RedisError, OSError, ValueError):
                continue
        return dict(self._memory)

    def usage(self) -> int:
        """Bytes the server(s) use now (``used_memory``; all of the server's data, not only kvx's)."""
        self._check_open()
        return sum(used for used, _ in self._memory_info().values())

    def capacity(self) -> int | None:
        """The servers' ``maxmemory`` (None if any server has no limit, or none was reached yet)."""
        self._check_open()
        mem = self._memory_info()
        if not mem or any(mx == 0 for _, mx in mem.values()):
            return None
        return sum(mx for _, mx in mem.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
        out["nodes_down"] = sum(1 for n in list(self._nodes.values()) if not n.up)
        if self.sentinel_spec is not None and self._node is None:
            out["nodes_down"] = 1       # no sentinel named a master yet
        return out

    def close(self) -> None:
        """Close sockets, stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._maint.is_alive() and self._maint is not threading.current_thread():
            self._maint.join(timeout=self._timeout + 1.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for node in list(self._nodes.values()):
            node.closed = True
            node.clear()
        for attr in ("_rc", "_sentinels"):
            client = getattr(self, attr)
            setattr(self, attr, None)
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - closing anyway
                    pass

    def __repr__(self) -> str:
        return f"RedisTier({self.url}, cluster={self.config.cluster})"


def _redis_error(e: BaseException) -> str:
    """redis-py's error as one line (its messages name hosts and ports, never the password)."""
    return f"{type(e).__name__}: {e}"
