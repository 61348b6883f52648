"""The multi-host rig of :mod:`kvx.testing.netns`: hosts reach each other only over TCP through their links, never
through another host's 127.0.0.1; a cut link makes TCP to and from its host time out (no refusal, no reset) and
stalls an established connection, which carries on after the link is restored; leaving the cluster removes its
namespaces and kills their processes, also after a failure, and a crashed run's namespaces are cleaned up.

On each host an agent process (:data:`AGENT`) does the socket calls the test asks for, one JSON line each."""

from __future__ import annotations

import ipaddress
import json
import os
import select
import subprocess
import sys
import time

import pytest

from kvx.testing.netns import Cluster, Host, available, remove_stale

# Reads {"op": ...} lines, answers each with one JSON line. listen(host, port) -> {"port"}: echoes every
# connection (a thread each); connect(host, port, timeout) -> {"id", "local"} or {"error": "timeout" | errno name};
# send(id, data); recv(id, timeout) -> {"data"} or {"error"}.
AGENT = r"""
import errno, json, socket, sys, threading
socks = {}
def echo(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
def accept(srv):
    while True:
        c, _ = srv.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()
def failed(e):
    return {"error": "timeout" if isinstance(e, TimeoutError) else errno.errorcode.get(e.errno, repr(e))}
def do(cmd):
    op = cmd["op"]
    if op == "listen":
        srv = socket.create_server((cmd["host"], cmd["port"]))
        threading.Thread(target=accept, args=(srv,), daemon=True).start()
        return {"port": srv.getsockname()[1]}
    if op == "connect":
        s = socket.socket()
        s.settimeout(cmd["timeout"])
        try:
            s.connect((cmd["host"], cmd["port"]))
        except OSError as e:
            s.close()
            return failed(e)
        socks[len(socks)] = s
        return {"id": len(socks) - 1, "local": s.getsockname()[0]}
    s = socks[cmd["id"]]
    if op == "send":
        s.sendall(cmd["data"].encode())
        return {}
    if op == "recv":
        s.settimeout(cmd["timeout"])
        try:
            return {"data": s.recv(65536).decode()}
        except OSError as e:
            return failed(e)
for line in sys.stdin:
    print(json.dumps(do(json.loads(line))), flush=True)
"""


@pytest.fixture(autouse=True)
def _needs_netns():
    if (reason := available()) is not None:
        pytest.skip(reason)


class Agent:
    """:data:`AGENT` running on ``host``; killed with the cluster."""

    def __init__(self, host: Host):
        self.host = host
        self.proc = host.popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, op: str, wait_s: float = 10.0, **kw) -> dict:
        """Do ``op``; its answer (waits at most ``wait_s``)."""
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], wait_s)
        assert ready, f"{self.host}: no answer to {op} {kw} in {wait_s} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.host}: agent exited ({self.proc.poll()}) on {op} {kw}"
        return json.loads(line)


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], check=True, capture_output=True, text=True).stdout.strip()
    return {e["name"] for e in json.loads(out)} if out else set()


