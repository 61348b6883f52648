"""The Redis tier itself (:class:`RedisTier`, registered as ``"redis"``): opening it, lookups, gets, puts
(one value or parts), deletes, capacity and stats, close. Its topology and failover are
:mod:`kvx.store.redis.topology` (a base class), its receive path :mod:`kvx.store.redis.sink`.

Every operation may be called from several threads at once. Lookups run on the tier's lookup threads
(``kvx-redis-lookup``; a cluster's per-node pipelines on ``kvx-redis-fanout``); ``_lock`` guards the
stats, the node table and the value cap.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from ...log import Throttle, get_logger
from .. import codec
from ..errors import ChunkError, StoreClosedError, StoreError, StoreFullError, StoreUnavailableError
from ..resp import ConnectionLost, RedirectError, RespConnection, ValueTooLarge
from ..seal import Sealer, check_encryption
from ..tier import REMOVED, STORED, Tier, TierConfig, TierContext, check_key, register_tier
from .config import RedisTierConfig, is_sentinel, parse_target, redact, sentinel_url
from .layout import PARTS_MAGIC, kid_suffix, redis_chunk_key, redis_part_key, value_split
from .pool import RedisNode
from .sink import ChunkSink
from .topology import RedisTopology

log = get_logger("kvx.store.redis")  # one logger for the whole tier, named as before the split

_PIECE = 256 << 10  # most GET payload bytes one receive takes (then checksummed), TCP
# over a unix socket: no cap (a receive brings what the socket holds): 4 MiB GETs 1.03-1.05x faster than
# 1 MiB pieces in each of three runs of bench_redis.py's step sweep (15 of 15 sub-runs >= 1.00x)
_PIECE_UNIX = None
# PUT over a unix socket: SO_SNDBUF of 256 KiB (the kernel makes it 512 KiB; 416 KiB where wmem_max is the
# usual 208 KiB) against the 208 KiB default: a 4 MiB put 1.30-1.56x faster here (at the default the value
# fills the buffer ~20 times over); 512 KiB - 4 MiB gained less (1.27-1.43x). TCP keeps the kernel's
# autotuning (a fixed 1-4 MiB buffer: 0.93-0.95x). bench_redis.py, "PUT: socket send buffer"
SNDBUF_UNIX = 256 << 10
_PENDING_MS = 60_000  # expiry of parts not yet published: a put takes milliseconds
_MIN_BULK = 1 << 20  # the smallest proto-max-bulk-len a server can be set to: always accepted
_LOOKUP_BATCH = 1024  # EXISTS per pipeline write
LOOKUP_KEEP = 256  # unanswered lookups kept for the caller's next ask
_LOOKUP_MAX_AGE_S = 1.0  # a finished lookup older than this is not served (recomputed)


@dataclass
class _Lookup:
    future: cf.Future
    done_at: float | None = None


# ------------------------------------------------------------------------------------------ the tier
@register_tier
class RedisTier(RedisTopology, Tier):
    """Chunks in Redis (see :mod:`kvx.store.redis`). Open with :meth:`open`; every operation may be called
    from several threads at once."""

    type = "redis"
    config_model = RedisTierConfig
    hit_source = "external_unspecified"

    def __init__(self, config: RedisTierConfig, ctx: TierContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.url = redact(config.url)
        self.target, self._params = parse_target(config.url)
        self.sentinel_spec = sentinel_url(config.url) if is_sentinel(config.url) else None
        # None: chunks in the clear; else every put seals and every get reads only sealed chunks it can open
        self.sealer = Sealer.of(config.encryption, ctx.fingerprint)
        # the names this tier reads a chunk under, newest secret first (it writes the first): its secrets' key
        # ids, or None for the name in the clear (kvx.store.seal, "Names")
        self._kids: tuple[str | None, ...] = (None,) if self.sealer is None else tuple(self.sealer.kids)
        self._suffixes = tuple(kid_suffix(kid) for kid in self._kids)  # each name: the clear one + its suffix
        self._timeout = config.timeout_ms / 1000.0
        # GET: most bytes one receive takes before they are checksummed (measured per transport)
        self.piece: int | None = _PIECE_UNIX if self._params.get("path") else _PIECE
        # PUT: SO_SNDBUF of new data connections (None: the kernel's default; measured per transport)
        self.send_buffer: int | None = SNDBUF_UNIX if self._params.get("path") else None
        self._ttl_ms = max(1, round(config.ttl_s * 1000)) if config.ttl_s is not None else 0
        # the largest value a server took: None until one refused a value (proto-max-bulk-len below
        # max_value_size + header), then puts split chunks into parts of at most this many bytes
        self._value_cap: int | None = None
        self._throttle = Throttle(log, 30.0)
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            (
                "gets",
                "get_bytes",
                "puts",
                "put_bytes",
                "misses",
                "errors",
                "timeouts",
                "full",
                "reconnects",
                "redirects",
                "dropped",
                "failovers",
                "refused",
            ),
            0,
        )
        self._closed = False
        self._nodes: dict[str, RedisNode] = {}
        self._rc = None  # redis-py client: slot map, INFO
        self._rc_lock = threading.Lock()
        self._rc_node: RedisNode | None = None  # Sentinel: the master self._rc talks to
        self._sentinels = None  # Sentinel: redis-py's Sentinel (asked by the maintenance thread)
        self._ask_at = 0.0  # Sentinel: when to ask the sentinels next
        self._slots: list[RedisNode | None] = []  # cluster: slot -> primary node
        self._topology_ok = False
        self._refresh = threading.Event()  # cluster: a MOVED asks for a new slot map
        self._memory: dict[str, tuple[int, int]] = {}  # node -> (used_memory, maxmemory), last known
        self._lookups: OrderedDict[tuple[str, ...], _Lookup] = OrderedDict()
        self._lookup_lock = threading.Lock()
        self._executor = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-redis-lookup")
        # a cluster lookup's per-node pipelines (separate from the lookups, which wait for them)
        self._fanout = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvx-redis-fanout")
        self._wake = threading.Event()
        self._suspects: set[RedisNode] = set()  # nodes an operation timed out on: the maintenance thread checks
        self._node: RedisNode | None = None  # Sentinel: the master (None until a sentinel named one)
        if not config.cluster and self.sentinel_spec is None:
            p = self._params
            node = (
                RedisNode(self, None, None, p["path"])
                if p.get("path")
                else RedisNode(self, p.get("host", "localhost"), int(p.get("port", 6379)))
            )
            self._node = self._nodes[node.name] = node
        self._maint = threading.Thread(target=self._maintain, name="kvx-redis-reconnect", daemon=True)

    @classmethod
    def open(cls, config: TierConfig, ctx: TierContext) -> RedisTier:
        """Connect (a server that cannot be reached now: warn, answer misses, retry every ``retry_s``)."""
        if isinstance(config, dict):
            config = RedisTierConfig.model_validate(config)
        if not isinstance(config, RedisTierConfig):
            raise TypeError(f"config: expected a RedisTierConfig, got {type(config).__name__}")
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
            tier._throttle.warning(
                "down",
                "kvx: redis tier %s: cannot reach the server (%s); answering misses and retrying every %.1f s",
                tier.url,
                "; ".join(map(str, errors)),
                config.retry_s,
            )
        tier._maint.start()
        return tier

    @classmethod
    def check_config(cls, config: RedisTierConfig, where: str, writes: bool) -> list[str]:
        """The TLS files a ``rediss://`` url names must be readable here (a server that is down is not a
        config problem: the tier opens anyway and retries)."""
        from redis.connection import parse_url

        problems = check_encryption(getattr(config, "encryption", None), where)
        if urlsplit(config.url).scheme != "rediss":
            return problems
        params = parse_url(config.url)
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            path = params.get(name)
            if path and not os.access(path, os.R_OK):
                problems.append(
                    f"{where}.url: expected {name}={path!r} to be a readable file, it is "
                    f"{'unreadable' if os.path.exists(path) else 'missing'} ({redact(config.url)})"
                )
        return problems

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"redis tier {self.url} is closed")

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    def value_key(self, key: str) -> str:
        """The Redis key this tier writes chunk ``key`` at (sealed: named by its newest secret's key id)."""
        return redis_chunk_key(check_key(key), self._kids[0])

    def value_keys(self, key: str) -> list[str]:
        """Every Redis key this tier reads chunk ``key`` at, newest secret first (one per secret of a rotation;
        all in the chunk's cluster slot)."""
        key = check_key(key)
        return [redis_chunk_key(key, kid) for kid in self._kids]

    # ---------------------------------------------------------------- lookups
    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Pipelined EXISTS of the chunk keys (per node on a cluster), run on a background thread: waits
        at most ``lookup_wait_ms``, else answers None and keeps the lookup for the next ask with the same
        keys. Keys on a node known to be down are False at once. During a rotation one ``EXISTS`` per chunk
        asks for its name under each secret (one slot: one command)."""
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
                del self._lookups[t]  # an answer nobody came for in time: ask again
                entry = None
            if entry is None:
                entry = _Lookup(self._executor.submit(self._lookup, keys))
                entry.future.add_done_callback(lambda f, e=entry: setattr(e, "done_at", time.monotonic()))
                self._lookups[t] = entry
                while len(self._lookups) > LOOKUP_KEEP:
                    self._lookups.popitem(last=False)
        fut = entry.future
        if not fut.done() and self.config.lookup_wait_ms > 0:
            cf.wait([fut], timeout=self.config.lookup_wait_ms / 1000.0)
        if not fut.done():
            return None
        with self._lookup_lock:
            if self._lookups.get(t) is entry:
                del self._lookups[t]  # an answer is served once
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - a failed lookup is a miss
            return [False] * len(keys)

    def _lookup(self, keys: list[str]) -> list[bool]:
        """On a lookup thread: EXISTS for every key, grouped by node (errors: False)."""
        found = [False] * len(keys)
        cks = [redis_chunk_key(k) for k in keys]  # + each suffix: the names asked for (routed by the chunk's slot)
        sfx = self._suffixes
        groups: dict[str, tuple[RedisNode, list[int]]] = {}
        for i, ck in enumerate(cks):
            node = self._route(ck)
            if node is not None and node.up:
                groups.setdefault(node.name, (node, []))[1].append(i)

        def ask_node(node: RedisNode, idx: list[int]) -> list[tuple[int, Any]]:
            out = []
            for lo in range(0, len(idx), _LOOKUP_BATCH):
                batch = idx[lo : lo + _LOOKUP_BATCH]
                deadline = time.monotonic() + self._timeout
                try:
                    replies = self._op(
                        cks[batch[0]],
                        lambda c, ask, b=batch, d=deadline: c.exists_each([cks[i] for i in b], d, sfx),
                        deadline,
                        node=node,
                    )
                except StoreError:
                    break  # node down or busy: its keys stay False
                out += zip(batch, replies)
            return out

        # the nodes of a cluster are asked at once: their round trips overlap (on loopback both orders cost about
        # the same; across hosts the round trips dominate)
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
        for i in redirected:  # a slot on the move: one key at a time, following the redirection
            deadline = time.monotonic() + self._timeout
            try:
                found[i] = (
                    self._op(
                        cks[i],
                        lambda c, ask, ck=cks[i], d=deadline: c.pipeline(
                            ([("ASKING",)] if ask else []) + [("EXISTS", *(ck + s for s in sfx))], d
                        )[-1],
                        deadline,
                    )
                    > 0
                )
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
        if not out.is_cpu or not out.is_contiguous():  # is_cpu: no device object (cheaper than .device when cold)
            raise ValueError(
                f"out: expected a contiguous CPU tensor, got one on {out.device} with strides "
                f"{tuple(out.stride())} for shape {tuple(out.shape)}"
            )
        names = list(zip(self.value_keys(key), self._kids))  # newest secret first: one name, or one per secret
        ck = names[0][0]  # the name being read (every name is in the chunk's cluster slot: routed by the first)
        deadline = time.monotonic() + self._timeout
        sink = ChunkSink(key, self.ctx.fingerprint, out, f"redis value {ck}", self.piece, self.sealer, names[0][1])
        manifest: list[bytes | None] = [None]

        def read(conn: RespConnection, asking: bool) -> None:
            nonlocal sink, ck
            ask = [("ASKING",)] if asking else []
            for ck, kid in names:  # a rotation: the next secret's name if this one is missing (a round trip)
                if sink.used:  # a second try (redirected, a dead pooled connection) or another name starts over
                    sink = ChunkSink(key, self.ctx.fingerprint, out, f"redis value {ck}", self.piece, self.sealer, kid)
                sink.used = True
                conn.get_into([ck], sink, deadline, prefix=ask, ready=sink.prepare)
                if not sink.missing:
                    break
            if sink.missing:
                return
            if sink.manifest is not None:
                manifest[0] = sink.manifest
                nonce, n = sink.expect_parts()
                if asking:  # ASKING covers one command; parts of a slot in migration: a miss this time
                    raise StoreUnavailableError(f"{ck} is being migrated between cluster nodes")
                conn.get_into([redis_part_key(ck, nonce, i) for i in range(n)], sink, deadline)

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
                raise ChunkError(
                    f"chunk {key}: redis {self.url} did not answer within {self.config.timeout_ms} ms ({e})"
                ) from None
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
            dropped = self._op(
                ck, lambda c, ask: self._script(c, "drop", [ck], [manifest or b""], deadline, ask), deadline
            )
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
                if self.sealer is not None:  # AES-GCM instead of the CRC: one pass, into a new buffer
                    encoded.extend(self.sealer.seal(chunk, key, extra, created=time.time()))
                else:
                    encoded.extend(codec.encode(chunk, key, self.ctx.fingerprint, extra, created=time.time()))
            return encoded[0], encoded[1]

        names = self.value_keys(key)  # present under any of them: not written again
        ck = names[0]
        deadline = time.monotonic() + self._timeout
        try:
            while True:
                try:
                    stored = self._op(ck, lambda c, ask: self._write(c, ask, names, encode, deadline), deadline)
                    break
                except ValueTooLarge as e:  # the server takes smaller values than we sent: parts
                    if not self._lower_value_cap(ck, e, deadline):
                        raise
        except StoreFullError as e:
            self._count(full=1)
            self._throttle.warning(
                "full", "kvx: redis tier %s: server out of memory, chunk not stored (%s)", self.url, e
            )
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
    def _lacks(conn, ask: list, names: list[str], encode: Callable, deadline: float) -> tuple[bytes, object] | None:
        """``encode()`` if none of ``names`` is stored yet, else None. The EXISTS goes out first and the chunk is
        encoded while the server answers: a chunk already there costs a round trip, not the value's
        transfer, and a new one does not wait for that round trip."""
        cmds = ask + [("EXISTS", *names)]
        conn.send(cmds, deadline)
        try:
            encoded = encode()
        except BaseException:
            conn.close()  # its reply is unread
            raise
        return None if conn.replies(cmds, deadline)[-1] else encoded

    def _write(self, conn, asking, names, encode, deadline) -> bool:
        """Store the chunk at ``names[0]`` unless present under any of ``names``: one ``SET NX`` of its
        encoding, or parts when that takes less of Redis's memory (:func:`~.layout.value_split`: a value of
        4 MiB + a header takes a 5 MiB allocation, one of 4 MiB - 12 bytes and one of the rest 4 MiB + 320 B) or
        the encoding is larger than ``max_value_size`` or than the servers take (``_value_cap``)."""
        ck = names[0]
        ask = [("ASKING",)] if asking else []
        encoded = self._lacks(conn, ask, names, encode, deadline)
        if encoded is None:
            return False
        header, payload = encoded
        hv, pv = memoryview(header), memoryview(payload)
        limit = self.config.max_value_size
        cap = self._value_cap
        if cap is not None:
            limit = min(limit, cap)
        n, psize = value_split(len(hv) + len(pv), limit)
        if n == 1:
            opts = ["NX"] + (["PX", self._ttl_ms] if self._ttl_ms else [])
            return conn.set_value(ck, [header, payload], opts, deadline, prefix=ask) == "OK"
        return self._put_parts(conn, asking, ask, ck, hv, pv, n, psize, deadline)

    def _put_parts(
        self,
        conn,
        asking: bool,
        ask: list,
        ck: str,
        hv: memoryview,
        pv: memoryview,
        n: int,
        psize: int,
        deadline: float,
    ) -> bool:
        """The chunk's encoding (``hv`` + ``pv``) as ``n`` parts of ``psize`` bytes (the last holds the rest),
        published by one script."""
        total = len(hv) + len(pv)
        nonce = os.urandom(6).hex()
        parts = []
        for i in range(n):
            lo, hi = i * psize, min(total, (i + 1) * psize)
            bufs = []
            if lo < len(hv):
                bufs.append(hv[lo : min(hi, len(hv))])
            if hi > len(hv):
                bufs.append(pv[max(lo, len(hv)) - len(hv) : hi - len(hv)])
            parts.append((redis_part_key(ck, nonce, i), bufs))
        keys = [k for k, _ in parts]
        try:
            if asking:  # ASKING holds for one command: one SET at a time
                replies = [conn.set_value(k, b, ["PX", _PENDING_MS], deadline, prefix=ask) for k, b in parts]
            else:
                replies = conn.set_many(parts, ["PX", _PENDING_MS], deadline)
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            manifest = b"%s:1:%s:%d:%d:%d" % (PARTS_MAGIC, nonce.encode(), n, total, psize)
            r = self._script(conn, "publish", [ck, *keys], [manifest, self._ttl_ms], deadline, asking)
        except (StoreError, OSError):
            if not conn.closed:  # OOM or an error reply: take this writer's parts back now
                try:
                    conn.pipeline([c for k in keys for c in (*ask, ("DEL", k))], deadline, raise_errors=False)
                except StoreError:
                    pass
            raise
        if r == -1:
            raise StoreFullError(
                f"parts of {ck} were evicted before they could be published (maxmemory too "
                f"small for chunks of {total} bytes?)"
            )
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
            r = self._op(
                ck,
                lambda c, ask: c.pipeline([("CONFIG", "GET", "proto-max-bulk-len")], deadline, raise_errors=False)[0],
                deadline,
            )
            if isinstance(r, list) and len(r) == 2:
                limit = int(r[1])
        except (StoreError, ValueError):
            pass
        cap = limit if limit is not None and _MIN_BULK <= limit < size else max(_MIN_BULK, size // 2)
        with self._lock:
            old = self._value_cap
            if old is not None and old <= cap:
                return old < size  # another put lowered it meanwhile
            self._value_cap = cap
            self._stats["refused"] += 1
        log.warning(
            "kvx: redis tier %s: the server refused a value of %d bytes (over its proto-max-bulk-len, "
            "%s): chunks are stored in values of at most %d bytes from now on",
            self.url,
            size,
            limit if limit is not None else "CONFIG GET not allowed",
            cap,
        )
        return True

    def delete(self, key: str) -> bool:
        """Remove chunk ``key`` (and its parts; under every name this tier reads it at); False if it was not
        there."""
        self._check_open()
        r = 0
        for ck in self.value_keys(key):
            deadline = time.monotonic() + self._timeout
            try:
                r += self._op(ck, lambda c, ask, ck=ck: self._script(c, "drop", [ck], [b""], deadline, ask), deadline)
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
            node = self._rc_node if self.sentinel_spec is not None else self._node  # the one rc talks to
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
            out["nodes_down"] = 1  # no sentinel named a master yet
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
