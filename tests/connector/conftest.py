"""Fixtures of the connector's tests. The vLLM-driven ones (``make_env``) import vLLM only when used, so the
vLLM-free tests here (config, keys, validity) run without it."""

from __future__ import annotations

import os

import pytest

from kvx.testing import RUNNER_ORDERS


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from kvx.testing.harness import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(params=RUNNER_ORDERS)
def runner_order(request):
    """The model runner's order of the end-of-step hooks (:data:`kvx.testing.RUNNER_ORDERS`): every test of a
    simulated engine runs with ``wait_for_save`` before the step's results and with the results first (vLLM's
    runners with speculative decoding: the V1 runner in 0.32 and 0.33, 0.33's V2 runner)."""
    return request.param


@pytest.fixture
def make_env(tiny_model, runner_order):
    """``make_env(extra, **kw) -> Env`` (see sim.py), in each runner order; engines of one test share their
    record of chunks."""
    from .sim import Env

    envs = []
    chunks = {}     # shared by the engines of a test: one may check chunks another one stored

    def make(extra, **kw):
        kw.setdefault("order", runner_order)
        env = Env(tiny_model, extra, chunks=chunks, **kw)
        envs.append(env)
        return env

    yield make
    for e in envs:
        e.close()


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "kvstore"
    os.makedirs(d)
    return str(d)