def gone(pid: int) -> bool:
    """The process ``pid`` has ended (no longer exists, or is a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.01)


def test_hosts_talk_over_their_own_addresses():
    with Cluster(2) as c:
        a, b = (Agent(h) for h in c.hosts)
        assert c.hosts[0].addr != c.hosts[1].addr
        assert all(ipaddress.ip_address(h.addr) in c.subnet for h in c.hosts)
        port = a("listen", host=c.hosts[0].addr, port=0)["port"]
        conn = b("connect", host=c.hosts[0].addr, port=port, timeout=5)
        assert conn["local"] == c.hosts[1].addr  # B's side of the connection is B's own address
        b("send", id=conn["id"], data="hello over the bridge")
        got = ""
        while len(got) < len("hello over the bridge"):
            got += b("recv", id=conn["id"], timeout=5)["data"]
        assert got == "hello over the bridge"


def test_a_hosts_loopback_is_its_own():
    root_links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    with Cluster(2) as c:
        a, b = (Agent(h) for h in c.hosts)
        port = a("listen", host="127.0.0.1", port=0)["port"]
        assert "id" in a("connect", host="127.0.0.1", port=port, timeout=5)  # there, for A
        assert b("connect", host="127.0.0.1", port=port, timeout=5) == {"error": "ECONNREFUSED"}  # B's own lo
        assert b("connect", host=c.hosts[0].addr, port=port, timeout=5) == {"error": "ECONNREFUSED"}
        # nothing of the cluster is in the root namespace
        now = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
        assert {ln.split(":")[1] for ln in now.splitlines()} == {ln.split(":")[1] for ln in root_links.splitlines()}
        routes = subprocess.run(["ip", "-4", "-j", "route", "show", "table", "all"], capture_output=True, text=True)
        dsts = [r["dst"] for r in json.loads(routes.stdout) if r.get("dst", "default") != "default"]
        assert not [d for d in dsts if ipaddress.ip_network(d, strict=False).overlaps(c.subnet)]


def test_a_cut_link_times_out_and_stalls_until_restored():
    with Cluster(2) as c:
        ha, hb = c.hosts
        a, b = Agent(ha), Agent(hb)
        pa = a("listen", host="0.0.0.0", port=0)["port"]
        pb = b("listen", host="0.0.0.0", port=0)["port"]
        conn = b("connect", host=ha.addr, port=pa, timeout=5)["id"]
        b("send", id=conn, data="before")
        assert b("recv", id=conn, timeout=5) == {"data": "before"}

        ha.cut()
        t0 = time.monotonic()
        assert b("connect", host=ha.addr, port=pa, timeout=0.5) == {"error": "timeout"}  # not refused: no RST
        assert a("connect", host=hb.addr, port=pb, timeout=0.5) == {"error": "timeout"}  # nor the other way
        assert time.monotonic() - t0 >= 1.0
        b("send", id=conn, data="during")  # into the socket buffer; the segment is lost
        assert b("recv", id=conn, timeout=0.5) == {"error": "timeout"}  # no echo: the connection stalls

        ha.restore()
        assert b("recv", id=conn, timeout=10) == {"data": "during"}  # retransmitted once the link is back
        assert "id" in b("connect", host=ha.addr, port=pa, timeout=5)
        assert "id" in a("connect", host=hb.addr, port=pb, timeout=5)


def test_leaving_removes_the_namespaces_and_their_processes():
    with Cluster(2) as c:
        made = {c.switch} | {h.name for h in c.hosts}
        assert made <= netns_names()
    assert not made & netns_names()

    with pytest.raises(RuntimeError, match="the body failed"), Cluster(3) as c:
        made = {c.switch} | {h.name for h in c.hosts}
        started = c.hosts[0].popen(["sleep", "60"])
        # a process the cluster did not start: found through `ip netns pids`
        orphan = int(c.hosts[2].run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True).stdout)
        assert made <= netns_names() and not gone(orphan)
        raise RuntimeError("the body failed")
    assert not made & netns_names()
    assert started.returncode is not None
    wait_for(lambda: gone(orphan), "the process left in a namespace killed")


def test_entering_that_fails_halfway_removes_what_it_made(monkeypatch):
    def link_never_up(self):
        raise TimeoutError(f"{self.name}: link not up")

    monkeypatch.setattr(Host, "_wait_up", link_never_up)
    prefix = f"kvxhalf{os.getpid()}"
    with pytest.raises(TimeoutError, match="link not up"), Cluster(2, prefix=prefix):
        pass
    assert not [n for n in netns_names() if n.startswith(prefix)]


def test_a_crashed_runs_namespaces_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"kvx{dead.pid}-h0"
    live = f"kvx{os.getpid()}.999-h0"  # this process's: kept
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        with Cluster(1):
            names = netns_names()
            assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in remove_stale() and stale not in netns_names()
