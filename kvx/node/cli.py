"""``kvx node``: run the host's KV pool daemon (:mod:`.daemon`), or ask a running one.

    kvx node --socket PATH --size 64GiB [--slot-size SIZE|auto] [--pool PATH] [--socket-mode 660]
             [--metrics-port N] [--allow-uid UID ...] [--allow-gid GID ...] [--quota NS=SIZE ...]
             [--listen HOST:PORT --secret-file FILE [--peers HOST:PORT,... | --membership URL]
              [--transport tcp|nixl]]
    kvx node stats  --socket PATH [--json]
    kvx node lookup --socket PATH --namespace NS (--tokens 1,2,3 | --tokens-file F) [--cache-salt S]
                    [--kvx-namespace S]      -> {"namespace", "tokens", "cached_tokens"}
    kvx node pin    (as lookup)              -> {"namespace", "tokens", "pinned_tokens"}: admin pins
    kvx node unpin  (as lookup)              -> {"namespace", "tokens", "unpinned_tokens"}
    kvx node evict  --socket PATH --namespace NS [--tokens ... | --tokens-file F]   -> {"namespace", "evicted"}
    kvx node quota  --socket PATH --namespace NS --bytes SIZE|none                   -> {"namespace", "quota"}

A prompt's chunk keys are computed here as an engine computes them (:func:`kvx.keys.chunk_keys` under
:func:`~kvx.keys.request_root`), with the namespace's chunk size as the daemon knows it.

``stats`` fields: ``pool`` {path, bytes, num_slots, slot_bytes, used, free, quarantined, pending}; ``clients``
(connections now); ``leases`` (lease pins held now); ``refused_clients`` (peers whose uid/gid is not admitted),
``bad_frames`` (frames kvx did not write: the connection was closed), ``bad_requests`` (unknown ops, wrong
arguments), ``internal_errors`` (requests the daemon failed on: see its log), ``leases_released`` and
``aborted_on_disconnect`` (pins and PENDING slots that connections left behind when they closed); ``namespaces``
{hex: {model, chunk_size, chunks (READY), pending, bytes, hits, misses, evictions (to make room), pinned (admin
pins), quota, sealed (an engine of it seals its byte tiers: its chunks cross between nodes only encrypted, over
the tcp transport, and stay on this host over nixl), clients, pulled (chunks pulled from peers), served (chunks peers
read)}}; with --listen, ``cluster`` {node, listen, transport, peers [{address, node, state, error, bytes_in,
chunks_in, bytes_out, bytes_sealed_in (sealed bytes pulled from it or pushed here by it), bytes_sealed_out (sealed
bytes it read from here or this node pushed to it), pulls, failures, rate_gbps}], bytes_out, bytes_sealed_out,
bytes_sealed_in, pulls, pulled, misses, declined_slow, failed, bad_chunks, refused_peers, served}.

Exit codes: 0 done; 1 the daemon is not reachable (or cannot start); 2 bad arguments, or the daemon refused the
request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys

from ..sizes import parse_size
from .connection import Connection, NodeError, NodeUnavailable
from .protocol import NAMESPACE_RE, SLOT_ALIGN, VERSION, PoolGeometry

_TIMEOUT_S = 5.0  # per control request
_PROMPT_OPS = ("lookup", "pin", "unpin")
_SUBCOMMANDS = {
    "stats": "the pool, counters and namespaces (a table; --json for the raw reply)",
    "lookup": "how many leading tokens of a prompt are cached",
    "pin": "admin-pin a prompt's cached chunks (within the namespace's quota), until unpin or evict",
    "unpin": "drop the admin pins of a prompt's chunks",
    "evict": "evict a prompt's chunks, or the whole namespace",
    "quota": "set (or clear: none) a namespace's quota; evicts its LRU chunks if it is now over",
}


class _UsageError(Exception):
    """A bad argument: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise _UsageError(f"{self.prog}: {message}")


# ------------------------------------------------------------------------------------------------ argument types
def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slot_size(text: str) -> int | None:
    """``--slot-size``: a size, or ``auto`` (None)."""
    return None if text == "auto" else _size(text)


