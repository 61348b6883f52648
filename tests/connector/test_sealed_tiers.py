"""Sealed tiers (``"encryption"``) under the connector, driven by vLLM's own scheduler (sim.py): a fresh engine
with the secret loads the chunks and gets exactly the cold KV. The tenant is part of a chunk's identity (issue 36):
an engine with another secret, or with none, misses the chunks at lookup (before: every chunk was "found", each load
failed verification and was recomputed, and that engine could never store its own), stores its own copy, and each
tenant's fresh engine then hits its own chunks with no load error, on one disk store and on one Redis; a rotation
(``key_files``, newest first) keeps hitting the older secret's chunks; chunks sealed before chunk names carried the
secret's key id are misses, never loads that fail."""

from __future__ import annotations

import os

import pytest

from kvx.store.seal import SEALED_VERSION

from .conftest import CHUNK, assert_pages_match, loads, prompt, tiers
from .sim import HEADS


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
    files = [c.path for c in env.conn.scheduler_side.tiers["disk"].scan()]
    assert len(files) == 2 * (HEADS + 1)  # per chunk: a part per KV head, and its record
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


KINDS = ["disk", "redis"]


@pytest.fixture(params=KINDS)
def shared(request, store_dir):
    """One store that several engines share: ``(kind, entry)``, ``entry(key_file)`` the tier's config entry (sealed
    with the secret in ``key_file``, or in the clear for None): a disk directory, or a real redis-server."""

    def entry_of(base):
        return lambda key_file: {**base, **({"encryption": {"key_file": key_file}} if key_file else {})}

    if request.param == "disk":
        yield "disk", entry_of({"type": "disk", "path": store_dir})
        return
    from kvx.testing.redis_server import RedisServer
    from tests.helpers import need_redis

    need_redis()
    with RedisServer() as server:
        # the scheduler waits for each lookup's answer (the default 2 ms may answer "not yet" on a busy machine)
        yield "redis", entry_of({"type": "redis", "url": server.url, "lookup_wait_ms": 1000})


def hits_own_chunks(make_env, config, ids, kind):
    """A fresh engine on ``config`` finds the prompt's 2 full chunks, loads them with no error, and holds the
    cold KV."""
    env = make_env(config)
    r = env.request("fresh", ids)
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    table = so.scheduled_new_reqs[0].block_ids[0]
    env.run()
    assert not any(env.load_errors) and "load_errors" not in env.stats
    assert env.sched_stats[f"hit_tokens_{kind}"] == 2 * CHUNK
    assert_pages_match(env, r, table[:4], 0)


@pytest.mark.parametrize("reader", ["another secret", "no encryption"])
def test_another_tenants_chunks_are_misses_and_each_tenant_hits_its_own(make_env, shared, secrets, reader):
    kind, entry = shared
    ids = prompt(600, seed=32)  # 2 full chunks and a partial one

    def config(key_file):
        return {"chunk_size": CHUNK, "tiers": [entry(key_file)]}

    env = make_env(config(secrets["mine"]))
    env.request("a", ids)
    env.run(settle_writes=True)
    assert env.stats.get(f"{kind}_writes") == 2
    theirs = secrets["theirs"] if reader == "another secret" else None
    env2 = make_env(config(theirs))
    env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # a miss at lookup: nothing to load, nothing fails
    env2.run(settle_writes=True)
    assert not any(env2.load_errors) and "load_errors" not in env2.stats
    assert env2.sched_stats.get(f"hit_tokens_{kind}", 0) == 0
    assert env2.stats.get(f"{kind}_writes") == 2  # it stores its own copy of the prompt's chunks
    hits_own_chunks(make_env, config(theirs), ids, kind)
    hits_own_chunks(make_env, config(secrets["mine"]), ids, kind)  # the first tenant's copy: untouched


def test_rotation_keeps_hitting_the_older_secrets_chunks(make_env, store_dir, secrets):
    """``key_files: [new, old]``: chunks sealed with the old secret are hits (0 load errors), new ones are written
    with the new secret; with the old secret dropped, its chunks are misses at lookup (not failed loads)."""
    old_ids, new_ids = prompt(600, seed=34), prompt(600, seed=35)

    def config(*key_files):
        return {
            "chunk_size": CHUNK,
            "tiers": [{"type": "disk", "path": store_dir, "encryption": {"key_files": list(key_files)}}],
        }

    env = make_env(config(secrets["theirs"]))  # the old secret
    env.request("a", old_ids)
    env.run(settle_writes=True)
    rotated = config(secrets["mine"], secrets["theirs"])
    hits_own_chunks(make_env, rotated, old_ids, "disk")
    env2 = make_env(rotated)
    env2.request("b", new_ids)
    env2.run(settle_writes=True)
    assert env2.stats.get("disk_writes") == 2
    new_kid = env2.conn.scheduler_side.tiers["disk"].sealer.write_kid
    kids = {c.key: c.kid for c in env2.conn.scheduler_side.tiers["disk"].scan()}
    # the new prompt's chunks (their parts and records): sealed with the newest secret
    assert sorted(kids.values()).count(new_kid) == 2 * (HEADS + 1)
    retired = make_env(config(secrets["mine"]))
    retired.request("c", old_ids)
    so = retired.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # the dropped secret's chunks: misses at lookup
    retired.run()
    assert not any(retired.load_errors) and "load_errors" not in retired.stats
    hits_own_chunks(make_env, config(secrets["mine"]), new_ids, "disk")


def test_chunks_sealed_before_names_carried_the_key_id_are_misses(make_env, store_dir, secrets):
    """A store written by a kvx that named sealed chunks like chunks in the clear (``<key>.safetensors``): a sealed
    engine never looks there, misses, and stores its own (0 load errors); nothing is misread."""
    ids = prompt(600, seed=36)
    cfg = sealed(store_dir, secrets["mine"])
    env = make_env(cfg)
    env.request("a", ids)
    env.run(settle_writes=True)
    for c in env.conn.scheduler_side.tiers["disk"].scan():  # renamed as the older kvx named them
        os.replace(c.path, os.path.join(os.path.dirname(c.path), f"{c.key}.safetensors"))
    env2 = make_env(cfg)
    env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    env2.run(settle_writes=True)
    assert not any(env2.load_errors) and "load_errors" not in env2.stats
    assert env2.stats.get("disk_writes") == 2
    hits_own_chunks(make_env, cfg, ids, "disk")
