"""A sealed disk tier (``"encryption"``) under the connector, driven by vLLM's own scheduler (sim.py): a fresh
engine with the secret loads the chunks and gets exactly the cold KV; an engine with another secret, or
with none, finds the chunks (lookups see files) but every load fails verification: the blocks are reported,
vLLM recomputes them, and nothing of the sealed bytes reaches its KV cache."""

from __future__ import annotations

import os

import pytest

from kvx.store.seal import SEALED_VERSION

from .conftest import CHUNK, assert_pages_match, loads, prompt, tiers


def sealed(store, key_file, cpu=None):
    cfg = tiers(store, cpu=cpu)
    if key_file is not None:
        cfg["tiers"][-1]["encryption"] = {"key_file": key_file}
    return cfg


@pytest.fixture
def secrets(tmp_path):
    out = {}
    for name in ("mine", "theirs"):
        p = tmp_path / f"{name}.key"
        p.write_text(os.urandom(32).hex() + "\n")
        out[name] = str(p)
    return out


def test_sealed_disk_tier_serves_a_fresh_engine(make_env, store_dir, secrets):
    ids = prompt(600, seed=31)
    env = make_env(sealed(store_dir, secrets["mine"]))
    env.request("a", ids)
    env.run()
    files = [c.path for c in env.conn._scheduler.tiers["disk"].scan()]
    assert len(files) == 2
    for f in files:
        with open(f, "rb") as fh:
            assert SEALED_VERSION.encode() in fh.read(512)
    env2 = make_env(sealed(store_dir, secrets["mine"], cpu="64MiB"))
    r = env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert [c.tier for c in loads(env2)[-1].chunks] == ["disk", "disk"]
    assert_pages_match(env2, r, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env2.run()
    assert not env2.load_errors or not any(env2.load_errors)
    assert env2.assert_store_sound() == 2 + 2  # CPU tier and disk: the cold KV, bit for bit
    env2.assert_clean()


@pytest.mark.parametrize("reader", ["another secret", "no encryption"])
def test_without_the_secret_every_load_fails_and_is_recomputed(make_env, store_dir, secrets, reader):
    ids = prompt(600, seed=32)
    env = make_env(sealed(store_dir, secrets["mine"]))
    env.request("a", ids)
    env.run()
    env2 = make_env(sealed(store_dir, secrets["theirs"] if reader == "another secret" else None))
    r = env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK  # the files are there
    table = so.scheduled_new_reqs[0].block_ids[0]
    assert env2.load_errors[-1] == set(table[:4])  # neither chunk loads: every block reported
    so2 = env2.step()  # vLLM recomputes from the start
    assert so2.scheduled_cached_reqs.num_computed_tokens[0] == 0
    env2.run()
    assert env2.stats.get("load_errors") == 2
    assert_pages_match(env2, r, table[:4], 0)  # what vLLM holds is its own cold computation
    # the other tenant's chunks are left in place (not ours to delete), and still serve their owner
    env3 = make_env(sealed(store_dir, secrets["mine"]))
    env3.request("c", ids)
    so3 = env3.step()
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    env3.run()
    assert not any(env3.load_errors)