def _namespace(text: str) -> str:
    if not NAMESPACE_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected 8-128 lowercase hex digits, got {text!r}")
    return text


def _quota(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE=SIZE, got {text!r}")
    return _namespace(name), _size(size)


def _quota_bytes(text: str) -> int | None:
    return None if text.lower() == "none" else _size(text)


def _mode(text: str) -> int:
    if not re.fullmatch(r"0?o?[0-7]{1,3}", text):
        raise argparse.ArgumentTypeError(f"expected an octal mode such as 660, got {text!r}")
    return int(text.replace("o", ""), 8)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return int(text)


def _tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None


def _tokens_file(path: str) -> list[int]:
    try:
        with open(path) as f:
            tokens = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON file with a list of token ids, got {path!r} ({e})") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise argparse.ArgumentTypeError(f"expected a JSON list of token ids (ints), got {type(tokens).__name__}")
    return tokens


# ------------------------------------------------------------------------------------------------ parsers
def _daemon_parser() -> _Parser:
    ap = _Parser(
        prog="kvx node",
        description="Run the host's KV pool: one file of chunk slots in shared memory, mapped by every vLLM\n"
        "engine on the host, and a unix socket through which they allocate, commit and pin slots.\n"
        "Runs in the foreground and logs to stderr; SIGTERM or SIGINT stops it and removes the socket\n"
        "and the pool file. It always starts empty.",
        epilog="Ask a running daemon: kvx node {"
        + ",".join(_SUBCOMMANDS)
        + "} --socket PATH ...\n"
        + "".join(f"  {name:7s} {text}\n" for name, text in _SUBCOMMANDS.items())
        + "(kvx node SUBCOMMAND --help for its arguments)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--socket", required=True, metavar="PATH", help="the unix socket to listen on")
    ap.add_argument("--size", required=True, type=_size, metavar="SIZE", help="bytes of the pool, e.g. 64GiB")
    ap.add_argument(
        "--slot-size",
        type=_slot_size,
        metavar="SIZE",
        default="64KiB",
        help="bytes of one slot, the pool's allocation unit (default 64KiB): a chunk takes the fewest consecutive "
        "slots that hold it, so the chunks of every model on the host share the pool; or auto: slots as large as "
        "the first engine's chunks (the pool made at its hello)",
    )
    ap.add_argument(
        "--pool",
        metavar="PATH",
        help="the pool file (default /dev/shm/kvx-node-<hash of the socket path>.pool; a hugetlbfs path)",
    )
    ap.add_argument(
        "--socket-mode",
        type=_mode,
        metavar="MODE",
        default=0o660,
        help="octal mode of the socket and the pool file (default 660)",
    )
    ap.add_argument(
        "--metrics-port", type=_port, metavar="PORT", default=0, help="Prometheus endpoint's port (default 0: none)"
    )
    ap.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        metavar="UID",
        help="admit this uid's processes (repeatable; the daemon's own uid and root always are). The socket's and "
        "the pool's mode must let them in too (e.g. --socket-mode 666)",
    )
    ap.add_argument(
        "--allow-gid",
        type=int,
        action="append",
        default=[],
        metavar="GID",
        help="admit processes whose primary group is GID (repeatable); the socket and the pool file are given to "
        "the first one",
    )
    ap.add_argument(
        "--quota",
        type=_quota,
        action="append",
        default=[],
        metavar="NS=SIZE",
        help="register namespace NS (hex) with a quota, e.g. 3f9a...=8GiB (repeatable)",
    )
    ap.add_argument(
        "--quarantine-s",
        type=float,
        default=5.0,
        metavar="S",
        help="a slot an engine left being written when its connection closed is reused this many seconds later "
        "(default 5: its workers may still be writing it)",
    )
    cluster = ap.add_argument_group("cluster (nodes on other hosts: a miss here is pulled from a peer that has it)")
    cluster.add_argument(
        "--listen", metavar="HOST:PORT", help="where peers reach this node (its address on the hosts' network)"
    )
    cluster.add_argument("--peers", metavar="HOST:PORT[,...]", help="the other nodes' --listen addresses")
    cluster.add_argument(
        "--membership",
        metavar="URL",
        help="in place of --peers: a Redis (redis://, rediss://, unix://, redis+sentinel://) where the nodes "
        "announce themselves with a heartbeat and leave by expiry",
    )
    cluster.add_argument(
        "--membership-cluster", action="store_true", help="the --membership url names a node of a Redis Cluster"
    )
    cluster.add_argument(
        "--membership-ttl-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a member not heard from this long has left (default 10; heartbeats every quarter of it)",
    )
    cluster.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the cluster's shared secret (16+ bytes, the same file on every node): only nodes holding it are peers",
    )
    cluster.add_argument(
        "--transport",
        choices=("tcp", "nixl"),
        default="tcp",
        help="how chunk bytes move between nodes: tcp (kvx's own channel, default) or nixl (one NIXL READ over UCX); "
        "the same on every node",
    )
    cluster.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        metavar="S",
        help="a peer's connection idle this long is closed, and the leases it held released (default 30)",
    )
    cluster.add_argument(
        "--node-id", metavar="ID", help="this node's name among its peers (default: HOST:PORT of --listen)"
    )
    return ap


