"""Moving a pull's bytes between two nodes' pool files, on one machine: each transport against a plain socket
stream measured in the same run.

Variants (``--variants``; each a serving process and a reading process, each with its own pool file in /dev/shm
holding the spans at scattered slots, so no two spans are adjacent on either side):

- ``socket``: the baseline. TCP over 127.0.0.1, default socket options: the server ``sendall``s each span
  straight from its mapping, the reader ``recv_into``s its mapping.
- ``nixl``: :class:`kvx.node.nixl.NixlTransport`, one NIXL READ of all spans, UCX's defaults (between two
  processes of one host: CMA, ``process_vm_readv``).
- ``nixl-tcp``: the same with ``UCX_TLS=tcp,self`` in both processes (UCX's software GET over TCP: what NIXL does
  between hosts without RDMA).
- ``kvx-tcp``: :class:`kvx.node.tcp.TcpTransport` (kvx's own channel; the reader dials a plain connection, the
  server answers it with ``serve``), where that module exists.
- ``kvx-tcp-sealed``: the same, the read sealed (a sealed namespace's chunks: AES-256-GCM pieces under the
  connection's keys, decrypted into the reader's slots, :mod:`kvx.node.wire_seal`); the connection admitted by the
  cluster handshake, which gives both ends its keys.

Each variant moves ``--total`` bytes as spans of ``--chunk`` (default 64 MiB as 16 x 4 MiB) per transfer; one
untimed warm-up each, whose bytes are checked (CRC32 of the spans on both sides), then ``--reps`` rounds, the
variants in turn within each round (a, b, c, a, b, c, ...), so that drift of the machine meets them alike; the
bytes are checked again after the last round. The reader times each transfer (``perf_counter`` around it).
Reported: median, p10 and p90 GB/s over the rounds, and each median over the socket's median.

    python benchmarks/bench_peer_transfer.py [--total 64MiB] [--chunk 4MiB] [--reps 7] [--variants ...] [--out STEM]

Writes ``<STEM>.md`` and ``<STEM>.csv`` (default ``benchmarks/results/peer_transfer_cpu``). Add a variant: a
:class:`Variant` in :data:`VARIANTS` (what the serving and the reading process each set up).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.metadata
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

from kvx.node.transport import Span  # noqa: E402
from kvx.testing.bench_timing import md_table, percentile  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT_S = 120.0  # a transfer's (and a child's answer's) bound: a hang guard


def parse_size(text: str) -> int:
    """``64MiB``, ``4KiB``, ``1GiB`` or a plain byte count."""
    units = {"GIB": 1 << 30, "MIB": MiB, "KIB": KiB, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the spans lie: chunk ``i`` at slot ``2 i`` of the serving pool and at slot ``2 (n - 1 - i) + 1`` of the
    reading pool (both pools ``2 n`` slots: no two spans adjacent on either side, the order reversed)."""

    total: int
    chunk: int

    @property
    def n(self) -> int:
        return self.total // self.chunk

    @property
    def pool_bytes(self) -> int:
        return 2 * self.n * self.chunk

    def spans(self) -> list[Span]:
        c, n = self.chunk, self.n
        return [Span(remote=2 * i * c, local=(2 * (n - 1 - i) + 1) * c, nbytes=c) for i in range(n)]


def make_pool(size: int, fill_seed: int | None) -> tuple[str, Any]:
    """A pool file in /dev/shm of ``size`` bytes (seeded random bytes, or zeros), mapped; its path and mapping."""
    import mmap

    path = f"/dev/shm/kvx-bench-peer-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if fill_seed is not None:
        m[:] = random.Random(fill_seed).randbytes(size)
    return path, m


def crc_of(pool, spans: list[Span], side: str) -> int:
    """CRC32 of the spans' bytes in order, on ``side`` ("remote" or "local")."""
    crc = 0
    with memoryview(pool) as view:
        for s in spans:
            off = s.remote if side == "remote" else s.local
            crc = zlib.crc32(view[off : off + s.nbytes], crc)
    return crc


