"""Redis tier: kvx's ``RedisTier`` against redis-py + hiredis, in the same run.

Why this exists: kvx's Redis tier (:mod:`kvx.store.redis`) speaks RESP itself and reads a value straight
into the caller's CPU-pool slot, instead of letting redis-py build a ``bytes`` object and copying it out.
This benchmark is the measurement behind that choice, and behind the tier's default part size
(``max_value_size``). It starts its own ``redis-server`` processes (:mod:`kvx.testing.redis_server`: one
standalone server listening on loopback TCP and on a unix socket; a 3-node cluster for the lookups) and
stops them at the end. Every method moves the same chunk: a bf16 KV chunk (8 layers x K/V x tokens x 8
heads x 128, 32 KiB per token) of 1, 4 or 16 MiB, encoded by :mod:`kvx.store.codec` (a ~250-byte
safetensors header + the payload; bytes counted = the payload).

GET (into a preallocated destination: a slot of a :class:`kvx.store.CPUPool`), interleaved per repeat::

  redis-py GET + verify (baseline)   r.get(k), then codec.decode_into: decode + check the header, copy the
                                     payload into the slot, CRC32C over it (the checks kvx does)
  kvx get_into                       RedisTier.get_into(key, slot): the same checks
  redis-py GET + copy                r.get(k) + copy of the payload into the slot, no checks
  redis-py GET only                  r.get(k): bytes built, nothing copied or checked
  socket GET into slot (roof)        one plain socket: GET, the value received (recv_into) into a header
                                     buffer and the slot, nothing parsed beyond the length, nothing checked

PUT (from a slot; every put a new key, deleted untimed after it)::

  redis-py SET + encode (baseline)   codec.encode (header + CRC32C), b"".join(header, payload),
                                     r.set(k, value, nx=True)
  kvx put                            RedisTier.put(key, slot): the same encoding
  redis-py SET only                  r.set(k, value, nx=True) of a value encoded beforehand
  socket SET (roof)                  one plain socket: SET NX, the header (built beforehand) and the slot's
                                     memory sent with sendall, no CRC

The destinations (GET) and sources (PUT) rotate over ``--rotate-mib`` of slots and keys (default 64 MiB,
twice the L3 of the machine this was written on), one step per call (every method's call its own chunk,
also within a repeat), so no method reads a cache-warm chunk. Each repeat runs every method once, in an
order shuffled every repeat (seeded): drift of the machine hits every method alike, and so does what a
call leaves behind for the next one. That is measurable: a kvx put right after a redis-py put took
0.24-0.28 ms longer than one right after another kvx put. A rotated order (used before) put each method
after the same one in 3 repeats of 4 (kvx after the baseline).

The redis-py variants (GET + copy, GET only, SET only) stay in the same interleave as the baseline on
purpose, so that the baseline is timed where it runs fastest: redis-py's time depends on how glibc's
malloc reuses its 4 MiB buffers, and the variants' buffers keep that memory in use. Measured (a variant
of this script, 4 MiB over TCP): interleaved with kvx and the roof alone, the PUT baseline ran 11-12 ms (a
SET of a freshly built value: ~4000 page faults a call) against 2.2-2.4 ms with the variants; the GET
baseline ran 6-7% slower without them. Pinning malloc's thresholds (mallopt) is no cure: it cost the GET
baseline ~20% (probably hiredis's growing buffer, copied instead of remapped).

The median of ``--repeats`` after ``--warmup`` is a run's value, and the whole measurement is done ``--runs``
times. ``x baseline`` = the baseline's median time over the method's (> 1: faster than redis-py); ``% roof``
= the roof's over the method's (what is left to win at all).

Back to back: the same methods, chunks and runs once more, each method's calls in blocks in a row
(:func:`time_back_to_back`; the first call of a block untimed), as a connector loads or saves a prefix
chunk after chunk. Both designs are reported and judged: the shuffled one puts another method before
every call, and what a call follows matters here. A kvx GET ends as its last byte lands, so back to back
the server never idles; every redis-py GET leaves it idle for its last ~millisecond of client work; and an
idle server answers later (a PING: ~80 us right after work, ~130 us after 3 ms idle; measured in the same
run, :func:`server_wake`).

Part-size sweep: 4 and 16 MiB chunks through ``RedisTier`` opened with ``max_value_size`` = 512 KiB .. 8 MiB
(GET and PUT as above, interleaved), to back the tier's default. Send-buffer sweep: 4 MiB kvx puts through
data connections opened with SO_SNDBUF = the kernel's default .. 4 MiB, to back ``RedisTier.send_buffer``.
Lookups: ``contains_many`` of a 256-chunk prefix (``lookup_wait_ms`` 1000, so it answers) against a
redis-py pipeline of 256 ``EXISTS``, every repeat on keys not asked for before (a tier that remembers
answers is timed asking the server), on the standalone server and on a 3-node cluster
(``RedisClusterServers``). Also measured in the same run, for the "where the time goes" note: memcpy and
CRC32C of a 4 MiB chunk.

    python benchmarks/bench_redis.py [--quick] [--out DIR] [--runs 5] [--repeats N] [--sizes 1,4,16]

Writes ``redis_cpu.md`` and ``redis_cpu.csv`` into ``--out`` (default benchmarks/results). ``--quick``:
1 MiB chunks, a 2 MiB sweep, 1 run of a few repeats (a smoke run, ``tests/bench/test_bench_redis.py``, ~10 s).
Under pytest-benchmark: ``pytest benchmarks/bench_redis.py --benchmark-only`` (the ``test_*`` functions at
the end: kvx and redis-py at 4 MiB, and the lookup).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvx.store import CPUPool, codec
from kvx.store.redis import _SNDBUF_UNIX, RedisTierConfig, _chunk_key
from kvx.testing.bench import cpu_name

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # the benchmarks' shared modules
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from redis_common import FINGERPRINT, chunk_shape, fmt6, new_key, open_tier, pct, server_version, verdict  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB = 1 << 10, 1 << 20

GET_METHODS = (
    "redis-py GET + verify (baseline)",
    "kvx get_into",
    "redis-py GET + copy",
    "redis-py GET only",
    "socket GET into slot (roof)",
)
PUT_METHODS = ("redis-py SET + encode (baseline)", "kvx put", "redis-py SET only", "socket SET (roof)")
GET_BASE, GET_KVX, GET_ROOF = GET_METHODS[0], GET_METHODS[1], GET_METHODS[-1]
PUT_BASE, PUT_KVX, PUT_ROOF = PUT_METHODS[0], PUT_METHODS[1], PUT_METHODS[-1]
LOOKUP_METHODS = ("redis-py pipelined EXISTS (baseline)", "kvx contains_many")
LOOKUP_BASE, LOOKUP_KVX = LOOKUP_METHODS

PART_SIZES = (512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB)
PIECES = (64 * KiB, 256 * KiB, 1 * MiB, None)  # GET bytes received per checksum step (None: the whole value)
SEND_BUFFERS = (None, 128 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)  # PUT: SO_SNDBUF asked for (None: the kernel's)
ORDER_SEED = 0  # time_interleaved's / time_back_to_back's shuffles
B2B_CALLS = 5  # timed calls per back-to-back block
WAKE_GAPS_MS = (0.0, 1.0, 3.0)  # server idle before a PING (server_wake)
LOOKUP_KEYS = 256
LOOKUP_WAIT_MS = 1000

# targets (4 MiB values): stated next to the numbers, judged, never asserted
TARGET_MIB = 4
GET_TARGET_GBS = 2.0
PUT_TARGET_GBS = 1.2
X_TARGET = 1.5
LOOKUP_TARGET_MS = 2.0

CSV_FIELDS = [
    "section",
    "transport",
    "deployment",
    "chunk_bytes",
    "part_bytes",
    "method",
    "baseline",
    "run",
    "repeats",
    "median_ms",
    "p90_ms",
    "p99_ms",
    "mean_ms",
    "GB/s",
    "baseline_median_ms",
    "x_baseline",
    "roof_median_ms",
    "pct_roof",
]
# sections with a roof measured in the same case and run (``-b2b``: the same methods back to back)
ROOF_OF = {"get": GET_ROOF, "put": PUT_ROOF, "get-b2b": GET_ROOF, "put-b2b": PUT_ROOF}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def l3_size() -> str:
    """The last-level cache of CPU 0, as sysfs says (e.g. ``32 MiB``)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        _, size = max(
            (int(_read(f"{base}/{d}/level")), _read(f"{base}/{d}/size"))
            for d in os.listdir(base)
            if d.startswith("index")
        )
        return f"{int(size[:-1]) // 1024} MiB" if size.endswith("K") and int(size[:-1]) % 1024 == 0 else size
    except (OSError, ValueError):
        return "unknown"


def wmem_max() -> int | None:
    """net.core.wmem_max: the cap on a socket's SO_SNDBUF (None: not Linux)."""
    try:
        return int(_read("/proc/sys/net/core/wmem_max"))
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------ servers and clients
def default_part() -> int | None:
    f = RedisTierConfig.model_fields.get("max_value_size")
    return None if f is None or f.default is None else int(f.default)


def redis_py(url: str):
    """A redis-py client (hiredis parses the replies when it is installed, as it is here)."""
    import redis

    return redis.Redis.from_url(url)