def _cluster(args: argparse.Namespace):
    """The daemon's cluster config from its flags (None without --listen); :class:`_UsageError` for bad ones,
    before anything starts."""
    from .handshake import read_secret
    from .peers import ClusterConfig, parse_address

    if args.listen is None:
        for flag, value in (
            ("--peers", args.peers),
            ("--membership", args.membership),
            ("--secret-file", args.secret_file),
        ):
            if value is not None:
                raise _UsageError(f"kvx node: {flag}: expected --listen HOST:PORT with it, got {flag} alone")
        return None
    try:
        listen = parse_address(args.listen, "--listen")
        peers = tuple(parse_address(p, "--peers") for p in (args.peers or "").split(",") if p.strip())
        if args.secret_file is None:
            raise ValueError("--secret-file: expected the cluster's secret file with --listen, got none")
        secret = read_secret(args.secret_file)
    except ValueError as e:
        raise _UsageError(f"kvx node: {e}") from None
    if listen in peers:
        raise _UsageError(f"kvx node: --peers: expected the other nodes, got this node's own --listen {args.listen}")
    if peers and args.membership:
        raise _UsageError("kvx node: --membership: expected in place of --peers, got both")
    if not args.lease_s > 0:
        raise _UsageError(f"kvx node: --lease-s: expected seconds > 0, got {args.lease_s}")
    if not args.membership_ttl_s > 0:
        raise _UsageError(f"kvx node: --membership-ttl-s: expected seconds > 0, got {args.membership_ttl_s}")
    if args.membership and not args.membership_cluster:  # a cluster's client connects as it is made: at start
        from .membership import redis_client

        try:
            redis_client(args.membership, args.membership_cluster, 2.0)  # the url's form, before anything starts
        except ValueError as e:
            raise _UsageError(f"kvx node: {e}") from None
    return ClusterConfig(
        args.node_id or f"{listen[0]}:{listen[1]}",
        listen,
        peers,
        secret,
        args.transport,
        membership=args.membership,
        membership_cluster=args.membership_cluster,
        membership_ttl_s=args.membership_ttl_s,
        lease_s=args.lease_s,
    )


def _control_parser() -> _Parser:
    ap = _Parser(prog="kvx node", description="Ask a running kvx node.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--socket", required=True, metavar="PATH", help="the daemon's unix socket")
        if name == "stats":
            p.add_argument("--json", action="store_true", help="the raw reply as JSON")
            continue
        p.add_argument("--namespace", required=True, type=_namespace, metavar="NS", help="the engine namespace (hex)")
        if name == "quota":
            p.add_argument(
                "--bytes", required=True, type=_quota_bytes, metavar="SIZE", help="a size such as 8GiB, or none"
            )
            continue
        prompt = p.add_mutually_exclusive_group(required=name in _PROMPT_OPS)
        prompt.add_argument("--tokens", type=_tokens, metavar="IDS", help="the prompt's token ids: 1,2,3,...")
        prompt.add_argument(
            "--tokens-file", type=_tokens_file, metavar="FILE", help="a JSON file with the prompt's token ids"
        )
        p.add_argument("--cache-salt", metavar="SALT", help="the request's cache_salt, if it had one")
        p.add_argument(
            "--kvx-namespace", metavar="NAME", help="the request's kvx_namespace (kv_transfer_params), if it had one"
        )
    return ap