# ------------------------------------------------------------------------------------------ the variants
# A variant's serve(pool, layout) runs in the serving process: it returns (what the reader needs, picklable; a
# close function). Its reader(pool, layout, info) runs in the reading process: it returns (a function moving every
# span once; a close function). Each process first sets the variant's env.
Setup = Callable[..., tuple[Any, Callable[[], None]]]


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str  # the table's row
    serve: Setup
    reader: Setup
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # in both processes, before anything is set up
    available: Callable[[], str | None] = lambda: None  # why the variant cannot run here (None: it can)


def _socket_serve(pool, layout: Layout):
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    spans = layout.spans()

    conns: list[socket.socket] = []

    def loop() -> None:
        conn, _ = listener.accept()
        conns.append(conn)
        with conn, memoryview(pool) as view:
            while conn.recv(1):  # one byte asks for every span; EOF (or the shutdown below) ends
                for s in spans:
                    conn.sendall(view[s.remote : s.remote + s.nbytes])

    th = threading.Thread(target=loop, daemon=True)
    th.start()

    def close() -> None:
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:  # the reader closed first, and so did the loop
                pass
        listener.close()
        th.join(10)  # it holds a view of the pool until it ends

    return listener.getsockname(), close


def _socket_reader(pool, layout: Layout, address):
    sock = socket.create_connection(address, timeout=TIMEOUT_S)
    spans = layout.spans()
    view = memoryview(pool)

    def transfer() -> None:
        sock.sendall(b"g")
        for s in spans:
            part = view[s.local : s.local + s.nbytes]
            got = 0
            while got < s.nbytes:
                n = sock.recv_into(part[got:])
                if n == 0:
                    raise ConnectionError("socket: the server closed the connection mid-transfer")
                got += n
            part.release()

    def close() -> None:
        sock.close()
        view.release()

    return transfer, close


def _nixl_serve(pool, layout: Layout):
    from kvx.node.nixl import NixlTransport

    t = NixlTransport(pool, f"srv-{uuid.uuid4().hex[:8]}")
    return t.descriptor(), t.close


def _nixl_reader(pool, layout: Layout, descriptor: bytes):
    from kvx.node.nixl import NixlTransport

    t = NixlTransport(pool, f"rdr-{uuid.uuid4().hex[:8]}")
    t.connect("server", ("127.0.0.1", 0), descriptor)
    spans = layout.spans()
    return (lambda: t.read("server", spans, TIMEOUT_S)), t.close


def _nixl_missing() -> str | None:
    try:
        import kvx.node.nixl  # noqa: F401
    except ImportError as e:
        return f"kvx.node.nixl does not import: {e}"
    return None


_SECRET = b"kvx-bench-cluster-secret-0123456789"


def _kvx_tcp_serve(pool, layout: Layout, sealed: bool = False):
    import threading

    from kvx.node import handshake
    from kvx.node.tcp import TcpTransport
    from kvx.node.wire_seal import WireSession

    t = TcpTransport(pool, dial=None, bounds=lambda: (0, len(pool)))
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn) -> None:
        session = None
        if sealed:
            conn.settimeout(TIMEOUT_S)
            _, _, keying = handshake.admit_keyed(conn, _SECRET, "server")
            session = WireSession(_SECRET, keying)
        t.serve(conn, "reader", session=session)

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()

    def close() -> None:
        listener.close()
        t.close()

    return listener.getsockname(), close


def _kvx_tcp_reader(pool, layout: Layout, address):
    from kvx.node.tcp import TcpTransport

    # a plain connection: the cluster handshake (kvx.node.handshake.dial) is once per connection, not per read
    def dial(a):
        return socket.create_connection(a, timeout=TIMEOUT_S), None

    t = TcpTransport(pool, dial=dial, bounds=lambda: (0, len(pool)))
    t.connect("server", tuple(address), b"")
    spans = layout.spans()
    return (lambda: t.read("server", spans, TIMEOUT_S)), t.close