# ------------------------------------------------------------------------------------------ the chunk
def make_pool(nbytes: int, slots: int, g: torch.Generator) -> CPUPool:
    """``slots`` CPU-pool slots of one chunk each, every slot random data (the PUT sources; GET destinations)."""
    pool = CPUPool(slots, chunk_shape(nbytes), torch.bfloat16)
    for i in range(slots):
        pool.data[i].copy_(torch.randn(chunk_shape(nbytes), generator=g).to(torch.bfloat16))
    return pool


def n_rotate(nbytes: int, rotate_bytes: int) -> int:
    return max(2, math.ceil(rotate_bytes / nbytes))


# ------------------------------------------------------------------------------------------ timing
def time_interleaved(
    fns: dict[str, Callable[[int], None]], repeats: int, warmup: int, after: Callable[[str, int], None] | None = None
) -> dict[str, list[float]]:
    """Milliseconds of every call of every method. Each repeat runs every method once, in an order shuffled
    by a seeded generator (the same sequence of orders in every run), so each method follows each other
    one about equally often. Every call gets its own index ``i`` (``fn(i)``; the calls of a repeat take
    consecutive ones), so a method that picks its chunk by ``i`` never touches the one the call before it
    just read or wrote: with chunks rotating over more than the L3, every call finds its chunk cold,
    whatever its place in the order. ``after(method, i)`` runs untimed after each call (e.g. a delete)."""
    rng = random.Random(ORDER_SEED)
    return _timed_calls(
        fns, [(m, r >= 0) for r in range(-warmup, repeats) for m in rng.sample(list(fns), len(fns))], after
    )


def _timed_calls(
    fns: dict[str, Callable[[int], None]], schedule: list[tuple[str, bool]], after: Callable[[str, int], None] | None
) -> dict[str, list[float]]:
    """Call ``fns[method](i)`` for each (method, timed) of ``schedule`` in order, ``i`` = its place; the
    milliseconds of the timed calls per method."""
    times: dict[str, list[float]] = {m: [] for m in fns}
    for i, (m, timed) in enumerate(schedule):
        t0 = time.perf_counter()
        fns[m](i)
        dt = time.perf_counter() - t0
        if after is not None:
            after(m, i)
        if timed:
            times[m].append(dt * 1e3)
    return times


def time_back_to_back(
    fns: dict[str, Callable[[int], None]], blocks: int, calls: int, after: Callable[[str, int], None] | None = None
) -> dict[str, list[float]]:
    """Milliseconds of every timed call, each method's calls in a row: ``blocks`` blocks per method, in an
    order shuffled by a seeded generator (blocks of the methods interleaved, so drift of the machine hits
    each alike), each block one untimed call (it meets what the method before left) then ``calls`` timed
    ones, each right after the method's own previous call: how a connector loads a prefix, chunk after
    chunk. Indices and ``after`` as in :func:`time_interleaved`."""
    rng = random.Random(ORDER_SEED)
    order = [m for _ in range(blocks) for m in rng.sample(list(fns), len(fns))]
    return _timed_calls(fns, [(m, c > 0) for m in order for c in range(calls + 1)], after)


def server_wake(url: str, pings: int = 1200) -> dict[float, float]:
    """Median microseconds of a PING after the server idled ``gap`` ms (the client spinning meanwhile):
    what an idle server costs the next request on this machine."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = random.Random(ORDER_SEED)
    rtt: dict[float, list[float]] = {g: [] for g in WAKE_GAPS_MS}
    try:
        for _ in range(pings):
            gap = rng.choice(WAKE_GAPS_MS)
            end = time.perf_counter() + gap / 1e3
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            got = b""
            while not got.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    raise ConnectionError("redis closed the connection")
                got += chunk
            rtt[gap].append((time.perf_counter() - t0) * 1e6)
            if got != b"+PONG\r\n":
                raise RuntimeError(f"PING answered {got!r}")
    finally:
        sock.close()
    return {g: statistics.median(v) for g, v in rtt.items() if v}


@dataclass
class Result:
    """One method of one case in one run."""

    section: str  # get, put, sweep-get, sweep-put, pieces-get, sndbuf-put, lookup
    transport: str  # tcp, unix
    deployment: str  # standalone, cluster
    chunk_bytes: int  # payload bytes per op (lookup: keys asked)
    part_bytes: int | None  # the tier's max_value_size (None: its default / not a kvx tier); pieces: the step;
    # sndbuf: the SO_SNDBUF asked for
    method: str
    baseline: str | None  # the method this one is compared with in the same case and run
    run: int
    times: list[float] = field(repr=False)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def gbs(self) -> float:
        return self.chunk_bytes / (self.median * 1e-3) / 1e9

    def case(self) -> tuple:
        """What a method is compared within (the sweep's part sizes are its methods)."""
        return (self.section, self.transport, self.deployment, self.chunk_bytes)


def _attach(results: list[Result]) -> dict[tuple, Result]:
    """Index results by (case, method, run)."""
    return {(r.case(), r.method, r.run): r for r in results}


# ------------------------------------------------------------------------------------------ GET and PUT
class Values:
    """The chunks GET reads, stored once per size: ``n`` under kvx keys (through the tier) and ``n`` under
    redis-py keys (``r.set`` of the codec's encoding), so every method reads a value written its own way."""

    def __init__(self, tier, r, pool: CPUPool):
        self.pool = pool
        self.n = pool.num_slots
        self.nbytes = pool.data[0].numel() * pool.data.element_size()
        self.kvx_keys = [new_key() for _ in range(self.n)]
        self.py_keys = [new_key() for _ in range(self.n)]
        self.tier, self.r = tier, r
        for i in range(self.n):
            if not tier.put(self.kvx_keys[i], pool.slot(i)):
                raise RuntimeError(f"kvx put of a new key {self.kvx_keys[i]} answered 'already present'")
            h, p = codec.encode(pool.slot(i), self.py_keys[i], FINGERPRINT)
            r.set(self.py_keys[i], b"".join((h, p)))
        self.header_bytes = len(h)

    def close(self) -> None:
        for k in self.kvx_keys:
            self.tier.delete(k)
        self.r.delete(*self.py_keys)


class RawSocket:
    """The roof: one plain socket speaking just enough RESP for one GET or SET of a known value, the bytes
    received into / sent from the slot's memory (``recv_into`` / ``sendall`` of memoryviews), nothing parsed
    beyond the length line, nothing checked. The socket options kvx's data connections use: TCP_NODELAY
    (as redis-py), and over a unix socket kvx's send buffer (``RedisTier.send_buffer``; TCP: the kernel's)."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        if u.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF_UNIX)
            self.sock.connect(u.path)
        else:
            self.sock = socket.create_connection((u.hostname, u.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.small = bytearray(64 * KiB)

    def _recv_line(self) -> tuple[bytes, memoryview]:
        """The reply's first line and the bytes received after it."""
        got = 0
        while True:
            n = self.sock.recv_into(memoryview(self.small)[got:])
            if n == 0:
                raise ConnectionError("redis closed the connection")
            got += n
            i = self.small.find(b"\r\n", 0, got)
            if i >= 0:
                return bytes(self.small[:i]), memoryview(self.small)[i + 2 : got]

    def get_into(self, key: str, views: list[memoryview]) -> None:
        """GET ``key`` whose value is exactly the concatenation of ``views`` (header buffer, slot)."""
        k = key.encode()
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k))
        line, rest = self._recv_line()
        if line != b"$%d" % sum(len(v) for v in views):
            raise RuntimeError(f"roof GET {key}: unexpected reply {line[:40]!r}")
        for v in [*views, memoryview(bytearray(2))]:  # the value, then its CRLF
            k = min(len(rest), len(v))
            v[:k] = rest[:k]
            rest = rest[k:]
            while k < len(v):
                n = self.sock.recv_into(v[k:])
                if n == 0:
                    raise ConnectionError("redis closed the connection")
                k += n

    def set_nx(self, key: str, bufs: list) -> None:
        k = key.encode()
        total = sum(memoryview(b).nbytes for b in bufs)
        self.sock.sendall(b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, total))
        for b in bufs:
            self.sock.sendall(b)
        self.sock.sendall(b"\r\n$2\r\nNX\r\n")
        line, _ = self._recv_line()
        if line != b"+OK":
            raise RuntimeError(f"roof SET {key}: unexpected reply {line[:40]!r}")

    def close(self) -> None:
        self.sock.close()


def get_fns(tier, r, vals: Values, raw: RawSocket) -> dict[str, Callable[[int], None]]:
    n, nb, hsize = vals.n, vals.nbytes, vals.header_bytes
    views = [codec.byte_view(vals.pool.slot(i)) for i in range(n)]
    head = memoryview(bytearray(hsize))

    def base(i):
        k = vals.py_keys[i % n]
        codec.decode_into(r.get(k), k, FINGERPRINT, vals.pool.slot(i % n))

    def kvx(i):
        tier.get_into(vals.kvx_keys[i % n], vals.pool.slot(i % n))

    def copy(i):
        views[i % n][:] = np.frombuffer(r.get(vals.py_keys[i % n]), np.uint8, count=nb, offset=hsize)

    def only(i):
        r.get(vals.py_keys[i % n])

    def roof(i):
        raw.get_into(vals.py_keys[i % n], [head, memoryview(views[i % n])])

    return dict(zip(GET_METHODS, (base, kvx, copy, only, roof)))


