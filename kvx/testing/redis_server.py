"""Real ``redis-server`` processes for tests, benchmarks and demos (never mocks).

A :class:`RedisServer` is one server on 127.0.0.1 (a free port, optionally a unix socket, a password,
a memory limit and eviction policy) in its own temporary directory, started with persistence off
(``--save "" --appendonly no``) and ready when its ``__init__`` returns (PING answered). It can be
stopped, killed, paused (SIGSTOP: a server that hangs) and restarted on the same port, which is how the
Redis tier's fault tests drive faults. :class:`RedisClusterServers` is a cluster of such servers;
:class:`RedisSentinelServers` a master, its replicas and the Sentinels that fail it over.

Every process started here is stopped on ``stop()``, on leaving the ``with`` block, at interpreter exit
(``atexit``) and, for servers started from the main thread, when this process dies (``PR_SET_PDEATHSIG``:
a test run killed by a timeout leaves no server behind).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from urllib.parse import quote

__all__ = ["RedisClusterServers", "RedisSentinelServers", "RedisServer", "redis_cli_binary", "redis_server_binary"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEPS_BIN = os.path.join(_REPO, ".deps", "redis", "usr", "bin")
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (its bus)

_LIVE: weakref.WeakSet = weakref.WeakSet()  # servers with a process, for the atexit sweep


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    local = os.path.join(_DEPS_BIN, name)
    if os.access(local, os.X_OK):
        return local
    raise RuntimeError(
        f"{name}: expected it on PATH or at {local}, found neither (install the Debian package "
        f"redis-server / redis-tools, or without root: `apt-get download redis-server redis-tools` "
        f"then `dpkg -x <deb> {os.path.join(_REPO, '.deps', 'redis')}`)"
    )


def binary_env() -> dict[str, str] | None:
    """The environment to run the binaries in: the libraries of an unpacked package (``.deps``, see
    scripts/setup.sh) on LD_LIBRARY_PATH when the binaries come from there."""
    if shutil.which("redis-server"):
        return None
    libs = os.path.join(_REPO, ".deps", "redis", "usr", "lib", "x86_64-linux-gnu")
    old = os.environ.get("LD_LIBRARY_PATH")
    return dict(os.environ, LD_LIBRARY_PATH=libs + (os.pathsep + old if old else ""))


def redis_server_binary() -> str:
    """Path of ``redis-server``: from PATH, else ``<repo>/.deps/redis/usr/bin/redis-server``."""
    return _binary("redis-server")


def redis_cli_binary() -> str:
    """Path of ``redis-cli``: from PATH, else ``<repo>/.deps/redis/usr/bin/redis-cli``."""
    return _binary("redis-cli")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(cluster: bool) -> int:
    """A port free now on 127.0.0.1 (and, for a cluster node, its bus port too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + _CLUSTER_BUS_OFFSET < 65536 and _port_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found on 127.0.0.1 for a cluster node")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it dies (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort: atexit still stops it
        pass


def _ping(host: str, port: int | None, unix_path: str | None, timeout: float = 0.5) -> bool:
    """True if something answers PING with a RESP reply (``+PONG``, or ``-NOAUTH`` behind a password)."""
    try:
        if unix_path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(unix_path)
        else:
            s = socket.create_connection((host, port), timeout=timeout)
        with s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply[:1] in (b"+", b"-") and not reply.startswith(b"-LOADING")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, started by the constructor and ready (PING answered).

    Args:
        port: TCP port (None: a free one).
        unix_socket: also listen on ``<dir>/redis.sock`` (``.unix_path``, ``.unix_url``).
        maxmemory: memory limit (bytes or a Redis size string like ``"4mb"``); None: unlimited.
        policy: ``maxmemory-policy`` (``noeviction``, ``allkeys-lru``, ...).
        password: ``requirepass`` (``.url`` and ``client()`` carry it).
        cluster: start as a cluster node (``--cluster-enabled yes``; see :class:`RedisClusterServers`).
        extra_args: more ``redis-server`` arguments, e.g. ``("--proto-max-bulk-len", "1mb")``.
        dir: working directory (logs, socket, nodes.conf); None: a temporary one, removed by ``stop()``.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        port: int | None = None,
        unix_socket: bool = False,
        maxmemory: int | str | None = None,
        policy: str = "noeviction",
        password: str | None = None,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        dir: str | None = None,
    ):
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port: expected an int in [1, 65535] or None, got {port!r}")
        if isinstance(extra_args, str):
            raise ValueError(f"extra_args: expected a sequence of arguments, got the string {extra_args!r}")
        self._fixed_port = port is not None
        self.port = port if port is not None else _free_port(cluster)
        self.unix_socket = unix_socket
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.cluster = cluster
        self.extra_args = tuple(str(a) for a in extra_args)
        self._own_dir = dir is None
        self.dir = tempfile.mkdtemp(prefix="kvx-redis-") if dir is None else os.path.abspath(dir)
        os.makedirs(self.dir, exist_ok=True)
        self.log_path = os.path.join(self.dir, "redis.log")
        self.unix_path = os.path.join(self.dir, "redis.sock") if unix_socket else None
        self._proc: subprocess.Popen | None = None
        self._paused = False
        self._lock = threading.Lock()
        self.start()

    # ---------------------------------------------------------------- addresses
    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        if not self.unix_path:
            raise ValueError("unix_url: this server was started with unix_socket=False")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"unix://{auth}{self.unix_path}?db=0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """A process exists (it may be paused)."""
        return self._proc is not None and self._proc.poll() is None

    def _args(self) -> list[str]:
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            self.log_path,
            "--daemonize",
            "no",
        ]
        if self.unix_path:
            args += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        elif self.policy != "noeviction":
            args += ["--maxmemory-policy", self.policy]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                os.path.join(self.dir, "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        return args + list(self.extra_args)

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Start the process (no-op if it runs) and wait until it answers PING (at most ~10 s)."""
        with self._lock:
            if self.running:
                return
            for _attempt in range(5):
                self._spawn()
                err = self._wait_ready()
                if err is None:
                    _LIVE.add(self)
                    return
                self._reap(signal.SIGKILL)
                if self._fixed_port or "Address already in use" not in err:
                    break
                self.port = _free_port(self.cluster)  # lost a race for the port: take another
            raise RuntimeError(
                f"redis-server on port {self.port} did not start: {err}\n--- log tail "
                f"({self.log_path}) ---\n{self.log_tail()}"
            )

    def _spawn(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        # PDEATHSIG fires when the *thread* that forked exits: only safe from the main thread.
        # stderr goes to a file: a pipe nobody reads would block a chatty server once 64 KiB are queued
        with open(os.path.join(self.dir, "stderr.log"), "ab") as err:
            self._proc = subprocess.Popen(
                self._args(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=binary_env(),
                preexec_fn=_die_with_parent if main else None,
            )
        self._paused = False

    def _wait_ready(self) -> str | None:
        """None once PING answers; else why not (the process exited, or the timeout)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                try:
                    with open(os.path.join(self.dir, "stderr.log"), errors="replace") as f:
                        stderr = f.read()[-2000:]
                except OSError:
                    stderr = ""
                return f"exited with status {rc}: {stderr.strip()} {self.log_tail(5)}"
            if _ping(self.host, self.port, None):
                if self.unix_path is None or _ping(self.host, None, self.unix_path):
                    return None
            time.sleep(0.005)
        return f"no PING answer within {_START_TIMEOUT_S:.0f} s"

    def _reap(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                if self._paused and sig != signal.SIGKILL:
                    proc.send_signal(signal.SIGCONT)  # a stopped process never handles SIGTERM
                proc.send_signal(sig)
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except ProcessLookupError:
                pass
        self._paused = False

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 5 s); :meth:`restart` may follow. Idempotent."""
        with self._lock:
            self._reap(signal.SIGTERM)
            _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL: the server dies at once (a crash), without closing its connections cleanly."""
        with self._lock:
            if self._proc is not None:
                self._reap(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (accepts connections in the kernel, answers nothing)."""
        if not self.running:
            raise RuntimeError(f"pause: redis-server on port {self.port} is not running")
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.running:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def restart(self) -> None:
        """Stop (or reap a killed process) and start again on the same port and directory (data is lost;
        a cluster node keeps its identity from nodes.conf)."""
        with self._lock:
            self._reap(signal.SIGTERM)
        self.start()

    def cleanup(self) -> None:
        """Stop and remove the temporary directory."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __del__(self):
        try:
            if self._proc is not None:
                self._reap(signal.SIGKILL)
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---------------------------------------------------------------- clients
    def client(self, **kwargs):
        """A redis-py client of this server (bytes replies)."""
        import redis

        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def config_set(self, name: str, value) -> None:
        """``CONFIG SET name value`` (e.g. ``config_set("maxmemory", "4mb")``)."""
        with self.client() as c:
            c.config_set(name, value)

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, pid={self.pid}, dir={self.dir!r})"


class RedisClusterServers:
    """A Redis cluster of ``nodes`` primaries (no replicas) on 127.0.0.1, ready (``cluster_state:ok`` on
    every node) when the constructor returns. ``server_kwargs`` go to every :class:`RedisServer`
    (``maxmemory``, ``policy``, ``password``, ``extra_args``; ``dir`` is a parent for ``node<i>``)."""

    def __init__(self, nodes: int = 3, **server_kwargs):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes: expected an int >= 1, got {nodes!r}")
        for k in ("port", "cluster"):
            if k in server_kwargs:
                raise ValueError(f"{k}: chosen by RedisClusterServers, got {server_kwargs[k]!r}")
        parent = server_kwargs.pop("dir", None)
        self.password = server_kwargs.get("password")
        self.nodes: list[RedisServer] = []
        try:
            for i in range(nodes):
                d = os.path.join(parent, f"node{i}") if parent else None
                self.nodes.append(RedisServer(cluster=True, dir=d, **server_kwargs))
            self._create()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def _create(self) -> None:
        if len(self.nodes) >= 3:
            args = [
                redis_cli_binary(),
                "--cluster",
                "create",
                *(f"{n.host}:{n.port}" for n in self.nodes),
                "--cluster-yes",
            ]
            env = binary_env()
            if self.password:
                env = dict(env or os.environ, REDISCLI_AUTH=self.password)
            r = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env)
            if r.returncode:
                raise RuntimeError(
                    f"redis-cli --cluster create failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
                )
            return
        # redis-cli wants >= 3 primaries: assign the slots by hand
        per = 16384 // len(self.nodes)
        for i, n in enumerate(self.nodes):
            with n.client() as c:
                lo, hi = i * per, (16383 if i == len(self.nodes) - 1 else (i + 1) * per - 1)
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                for other in self.nodes[:i]:
                    c.execute_command("CLUSTER", "MEET", other.host, other.port)

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every node reports ``cluster_state:ok`` and knows every node (after a restart too)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            ok = True
            for n in self.nodes:
                try:
                    with n.client(socket_timeout=1) as c:
                        info = c.execute_command("CLUSTER", "INFO").decode()
                except Exception as e:  # noqa: BLE001 - not up yet
                    ok, last = False, f"node {n.port}: {e}"
                    break
                fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
                if fields.get("cluster_state") != "ok" or int(fields.get("cluster_known_nodes", 0)) < len(self.nodes):
                    ok, last = False, f"node {n.port}: {info.split()[:3]}"
                    break
            if ok:
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok within {timeout:.0f} s: {last}")

    def client(self, **kwargs):
        """A redis-py ``RedisCluster`` client of this cluster."""
        import redis

        return redis.RedisCluster(host=self.nodes[0].host, port=self.nodes[0].port, password=self.password, **kwargs)

    def node_of(self, key: bytes | str) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode() if isinstance(key, str) else key)
        with self.nodes[0].client() as c:
            for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        """Stop every node and remove their temporary directories. Idempotent."""
        for n in self.nodes:
            try:
                n.cleanup()
            except Exception:  # noqa: BLE001 - stop the others whatever happens
                pass

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Sentinel(RedisServer):
    """One Sentinel: ``redis-server <dir>/sentinel.conf --sentinel`` (Sentinel needs a config file it can
    rewrite: what it learns, replicas, other sentinels, the current master, survives a restart)."""

    def __init__(self, conf_lines: Sequence[str], **kwargs):
        self._conf_lines = list(conf_lines)
        super().__init__(**kwargs)

    @property
    def conf_path(self) -> str:
        return os.path.join(self.dir, "sentinel.conf")

    def _args(self) -> list[str]:
        return [
            redis_server_binary(),
            self.conf_path,
            "--sentinel",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--logfile",
            self.log_path,
            "--daemonize",
            "no",
            *self.extra_args,
        ]

    def _spawn(self) -> None:
        if not os.path.exists(self.conf_path):
            with open(self.conf_path, "w") as f:
                f.write("".join(line + "\n" for line in self._conf_lines))
        super()._spawn()


class RedisSentinelServers:
    """A master, ``replicas`` replicas (``--replicaof``) and ``sentinels`` Sentinels monitoring them as
    ``service`` (quorum: a majority), on 127.0.0.1. Ready when the constructor returns: every replica is
    in sync and every Sentinel knows the replicas and the other Sentinels, so a failover can happen.
    ``down_after_ms`` / ``failover_timeout_ms`` are short: a killed master is replaced in ~1-3 s.

    ``password``: the data servers' ``requirepass`` (and ``masterauth``, Sentinel's ``auth-pass``).
    ``sentinel_password``: the Sentinels' own ``requirepass`` (they use it with each other too).
    ``servers`` lists the data servers, the first master at index 0; :meth:`master` says which one is now."""

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        service: str = "kvx",
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after_ms: int = 500,
        failover_timeout_ms: int = 2000,
    ):
        for name, v, lo in (("replicas", replicas, 1), ("sentinels", sentinels, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password
        self.servers: list[RedisServer] = []
        self.sentinels: list[_Sentinel] = []
        # a replica's first sync waits repl-diskless-sync-delay (5 s) for others to join it: none will here
        auth = ("--repl-diskless-sync-delay", "0") + (("--masterauth", password) if password else ())
        try:
            self.servers.append(RedisServer(password=password, extra_args=auth))
            master = self.servers[0]
            for _ in range(replicas):
                self.servers.append(
                    RedisServer(password=password, extra_args=(*auth, "--replicaof", master.host, str(master.port)))
                )
            conf = [
                f"sentinel monitor {service} {master.host} {master.port} {sentinels // 2 + 1}",
                f"sentinel down-after-milliseconds {service} {down_after_ms}",
                f"sentinel failover-timeout {service} {failover_timeout_ms}",
            ]
            if password:
                conf.append(f"sentinel auth-pass {service} {password}")
            if sentinel_password:
                conf += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
            for _ in range(sentinels):
                self.sentinels.append(_Sentinel(conf))
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:<p1>,127.0.0.1:<p2>,.../<service>/0``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{quote(self.service, safe='')}/0"

    def sentinel_client(self, i: int = 0, **kwargs):
        """A redis-py client of Sentinel ``i``."""
        import redis

        s = self.sentinels[i]
        return redis.Redis(host=s.host, port=s.port, password=self.sentinel_password, **kwargs)

    def _views(self) -> list[dict]:
        """``SENTINEL MASTER <service>`` of every running Sentinel (those that answer)."""
        views = []
        for i, s in enumerate(self.sentinels):
            if not s.running:
                continue
            try:
                with self.sentinel_client(i, socket_timeout=1) as c:
                    views.append(c.sentinel_master(self.service))
            except Exception:  # noqa: BLE001 - not up yet: not a view
                continue
        return views

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until every replica's link is up and every Sentinel knows the replicas and the others (the
        Sentinels find each other through hello messages every 2 s)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            views = self._views()
            ok = len(views) == len(self.sentinels) and all(
                v["num-slaves"] >= len(self.servers) - 1 and v["num-other-sentinels"] >= len(self.sentinels) - 1
                for v in views
            )
            for r in self.servers[1:]:
                with r.client(socket_timeout=1) as c:
                    ok = ok and c.info("replication").get("master_link_status") == "up"
            if ok:
                return
            last = str([(v["num-slaves"], v["num-other-sentinels"]) for v in views])
            time.sleep(0.05)
        raise RuntimeError(f"sentinels not ready within {timeout:.0f} s: (replicas, other sentinels) seen {last}")

    def master(self) -> RedisServer:
        """The data server the Sentinels name as the master now (asks the first one that answers)."""
        for v in self._views():
            return next(s for s in self.servers if s.port == int(v["port"]))
        raise RuntimeError("no sentinel answers")

    def wait_failover(self, old: RedisServer, timeout: float = 20.0) -> RedisServer:
        """Wait until every running Sentinel names a master other than ``old``, and it answers ROLE as the
        master; that server."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            views = self._views()
            ports = {int(v["port"]) for v in views}
            if views and len(ports) == 1 and old.port not in ports:
                new = next(s for s in self.servers if s.port in ports)
                try:
                    with new.client(socket_timeout=1) as c:
                        if c.role()[0] == b"master":
                            return new
                except Exception:  # noqa: BLE001 - not answering yet
                    pass
            last = str([(v["port"], v["flags"]) for v in views])
            time.sleep(0.05)
        raise RuntimeError(f"no failover from port {old.port} within {timeout:.0f} s: sentinels see {last}")

    def stop(self) -> None:
        """Stop every Sentinel and server, remove their temporary directories. Idempotent."""
        for s in [*self.sentinels, *self.servers]:
            try:
                s.cleanup()
            except Exception:  # noqa: BLE001 - stop the others whatever happens
                pass

    def __enter__(self) -> RedisSentinelServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        try:
            s.cleanup()
        except Exception:  # noqa: BLE001
            pass
