"""A cluster's members for the tests: a ``kvx node`` process with ``--listen``/``--peers``/``--secret-file``, and an
engine's view of it (its index and its pool mapping), as the connector uses them."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import torch

from kvx.node.client import NodeIndex, NodePool
from kvx.testing.node_procs import Node
from kvx.testing.slow_proxy import SlowProxy
from tests.helpers import wait_for

SLOT_BYTES = 1 << 20
NAMESPACE = bytes(range(16))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(tmp: str, name: str = "secret", text: str = "kvx-cluster-secret-0123456789") -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


class Member:
    """A node of the cluster (a ``kvx node`` process) and an engine's view of it (index and pool)."""

    def __init__(
        self,
        tmp: str,
        name: str,
        port: int,
        peers: list[int] | list[str],
        secret: str,
        *extra: str,
        addr: str = "127.0.0.1",
        launch: Callable[[list[str]], list[str]] | None = None,
        sealed: bool = False,
    ):
        """``peers``: ports on 127.0.0.1, or HOST:PORT addresses; ``addr``, ``launch``: where the node listens and
        runs (a network namespace's address and ``Host.argv``); ``sealed``: the engine seals its byte tiers."""
        self.port, self.tmp, self.name, self.launch = port, tmp, name, launch
        self.sock = os.path.join(tmp, f"{name}.sock")
        self.args = ["--listen", f"{addr}:{port}", "--secret-file", secret, *extra]
        if peers:
            self.args += ["--peers", ",".join(p if isinstance(p, str) else f"127.0.0.1:{p}" for p in peers)]
        self.node = self._start()
        self.index = NodeIndex(
            self.sock, NAMESPACE, "m", 16, SLOT_BYTES, timeout=10, retry_s=0.05, pull_wait_ms=3000, sealed=sealed
        )
        self.pool = NodePool((SLOT_BYTES,), torch.uint8, None, (SLOT_BYTES,))
        wait_for(lambda: self.index.contains_many(["0" * 32]) is not None and self.index.pool is not None, 10, "hello")
        self.pool.attach(self.index.pool, background=False)

    def _start(self) -> Node:
        log = os.path.join(self.tmp, f"{self.name}.log")
        return Node(self.sock, "16MiB", str(SLOT_BYTES), log, *self.args, launch=self.launch).start()

    def restart(self) -> None:
        """Kill the node and start it again, empty (the engine's index reconnects and maps the new pool)."""
        self.node.kill()
        self.node = self._start()
        wait_for(lambda: self.index.contains_many(["0" * 32]) is not None and self.index.pool is not None, 10, "hello")
        self.pool.attach(self.index.pool, background=False)

    def store(self, k: str, data: torch.Tensor) -> None:
        slot = self.index.allocate(k)
        assert slot is not None, k
        self.pool.slot(slot).copy_(data)
        self.index.commit(k)

    def read(self, k: str) -> torch.Tensor:
        slot = self.index.pin([k])[0]
        assert slot >= 0, k
        out = self.pool.slot(slot).clone()
        self.index.unpin([k])
        return out

    def pull(self, keys: list[str], timeout: float = 30) -> list[bool]:
        """As the scheduler does: look up, and while the node pulls the misses, ask again."""
        wait_for(lambda: not self.index.pulling(keys[next_miss(self.index.contains_many(keys)) :]), timeout, "a pull")
        return self.index.contains_many(keys)

    def close(self) -> None:
        self.index.close()
        self.pool.close()
        self.node.stop()


def next_miss(found: list[bool]) -> int:
    return next((i for i, f in enumerate(found) if not f), len(found))


def key(i: int) -> str:
    return f"{i:032x}"


class Relay(SlowProxy):
    """A TCP relay in front of a node's listen port that records what crosses it: ``down`` the bytes from the node
    (what a reader receives), ``up`` the bytes to it (what a writer sends); :meth:`flip` arms it to change one byte
    of ``down`` or ``up`` in transit. A :class:`~kvx.testing.slow_proxy.SlowProxy` at full speed whose tap records
    (its pump threads); accepting from the start."""

    def __init__(self, port: int):
        super().__init__("127.0.0.1", port, tap=self._record)
        self.lock = threading.Lock()  # guards the buffers and the armed flips
        self.down, self.up = bytearray(), bytearray()
        self._flip: dict[str, int] = {}  # direction -> the stream offset of the byte to change
        self.__enter__()

    def flip(self, direction: str, after: int) -> None:
        """Change the byte ``after`` bytes past what ``direction`` ("down" or "up") has carried so far."""
        with self.lock:
            self._flip[direction] = len(getattr(self, direction)) + after

    def _record(self, direction: str, data: bytes) -> bytes:
        buf, data = getattr(self, direction), bytearray(data)
        with self.lock:
            at = self._flip.get(direction)
            if at is not None and len(buf) <= at < len(buf) + len(data):
                data[at - len(buf)] ^= 0x5A
                del self._flip[direction]
            buf += data
        return bytes(data)