def _kvx_tcp_sealed_serve(pool, layout: Layout):
    return _kvx_tcp_serve(pool, layout, sealed=True)


def _kvx_tcp_sealed_reader(pool, layout: Layout, address):
    from kvx.node import handshake
    from kvx.node.tcp import TcpTransport
    from kvx.node.wire_seal import WireSession

    def dial(a):  # the cluster handshake: once per connection, and its keys
        sock, _, keying = handshake.dial_keyed(a, _SECRET, "reader", "data", TIMEOUT_S)
        return sock, WireSession(_SECRET, keying)

    t = TcpTransport(pool, dial=dial, bounds=lambda: (0, len(pool)))
    t.connect("server", tuple(address), b"")
    spans = layout.spans()
    return (lambda: t.read("server", spans, TIMEOUT_S, sealed=True)), t.close


def _kvx_tcp_missing() -> str | None:
    try:
        from kvx.node.tcp import TcpTransport  # noqa: F401
    except ImportError as e:
        return f"kvx.node.tcp.TcpTransport does not import: {e}"
    return None


VARIANTS: dict[str, Variant] = {
    "socket": Variant("socket (baseline)", _socket_serve, _socket_reader),
    "nixl": Variant("nixl, UCX defaults", _nixl_serve, _nixl_reader, available=_nixl_missing),
    "nixl-tcp": Variant("nixl, UCX_TLS=tcp,self", _nixl_serve, _nixl_reader, {"UCX_TLS": "tcp,self"}, _nixl_missing),
    "kvx-tcp": Variant("kvx TcpTransport", _kvx_tcp_serve, _kvx_tcp_reader, available=_kvx_tcp_missing),
    "kvx-tcp-sealed": Variant(
        "kvx TcpTransport, sealed", _kvx_tcp_sealed_serve, _kvx_tcp_sealed_reader, available=_kvx_tcp_missing
    ),
}
BASELINE = "socket"
NOTES = {  # the table's notes on each variant
    "socket": "TCP over 127.0.0.1, default socket options; `sendall` from the server's mapping, `recv_into` the "
    "reader's.",
    "nixl": "one NIXL READ of all spans; between two processes of one host UCX picks CMA (`process_vm_readv`: the "
    "reader's process copies, the server does nothing).",
    "nixl-tcp": "one NIXL READ over UCX's TCP transport: a software GET, which the server's NIXL progress thread "
    "answers. That thread sleeps between UCX events (`kvx.node.nixl`); NIXL's own Python API makes every agent's "
    "spin a core, which on a small machine slows every row, the socket's too (here those measured so fell ~4x).",
    "kvx-tcp": "`kvx.node.tcp.TcpTransport` over a plain connection (no cluster handshake: once per connection).",
    "kvx-tcp-sealed": "`kvx.node.tcp.TcpTransport`, a sealed read: AES-256-GCM pieces of 256 KiB under the "
    "connection's keys (from the cluster handshake, once per connection), encrypted by the server from its pool, "
    "decrypted by the reader in its slots, CRC32C of the plaintext summed as it lands.",
}


