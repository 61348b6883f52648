"""Fixtures of the daemon tests (``tests/node/test_daemon_*.py``): ``short_dir``, a short temporary directory, and
``node``, one ``kvx node`` process per test module (helpers in ``tests/node/daemon_helpers.py``)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.node.daemon_helpers import Daemon, free_port


@pytest.fixture(scope="module")
def short_dir():
    """A directory with a short path (a unix socket's path must be < 108 bytes), that uid 65534 may traverse."""
    root = Path(tempfile.mkdtemp(prefix="kvxd", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def node(short_dir):
    """One daemon for the tests that do not stop it: socket mode 666 (the refused-uid test's child may connect, to
    be refused by its credentials), a metrics port."""
    port = free_port()
    (short_dir / "main").mkdir()
    (short_dir / "main").chmod(0o755)
    d = Daemon(short_dir / "main", "--socket-mode", "666", "--metrics-port", str(port))
    d.metrics_port = port
    try:
        yield d.wait_ready()
    finally:
        assert d.stop() == 0, d.stderr()
