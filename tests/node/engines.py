"""Processes of the node's end-to-end tests: a ``kvx node`` daemon and vLLM engines (:mod:`.engine_driver`), each
its own process group, stopped at the end of the test whatever happened."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

from kvx.node.connection import Connection, NodeUnavailable
from tests.helpers import wait_for

from .engine_driver import MARK

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Node:
    """``kvx node`` on ``socket`` (a subprocess); its log at ``log``."""

    def __init__(self, socket: str, size: str = "64MiB", slot_size: str = "1MiB", log: str | None = None, *args: str):
        self.socket, self.size, self.slot_size, self.args = socket, size, slot_size, list(args)
        self.log_path = log or socket + ".log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        cmd = [sys.executable, "-m", "kvx.node.cli", "--socket", self.socket, "--size", self.size]
        cmd += ["--slot-size", self.slot_size, "--pool", self.socket + ".pool", *self.args]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        wait_for(self.up, timeout=30, what=f"kvx node on {self.socket} ({self.log_path})")
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
            c.call("hello", version=1, role="control", pid=os.getpid())
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
    """A vLLM engine process (:mod:`.engine_driver`) with kvx ``config`` (None: without kvx)."""

    def __init__(self, model: str, config: dict | None, log: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "tests.node.engine_driver", model, json.dumps(config)]
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
