"""The Redis benchmarks' plumbing (``benchmarks/bench_redis.py``, ``benchmarks/bench_redis_faults.py``): the
chunk they move and how they open kvx's Redis tier, the redis-server version; ``bench_redis``'s methods (their
names, constants and targets), the machine's facts it reports, its back-to-back timing loop, its results, and the
GET / PUT / lookup calls it times (kvx's tier, redis-py, a raw socket: the roofs) with their checks; the CPU's
memcpy / CRC32C / AES-GCM roofs. What the benchmark measures, section by section, and its command line are in the
script; its report is :mod:`kvx.testing.redis_bench_report`.
"""

from __future__ import annotations

import math
import os
import random
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvx.store import CPUPool, codec
from kvx.store.redis import SNDBUF_UNIX, RedisTier, RedisTierConfig, redis_chunk_key
from kvx.store.tier import TierContext
from kvx.testing.bench_timing import time_interleaved, timed_calls

FINGERPRINT = "bench-redis-0123456789abcdef"
TOKEN_BYTES = 8 * 2 * 8 * 128 * 2  # one token of the chunk: 8 layers x K/V x 8 heads x 128 x bf16


def fmt6(x: float) -> str:
    """6 significant digits: enough that ratios recomputed from the CSV agree with the ones in it."""
    return f"{x:.6g}"


def new_key() -> str:
    return os.urandom(16).hex()


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def open_tier(url: str, part: int | None = None, **kw):
    """A ``RedisTier`` on ``url`` (``part``: its ``max_value_size``; None: the tier's default)."""
    fields = {"type": "redis", "url": url, **kw}
    if part is not None:
        fields["max_value_size"] = part
    return RedisTier.open(RedisTierConfig(**fields), TierContext(fingerprint=FINGERPRINT))


def server_version() -> str:
    """``redis-server --version``'s v=... (the binary kvx.testing.redis_server starts)."""
    from kvx.testing.redis_server import binary_env, redis_server_binary

    try:
        out = subprocess.run(
            [redis_server_binary(), "--version"], capture_output=True, text=True, timeout=10, env=binary_env()
        ).stdout
        return next(w.split("=", 1)[1] for w in out.split() if w.startswith("v="))
    except (OSError, RuntimeError, StopIteration, subprocess.SubprocessError):
        return "?"


def chunk_shape(nbytes: int) -> tuple[int, ...]:
    """A bf16 KV chunk of ``nbytes``: 8 layers x K/V x tokens x 8 KV heads x 128 (32 KiB per token)."""
    if nbytes % TOKEN_BYTES:
        raise ValueError(f"chunk: expected a multiple of {TOKEN_BYTES} bytes, got {nbytes}")
    return (8, 2, nbytes // TOKEN_BYTES, 8, 128)


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
ORDER_SEED = 0  # time_back_to_back's and server_wake's shuffles (time_interleaved's default seed is 0 too)
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
    return timed_calls(fns, [(m, c > 0) for m in order for c in range(calls + 1)], after)


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


def _log_case(log, run, runs, rs: list[Result]) -> None:
    base = {r.section: r for r in rs if r.baseline is None}
    for r in rs:
        log(
            f"run {run}/{runs} {r.transport:4s} {r.chunk_bytes // MiB:2d} MiB {r.section:7s} {r.method:33s} "
            f"median {r.median:7.3f} ms {r.gbs:6.2f} GB/s {base[r.section].median / r.median:5.2f}x baseline"
        )


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
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_UNIX)
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
    r.set(redis_chunk_key(k), b"".join(codec.encode(slot, k, FINGERPRINT)))
    try:
        out.fill_(float("nan"))
        tier.get_into(k, out)
        if not torch.equal(out.view(torch.uint8), slot.view(torch.uint8)):
            raise AssertionError("redis-py SET then kvx get_into: the chunk differs")
    finally:
        r.delete(redis_chunk_key(k))


# ------------------------------------------------------------------------------------------ sealed chunks
SEALED_METHODS = ("kvx in the clear (baseline)", "kvx sealed (AES-256-GCM)")
SEALED_TARGET = 0.70  # sealed GET throughput / in the clear, 4 MiB: stated, judged, never asserted


def _piece_name(p: int | None) -> str:
    return "whole value" if p is None else f"piece {_fmt(p)}"


def _sndbuf_name(b: int | None) -> str:
    return "kernel default" if b is None else f"SO_SNDBUF {_fmt(b)}"


def n_values(payload: int, header: int, part: int) -> int:
    """Redis values the tier writes for a chunk: one if the payload fits in ``part`` (the header rides
    along), else ceil(payload / part) parts (the manifest under the chunk key not counted)."""
    return 1 if payload <= part else math.ceil(payload / part)


def _fmt(b: int | None) -> str:
    if b is None:
        return "default"
    return f"{b // MiB} MiB" if b % MiB == 0 else f"{b // KiB} KiB"


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
