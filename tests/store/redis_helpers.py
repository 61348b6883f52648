"""Helpers of the RedisTier test modules (tests/store/test_redis_*.py) beyond tests/store/conftest.py's: servers
started by a test itself, the Redis keys a chunk's parts are stored under, and a TLS certificate for a server."""

from __future__ import annotations

import pytest
import torch

from kvx.store.redis.layout import value_split
from kvx.testing.redis_server import RedisServer
from tests.helpers import need_redis
from tests.store.conftest import MVS, encoded_size


def start_server(**kwargs) -> RedisServer:
    """A RedisServer (skips where redis-server is not installed; fails in CI)."""
    need_redis()
    return RedisServer(**kwargs)


def n_parts(x: torch.Tensor, key: str) -> int:
    """Redis values of a chunk stored with max_value_size=MVS (1: a single value): the tier's split, values sized to
    the allocator's classes (``layout.value_split``)."""
    return value_split(encoded_size(x.numel(), x.dtype, key), MVS)[0]


def part_keys(client, key: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"kvx:1:{{{key}}}:*"))


def tls_files(tmp_path):
    """(certificate, key, a free port) for a TLS server on 127.0.0.1; skips without openssl."""
    import shutil
    import socket
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key_file),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return cert, key_file, s.getsockname()[1]


def tls_args(port, cert, key_file) -> list:
    return [
        "--tls-port",
        port,
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key_file,
        "--tls-ca-cert-file",
        cert,
        "--tls-auth-clients",
        "no",
    ]