def put_fns(tier, r, pool: CPUPool, written: dict[str, list[str]], raw: RawSocket):
    """PUT methods writing slot ``i % n`` under a new key (recorded in ``written`` for the untimed delete)."""
    n = pool.num_slots
    encoded = [b"".join(codec.encode(pool.slot(i), new_key(), FINGERPRINT)) for i in range(n)]

    def new(m):
        k = new_key()
        written[m].append(k)
        return k

    def base(i):
        k = new(PUT_BASE)
        h, p = codec.encode(pool.slot(i % n), k, FINGERPRINT)
        if not r.set(k, b"".join((h, p)), nx=True):
            raise RuntimeError(f"redis-py SET NX of a new key {k} wrote nothing")

    def kvx(i):
        k = new(PUT_KVX)
        if not tier.put(k, pool.slot(i % n)):
            raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

    def only(i):
        k = new(PUT_METHODS[2])
        if not r.set(k, encoded[i % n], nx=True):
            raise RuntimeError(f"redis-py SET NX of a new key {k} wrote nothing")

    def roof(i):
        # the header the value needs, built untimed: the roof is the transfer alone
        raw.set_nx(new(PUT_ROOF), [headers[i % n], codec.byte_view(pool.slot(i % n))])

    headers = [e[: len(e) - pool.data[0].numel() * pool.data.element_size()] for e in encoded]
    return dict(zip(PUT_METHODS, (base, kvx, only, roof)))


def deleter(tier, r, written: dict[str, list[str]]) -> Callable[[str, int], None]:
    def after(m: str, i: int) -> None:
        k = written[m].pop()
        if m == PUT_KVX:
            tier.delete(k)
        else:
            r.delete(k)

    return after


def check_get(tier, r, vals: Values, raw: RawSocket) -> None:
    """The timed reads happened: each GET method's destination holds the chunk, bit-exact (not timed)."""
    src = vals.pool.data[0].clone()
    fns = get_fns(tier, r, vals, raw)
    for m in (GET_BASE, GET_KVX, GET_METHODS[2], GET_ROOF):
        vals.pool.data[0].fill_(float("nan"))  # poisoned first
        fns[m](0)
        if not torch.equal(vals.pool.data[0].view(torch.uint8), src.view(torch.uint8)):
            raise AssertionError(f"{m}: the slot does not hold the chunk after the read")
    vals.pool.data[0].copy_(src)


def check_put(tier, r, pool: CPUPool) -> None:
    """A chunk kvx put reads back through the tier, and one redis-py SET where the tier keeps chunks reads
    back through the tier too: both write the same encoding (not timed)."""
    slot = pool.slot(0)
    out = torch.empty_like(slot)
    k = new_key()
    tier.put(k, slot)
    try:
        tier.get_into(k, out)
        if not torch.equal(out.view(torch.uint8), slot.view(torch.uint8)):
            raise AssertionError("kvx put then get_into: the chunk differs")
    finally:
        tier.delete(k)
    k = new_key()  # a redis-py SET where the tier keeps chunk k (one value)
    r.set(_chunk_key(k), b"".join(codec.encode(slot, k, FINGERPRINT)))
    try:
        out.fill_(float("nan"))
        tier.get_into(k, out)
        if not torch.equal(out.view(torch.uint8), slot.view(torch.uint8)):
            raise AssertionError("redis-py SET then kvx get_into: the chunk differs")
    finally:
        r.delete(_chunk_key(k))


def bench_get_put(
    urls: dict[str, str],
    sizes: list[int],
    runs: int,
    repeats: dict[int, int],
    warmup: int,
    rotate_bytes: int,
    g: torch.Generator,
    log,
) -> tuple[list[Result], dict]:
    results: list[Result] = []
    info = {}
    tiers = {t: open_tier(u) for t, u in urls.items()}
    clients = {t: redis_py(u) for t, u in urls.items()}
    raws = {t: RawSocket(u) for t, u in urls.items()}
    any_t = next(iter(urls))
    try:
        pools = {mib: make_pool(mib * MiB, n_rotate(mib * MiB, rotate_bytes), g) for mib in sizes}
        stored = {mib: Values(tiers[any_t], clients[any_t], pools[mib]) for mib in sizes}
        info["header_bytes"] = {mib: v.header_bytes for mib, v in stored.items()}
        info["rotate"] = {mib: p.num_slots for mib, p in pools.items()}
        try:
            for t in urls:
                for mib in sizes:
                    check_get(tiers[t], clients[t], stored[mib], raws[t])
                    check_put(tiers[t], clients[t], pools[mib])
            for run in range(1, runs + 1):
                for t in urls:
                    for mib in sizes:
                        nb = mib * MiB
                        blocks = max(1, math.ceil(repeats[mib] / B2B_CALLS))
                        # shuffled, then the same methods with each one's calls in a row
                        timings = (
                            ("", lambda fns, after: time_interleaved(fns, repeats[mib], warmup, after)),
                            ("-b2b", lambda fns, after: time_back_to_back(fns, blocks, B2B_CALLS, after)),
                        )
                        for sfx, timing in timings:
                            times = timing(get_fns(tiers[t], clients[t], stored[mib], raws[t]), None)
                            written = {m: [] for m in PUT_METHODS}
                            times |= timing(
                                put_fns(tiers[t], clients[t], pools[mib], written, raws[t]),
                                deleter(tiers[t], clients[t], written),
                            )
                            for sec, methods, base in (("get", GET_METHODS, GET_BASE), ("put", PUT_METHODS, PUT_BASE)):
                                for m in methods:
                                    results.append(
                                        Result(
                                            sec + sfx,
                                            t,
                                            "standalone",
                                            nb,
                                            None,
                                            m,
                                            base if m != base else None,
                                            run,
                                            times[m],
                                        )
                                    )
                            _log_case(log, run, runs, results[-len(GET_METHODS) - len(PUT_METHODS) :])
        finally:
            for v in stored.values():
                v.close()
    finally:
        for tier in tiers.values():
            tier.close()
        for c in [*clients.values(), *raws.values()]:
            c.close()
    return results, info


def _log_case(log, run, runs, rs: list[Result]) -> None:
    base = {r.section: r for r in rs if r.baseline is None}
    for r in rs:
        log(
            f"run {run}/{runs} {r.transport:4s} {r.chunk_bytes // MiB:2d} MiB {r.section:7s} {r.method:33s} "
            f"median {r.median:7.3f} ms {r.gbs:6.2f} GB/s {base[r.section].median / r.median:5.2f}x baseline"
        )


# ------------------------------------------------------------------------------------------ part-size sweep
def bench_sweep(
    urls: dict[str, str],
    mib: int,
    parts: list[int],
    runs: int,
    repeats: int,
    warmup: int,
    rotate_bytes: int,
    g: torch.Generator,
    log,
    info: dict,
) -> list[Result]:
    """GET and PUT of one chunk size through tiers opened with each ``max_value_size``, interleaved."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    info.setdefault("sweep_header_bytes", {})[nb] = len(codec.encode_header(pool.slot(0), new_key(), FINGERPRINT))
    results = []
    dflt = default_part()
    base_name = f"part {_fmt(dflt)}" if dflt in parts else None
    for t, url in urls.items():
        tiers = {p: open_tier(url, p) for p in parts}
        try:
            keys = {p: [new_key() for _ in range(pool.num_slots)] for p in parts}
            for p in parts:
                for i, k in enumerate(keys[p]):
                    tiers[p].put(k, pool.slot(i))
            try:
                for run in range(1, runs + 1):
                    gets = {
                        f"part {_fmt(p)}": (
                            lambda i, p=p: tiers[p].get_into(keys[p][i % pool.num_slots], pool.slot(i % pool.num_slots))
                        )
                        for p in parts
                    }
                    times = time_interleaved(gets, repeats, warmup)
                    part_of = {f"part {_fmt(p)}": p for p in parts}
                    written: dict[str, list[str]] = {m: [] for m in part_of}

                    def put(i, p):
                        k = new_key()
                        written[f"part {_fmt(p)}"].append(k)
                        if not tiers[p].put(k, pool.slot(i % pool.num_slots)):
                            raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

                    def after(m, i):
                        tiers[part_of[m]].delete(written[m].pop())

                    puts = {f"part {_fmt(p)}": (lambda i, p=p: put(i, p)) for p in parts}
                    ptimes = time_interleaved(puts, repeats, warmup, after)
                    for p in parts:
                        m = f"part {_fmt(p)}"
                        b = base_name if m != base_name else None
                        results.append(Result("sweep-get", t, "standalone", nb, p, m, b, run, times[m]))
                        results.append(Result("sweep-put", t, "standalone", nb, p, m, b, run, ptimes[m]))
                        log(
                            f"run {run}/{runs} {t:4s} {mib:2d} MiB max_value_size {_fmt(p):>7s}: GET "
                            f"{statistics.median(times[m]):7.3f} ms {results[-2].gbs:5.2f} GB/s, PUT "
                            f"{statistics.median(ptimes[m]):7.3f} ms {results[-1].gbs:5.2f} GB/s"
                        )
            finally:
                for p in parts:
                    for k in keys[p]:
                        tiers[p].delete(k)
        finally:
            for tier in tiers.values():
                tier.close()
    return results


# ------------------------------------------------------------------------------------------ GET piece sweep
def knob_runs(
    section: str,
    transport: str,
    nb: int,
    op: str,
    values,
    name: Callable,
    dflt: str,
    call: Callable[[int, object], None],
    runs: int,
    repeats: int,
    warmup: int,
    log,
    after: Callable[[str, int], None] | None = None,
) -> list[Result]:
    """``runs`` interleaved measurements of ``call(i, value)`` for each of a knob's ``values`` (method
    ``name(value)``; compared with ``dflt``, the tier's own choice)."""
    out = []
    for run in range(1, runs + 1):
        times = time_interleaved({name(v): (lambda i, v=v: call(i, v)) for v in values}, repeats, warmup, after)
        for v in values:
            m = name(v)
            out.append(Result(section, transport, "standalone", nb, v, m, dflt if m != dflt else None, run, times[m]))
            log(
                f"run {run}/{runs} {transport:4s} {nb // MiB:2d} MiB {op} {m:16s}: "
                f"{statistics.median(times[m]):7.3f} ms"
            )
    return out


