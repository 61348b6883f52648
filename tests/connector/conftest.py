"""Fixtures of the connector's tests, and the helpers they share (``tiers``, ``prompt``, ``saves``, ...). The
vLLM-driven fixtures (``make_env``) import vLLM only when used, so the vLLM-free tests here (config, keys,
validity) run without it."""

from __future__ import annotations

import os

import pytest

from kvx.connector.metadata import KVXMetadata
from kvx.testing import RUNNER_ORDERS
from tests.helpers import assert_same_bytes

BLOCK = 128  # vLLM's block size in the simulated engines (sim.py)
CHUNK = 256  # kvx's chunk size in most tests


def tiers(store, cpu="64MiB", disk=True):
    """kvx's config: a CPU tier of ``cpu`` and a disk tier at ``store`` (either may be left out)."""
    t = []
    if cpu:
        t.append({"type": "cpu", "size": cpu})
    if disk:
        t.append({"type": "disk", "path": store})
    return {"chunk_size": CHUNK, "tiers": t}


def prompt(n, seed=0):
    """``n`` random token ids (a fixed sequence per seed)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def saves(env):
    """Every save the scheduler side has planned so far."""
    return [s for m in env.metas if isinstance(m, KVXMetadata) for s in m.saves]


def loads(env):
    """Every load the scheduler side has planned so far."""
    return [spec for m in env.metas if isinstance(m, KVXMetadata) for spec in m.loads]


def assert_pages_match(env, req, block_ids, first_block_index):
    """vLLM blocks ``block_ids`` hold what a cold run computes for ``req``'s blocks from ``first_block_index`` on."""
    for i, b in enumerate(block_ids):
        for layer in range(2):
            what = f"block {b} (request block {first_block_index + i}) layer {layer}: the page and the saved KV"
            assert_same_bytes(env.page(layer, b), env.expected_page(req, first_block_index + i, layer), what)


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
    chunks = {}  # shared by the engines of a test: one may check chunks another one stored

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
