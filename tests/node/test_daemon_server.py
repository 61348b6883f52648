"""``kvx node``'s daemon as a real process (:class:`~kvx.node.daemon.NodeServer` behind its socket): an engine's
cycle against the mapped pool file, posted requests, :class:`~kvx.node.client.NodeIndex` pins from the directory, a
client killed with SIGKILL, garbage frames, a lookup of 256 keys, the Prometheus endpoint, socket and pool permissions
(a refused uid, an allowed gid), a pool made at the first engine's hello (``--slot-size auto``), SIGTERM and a second
daemon on the same socket."""

from __future__ import annotations

import json
import mmap
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import Counter

import pytest

from kvx.node import cli
from kvx.node.connection import Connection
from kvx.node.protocol import (
    FREE,
    HEADER,
    MAGIC,
    MAX_BODY,
    PENDING,
    READY,
    VERSION,
    encode,
    slot_entry,
    unpack_header,
)
from tests.helpers import wait_for
from tests.node.daemon_helpers import NS_A, NS_B, NS_C, REPO, SLOT, START_S, Daemon, key, raw, read_reply


def test_an_engine_cycle_matches_the_mapped_pool_file(node):
    eng = node.engine(NS_A)
    hello = eng.hello
    assert hello["pool"] == node.pool and oct(os.stat(node.pool).st_mode & 0o777) == oct(0o666)
    k1, k2 = key(0xA1), key(0xA2)
    a1 = eng.call("allocate", key=k1)
    a2 = eng.call("allocate", key=k2)
    eng.call("commit", key=k1)
    pinned = eng.call("pin", keys=[k1])
    assert pinned["slots"] == [a1["slot"]] and pinned["generations"] == [a1["generation"]]
    assert eng.call("lookup", keys=[k1, k2, key(0xA3)])["states"] == [READY, PENDING, FREE]
    with open(node.pool, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        geom, epoch = unpack_header(m)
        assert (geom.num_slots, geom.slot_bytes, geom.data_offset) == (
            hello["num_slots"],
            hello["slot_bytes"],
            hello["data_offset"],
        )
        assert epoch.hex() == hello["epoch"] and len(m) >= geom.file_bytes
        assert slot_entry(m, geom, a1["slot"]) == (bytes.fromhex(k1), a1["generation"], READY)
        assert slot_entry(m, geom, a2["slot"]) == (bytes.fromhex(k2), a2["generation"], PENDING)
        eng.call("abort", key=k2)
        assert slot_entry(m, geom, a2["slot"]) == (bytes(16), a2["generation"] + 1, FREE)
    eng.call("unpin", keys=[k1])
    eng.close()


def test_posted_requests_are_answered_in_order_and_read_by_the_next_call(node, caplog):
    eng = node.engine(NS_A)
    k1, k2 = key(0xB1), key(0xB2)
    got = []
    eng.post("allocate", got.append, key=k1)
    eng.post("commit", got.append, key=k1)
    eng.post("pin", keys=[k2])  # refused (not stored), without on_reply: logged, never raised
    eng.post("unpin", got.append, keys=[k2])  # refused too: handed to on_reply
    assert eng.call("lookup", keys=[k1])["states"] == [READY]  # read after the four posted replies
    assert [type(r).__name__ for r in got] == ["dict", "dict", "NodeError"]
    assert got[0]["slot"] >= 0 and "unpin: expected keys this connection leased" in str(got[2])
    assert "kvx node: pin:" in caplog.text
    eng.post("pin", got.append, keys=[k1])
    wait_for(lambda: node.stats()["leases"] == 1, 10, "the posted pin to be held")
    eng.poll()  # its reply is here: read without a request
    assert got[-1]["slots"] == [got[0]["slot"]] and not eng._posted
    eng.post("unpin", keys=[k1])
    eng.drain()
    assert node.stats()["leases"] == 0
    eng.close()


def test_wait_returns_once_a_posted_reply_is_here_and_at_once_with_nothing_posted(node):
    eng = node.engine(NS_A)
    t0 = time.monotonic()
    eng.wait(30)  # nothing posted: nothing to wait for
    assert time.monotonic() - t0 < 10
    got = []
    eng.post("allocate", got.append, key=key(0xB7))
    eng.wait(30)  # returns when the reply is readable, long before its timeout
    assert time.monotonic() - t0 < 10
    eng.poll()
    assert got and got[0]["slot"] >= 0 and not eng._posted
    eng.call("abort", key=key(0xB7))
    eng.close()


def test_a_node_index_pin_is_posted_with_the_directorys_slots_and_released_by_unpin(node):
    from kvx.node.client import NodeIndex

    writer = node.engine(NS_C)
    k1, k2, gone = key(0xC1), key(0xC2), key(0xC3)
    s1, s2 = writer.call("allocate", key=k1)["slot"], writer.call("allocate", key=k2)["slot"]
    writer.call("commit", key=k1)
    writer.call("commit", key=k2)
    idx = NodeIndex(node.socket, bytes.fromhex(NS_C), "tiny", 16, SLOT, timeout=10)
    try:
        assert idx.contains_many([k1, k2, gone]) == [True, True, False]
        assert idx.pin([k1, k2, gone]) == [s1, s2, -1]  # no round trip: the directory's slots
        idx.unpin([k1, k2, gone])  # at once: the pin's reply is read first, so both leases are released
        idx.conn.drain()
        assert node.stats()["leases"] == 0 and not idx._held
        assert idx.pin([k1]) == [s1] and idx.pin([k1]) == [s1]  # two loads of one chunk: two leases
        wait_for(lambda: node.stats()["leases"] == 2, 10, "both posted pins to be held")
        idx.unpin([k1])
        idx.conn.drain()
        assert node.stats()["leases"] == 1 and idx._held == Counter({k1: 1})
    finally:
        idx.close()
        writer.close()
    wait_for(lambda: node.stats()["leases"] == 0, 10, "the closed connection's lease to be released")


KILLED_CLIENT = textwrap.dedent(
    """
    import sys
    from kvx.node.connection import Connection
    from kvx.node.protocol import VERSION

    c = Connection(sys.argv[1])
    c.call("hello", version=VERSION, role="engine", namespace=sys.argv[2], model="tiny", chunk_size=16, slot_bytes=1)
    pending = c.call("allocate", key="%032x" % 1)["slot"]
    ready = c.call("allocate", key="%032x" % 2)["slot"]
    c.call("commit", key="%032x" % 2)
    c.call("pin", keys=["%032x" % 2])
    c.call("hold", key="%032x" % 2)
    print(pending, ready, flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_a_client_killed_with_sigkill_leaves_nothing_pinned_or_pending(node):
    before = node.stats()
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, node.socket, NS_B],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pending, ready = map(int, child.stdout.readline().split())
        ns = node.stats()["namespaces"][NS_B]
        assert (ns["pending"], ns["chunks"], ns["clients"]) == (1, 1, 1)
    finally:
        child.kill()
        child.wait()

    def released():
        s = node.stats()
        gone = s["namespaces"][NS_B]["clients"] == 0
        return gone and s

    after = wait_for(released, 10, "the daemon to see the killed client's connection close")
    assert after["aborted_on_disconnect"] - before["aborted_on_disconnect"] == 1
    assert after["leases_released"] - before["leases_released"] == 2
    assert (after["namespaces"][NS_B]["pending"], after["namespaces"][NS_B]["chunks"]) == (0, 1)
    assert after["pool"]["quarantined"] == 1  # its abandoned slot waits --quarantine-s (5 s) before reuse
    with open(node.pool, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        geom, _ = unpack_header(m)
        assert slot_entry(m, geom, pending)[2] == FREE
        ctl = node.control()
        assert ctl.call("evict", namespace=NS_B, keys=[key(2)])["evicted"] == 1
        assert slot_entry(m, geom, ready)[2] == FREE  # no lease left: freed at once, not doomed
        ctl.close()


def frame(magic: bytes = MAGIC, version: int = VERSION, body: bytes = b"{}", length: int | None = None) -> bytes:
    return HEADER.pack(magic, version, 0, len(body) if length is None else length) + body


BAD_FRAMES = [  # (what, bytes sent, what the error reply names)
    ("random bytes", random.Random(7).randbytes(64), "frame: expected magic"),
    ("wrong magic", frame(magic=b"HTTP"), "frame: expected magic b'KVXN', got b'HTTP'"),
    ("wrong version", frame(version=1), f"frame: expected protocol version {VERSION}, got 1"),
    ("oversize", frame(length=MAX_BODY + 1, body=b""), f"frame: expected a body of at most {MAX_BODY} bytes"),
    ("not JSON", frame(body=b"\xff{not json"), "body: expected a JSON object, got undecodable bytes"),
    ("a JSON list", frame(body=b"[1, 2]"), "body: expected a JSON object, got list"),
    ("deeply nested JSON", frame(body=b"[" * 100_000), "maximum recursion depth exceeded"),
]


def test_garbage_frames_get_an_error_and_a_closed_connection(node):
    before = node.stats()
    for what, data, error in BAD_FRAMES:
        with raw(node) as s:
            s.sendall(data)
            reply = read_reply(s)
            assert reply is not None and reply["id"] is None and not reply["ok"] and error in reply["error"], what
            assert read_reply(s) is None, f"{what}: the connection stays open"
    with raw(node) as s:  # an op before hello: an error, then closed
        s.sendall(encode({"op": "lookup", "id": 1, "keys": []}))
        assert "expected 'hello' first" in read_reply(s)["error"]
        assert read_reply(s) is None
    with raw(node) as s:  # bad requests on a good connection: answered, the connection stays open
        hello = encode({"op": "hello", "id": 1, "version": VERSION, "role": "engine", "namespace": NS_C, "model": "t"})
        hello = encode({**json.loads(hello[HEADER.size :]), "chunk_size": 16, "slot_bytes": 1})
        for byte in hello:  # a frame that arrives one byte at a time
            s.send(bytes([byte]))
        assert read_reply(s)["ok"]
        requests = [
            ({"op": "frobnicate", "id": 2}, "op: expected one of"),
            ({"op": "allocate", "id": 3, "key": "k"}, "key: expected 32 lowercase hex digits, got 'k'"),
            ({"op": "evict", "id": 4, "namespace": "00" * 8}, "namespace: expected a known namespace ("),
        ]
        s.sendall(b"".join(encode(msg) for msg, _ in requests))  # pipelined
        for msg, error in requests:
            reply = read_reply(s)
            assert reply["id"] == msg["id"] and not reply["ok"] and error in reply["error"]
        s.sendall(encode({"op": "lookup", "id": 5, "keys": [key(1)]}))
        assert read_reply(s) == {"id": 5, "ok": True, "states": [FREE]}
    after = node.stats()
    assert after["bad_frames"] - before["bad_frames"] == len(BAD_FRAMES)
    assert after["bad_requests"] - before["bad_requests"] == 4
    assert after["internal_errors"] == 0


def test_a_lookup_of_256_keys(node):
    eng = node.engine(NS_C)
    keys = [key(0xC000 + i) for i in range(256)]
    for k in keys:
        assert eng.call("allocate", key=k)["reason"] is None
        eng.call("commit", key=k)
    assert eng.call("lookup", keys=keys)["states"] == [READY] * 256
    assert eng.call("lookup", keys=[*keys[:100], key(1), *keys[100:]])["states"][100] == FREE
    assert len(eng.call("pin", keys=keys)["slots"]) == 256
    eng.call("unpin", keys=keys)
    eng.close()


def test_the_metrics_endpoint(node):
    eng = node.engine(NS_A)
    eng.call("lookup", keys=[key(0xA1)])  # stored by the engine-cycle test, or not: a hit or a miss

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
        return f'kvx_node_hits_total{{model="tiny",namespace="{NS_A}"}}' in text and text

    text = wait_for(scrape, 10, "the metrics to show the namespace")
    eng.close()
    s = node.stats()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvx_")
    }
    assert values["kvx_node_slots"] == s["pool"]["num_slots"]
    assert values["kvx_node_pool_bytes"] == s["pool"]["num_slots"] * SLOT
    for name in ("kvx_node_slots_used", "kvx_node_clients", "kvx_node_refused_clients_total"):
        assert name in values
    assert values["kvx_node_bad_frames_total"] >= 0
    labels = f'{{model="tiny",namespace="{NS_A}"}}'
    for name in ("chunks", "bytes", "hits_total", "misses_total", "evictions_total", "pinned_chunks"):
        assert f"kvx_node_{name}{labels}" in values
    assert f"kvx_node_quota_bytes{labels}" not in values  # no quota


NOBODY = 65534


def hello_as_nobody(path: str) -> str:
    """In a forked child running as uid and gid 65534: connect to ``path`` and say hello. What happened: "closed"
    (no reply), "ok", "refused: <error>", or "failed: <exception>"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(path)
                s.sendall(encode({"op": "hello", "id": 1, "version": VERSION, "role": "control"}))
                reply = read_reply(s)
            what = "closed" if reply is None else "ok" if reply["ok"] else f"refused: {reply['error']}"
        except BrokenPipeError:
            what = "closed"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            what = f"failed: {e!r}"
        os.write(w, what.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        what = f.read().decode()
    os.waitpid(pid, 0)
    return what


def test_a_refused_uid_is_disconnected_and_counted(node):
    if os.getuid() != 0:
        pytest.skip("needs root, to run a child as uid 65534")
    before = node.stats()["refused_clients"]
    assert hello_as_nobody(node.socket) == "closed"  # the socket's mode (666) let it connect; its uid did not
    assert node.stats()["refused_clients"] == before + 1


def test_an_allowed_gid_is_admitted_and_given_the_socket_and_pool(short_dir):
    if os.getuid() != 0:
        pytest.skip("needs root, to run a child as uid 65534")
    root = short_dir / "gid"
    root.mkdir()
    root.chmod(0o755)
    d = Daemon(root, "--allow-gid", str(NOBODY)).wait_ready()  # socket mode 660: the group's
    try:
        assert os.stat(d.socket).st_gid == NOBODY and os.stat(d.pool).st_gid == NOBODY
        assert oct(os.stat(d.pool).st_mode & 0o777) == oct(0o660)
        assert hello_as_nobody(d.socket) == "ok"
        assert d.stats()["refused_clients"] == 0
    finally:
        assert d.stop() == 0, d.stderr()


def test_a_daemon_with_auto_slots_makes_its_pool_at_the_first_engines_hello(short_dir, capsys):
    root = short_dir / "auto"
    root.mkdir()
    d = Daemon(root, "--slot-size", "auto").wait_ready()
    try:
        assert cli.main(["stats", "--socket", d.socket]) == 0
        assert "pool: not made yet (its slots are sized by the first engine's chunks)" in capsys.readouterr().out
        assert not os.path.exists(d.pool)
        eng = Connection(d.socket, timeout=10)
        hello = eng.call(
            "hello", version=VERSION, role="engine", namespace=NS_A, model="m", chunk_size=16, slot_bytes=3 * SLOT - 1
        )
        assert hello["slot_bytes"] == 3 * SLOT and hello["pool"] == d.pool and os.path.exists(d.pool)
        pool = d.stats()["pool"]
        assert pool["slot_bytes"] == 3 * SLOT and pool["num_slots"] * 3 * SLOT <= 8 << 20
        assert eng.call("allocate", key=key(1))["slot"] == 0
        eng.close()
        assert "slots sized by the first engine's chunks" in d.stderr()
    finally:
        assert d.stop() == 0, d.stderr()
    assert not os.path.exists(d.pool)


def test_sigterm_stops_cleanly_and_a_second_daemon_refuses_the_socket(short_dir):
    root = short_dir / "term"
    root.mkdir()
    stale = socket.socket(socket.AF_UNIX)  # a socket file whose daemon died: reused
    stale.bind(str(root / "s"))
    stale.close()
    first = Daemon(root, pool=None).wait_ready()  # the default pool path, on /dev/shm
    try:
        pool_inode = os.stat(first.pool).st_ino
        eng = first.engine(NS_A)
        eng.call("allocate", key=key(1))
        second = Daemon(root, pool=None)
        assert second.proc.wait(START_S) == 1
        assert f"another kvx node is listening on {first.socket}" in second.stderr()
        assert os.stat(first.pool).st_ino == pool_inode  # the second daemon did not touch the first's pool
        assert eng.call("lookup", keys=[key(1)])["states"] == [PENDING]
    finally:
        assert first.stop() == 0, first.stderr()
    assert closed_by_daemon(eng)
    assert not os.path.exists(first.socket) and not os.path.exists(first.pool)
    assert "stopping; closing 1 connection(s)" in first.stderr()


def closed_by_daemon(conn: Connection) -> bool:
    """True if the connection was closed by the daemon."""
    try:
        conn.call("lookup", keys=[])
    except OSError:
        return True
    return False