# ------------------------------------------------------------------------------------------ the processes
def _child(role: str, name: str, layout: Layout, conn, extra: Any = None) -> None:
    """A variant's serving or reading process: sets its env, makes its pool, sets up, then answers ``conn``.
    Serving: sends ``("ready", info, crc of the spans)``, then waits for ``"stop"``. Reading: sends ``("ready",)``,
    then per ``"go"`` moves the spans and sends the seconds it took; ``"crc"``: the CRC of its spans."""
    v = VARIANTS[name]
    os.environ.update(v.env)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    path, pool = make_pool(layout.pool_bytes, 1234 if role == "serve" else None)
    close = None
    try:
        if role == "serve":
            info, close = v.serve(pool, layout)
            conn.send(("ready", info, crc_of(pool, layout.spans(), "remote")))
            conn.recv()
            return
        transfer, close = v.reader(pool, layout, extra)
        conn.send(("ready",))
        while True:
            cmd = conn.recv()
            if cmd == "go":
                t0 = time.perf_counter()
                transfer()
                conn.send(time.perf_counter() - t0)
            elif cmd == "crc":
                conn.send(crc_of(pool, layout.spans(), "local"))
                pool[:] = bytes(len(pool))  # the next check sees only what the next transfers brought
            else:
                return
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        os.unlink(path)  # first: the file goes even if what follows fails
        if close is not None:
            close()
        pool.close()