# ------------------------------------------------------------------------------------------------ the daemon
def _run_daemon(args: argparse.Namespace) -> int:
    from .daemon import NodeServer, StartError, default_pool_path

    slot = args.slot_size if args.slot_size is not None else SLOT_ALIGN  # auto: at least the smallest slot
    geom = PoolGeometry.fit(args.size, slot)
    if geom.num_slots < 1:
        raise _UsageError(
            f"kvx node: --size: expected room for the table and at least one slot of --slot-size "
            f"{args.slot_size or 'auto'} ({PoolGeometry(1, slot).file_bytes} bytes or more), got {args.size}"
        )
    if args.slot_size is None:
        geom = None  # made at the first engine's hello
    cluster = _cluster(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    server = NodeServer(
        args.socket,
        args.pool or default_pool_path(args.socket),
        geom,
        socket_mode=args.socket_mode,
        allow_uids=args.allow_uid,
        allow_gids=args.allow_gid,
        quotas=dict(args.quota),
        metrics_port=args.metrics_port,
        quarantine_s=args.quarantine_s,
        size=args.size,
        cluster=cluster,
    )
    previous = {sig: signal.signal(sig, lambda *_: server.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # a signal during start: serve() returns at once and cleans up
        server.start()
        server.serve()
    except StartError as e:
        print(f"kvx node: {e}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


# ------------------------------------------------------------------------------------------------ control
def _prompt_keys(conn: Connection, args: argparse.Namespace) -> tuple[list[str], int]:
    """The chunk keys of ``--tokens`` in ``--namespace``, and the namespace's chunk size."""
    from kvx.keys import chunk_keys, request_root

    known = conn.call("stats")["namespaces"]
    if args.namespace not in known:
        raise _UsageError(
            f"kvx node {args.cmd}: --namespace: expected one the daemon knows ({', '.join(known) or 'none yet'}), "
            f"got {args.namespace}"
        )
    chunk_size = known[args.namespace]["chunk_size"]
    if chunk_size is None:
        raise _UsageError(
            f"kvx node {args.cmd}: --namespace: expected one an engine has joined (its chunk size is unknown "
            f"until then), got {args.namespace}, registered by --quota only"
        )
    root = request_root(bytes.fromhex(args.namespace), args.cache_salt, None, args.kvx_namespace)
    try:
        return chunk_keys(root, _prompt(args), chunk_size), chunk_size
    except ValueError as e:  # token ids numpy cannot hold as int64
        raise _UsageError(f"kvx node {args.cmd}: --tokens: {e}") from None


def _prompt(args: argparse.Namespace) -> list[int] | None:
    return args.tokens if args.tokens is not None else args.tokens_file


def _lookup(conn: Connection, args: argparse.Namespace) -> dict:
    keys, chunk_size = _prompt_keys(conn, args)
    ready = conn.call("lookup", namespace=args.namespace, keys=keys)["ready"]
    return {"namespace": args.namespace, "tokens": len(_prompt(args)), "cached_tokens": ready * chunk_size}


def _pin(conn: Connection, args: argparse.Namespace) -> dict:
    keys, chunk_size = _prompt_keys(conn, args)
    pinned = conn.call("pin_prefix", namespace=args.namespace, keys=keys)["pinned"]
    return {"namespace": args.namespace, "tokens": len(_prompt(args)), "pinned_tokens": pinned * chunk_size}


def _unpin(conn: Connection, args: argparse.Namespace) -> dict:
    keys, chunk_size = _prompt_keys(conn, args)
    unpinned = conn.call("unpin_prefix", namespace=args.namespace, keys=keys)["unpinned"]
    return {"namespace": args.namespace, "tokens": len(_prompt(args)), "unpinned_tokens": unpinned * chunk_size}


def _evict(conn: Connection, args: argparse.Namespace) -> dict:
    keys = _prompt_keys(conn, args)[0] if _prompt(args) is not None else None
    evicted = conn.call("evict", namespace=args.namespace, keys=keys)["evicted"]
    return {"namespace": args.namespace, "evicted": evicted}


def _quota_op(conn: Connection, args: argparse.Namespace) -> dict:
    conn.call("quota", namespace=args.namespace, bytes=args.bytes)
    return {"namespace": args.namespace, "quota": args.bytes}


def _stats(conn: Connection, args: argparse.Namespace) -> dict | str:
    s = conn.call("stats")
    for field in ("id", "ok"):
        s.pop(field)
    return s if args.json else _stats_table(s)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _stats_table(s: dict) -> str:
    pool = s["pool"]
    if pool["slot_bytes"] is None:
        head = "pool: not made yet (its slots are sized by the first engine's chunks)"
    else:
        head = (
            f"pool {pool['path']}: {pool['num_slots']} slots x {_mib(pool['slot_bytes'])} = {_mib(pool['bytes'])}; "
            f"used {pool['used']} (pending {pool['pending']}), free {pool['free']}"
        )
    lines = [
        head,
        f"clients {s['clients']}, refused {s['refused_clients']}; bad frames {s['bad_frames']}, bad requests "
        f"{s['bad_requests']}, internal errors {s['internal_errors']}; released on disconnect: "
        f"{s['leases_released']} leases, {s['aborted_on_disconnect']} pending slots",
    ]
    cols = ("namespace", "model", "chunk", "chunks", "pending", "bytes", "hits", "misses", "evicted", "pinned")
    rows = [(*cols, "quota", "clients")]
    for name, n in s["namespaces"].items():
        quota = "-" if n["quota"] is None else _mib(n["quota"])
        rows.append(
            (name[:16], n["model"] or "-", n["chunk_size"] or "-", n["chunks"], n["pending"], _mib(n["bytes"]))
            + (n["hits"], n["misses"], n["evictions"], n["pinned"], quota, n["clients"])
        )
    lines += _columns(rows)
    c = s.get("cluster")
    if c is not None:
        lines.append(
            f"cluster: node {c['node']} on {c['listen']} ({c['transport']}); pulls {c['pulls']}: {c['pulled']} chunks "
            f"pulled, {c['misses']} found nowhere, {c['declined_slow']} cut as too slow, {c['failed']} failed, "
            f"{c['bad_chunks']} bad chunks; served {c['served']} chunks ({_mib(c['bytes_out'])}); refused peers "
            f"{c['refused_peers']}"
        )
        rows = [("peer", "node", "state", "in", "chunks in", "out", "sealed in", "sealed out", "pulls", "failures")]
        rows[0] += ("GB/s",)
        for p in c["peers"]:
            sealed = (_mib(p.get("bytes_sealed_in", 0)), _mib(p.get("bytes_sealed_out", 0)))
            rows.append(
                (p["address"], p["node"] or "-", p["state"], _mib(p["bytes_in"]), p["chunks_in"])
                + (_mib(p["bytes_out"]), *sealed, p["pulls"], p["failures"], p["rate_gbps"] or "-")
            )
        lines += _columns(rows)
    return "\n".join(lines)


def _columns(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]


_CONTROL = {"stats": _stats, "lookup": _lookup, "pin": _pin, "unpin": _unpin, "evict": _evict, "quota": _quota_op}


def _run_control(args: argparse.Namespace) -> int:
    conn = Connection(args.socket, timeout=_TIMEOUT_S)
    try:
        conn.call("hello", version=VERSION, role="control", pid=os.getpid())
        out = _CONTROL[args.cmd](conn, args)
    except NodeUnavailable as e:
        print(f"kvx node {args.cmd}: --socket: expected a running kvx node, got {e}", file=sys.stderr)
        return 1
    except NodeError as e:
        print(f"kvx node {args.cmd}: {e}", file=sys.stderr)
        return 2
    finally:
        conn.close()
    print(out if isinstance(out, str) else json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in _SUBCOMMANDS:
            return _run_control(_control_parser().parse_args(argv))
        return _run_daemon(_daemon_parser().parse_args(argv))
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
