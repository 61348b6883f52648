"""Several "hosts" on one machine for tests: each a Linux network namespace with its own IPv4 address, all joined
by one bridge, so that processes on different hosts talk only over real TCP through their links (never through
127.0.0.1 by accident), and a link can be cut (a network partition) and restored.

Topology of ``Cluster(3)`` (prefix ``kvx1234``, subnet ``10.213.4.0/24``)::

    namespace kvx1234-sw (the switch: no address, no route, only a bridge)
        br0 (bridge, STP off) -- p0, p1, p2 (veth ends)
                                  |   |   |
    namespace kvx1234-h0:  eth0 10.213.4.2/24 (the other end of p0), lo up
    namespace kvx1234-h1:  eth0 10.213.4.3/24
    namespace kvx1234-h2:  eth0 10.213.4.4/24

Nothing is created in the root namespace, even for a moment (the veth pairs are made in the switch namespace
with their other end put straight into the host's), and no sysctl of the root namespace is read or changed:
the hosts route only to their /24, which has no way out, so nothing leaks into the machine's routing. In the
switch namespace the ``bridge-nf-call-*`` sysctls (there when ``br_netfilter`` is loaded, 1 by default in every
new namespace) are set to 0, so frames crossing the bridge never go through netfilter.

Every host knows every other host's MAC address (a permanent neighbour entry: no ARP), so a cut behaves as a
partition of a routed network: packets to and from the host vanish, and TCP times out. There is no ARP failure
that would turn into ``EHOSTUNREACH`` after ~3 s and no RST. :meth:`Host.cut` takes the host's veth end on the
bridge side down (``ip link set pN down`` in the switch namespace): frames the bridge would send to the host are
dropped, and the host's own ``eth0`` keeps its address and its route (flagged ``linkdown``, still used) but loses
its carrier, so what it sends is dropped too. Taking the host's own ``eth0`` down instead would remove its route,
and its connects would fail at once with ``ENETUNREACH``, not time out.

The file system, ``/dev/shm`` and the process table are shared by all hosts (only the network is not): a test
gives each host its own paths. ``ip netns exec`` keeps the environment (``PATH``, a virtual environment) and
remounts ``/sys`` for the namespace.

Names: the namespaces are ``{prefix}-sw`` and ``{prefix}-h{i}``; the default prefix is ``kvx{pid}`` (``kvx{pid}.{k}``
for a process's k-th cluster). Interface names are fixed and short (``br0``, ``p{i}``, ``eth0``): each lives in its
own namespace. A cluster starting removes the namespaces a crashed run left (names ``kvx{pid}...`` whose pid is
no longer running).

    with Cluster(2) as c:
        a, b = c.hosts
        server = a.popen([sys.executable, "-m", "some.server", "--bind", a.addr])
        b.run([sys.executable, "-m", "some.client", a.addr])
        a.cut()      # a partition: b's packets to a vanish
        a.restore()

Tests skip only through :func:`available` (not root, no ``ip`` binary, namespaces not permitted).
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Sequence

__all__ = ["Cluster", "Host", "available", "remove_stale"]

BRIDGE = "br0"  # the bridge, in the switch namespace
DEV = "eth0"  # each host's link, in its namespace
MAX_HOSTS = 200  # addresses .2 ... .201 of the /24
SETTLE_S = 10.0  # the longest a link may take to come up (restore, start) or a namespace's processes to die

# the namespaces this module makes: kvx{pid}[.{k}]-{sw|h{i}|probe}; a crashed run's are removed by the next
_OURS = re.compile(r"^kvx(\d+)(?:\.\d+)?-(?:sw|probe|h\d+)$")
_PREFIX = re.compile(r"^[A-Za-z0-9_.]{1,40}$")
_clusters = itertools.count()  # the k of a process's default prefixes


def _ip(*args: str, stdin: str | None = None) -> str:
    """Run ``ip ARGS`` and return its stdout; raises RuntimeError naming the command and ip's error."""
    r = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def _netns_names() -> list[str]:
    """The named network namespaces (``ip netns list``)."""
    out = _ip("-j", "netns", "list").strip()
    return [e["name"] for e in json.loads(out)] if out else []


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(name: str) -> None:
    """Kill every process in namespace ``name`` (SIGKILL), wait until none is left, delete the namespace (its
    interfaces go with it; their veth peers in other namespaces too)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        if r.returncode:  # gone already (or never made completely)
            break
        pids = [int(p) for p in r.stdout.split()]
        if not pids:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"namespace {name}: processes {pids} still running {SETTLE_S} s after SIGKILL")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    if name in _netns_names():
        _ip("netns", "del", name)


def remove_stale() -> list[str]:
    """Delete the namespaces an earlier run of this module left behind (names ``kvx{pid}...`` whose process is
    no longer running), with any process still in them; returns their names. :meth:`Cluster.__enter__` calls it."""
    stale = [n for n in _netns_names() if (m := _OURS.match(n)) and not _pid_running(int(m.group(1)))]
    for name in stale:
        _delete_netns(name)
    return stale


@functools.cache
def available() -> str | None:
    """None if this machine can run a :class:`Cluster`, else why not (for ``pytest.skip``): not root, no ``ip``
    binary, or a namespace with a bridge and a veth pair cannot be made. Probed once per process."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid is {os.geteuid()})"
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2) on PATH"
    name = f"kvx{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
        try:
            _ip("-n", name, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        finally:
            _delete_netns(name)
    except (RuntimeError, OSError) as e:
        return f"cannot make a network namespace with a bridge and a veth pair: {e}"
    return None


def _pick_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0 - 10.249.255.0, picked from ``seed`` (a hash of the prefix, which holds the pid), that
    overlaps no route or address of the root namespace (not needed for isolation: the hosts cannot reach it; but
    an address in a log then names one thing only)."""
    taken = []
    for e in json.loads(_ip("-4", "-j", "route", "show", "table", "all") or "[]"):
        dst = e.get("dst", "default")
        if dst != "default":
            taken.append(ipaddress.ip_network(dst, strict=False))
    for link in json.loads(_ip("-4", "-j", "addr") or "[]"):
        for a in link.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    n = 50 * 256
    for k in range(n):
        i = (seed + k) % n
        net = ipaddress.IPv4Network(f"10.{200 + i // 256}.{i % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 in 10.200.0.0/13 - 10.249.255.0/24: the root namespace's routes cover them all")


class Host:
    """One simulated host: network namespace :attr:`name`, whose only link ``eth0`` (:attr:`addr`/24) goes to the
    cluster's bridge. Made by :class:`Cluster`; used from the thread that uses the cluster (nothing is locked)."""

    def __init__(self, name: str, addr: str, mac: str, switch: str, port: str):
        self.name = name  # the namespace
        self.addr = addr  # its IPv4 address
        self.mac = mac  # eth0's MAC address
        self._switch, self._port = switch, port  # its veth end on the bridge: port, in namespace switch
        self._procs: list[subprocess.Popen] = []  # started by popen: killed and reaped when the cluster ends

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr!r})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs it in this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in this host's namespace (``subprocess.Popen`` with ``kw``); killed (SIGKILL) and reaped
        when the cluster ends if still running."""
        p = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(p)
        return p

    def run(self, argv: Sequence[str], *, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host's namespace and wait for it (``subprocess.run`` with ``check`` and ``kw``)."""
        return subprocess.run(self.argv(argv), check=check, **kw)

    def cut(self) -> None:
        """Cut this host off: its link goes down on the bridge side, so every packet to or from it is dropped
        from now on (TCP to or from it times out; nothing is refused). Its own ``eth0`` keeps its address and
        route. Until :meth:`restore`."""
        _ip("-n", self._switch, "link", "set", self._port, "down")

    def limit(self, rate: str) -> None:
        """Cap what this host sends at ``rate`` (``tc``'s units: "4gbit"), a token bucket on its ``eth0``: a link
        slower than the machine's cores, as between real hosts, where the wire, not the CPU, paces a transfer."""
        tbf = ["qdisc", "replace", "dev", DEV, "root", "tbf", "rate", rate, "burst", "4mb", "latency", "100ms"]
        subprocess.run(["tc", "-n", self.name, *tbf], check=True, capture_output=True)

    def restore(self) -> None:
        """Undo :meth:`cut`; returns once the link forwards again (TCP's pending retransmissions get through)."""
        _ip("-n", self._switch, "link", "set", self._port, "up")
        self._wait_up()

    def _wait_up(self) -> None:
        """Wait until the bridge forwards to and from this host and its ``eth0`` has a carrier."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            port = json.loads(_ip("-n", self._switch, "-j", "-d", "link", "show", self._port))[0]
            dev = json.loads(_ip("-n", self.name, "-j", "link", "show", DEV))[0]
            state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
            if state == "forwarding" and port["operstate"] == "UP" and dev["operstate"] == "UP":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: link not up {SETTLE_S} s after `ip link set {self._port} up`: bridge port "
                    f"{state}/{port['operstate']}, {DEV} {dev['operstate']}"
                )
            time.sleep(0.005)

    def _stop(self) -> None:
        """Kill (SIGKILL) and reap the processes :meth:`popen` started that still run."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
                try:
                    p.wait(timeout=SETTLE_S)
                except subprocess.TimeoutExpired:
                    pass


