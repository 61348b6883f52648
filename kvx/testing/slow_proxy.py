"""A TCP proxy that makes a real server slow: bytes from the server reach the client at a set rate, after a set
delay per read. Used to put a real redis-server behind a slow network (tests and benchmarks of kvx's slow-tier
rules), never to stand in for a server.

    with SlowProxy("127.0.0.1", redis_port, bytes_per_s=20 << 20) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"

One thread accepts; each connection gets two pump threads (client -> server at full speed, server -> client
throttled). ``bytes_per_s`` and ``delay_s`` may be changed while it runs (a tier that slows down or recovers).
``tap(direction, data)``, where given, sees every read on its pump thread ("down": server -> client, "up": client ->
server) and returns the bytes to pass on (a test's recording or a byte changed in transit).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class SlowProxy:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        bytes_per_s: float | None = None,
        delay_s: float = 0.0,
        tap: Callable[[str, bytes], bytes] | None = None,
    ):
        self.target = (host, port)
        self.tap = tap
        self.bytes_per_s = bytes_per_s
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, name="slow-proxy", daemon=True)

    def __enter__(self) -> SlowProxy:
        self._accept.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if self.tap is not None:
                    data = self.tap("down" if slow else "up", data)
                if slow:
                    pause = self.delay_s + (len(data) / self.bytes_per_s if self.bytes_per_s else 0.0)
                    if pause > 0:
                        time.sleep(pause)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
