"""Fixtures of the connector's tests. The vLLM-driven ones (``make_env``) import vLLM only when used, so the
vLLM-free tests here (config, keys, validity) run without it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from kvx.harness import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture
def make_env(tiny_model):
    """``make_env(extra, **kw) -> Env`` (see sim.py); engines of one test share their record of chunks."""
    from .sim import Env

    envs = []
    chunks = {}     # shared by the engines of a test: one may check chunks another one stored

    def make(extra, **kw):
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