class Cluster:
    """``n`` hosts (:attr:`hosts`, addresses ``.2``, ``.3``, ... of :attr:`subnet`) on one bridge in namespace
    :attr:`switch`; a context manager. Entering makes everything (after removing a crashed run's namespaces);
    leaving kills every process still in the cluster's namespaces and deletes them, also after an exception, and
    also when entering failed halfway. Used from one thread (nothing is locked)."""

    def __init__(self, n: int, prefix: str | None = None):
        """``prefix``: of the namespaces' names, unique among the clusters that exist at one time (default
        ``kvx{pid}``, ``kvx{pid}.{k}`` for this process's k-th cluster)."""
        if not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n: expected an int in 1..{MAX_HOSTS}, got {n!r}")
        k = next(_clusters)
        if prefix is None:
            prefix = f"kvx{os.getpid()}" + (f".{k}" if k else "")
        elif not _PREFIX.match(prefix):
            raise ValueError(f"prefix: expected 1-40 characters of A-Z a-z 0-9 _ ., got {prefix!r}")
        self.n, self.prefix = n, prefix
        self.switch = f"{prefix}-sw"  # the namespace of the bridge
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None  # picked on entering
        self._made: list[str] = []  # namespaces this cluster created, in order
        self._entered = False

    def __repr__(self) -> str:
        return f"Cluster({self.n}, prefix={self.prefix!r}, subnet={self.subnet})"

    def __enter__(self) -> Cluster:
        if self._entered:
            raise RuntimeError(f"{self!r}: entered twice (a Cluster is used once)")
        self._entered = True
        try:
            self._create()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        errors = self._teardown()
        if errors and exc_type is None:
            raise RuntimeError(f"{self!r}: teardown failed: " + "; ".join(errors))

    def _create(self) -> None:
        remove_stale()
        names = [self.switch] + [f"{self.prefix}-h{i}" for i in range(self.n)]
        clash = sorted(set(names) & set(_netns_names()))
        if clash:
            raise RuntimeError(
                f"prefix: namespaces {clash} exist already (another cluster with prefix {self.prefix!r})"
            )
        self.subnet = net = _pick_subnet(zlib.crc32(self.prefix.encode()))
        x, y = net.network_address.packed[1:3]

        self._add_netns(self.switch)
        bridge_nf = "for f in /proc/sys/net/bridge/bridge-nf-call-*; do [ -e $f ] && echo 0 > $f; done; true"
        subprocess.run(["ip", "netns", "exec", self.switch, "sh", "-c", bridge_nf], check=True, capture_output=True)
        sw = [f"link add {BRIDGE} type bridge stp_state 0 forward_delay 0 mcast_snooping 0", f"link set {BRIDGE} up"]
        _ip("-n", self.switch, "-batch", "-", stdin="\n".join(sw) + "\n")

        for i in range(self.n):
            addr = str(net.network_address + 2 + i)
            host = Host(names[1 + i], addr, f"02:6b:{x:02x}:{y:02x}:00:{2 + i:02x}", self.switch, f"p{i}")
            self._add_netns(host.name)
            self.hosts.append(host)
            peer = ["peer", "name", DEV, "address", host.mac, "netns", host.name]  # made straight in its namespace
            _ip("-n", self.switch, "link", "add", host._port, "type", "veth", *peer)
            _ip("-n", self.switch, "link", "set", host._port, "master", BRIDGE, "up")
        for host in self.hosts:
            cmds = ["link set lo up", f"addr add {host.addr}/24 dev {DEV}", f"link set {DEV} up"]
            cmds += [f"neigh replace {o.addr} lladdr {o.mac} dev {DEV} nud permanent" for o in self.hosts if o != host]
            _ip("-n", host.name, "-batch", "-", stdin="\n".join(cmds) + "\n")
        for host in self.hosts:
            host._wait_up()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _teardown(self) -> list[str]:
        """Kill the processes, delete the namespaces this cluster made (hosts first); returns what failed."""
        errors = []
        for host in self.hosts:
            host._stop()
        for name in reversed(self._made):
            try:
                _delete_netns(name)
            except Exception as e:  # go on: the other namespaces still go
                errors.append(f"{name}: {e}")
        self._made.clear()
        return errors