def _piece_name(p: int | None) -> str:
    return "whole value" if p is None else f"piece {_fmt(p)}"


def bench_pieces(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx GET with each cap on the bytes one receive takes (the tier's ``piece``), interleaved."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    results = []
    for t, url in urls.items():
        tier = open_tier(url)
        dflt = _piece_name(tier.piece)  # the tier's own choice for this transport
        keys = [new_key() for _ in range(pool.num_slots)]
        try:
            for i, k in enumerate(keys):
                tier.put(k, pool.slot(i))

            def get(i, p):
                tier.piece = p
                tier.get_into(keys[i % pool.num_slots], pool.slot(i % pool.num_slots))

            results += knob_runs("pieces-get", t, nb, "GET", PIECES, _piece_name, dflt, get, runs, repeats, warmup, log)
        finally:
            for k in keys:
                tier.delete(k)
            tier.close()
    return results


def _sndbuf_name(b: int | None) -> str:
    return "kernel default" if b is None else f"SO_SNDBUF {_fmt(b)}"


def bench_send_buffers(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx PUT through data connections opened with each SO_SNDBUF (the tier's ``send_buffer``), interleaved:
    one tier per buffer size, its pooled connections reopened with that size."""
    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    results = []
    for t, url in urls.items():
        tiers = {}
        try:
            for b in SEND_BUFFERS:
                tier = tiers[b] = open_tier(url)
                dflt = _sndbuf_name(tier.send_buffer)  # the tier's own choice for this transport
                tier.send_buffer = b
                tier._node.clear()  # the probe opened one with the tier's own
            written: dict[str, list[str]] = {_sndbuf_name(b): [] for b in SEND_BUFFERS}
            buffer_of = {_sndbuf_name(b): b for b in SEND_BUFFERS}

            def put(i, b):
                k = new_key()
                written[_sndbuf_name(b)].append(k)
                if not tiers[b].put(k, pool.slot(i % pool.num_slots)):
                    raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

            def after(m, i):
                tiers[buffer_of[m]].delete(written[m].pop())

            results += knob_runs(
                "sndbuf-put", t, nb, "PUT", SEND_BUFFERS, _sndbuf_name, dflt, put, runs, repeats, warmup, log, after
            )
        finally:
            for tier in tiers.values():
                tier.close()
    return results


# ------------------------------------------------------------------------------------------ sealed chunks
SEALED_METHODS = ("kvx in the clear (baseline)", "kvx sealed (AES-256-GCM)")
SEALED_TARGET = 0.70  # sealed GET throughput / in the clear, 4 MiB: stated, judged, never asserted


def bench_sealed(
    urls: dict[str, str], mib: int, runs: int, repeats: int, warmup: int, rotate_bytes: int, g: torch.Generator, log
) -> list[Result]:
    """kvx GET and PUT through a tier in the clear and a sealed one (``"encryption"``: AES-256-GCM, a key file
    written here), interleaved in the same run, same slots, same server."""
    import tempfile

    nb = mib * MiB
    pool = make_pool(nb, n_rotate(nb, rotate_bytes), g)
    clear, sealed = SEALED_METHODS
    results = []
    with tempfile.TemporaryDirectory(prefix="kvx-bench-seal-") as d:
        key_file = os.path.join(d, "key")
        with open(key_file, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        for t, url in urls.items():
            tiers = {clear: open_tier(url), sealed: open_tier(url, encryption={"key_file": key_file})}
            keys = {m: [new_key() for _ in range(pool.num_slots)] for m in tiers}
            try:
                for m, tier in tiers.items():
                    for i, k in enumerate(keys[m]):
                        if not tier.put(k, pool.slot(i)):
                            raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")
                # what a sealed GET returns is the chunk, bit for bit
                check = torch.empty_like(pool.slot(0))
                tiers[sealed].get_into(keys[sealed][0], check)
                if not torch.equal(check.view(torch.uint8), pool.slot(0).view(torch.uint8)):
                    raise RuntimeError("sealed GET returned other bytes than were put")
                written: dict[str, list[str]] = {m: [] for m in tiers}

                def get(i, m):
                    tiers[m].get_into(keys[m][i % pool.num_slots], pool.slot(i % pool.num_slots))

                def put(i, m):
                    k = new_key()
                    written[m].append(k)
                    if not tiers[m].put(k, pool.slot(i % pool.num_slots)):
                        raise RuntimeError(f"kvx put of a new key {k} answered 'already present'")

                def after(m, i):
                    tiers[m].delete(written[m].pop())

                for run in range(1, runs + 1):
                    gt = time_interleaved({m: (lambda i, m=m: get(i, m)) for m in tiers}, repeats, warmup)
                    pt = time_interleaved({m: (lambda i, m=m: put(i, m)) for m in tiers}, repeats, warmup, after)
                    for m in tiers:
                        b = clear if m != clear else None
                        results.append(Result("sealed-get", t, "standalone", nb, None, m, b, run, gt[m]))
                        results.append(Result("sealed-put", t, "standalone", nb, None, m, b, run, pt[m]))
                    gs, ps = (
                        statistics.median(gt[clear]) / statistics.median(gt[sealed]),
                        statistics.median(pt[clear]) / statistics.median(pt[sealed]),
                    )
                    log(
                        f"run {run}/{runs} {t:4s} {mib:2d} MiB sealed/clear throughput: GET {gs:.2f} "
                        f"({statistics.median(gt[sealed]):.3f} vs {statistics.median(gt[clear]):.3f} ms), PUT "
                        f"{ps:.2f} ({statistics.median(pt[sealed]):.3f} vs {statistics.median(pt[clear]):.3f} ms)"
                    )
            finally:
                for m, tier in tiers.items():
                    for k in keys[m]:
                        tier.delete(k)
                    tier.close()
    return results


def write_sealed_md(path: str, results: list[Result], info: dict, cmd: str, quick: bool) -> list[tuple]:
    """``redis_sealed_cpu.md``: sealed against in-the-clear GET / PUT; returns (transport, op, ratio, met)."""
    index = _attach(results)
    runs = max(r.run for r in results)
    clear, sealed = SEALED_METHODS
    lines = [
        "# SMOKE RUN, not a measurement\n" if quick else "",
        "# Redis tier: sealed chunks (AES-256-GCM) against chunks in the clear\n",
        f"Reproduce: `{cmd}`\n",
        f"Machine: {cpu_name()}; redis-server {info.get('server_version', '?')}; "
        f"{info.get('date', '')}; load average {info.get('load', 0):.2f} at the start.\n",
        'Two `RedisTier`s on the same server, one opened with `"encryption": {"key_file": ...}`, the other '
        "without; GET into and PUT from the same CPU-pool slots (rotating over `--rotate-mib`), the two methods in a "
        "shuffled order every repeat (`time_interleaved`), in the same run. Sealed GET: the header checked, the "
        "ciphertext received into a 256 KiB staging buffer and decrypted from there into the slot as it lands, "
        "the GCM tag checked at the end (instead of the CRC32C). Sealed PUT: AES-GCM into a new buffer (instead "
        "of the CRC32C pass), then the same SET. Throughput ratio = the in-the-clear median time / the sealed "
        "one (1.00: free), the median over the runs, then [every run].\n",
        f"Target: sealed GET throughput >= {SEALED_TARGET:.0%} of in the clear at {TARGET_MIB} MiB"
        + (" (not judged in a smoke run)." if quick else "."),
        "",
        "| transport | chunk | op | clear ms | sealed ms | clear GB/s | sealed GB/s | sealed / clear throughput |"
        + ("" if quick else " target |"),
        "|---|---|---|---|---|---|---|---|" + ("" if quick else "---|"),
    ]
    judged = []
    cases = sorted({(r.transport, r.chunk_bytes, r.section) for r in results if r.section.startswith("sealed-")})
    for t, nb, sec in cases:
        case = (sec, t, "standalone", nb)
        rs = ratios(index, case, sealed, clear, runs)
        if not rs:
            continue
        op = "GET" if sec.endswith("get") else "PUT"
        tc, ts = per_run(index, case, clear, runs), per_run(index, case, sealed, runs)
        row = (
            f"| {t} | {nb // MiB} MiB | {op} | {cell(tc, '.3f')} | {cell(ts, '.3f')} | "
            f"{nb / statistics.median(tc) / 1e6:.2f} | {nb / statistics.median(ts) / 1e6:.2f} | {cell(rs)} |"
        )
        ok = statistics.median(rs) >= SEALED_TARGET
        if op == "GET" and nb == TARGET_MIB * MiB:
            judged.append((t, op, statistics.median(rs), ok))
            row += "" if quick else f" {verdict(ok)} |"
        elif not quick:
            row += " |"
        lines.append(row)
    if "cpu_costs" in info:
        c = info["cpu_costs"]
        lines += [
            "",
            f"Same run, one core, {TARGET_MIB} MiB in cache-cold memory: memcpy {c['memcpy']:.1f} GB/s, CRC32C "
            f"{c['crc32']:.1f} GB/s, AES-256-GCM encrypt {c.get('aes_gcm_encrypt', float('nan')):.1f} GB/s, "
            f"decrypt (staged) {c.get('aes_gcm_decrypt', float('nan')):.1f} GB/s.",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return judged


def n_values(payload: int, header: int, part: int) -> int:
    """Redis values the tier writes for a chunk: one if the payload fits in ``part`` (the header rides
    along), else ceil(payload / part) parts (the manifest under the chunk key not counted)."""
    return 1 if payload <= part else math.ceil(payload / part)


def _fmt(b: int | None) -> str:
    if b is None:
        return "default"
    return f"{b // MiB} MiB" if b % MiB == 0 else f"{b // KiB} KiB"


# ------------------------------------------------------------------------------------------ lookups
def bench_lookup(deployment: str, tier, r, repeats: int, warmup: int, log) -> list[Result]:
    """``contains_many`` of 256 stored keys vs a redis-py pipeline of 256 EXISTS; every repeat and method asks
    for keys nobody asked for before (so neither a cache in the tier nor one anywhere else answers)."""
    tiny = torch.zeros(8, 2, 1, 8, 4, dtype=torch.bfloat16)  # 1 KiB chunks: only the keys matter
    kvx_sets = [[new_key() for _ in range(LOOKUP_KEYS)] for _ in range(repeats + warmup)]
    py_sets = [[new_key() for _ in range(LOOKUP_KEYS)] for _ in range(repeats + warmup)]
    enc = b"".join(codec.encode(tiny, "0" * 32, FINGERPRINT))
    for ks in kvx_sets:
        for k in ks:
            tier.put(k, tiny)
    for ks in py_sets:
        pipe = r.pipeline(transaction=False)
        for k in ks:
            pipe.set(k, enc)
        pipe.execute()
    try:
        # a repeat's calls take consecutive indices: i // len(LOOKUP_METHODS) is the repeat
        def kvx(i):
            got = tier.contains_many(kvx_sets[i // len(LOOKUP_METHODS)])
            if got is None or not all(got):
                raise RuntimeError(
                    f"kvx contains_many of {LOOKUP_KEYS} stored keys answered "
                    f"{'None' if got is None else f'{sum(got)} present'} "
                    f"(lookup_wait_ms {LOOKUP_WAIT_MS})"
                )

        def base(i):
            pipe = r.pipeline(transaction=False)
            for k in py_sets[i // len(LOOKUP_METHODS)]:
                pipe.exists(k)
            got = pipe.execute()
            if sum(got) != LOOKUP_KEYS:
                raise RuntimeError(f"redis-py EXISTS of {LOOKUP_KEYS} stored keys: {sum(got)} present")

        times = time_interleaved({LOOKUP_BASE: base, LOOKUP_KVX: kvx}, repeats, warmup)
    finally:
        for ks in kvx_sets:
            for k in ks:
                tier.delete(k)
        for ks in py_sets:
            pipe = r.pipeline(transaction=False)
            for k in ks:
                pipe.delete(k)
            pipe.execute()
    out = [
        Result(
            "lookup", "tcp", deployment, LOOKUP_KEYS, None, m, LOOKUP_BASE if m != LOOKUP_BASE else None, 1, times[m]
        )
        for m in LOOKUP_METHODS
    ]
    for x in out:
        log(
            f"lookup {deployment:10s} {x.method:37s} p50 {x.median:7.3f} ms p90 {pct(x.times, 90):7.3f} ms "
            f"p99 {pct(x.times, 99):7.3f} ms"
        )
    return out


# ------------------------------------------------------------------------------------------ memory roofs
def cpu_costs(nbytes: int, repeats: int = 20) -> dict[str, float]:
    """GB/s of a memcpy (numpy copy into a preallocated array) and of CRC32C (the codec's checksum) over
    ``nbytes``, here."""
    n = n_rotate(nbytes, 64 * MiB)
    src = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8) for i in range(n)]
    dst = [np.ones(nbytes, np.uint8) for _ in range(n)]  # written now (np.zeros is calloc: untouched pages)
    t_copy, t_crc = [], []
    for i in range(repeats + n):  # the first n: warm-up, one pass over every array
        t0 = time.perf_counter()
        dst[i % n][:] = src[i % n]
        t1 = time.perf_counter()
        codec.crc32c_update(src[(i + 1) % n])
        t2 = time.perf_counter()
        if i >= n:
            t_copy.append(t1 - t0)
            t_crc.append(t2 - t1)
    out = {"memcpy": nbytes / statistics.median(t_copy) / 1e9, "crc32": nbytes / statistics.median(t_crc) / 1e9}
    out.update(aes_gcm_costs(src, dst, repeats))
    return out


def aes_gcm_costs(src: list, dst: list, repeats: int) -> dict[str, float]:
    """GB/s of the seal's AES-256-GCM (kvx.store.seal) over these arrays: encrypt into a new buffer (a PUT),
    and decrypt through the 256 KiB staging buffer into a destination (a GET; the staging copy stands for
    the socket's receive)."""
    from kvx.store.seal import Sealer

    sealer = Sealer([os.urandom(32)], FINGERPRINT)
    n, nbytes = len(src), src[0].nbytes
    chunks = [torch.from_numpy(a) for a in src]
    sealed = [sealer.seal(c, f"{i:032x}") for i, c in enumerate(chunks)]
    t_enc, t_dec = [], []
    for i in range(repeats + n):
        k = i % n
        t0 = time.perf_counter()
        sealer.seal(chunks[k], f"{k:032x}")
        t1 = time.perf_counter()
        h = codec.decode_header(sealed[k][0])
        op = sealer.opening(h, f"{k:032x}", torch.from_numpy(dst[k]), "bench")
        payload, pos = memoryview(sealed[k][1]), 0
        while pos < nbytes:
            buf = op.buffer()
            buf[:] = payload[pos : pos + len(buf)]
            op.advance(len(buf))
            pos += len(buf)
        op.finish()
        t2 = time.perf_counter()
        if i >= n:
            t_enc.append(t1 - t0)
            t_dec.append(t2 - t1)
    return {
        "aes_gcm_encrypt": nbytes / statistics.median(t_enc) / 1e9,
        "aes_gcm_decrypt": nbytes / statistics.median(t_dec) / 1e9,
    }


# ------------------------------------------------------------------------------------------ results
def per_run(index, case, method, runs, stat=lambda r: r.median) -> list[float]:
    return [stat(index[(case, method, run)]) for run in range(1, runs + 1) if (case, method, run) in index]


def ratios(index, case, method, base, runs) -> list[float]:
    return [b / a for a, b in zip(per_run(index, case, method, runs), per_run(index, case, base, runs))]


def cell(xs: list[float], fmt: str = ".2f") -> str:
    """The median over the runs, then [every run]."""
    if not xs:
        return ""
    return f"{statistics.median(xs):{fmt}}" + (f" [{' / '.join(f'{x:{fmt}}' for x in xs)}]" if len(xs) > 1 else "")


def write_csv(path: str, results: list[Result]) -> None:
    index = _attach(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            base = index.get((r.case(), r.baseline, r.run)) if r.baseline else None
            roof = index.get((r.case(), ROOF_OF[r.section], r.run)) if r.section in ROOF_OF else None
            is_bytes = r.section != "lookup"
            w.writerow(
                [
                    r.section,
                    r.transport,
                    r.deployment,
                    r.chunk_bytes,
                    "" if r.part_bytes is None else r.part_bytes,
                    r.method,
                    r.baseline or "",
                    r.run,
                    len(r.times),
                    fmt6(r.median),
                    fmt6(pct(r.times, 90)),
                    fmt6(pct(r.times, 99)),
                    fmt6(statistics.fmean(r.times)),
                    fmt6(r.chunk_bytes / (float(fmt6(r.median)) * 1e-3) / 1e9) if is_bytes else "",
                    fmt6(base.median) if base else "",
                    fmt6(float(fmt6(base.median)) / float(fmt6(r.median))) if base else "",
                    fmt6(roof.median) if roof else "",
                    fmt6(100 * float(fmt6(roof.median)) / float(fmt6(r.median))) if roof else "",
                ]
            )


def write_md(path: str, results: list[Result], info: dict, args, cmd: str, quick: bool) -> dict:
    """The markdown report; returns the judged targets (also for the caller's summary)."""
    index = _attach(results)
    runs = max(r.run for r in results)
    med = statistics.median
    gp = [r for r in results if r.section in ("get", "put")]
    transports = list(dict.fromkeys(r.transport for r in gp))
    sizes = sorted({r.chunk_bytes for r in gp})
    lines = (
        ["# SMOKE RUN, not a measurement (--quick): kvx Redis tier vs redis-py + hiredis", ""]
        if quick
        else ["# kvx Redis tier vs redis-py + hiredis", ""]
    )
    lines += [
        f"Machine: {cpu_name()}; kernel {platform.release()}; redis-server {info['server_version']}; "
        f"redis-py {info['redis_py']} with hiredis {info['hiredis']}; torch {torch.__version__}; "
        f"Python {platform.python_version()}. {info['date']}. {runs} run(s), {info['repeats_desc']} after "
        f"{args.warmup} warm-up, interleaved (the order shuffled every repeat); load average at start "
        f"{info['load']:.2f}, at the end {info.get('load_end', float('nan')):.2f} (other work on the machine "
        f"shows here); total {info['elapsed']:.0f} s.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "One local `redis-server` (started by the benchmark through `kvx.testing.redis_server`: no persistence, "
        "noeviction), the client on the same 2-core VM (the server takes one core). GB/s = payload bytes "
        "(the chunk; the ~"
        f"{max(info['header_bytes'].values()) if info.get('header_bytes') else 300}-byte codec header is "
        "not counted) / median time. GET: into a CPU-pool slot, verified (header, key, fingerprint, shape, "
        "CRC32C); PUT: encoded (header with CRC32C), every put a new key. `% roof` = the time of the roof "
        "(`socket GET into slot` / `socket SET`: one plain socket, the same value received into / sent "
        "from the slot's memory, nothing parsed or checked) over the method's, same run. `x baseline` = "
        "the baseline's median time / the method's in the same run (> 1: faster than redis-py + hiredis "
        "doing the same work). Each cell: the median over the runs, then [every run]; GB/s from the "
        f"median over the runs. Destinations and sources rotate over {args.rotate_mib} MiB of slots and keys "
        f"(L3: {l3_size()}), one step per call: every call finds its chunk cold.",
        "",
    ]

    # ---- targets
    tgt = {}
    lines += [
        "## Targets",
        "",
        f"{TARGET_MIB} MiB values; lookup = `contains_many` of {LOOKUP_KEYS} keys.",
        "",
        "| target | transport | measured | verdict |",
        "|---|---|---:|---|",
    ]
    tb = TARGET_MIB * MiB
    for t in transports:
        if tb not in sizes:
            continue
        for how, sfx in (("shuffled", ""), ("back to back", "-b2b")):
            g_case, p_case = ("get" + sfx, t, "standalone", tb), ("put" + sfx, t, "standalone", tb)
            if (g_case, GET_KVX, 1) not in index:
                continue
            g = med(per_run(index, g_case, GET_KVX, runs, lambda r: r.gbs))
            p = med(per_run(index, p_case, PUT_KVX, runs, lambda r: r.gbs))
            gx = med(ratios(index, g_case, GET_KVX, GET_BASE, runs))
            px = med(ratios(index, p_case, PUT_KVX, PUT_BASE, runs))
            for name, val, ok, unit in (
                (f"GET >= {GET_TARGET_GBS} GB/s into the slot", g, g >= GET_TARGET_GBS, "GB/s"),
                (f"PUT >= {PUT_TARGET_GBS} GB/s", p, p >= PUT_TARGET_GBS, "GB/s"),
                (f"GET >= {X_TARGET}x redis-py + hiredis", gx, gx >= X_TARGET, "x"),
                (f"PUT >= {X_TARGET}x redis-py + hiredis", px, px >= X_TARGET, "x"),
            ):
                name = f"{name}, {how}"
                tgt[(name, t)] = (val, ok)
                lines.append(f"| {name} | {t} | {val:.2f} {unit} | {'n/a (smoke run)' if quick else verdict(ok)} |")
    for r in results:
        if r.section == "lookup" and r.method == LOOKUP_KVX:
            ok = r.median <= LOOKUP_TARGET_MS
            tgt[(f"lookup <= {LOOKUP_TARGET_MS} ms p50", r.deployment)] = (r.median, ok)
            lines.append(
                f"| {LOOKUP_KEYS}-chunk lookup <= {LOOKUP_TARGET_MS:g} ms p50 | {r.transport} "
                f"({r.deployment}) | {r.median:.3f} ms | {'n/a (smoke run)' if quick else verdict(ok)} |"
            )

    # ---- get / put
    def gp_table(sfx: str) -> None:
        lines.extend(
            [
                "| transport | chunk | op | method | median ms | p90 ms | GB/s | % roof | x baseline |",
                "|---|---:|---|---|---:|---:|---:|---:|---|",
            ]
        )
        for t in transports:
            for nb in sizes:
                for sec, methods, base in (("get" + sfx, GET_METHODS, GET_BASE), ("put" + sfx, PUT_METHODS, PUT_BASE)):
                    case = (sec, t, "standalone", nb)
                    if (case, base, 1) not in index:
                        continue
                    for m in methods:
                        ms = med(per_run(index, case, m, runs))
                        p90 = med(per_run(index, case, m, runs, lambda r: pct(r.times, 90)))
                        x = cell(ratios(index, case, m, base, runs))
                        roof = med(ratios(index, case, m, ROOF_OF[sec], runs))
                        lines.append(
                            f"| {t} | {nb // MiB} MiB | {sec.split('-')[0].upper()} | {m} | {ms:.3f} | "
                            f"{p90:.3f} | {nb / (ms * 1e-3) / 1e9:.2f} | {100 * roof:.0f}% | "
                            f"{x}{'x' if x else ''} |"
                        )

    lines += ["", "## GET into a slot and PUT (shuffled: each call after another method)", ""]
    gp_table("")

    over = sorted(
        {
            r.chunk_bytes // MiB
            for r in gp
            if r.method in (GET_KVX, PUT_KVX) and med(ratios(index, r.case(), r.method, ROOF_OF[r.section], runs)) > 1.0
        }
    )
    if over:
        lines += [
            "",
            f"`% roof` above 100 ({', '.join(f'{m} MiB' for m in over)}): the roof moves the chunk as one "
            "Redis value, kvx as parts of `max_value_size` (below); Redis serves one large value more slowly "
            "than several smaller ones (see the part-size sweep).",
        ]
    dflt = info.get("default_part")
    if dflt and info.get("header_bytes"):
        per = [f"{mib} MiB: {n_values(mib * MiB, h, dflt)}" for mib, h in sorted(info["header_bytes"].items())]
        lines += [
            "",
            f"Redis values kvx writes per chunk at its default `max_value_size` ({_fmt(dflt)}; the limit "
            "counts chunk bytes, the codec header rides along; a chunk of several values also has a manifest "
            f"under its key and is published by a script): {', '.join(per)}.",
        ]

    # ---- back to back
    if any(r.section == "get-b2b" for r in results):
        wake = info.get("wake") or {}
        lines += [
            "",
            "## GET into a slot and PUT, back to back (each method's calls in a row)",
            "",
            f"The same methods, runs and chunks, each method's calls in blocks of {B2B_CALLS + 1} in a row "
            "(the first untimed), the blocks of all methods in a shuffled order: every timed call follows "
            "the method's own previous call, as when a connector loads or saves a prefix chunk after "
            "chunk. The shuffled table above puts another method before every call, and on this machine "
            "what came before changes the next call's time: kvx's GET ends as the last byte lands and its "
            "PUT as the server answers, so back to back the server never idles, while a redis-py GET spends "
            "its last millisecond on the client (building, decoding, checksumming, copying the value) "
            "with the server idle, back to back or not."
            + (
                " A server that idled answers later: a PING right after the server was busy, after 1 ms "
                "and after 3 ms idle (the client spinning meanwhile), median: "
                + " / ".join(f"{wake[g]:.0f} us" for g in sorted(wake))
                + " (same run)."
                if wake
                else ""
            ),
            "",
        ]
        gp_table("-b2b")

    # ---- sweep
    sw = [r for r in results if r.section.startswith("sweep")]
    if sw:
        parts = sorted({r.part_bytes for r in sw})
        chunks = sorted({r.chunk_bytes for r in sw})
        bname = f"part {_fmt(dflt)}"
        lines += [
            "",
            "## Part size (`max_value_size`)",
            "",
            f"`RedisTier` opened with each part size, the same chunks; the tier's default is {_fmt(dflt)}. "
            "`values` = Redis values per chunk (header + payload cut into parts; a chunk of several also has "
            "a manifest). `x default` = the default's median time / this one's (same run). Best = the least "
            "GET + PUT time, summed over the transports.",
            "",
            "| chunk | transport | part | values | GET ms | GET GB/s | GET x default | PUT ms | PUT GB/s | "
            "PUT x default | GET + PUT ms |",
            "|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|",
        ]
        score: dict[int, float] = {}
        verdicts = []
        for nb in chunks:
            total: dict[int, float] = {}
            for t in dict.fromkeys(r.transport for r in sw):
                for p in parts:
                    m = f"part {_fmt(p)}"
                    gc, pc = ("sweep-get", t, "standalone", nb), ("sweep-put", t, "standalone", nb)
                    gms, pms = med(per_run(index, gc, m, runs)), med(per_run(index, pc, m, runs))
                    total[p] = total.get(p, 0.0) + gms + pms
                    gx = cell(ratios(index, gc, m, bname, runs)) if dflt in parts else ""
                    px = cell(ratios(index, pc, m, bname, runs)) if dflt in parts else ""
                    lines.append(
                        f"| {nb // MiB} MiB | {t} | {_fmt(p)} | "
                        f"{n_values(nb, info['sweep_header_bytes'][nb], p)} | {gms:.3f} | "
                        f"{nb / (gms * 1e-3) / 1e9:.2f} | {gx}{'x' if gx else ''} | {pms:.3f} | "
                        f"{nb / (pms * 1e-3) / 1e9:.2f} | {px}{'x' if px else ''} | {gms + pms:.3f} |"
                    )
            best = min(total, key=total.get)
            close = sorted(p for p in total if p != best and total[p] <= total[best] * 1.05)
            line = (
                f"{nb // MiB} MiB chunk: best **{_fmt(best)}** (GET + PUT {total[best]:.2f} ms over the "
                f"transports" + (f"; within 5%: {', '.join(_fmt(p) for p in close)}" if close else "") + ")"
            )
            if dflt in total and dflt != best:
                line += f"; the default takes {total[dflt] / total[best]:.2f}x the best time"
            verdicts.append(line + ".")
            for p in parts:
                score[p] = score.get(p, 0.0) + total[p] / total[best] / len(chunks)
        overall = min(score, key=score.get)
        info["best_part"] = overall
        lines += [
            "",
            *[f"- {v}" for v in verdicts],
            "- Over the chunk sizes (each part size's time over the best one's, averaged): "
            + ", ".join(f"{_fmt(p)} {score[p]:.2f}" for p in parts)
            + f"; best **{_fmt(overall)}**.",
        ]

    # ---- one-knob sweeps: GET receive step, PUT send buffer
    def knob_table(section: str, title: str, text: str, knob: str, op: str, methods: list[str]) -> None:
        rows = [r for r in results if r.section == section]
        if not rows:
            return
        lines.extend(
            [
                "",
                f"## {title}",
                "",
                text + " `x default` = the median time of the tier's own choice for "
                "the transport / this one's (same run).",
                "",
                f"| transport | chunk | {knob} | {op} ms | GB/s | x default |",
                "|---|---:|---|---:|---:|---|",
            ]
        )
        for t in dict.fromkeys(r.transport for r in rows):
            for nb in sorted({r.chunk_bytes for r in rows}):
                case = (section, t, "standalone", nb)
                base = next(r.method for r in rows if r.baseline is None and r.case() == case)
                for m in methods:
                    ms = med(per_run(index, case, m, runs))
                    x = cell(ratios(index, case, m, base, runs))
                    lines.append(
                        f"| {t} | {nb // MiB} MiB | {m} | {ms:.3f} | {nb / (ms * 1e-3) / 1e9:.2f} | "
                        f"{x}{'x' if x else ''} |"
                    )

    knob_table(
        "pieces-get",
        "GET: bytes received per checksum step",
        "kvx receives a value's payload straight into the slot and checksums what each receive brought "
        "while it is still in cache; a step caps the bytes one receive may take (`whole value`: no cap, "
        "the kernel hands over what it holds; the tier's choice: `RedisTier.piece`).",
        "step",
        "GET",
        [_piece_name(p) for p in PIECES],
    )
    knob_table(
        "sndbuf-put",
        "PUT: socket send buffer",
        "kvx put through data connections opened with each SO_SNDBUF (`RedisTier.send_buffer`; Linux "
        "doubles the size asked for and caps it at `net.core.wmem_max`, here "
        f"{info.get('wmem_max', '?')} bytes; `kernel default`: not set, which over TCP leaves the "
        "kernel's autotuning on).",
        "send buffer",
        "PUT",
        [_sndbuf_name(b) for b in SEND_BUFFERS],
    )

    # ---- lookups
    lk = [r for r in results if r.section == "lookup"]
    if lk:
        lines += [
            "",
            f"## Lookup of a {LOOKUP_KEYS}-chunk prefix",
            "",
            f"`contains_many({LOOKUP_KEYS} keys)` (`lookup_wait_ms` {LOOKUP_WAIT_MS}) vs a redis-py pipeline "
            f"(transaction=False) of {LOOKUP_KEYS} `EXISTS`, every key present; each repeat asks for keys "
            "not asked for before. Loopback TCP. `x baseline` = the baseline's p50 / this one's.",
            "",
            "| deployment | method | repeats | p50 ms | p90 ms | p99 ms | x baseline (p50) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        lix = _attach(lk)
        for r in lk:
            b = lix.get((r.case(), r.baseline, r.run)) if r.baseline else None
            lines.append(
                f"| {r.deployment} | {r.method} | {len(r.times)} | {r.median:.3f} | {pct(r.times, 90):.3f} "
                f"| {pct(r.times, 99):.3f} | {f'{b.median / r.median:.2f}x' if b else ''} |"
            )
    if info.get("cluster_skipped"):
        lines += ["", f"Cluster lookup not measured: {info['cluster_skipped']}"]

    # ---- where the time goes
    cc = info.get("cpu_costs")
    if cc:
        lines += [
            "",
            "## Where the time goes (same run)",
            "",
            f"memcpy {cc['memcpy']:.2f} GB/s and CRC32C ({codec.CRC32C_IMPL}) {cc['crc32']:.2f} GB/s over "
            f"a {TARGET_MIB} MiB chunk (cache-cold, single thread): the verified GET and the encoding PUT each "
            "pay one CRC32 "
            "pass over the payload (kvx's GET piece by piece as the bytes land, its PUT while the server "
            "answers the EXISTS that precedes it), redis-py's GET one more copy (bytes -> slot) and its SET "
            "one more (the join).",
        ]
        if tb in sizes:
            crc_ms = tb / (cc["crc32"] * 1e9) * 1e3
            lines += [
                "",
                f"{TARGET_MIB} MiB: what kvx adds to the bare transfer (kvx - roof), next to one cold "
                "CRC32C pass over the payload (an upper bound of the checksum's share: data just received is "
                "partly still in cache).",
                "",
                "| transport | op | kvx ms | roof ms | kvx - roof ms | CRC32C pass ms |",
                "|---|---|---:|---:|---:|---:|",
            ]
            for t in transports:
                for sec, kvx_m in (("get", GET_KVX), ("put", PUT_KVX)):
                    case = (sec, t, "standalone", tb)
                    k_ms = med(per_run(index, case, kvx_m, runs))
                    r_ms = med(per_run(index, case, ROOF_OF[sec], runs))
                    lines.append(
                        f"| {t} | {sec.upper()} | {k_ms:.3f} | {r_ms:.3f} | {k_ms - r_ms:.3f} | {crc_ms:.3f} |"
                    )
    if info.get("notes"):
        lines += ["", *info["notes"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return tgt


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 MiB chunks, a 2 MiB sweep, 1 run of 3 repeats, 20 lookups"
    )
    ap.add_argument(
        "--out",
        default=os.path.join(REPO, "benchmarks", "results"),
        help="directory for redis_cpu.md and redis_cpu.csv",
    )
    ap.add_argument("--sizes", default=None, help="chunk sizes in MiB, comma-separated (default 1,4,16)")
    ap.add_argument(
        "--runs",
        type=int,
        default=None,
        help="whole measurements back to back (default 5: on a shared machine a busy stretch spoils a "
        "run, not the median of five; quick 1)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed ops per method, case and run (default 50 up to 1 MiB, 30 up to 4 MiB, 15 above; quick 3)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed ops per method, case and run")
    ap.add_argument(
        "--sweep-mib",
        default=None,
        help="chunk sizes of the part-size sweep, MiB, comma-separated (default 4,16; quick 2; '' = none)",
    )
    ap.add_argument("--lookup-repeats", type=int, default=None, help="lookups per method (default 300; quick 20)")
    ap.add_argument(
        "--rotate-mib", type=int, default=None, help="slots and keys rotated over per size (default 64 MiB; quick 4)"
    )
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-node cluster lookup")
    ap.add_argument("--no-pieces", action="store_true", help="skip the GET receive-step sweep")
    ap.add_argument("--no-sndbuf", action="store_true", help="skip the PUT send-buffer sweep")
    ap.add_argument("--no-sealed", action="store_true", help="skip sealed (encrypted) against in-the-clear chunks")
    ap.add_argument(
        "--sealed-only",
        action="store_true",
        help="only sealed against in-the-clear GET / PUT (at --sizes, default 4 MiB), into redis_sealed_cpu.md/.csv",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([1] if args.quick else [1, 4, 16])
    except ValueError:
        ap.error(f"--sizes: expected MiB as integers, comma-separated, got {args.sizes!r}")
    runs = args.runs if args.runs is not None else (1 if args.quick else 5)
    try:
        sweep = (
            [int(x) for x in args.sweep_mib.split(",") if x.strip()]
            if args.sweep_mib is not None
            else ([2] if args.quick else [4, 16])
        )
    except ValueError:
        ap.error(f"--sweep-mib: expected MiB as integers, comma-separated, got {args.sweep_mib!r}")
    lookups = args.lookup_repeats if args.lookup_repeats is not None else (20 if args.quick else 300)
    args.rotate_mib = args.rotate_mib if args.rotate_mib is not None else (4 if args.quick else 64)
    if args.repeats is not None:
        repeats = {mib: args.repeats for mib in set(sizes) | set(sweep)}
    else:
        repeats = {
            mib: 3 if args.quick else (50 if mib <= 1 else 30 if mib <= 4 else 15) for mib in set(sizes) | set(sweep)
        }
    if (
        runs < 1
        or args.warmup < 0
        or lookups < 1
        or args.rotate_mib < 1
        or any(x < 1 for x in sizes + sweep)
        or any(x < 1 for x in repeats.values())
    ):
        ap.error(
            "--runs, --repeats, --sizes, --sweep-mib, --lookup-repeats and --rotate-mib must be >= 1, --warmup >= 0"
        )
    try:
        import hiredis
        import redis

        from kvx.testing import redis_server
    except ImportError as e:
        print(f"bench_redis: needs redis-py and hiredis ({e})", file=sys.stderr)
        return 2

    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        print(f"warning: load average {load1:.2f}: timings will be noisy", file=sys.stderr)
    cmd = ("python benchmarks/bench_redis.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    log = lambda s: print(s, flush=True)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    t_start = time.perf_counter()
    info: dict = {
        "server_version": server_version(),
        "redis_py": redis.__version__,
        "hiredis": hiredis.__version__,
        "load": load1,
        "notes": [],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "default_part": default_part(),
        "wmem_max": wmem_max(),
    }
    rotate = args.rotate_mib * MiB
    if args.sealed_only:
        return sealed_main(
            args,
            [int(x) for x in args.sizes.split(",")] if args.sizes else [TARGET_MIB],
            runs,
            repeats,
            rotate,
            g,
            log,
            info,
            cmd,
        )
    results: list[Result] = []
    with redis_server.RedisServer(unix_socket=True) as srv:
        urls = {"tcp": srv.url, "unix": srv.unix_url}
        rs, more = bench_get_put(urls, sizes, runs, repeats, args.warmup, rotate, g, log)
        results += rs
        info.update(more)
        info["wake"] = server_wake(srv.url, 300 if args.quick else 1200)
        log("PING after the server idled " + ", ".join(f"{g:g} ms: {us:.0f} us" for g, us in info["wake"].items()))
        if not args.no_pieces:
            results += bench_pieces(
                urls, TARGET_MIB, runs, repeats.get(TARGET_MIB, 3 if args.quick else 30), args.warmup, rotate, g, log
            )
        if not args.no_sndbuf:
            results += bench_send_buffers(
                urls, TARGET_MIB, runs, repeats.get(TARGET_MIB, 3 if args.quick else 30), args.warmup, rotate, g, log
            )
        if not args.no_sealed:
            results += bench_sealed(
                urls,
                TARGET_MIB if not args.quick else sizes[0],
                runs,
                repeats.get(TARGET_MIB, 3 if args.quick else 30),
                args.warmup,
                rotate,
                g,
                log,
            )
        for mib in sweep:
            results += bench_sweep(urls, mib, list(PART_SIZES), runs, repeats[mib], args.warmup, rotate, g, log, info)
        tier, r = open_tier(srv.url, lookup_wait_ms=LOOKUP_WAIT_MS), redis_py(srv.url)
        try:
            results += bench_lookup("standalone", tier, r, lookups, args.warmup, log)
        finally:
            tier.close()
            r.close()
    if args.no_cluster:
        info["cluster_skipped"] = "--no-cluster."
    else:
        results += run_cluster_lookup(lookups, args.warmup, log, info)
    info["cpu_costs"] = cpu_costs(TARGET_MIB * MiB)
    info["elapsed"] = time.perf_counter() - t_start
    info["load_end"] = os.getloadavg()[0]
    info["repeats_desc"] = (
        ", ".join(f"{repeats[m]} repeats at {m} MiB" for m in sorted(repeats)) + f", {lookups} lookups"
    )
    os.makedirs(args.out, exist_ok=True)
    md, csv_path = os.path.join(args.out, "redis_cpu.md"), os.path.join(args.out, "redis_cpu.csv")
    write_csv(csv_path, results)
    tgt = write_md(md, results, info, args, cmd, args.quick)
    with open(md) as f:
        print(f.read())
    if any(r.section.startswith("sealed-") for r in results):
        smd = os.path.join(args.out, "redis_sealed_cpu.md")
        for t, op, ratio, ok in write_sealed_md(smd, results, info, cmd, args.quick):
            if not args.quick:
                log(f"target sealed {op} >= {SEALED_TARGET:.0%} of clear ({t}): {ratio:.3f} {verdict(ok)}")
        log(f"wrote {smd}")
    for (name, where), (val, ok) in tgt.items():
        log(f"target {name} ({where}): {val:.3f} {'met' if ok else 'MISSED'}")
    log(f"wrote {md} and {csv_path}")
    return 0


def sealed_main(args, sizes, runs, repeats, rotate, g, log, info, cmd) -> int:
    """``--sealed-only``: sealed against in-the-clear GET / PUT at each size, TCP and unix socket."""
    from kvx.testing import redis_server

    results: list[Result] = []
    with redis_server.RedisServer(unix_socket=True) as srv:
        urls = {"tcp": srv.url, "unix": srv.unix_url}
        for mib in sizes:
            reps = args.repeats if args.repeats is not None else (3 if args.quick else 30)
            results += bench_sealed(urls, mib, runs, reps, args.warmup, rotate, g, log)
    info["cpu_costs"] = cpu_costs(TARGET_MIB * MiB)
    os.makedirs(args.out, exist_ok=True)
    md, csv_path = os.path.join(args.out, "redis_sealed_cpu.md"), os.path.join(args.out, "redis_sealed_cpu.csv")
    write_csv(csv_path, results)
    judged = write_sealed_md(md, results, info, cmd, args.quick)
    with open(md) as f:
        print(f.read())
    for t, op, ratio, ok in judged:
        if not args.quick:
            log(f"target sealed {op} >= {SEALED_TARGET:.0%} of clear ({t}): {ratio:.3f} {verdict(ok)}")
    log(f"wrote {md} and {csv_path}")
    return 0


def run_cluster_lookup(lookups: int, warmup: int, log, info: dict) -> list[Result]:
    """The lookup on a 3-node cluster, if ``RedisClusterServers`` and the tier's cluster mode work here."""
    from kvx.testing import redis_server

    try:
        cluster_cm = redis_server.RedisClusterServers(nodes=3)
        cl = cluster_cm.__enter__()
    except Exception as e:  # noqa: BLE001 - a cluster that does not start is reported, not fatal
        info["cluster_skipped"] = f"RedisClusterServers(nodes=3) did not start ({type(e).__name__}: {e})."
        log(f"cluster skipped: {info['cluster_skipped']}")
        return []
    try:
        tier = open_tier(cl.url, lookup_wait_ms=LOOKUP_WAIT_MS, cluster=True)
        r = cl.client()
        try:
            return bench_lookup("cluster (3 nodes)", tier, r, lookups, warmup, log)
        except Exception as e:  # noqa: BLE001 - the standalone results stand; say why this one is missing
            info["cluster_skipped"] = f"the lookup on the 3-node cluster failed ({type(e).__name__}: {e})."
            log(f"cluster lookup failed: {info['cluster_skipped']}")
            return []
        finally:
            tier.close()
            r.close()
    finally:
        cluster_cm.__exit__(None, None, None)


# ------------------------------------------------------------------------------------------ pytest-benchmark
# ``pytest benchmarks/bench_redis.py --benchmark-only``: kvx and redis-py at 4 MiB over TCP, and the lookup.
# (``pytest benchmarks`` collects this file once pytest's python_files includes ``bench_*.py``.)
try:
    import pytest
except ImportError:  # the script does not need pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def _redis():
        pytest.importorskip("redis")
        pytest.importorskip("kvx.store.redis")
        redis_server = pytest.importorskip("kvx.testing.redis_server")
        with redis_server.RedisServer() as srv:
            tier, r = open_tier(srv.url, lookup_wait_ms=LOOKUP_WAIT_MS), redis_py(srv.url)
            pool = make_pool(TARGET_MIB * MiB, n_rotate(TARGET_MIB * MiB, 64 * MiB), torch.Generator().manual_seed(0))
            vals = Values(tier, r, pool)
            yield tier, r, vals
            vals.close()
            tier.close()
            r.close()

    def _rotating(fn):
        state = {"i": 0}

        def call():
            fn(state["i"])
            state["i"] += 1

        return call

    @pytest.mark.parametrize("method", [GET_KVX, GET_BASE])
    def test_get_4mib(benchmark, _redis, method):
        tier, r, vals = _redis
        raw = RawSocket(tier.config.url)
        benchmark(_rotating(get_fns(tier, r, vals, raw)[method]))
        raw.close()

    @pytest.mark.parametrize("method", [PUT_KVX, PUT_BASE])
    def test_put_4mib(benchmark, _redis, method):
        tier, r, vals = _redis
        written = {m: [] for m in PUT_METHODS}
        raw = RawSocket(tier.config.url)
        fn, after = put_fns(tier, r, vals.pool, written, raw)[method], deleter(tier, r, written)
        state = {"i": 0}

        def setup():
            if written[method]:
                after(method, 0)

        def call():
            fn(state["i"])
            state["i"] += 1

        benchmark.pedantic(call, setup=setup, rounds=20, warmup_rounds=2)
        setup()
        raw.close()

    def test_lookup_256(benchmark, _redis):
        tier, r, _ = _redis
        keys = [new_key() for _ in range(LOOKUP_KEYS)]
        tiny = torch.zeros(8, 2, 1, 8, 4, dtype=torch.bfloat16)
        for k in keys:
            tier.put(k, tiny)
        try:
            got = benchmark(tier.contains_many, keys)
            assert got is not None and all(got)
        finally:
            for k in keys:
                tier.delete(k)


if __name__ == "__main__":
    sys.exit(main())