class Pair:
    """A variant's two processes, set up (the main process only sends them commands)."""

    def __init__(self, name: str, layout: Layout):
        ctx = mp.get_context("spawn")
        self.name = name
        self._srv, srv_end = ctx.Pipe()
        self._rdr, rdr_end = ctx.Pipe()
        self.procs = [ctx.Process(target=_child, args=("serve", name, layout, srv_end), daemon=True)]
        self.procs[0].start()
        _, info, self.want_crc = self._answer(self._srv, "set up its server")
        self.procs.append(ctx.Process(target=_child, args=("read", name, layout, rdr_end, info), daemon=True))
        self.procs[1].start()
        self._answer(self._rdr, "set up its reader")

    def _answer(self, conn, what: str):
        if not conn.poll(TIMEOUT_S):
            raise RuntimeError(f"{self.name}: no answer within {TIMEOUT_S} s to: {what}")
        got = conn.recv()
        if isinstance(got, tuple) and got[0] == "error":
            raise RuntimeError(f"{self.name}: {what}: {got[1]}")
        return got

    def transfer(self) -> float:
        """One transfer of every span; the seconds the reader measured."""
        self._rdr.send("go")
        return self._answer(self._rdr, "a transfer")

    def check(self) -> None:
        """The reader's spans hold the server's bytes (then its pool is zeroed)."""
        self._rdr.send("crc")
        got = self._answer(self._rdr, "the CRC of its spans")
        if got != self.want_crc:
            raise RuntimeError(f"{self.name}: the bytes read differ (CRC32 {got:08x}, expected {self.want_crc:08x})")

    def close(self) -> None:
        for conn in (self._rdr, self._srv):
            try:
                conn.send("stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------------------------ measuring
@dataclasses.dataclass
class Result:
    name: str
    label: str
    nbytes: int
    seconds: list[float]  # per round

    @property
    def gbs(self) -> list[float]:
        return [self.nbytes / s / 1e9 for s in self.seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.gbs)

    def pct(self, p: int) -> float:
        """The p-th percentile (:func:`kvx.testing.bench_timing.percentile`, linear) of the rounds' GB/s."""
        return percentile(self.gbs, p)


def run(layout: Layout, reps: int, names: list[str], log: Callable[[str], None] = print) -> tuple[list[Result], dict]:
    """Set every variant up, warm each up (bytes checked), time ``reps`` interleaved rounds, check the bytes again.
    Returns the results (in ``names``' order) and the variants left out, with why."""
    skipped = {}
    pairs: list[Pair] = []
    try:
        for name in names:
            why = VARIANTS[name].available()
            if why:
                skipped[name] = why
                log(f"{name}: left out: {why}")
                continue
            pair = Pair(name, layout)
            pairs.append(pair)
            pair.transfer()  # warm-up: connections, registrations, first touch of the pages
            pair.check()
            log(f"{name}: set up, warm-up bytes checked")
        times: dict[str, list[float]] = {p.name: [] for p in pairs}
        for r in range(reps):
            for p in pairs:
                times[p.name].append(p.transfer())
            log(
                f"round {r + 1}/{reps}: "
                + ", ".join(f"{n} {layout.total / ts[-1] / 1e9:.2f} GB/s" for n, ts in times.items())
            )
        for p in pairs:
            p.check()
    finally:
        for p in pairs:
            p.close()
    return [Result(p.name, VARIANTS[p.name].label, layout.total, times[p.name]) for p in pairs], skipped


def versions(load: float) -> str:
    parts = [f"Python {platform.python_version()}", f"Linux {platform.release()}", f"load average {load:.2f} at start"]
    for dist in ("nixl-cu12", "nixl"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def write(
    results: list[Result], skipped: dict, layout: Layout, reps: int, stem: str, argv: list[str], load: float
) -> list[str]:
    from kvx.testing.bench_timing import cpu_name  # imports torch: not in the children

    base = next((r.median for r in results if r.name == BASELINE), None)
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "bytes", "spans", "span_bytes", "rounds", "median_GB/s", "p10_GB/s", "p90_GB/s",
                    "x_socket", "round_GB/s"])  # fmt: skip
        for r in results:
            ratio = f"{r.median / base:.3f}" if base else ""
            rounds = " ".join(f"{x:.3f}" for x in r.gbs)
            w.writerow([r.name, r.nbytes, layout.n, layout.chunk, len(r.seconds), f"{r.median:.3f}",
                        f"{r.pct(10):.3f}", f"{r.pct(90):.3f}", ratio, rounds])  # fmt: skip
    lines = [
        "# Peer transfer: a pull's bytes between two pool files on one machine",
        "",
        f"Machine: {cpu_name()}; {versions(load)}.",
        "",
        f"Reproduce: `{' '.join(['python benchmarks/bench_peer_transfer.py', *argv])}`",
        "",
        f"{layout.total / MiB:g} MiB per transfer as {layout.n} spans of {layout.chunk / KiB:g} KiB, scattered on both "
        f"sides; {reps} round{'s' if reps != 1 else ''}, the variants in turn within each round; GB/s = bytes / the "
        "reader's time for the whole transfer. `x socket` = median over the socket stream's median, measured in the "
        "same run. Bytes checked (CRC32) after the warm-up and after the last round.",
        "",
    ]
    lines += md_table(
        ["variant", "median GB/s", "p10", "p90", "x socket"],
        [
            (
                r.label,
                f"{r.median:.2f}",
                f"{r.pct(10):.2f}",
                f"{r.pct(90):.2f}",
                f"{r.median / base:.2f}x" if base else "",
            )
            for r in results
        ],
        "lrrrr",
    )
    lines += ["", "Variants:", ""] + [f"- {VARIANTS[r.name].label}: {NOTES[r.name]}" for r in results]
    if skipped:
        lines += ["", "Left out:"] + [f"- {n}: {why}" for n, why in skipped.items()]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", default="64MiB", help="bytes per transfer (default 64MiB)")
    ap.add_argument("--chunk", default="4MiB", help="bytes per span (default 4MiB)")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated of {', '.join(VARIANTS)} (default: all; those that cannot run here are left out)",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "peer_transfer_cpu"), help="results path stem")
    args = ap.parse_args(argv)
    total, chunk = parse_size(args.total), parse_size(args.chunk)
    if chunk <= 0 or total < chunk or total % chunk:
        ap.error(f"--total must be a positive multiple of --chunk, got {total} and {chunk}")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or args.reps < 1:
        ap.error(f"--variants: expected names of {list(VARIANTS)}, got {unknown}" if unknown else "--reps must be >= 1")
    layout = Layout(total, chunk)
    load = os.getloadavg()[0]  # others' load: this is a measurement between processes of one machine
    results, skipped = run(layout, args.reps, names)
    lines = write(results, skipped, layout, args.reps, args.out, sys.argv[1:] if argv is None else argv, load)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
