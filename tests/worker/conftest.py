"""Fixtures of the chunk portability tests (``tests/worker/test_chunk_portability*.py``, which use ``runner_order``
through ``pytestmark``; not autouse here, so the other tests of this folder keep their own runner orders)."""

from __future__ import annotations

import pytest

from kvx import engine as kvx_engine
from kvx.testing import RUNNER_ORDERS
from tests.worker.portability_helpers import Engine


@pytest.fixture(params=RUNNER_ORDERS)
def runner_order(request, monkeypatch):
    """Every test runs in each runner order of the end-of-step hooks (kvx.testing.RUNNER_ORDERS)."""
    monkeypatch.setattr(Engine, "order", request.param)
    return request.param


@pytest.fixture
def queue(request, monkeypatch):
    """(device, copy queue): CPU cases set KVX_COPY_QUEUE whatever the caller's environment (CUDA ignores it)."""
    device, mode = request.param
    if mode is not None:
        monkeypatch.setenv(kvx_engine.ENV, mode)
    yield device, mode
