"""Fixtures shared by every test package (plain helper functions are in tests/helpers.py)."""

from __future__ import annotations

import pytest

from tests.helpers import mount_tmpfs, umount


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size="8m", name="tmpfs") -> path``: a real, small file system mounted for the test (a disk
    that really fills up, or that can be remounted read-only with :func:`tests.helpers.remount`). Needs root
    and the right to mount; skips with the reason otherwise. Unmounted at teardown."""
    mounted = []

    def make(size: str = "8m", name: str = "tmpfs"):
        mnt = mount_tmpfs(tmp_path / name, size)
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in reversed(mounted):
        umount(mnt)


@pytest.fixture(autouse=True)
def _kvx_logger_back_to_root():
    """An engine started by a test puts the ``kvx`` logger under vLLM's (kvx.log.attach_to_vllm), whose
    handlers do not propagate: put it back, so a later test's ``caplog`` sees kvx's records."""
    import logging

    kvx = logging.getLogger("kvx")
    parent, propagate = kvx.parent, kvx.propagate
    yield
    kvx.parent, kvx.propagate = parent, propagate
