"""RedisTier faults of a real redis-server: SIGSTOP before and in the middle of a transfer (failing within
``timeout_ms``, the node marked down only once its PING times out too), short deadlines after long ones, SIGKILL
and restart (also while idle, also over TLS), a server down at open, a wrong password (redacted in the log), and a
client stalled off the CPU that must not mark a live server down."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvx.store import resp
from kvx.store.errors import ChunkError, StoreUnavailableError
from kvx.store.redis import ChunkSink, redact
from kvx.store.resp import ConnectionLost, RespConnection
from tests.helpers import assert_same_bytes, wait_for
from tests.store.conftest import (
    SLACK_S,
    assert_fails_at_once,
    commands,
    new_key,
    poisoned,
    random_chunk,
    shape_for,
    works,
)
from tests.store.redis_helpers import start_server, tls_args, tls_files


# ------------------------------------------------------------------------------------------ a stopped server
def test_sigstop_mid_get_fails_within_the_deadline(redis_server, open_tier):
    timeout_ms = 300
    tier = open_tier(redis_server.url, timeout_ms=timeout_ms, retry_s=0.2)
    key = new_key()
    x = random_chunk(shape_for("multi", torch.float32, key), torch.float32, 12)
    assert tier.put(key, x)
    redis_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkError, match="did not answer within 300 ms"):
            tier.get_into(key, poisoned(x))
        took = time.monotonic() - t0
        print(f"\nSIGSTOP: get_into failed after {1e3 * took:.0f} ms (timeout_ms={timeout_ms})")
        assert timeout_ms / 1e3 - 0.05 <= took <= timeout_ms / 1e3 + SLACK_S
        # a timeout alone may be this client stalling: the maintenance thread's PING (another timeout_ms)
        # decides that the server is down
        wait_for(lambda: tier.stats()["nodes_down"] == 1, timeout_ms / 1e3 + 2, "the node to be marked down")
        t0 = time.monotonic()  # known down: everything answers at once
        with pytest.raises(ChunkError):
            tier.get_into(key, poisoned(x))
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        assert tier.contains_many([key]) == [False]
        assert time.monotonic() - t0 < 0.1
        assert tier.stats()["timeouts"] == 1
    finally:
        redis_server.resume()
    wait_for(lambda: works(tier), 5, "the tier to be back after SIGCONT")
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_short_deadline_after_long_ones_still_bounds_each_call(transport, redis_server):
    """A connection sets its socket timeout again only when it is more than ``_REARM_S`` off the time
    left. After calls with 30 s deadlines, a receive and a send (a value larger than the socket buffers)
    with a 200 ms deadline on a stopped server still fail as timeouts at about 200 ms, and the connection
    is closed."""
    where = (
        dict(unix_path=redis_server.unix_path)
        if transport == "unix"
        else dict(host="127.0.0.1", port=redis_server.port)
    )
    conns = [RespConnection(**where, deadline=time.monotonic() + 5) for _ in range(2)]
    for conn in conns:
        assert conn.command("PING", deadline=time.monotonic() + 30) == "PONG"
    redis_server.pause()
    try:
        for conn, call in zip(
            conns,
            [lambda c, d: c.command("PING", deadline=d), lambda c, d: c.set_value("kvx:big", [bytes(64 << 20)], [], d)],
        ):
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost) as e:
                call(conn, t0 + 0.2)
            took = time.monotonic() - t0
            assert e.value.timeout, e.value
            assert 0.2 - resp._REARM_S - 0.01 <= took <= 0.2 + SLACK_S, took
            assert conn.closed
    finally:
        redis_server.resume()
        for conn in conns:
            conn.close()


def test_lookup_on_a_stopped_server_never_blocks(redis_server, open_tier):
    """SIGSTOP before a lookup: the caller gets None at once (the lookup thread waits out the deadline),
    then all False once the server is known to be down."""
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2, lookup_wait_ms=5)
    keys = [new_key() for _ in range(3)]
    assert tier.put(keys[0], torch.zeros(4))
    redis_server.pause()
    try:
        t0 = time.monotonic()
        assert tier.contains_many(keys) is None
        assert time.monotonic() - t0 < 0.1
        assert wait_for(lambda: tier.contains_many(keys), 0.3 + SLACK_S + 0.5, "an answer") == [False] * 3
    finally:
        redis_server.resume()
    assert wait_for(lambda: tier.contains_many(keys) == [True, False, False], 5, "the server to be back")


def test_sigstop_mid_put_fails_within_the_deadline(redis_server, open_tier):
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2)
    x = random_chunk((300_000,), torch.uint8, 13)  # 5 parts
    redis_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        took = time.monotonic() - t0
        print(f"\nSIGSTOP: put failed after {1e3 * took:.0f} ms")
        assert took <= 0.3 + SLACK_S
    finally:
        redis_server.resume()
    wait_for(lambda: works(tier), 5, "the tier to be back after SIGCONT")


def test_a_stalled_client_does_not_mark_a_live_server_down(redis_server, open_tier, monkeypatch):
    """A put that runs out of time because its own thread was kept off the CPU (writers run at idle
    priority) is a failed put, not a dead server: the maintenance thread's PING answers, the node stays up,
    and loads keep being served."""
    tier = open_tier(redis_server.url, timeout_ms=300, retry_s=0.2)
    key = new_key()
    x = random_chunk((1000,), torch.float32, 5)
    assert tier.put(key, x)
    real = resp.RespConnection.set_value

    def stalled(self, *a, **k):
        time.sleep(0.35)  # past the deadline, with the server answering all along
        raise resp.ConnectionLost("no answer in time (SET)", timeout=True)

    monkeypatch.setattr(resp.RespConnection, "set_value", stalled)
    with redis_server.client() as c:
        pings = commands(c, "ping")
        with pytest.raises(StoreUnavailableError):
            tier.put(new_key(), x)
        monkeypatch.setattr(resp.RespConnection, "set_value", real)
        assert tier.stats()["nodes_down"] == 0  # the timed-out put alone marks nothing down
        wait_for(lambda: commands(c, "ping") > pings, 10, "the maintenance thread's PING of the suspect node")
    # the PING answered: the node stays up (one that itself timed out on a loaded machine would mark the node
    # down until the next probe, retry_s later)
    wait_for(lambda: tier.stats()["nodes_down"] == 0, 10, lambda: f"the node to be up: {tier.stats()}")
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_server_stops_or_dies_in_the_middle_of_a_transfer(fault, redis_server, open_tier, monkeypatch):
    """The fault strikes once the first payload bytes of a 64 MiB chunk (16 parts) have landed in ``out``,
    the rest still on the server. SIGSTOP: the get fails at its deadline; SIGKILL: at once (the connection
    ends, and the server refuses the retry). Either way a ChunkError, which the connector reports as a load
    error (vLLM recomputes the chunk), and the tier comes back."""
    timeout_ms = 500
    tier = open_tier(redis_server.url, timeout_ms=timeout_ms, retry_s=0.1, max_value_size="4MiB")
    key = new_key()
    x = random_chunk((64 << 20,), torch.uint8, 21)
    assert tier.put(key, x)
    advance = ChunkSink.advance
    struck: list[int] = []  # payload bytes received when the fault struck

    def advance_then_fault(self, n):
        advance(self, n)
        if self.phase in (ChunkSink._PAYLOAD, ChunkSink._DONE) and not struck:
            struck.append(self.pos)
            redis_server.pause() if fault == "sigstop" else redis_server.kill()

    monkeypatch.setattr(ChunkSink, "advance", advance_then_fault)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkError) as e:
            tier.get_into(key, poisoned(x))
        took = time.monotonic() - t0
        print(
            f"\n{fault} after {struck[0]} of {x.nbytes} payload bytes: get_into failed after "
            f"{1e3 * took:.0f} ms (timeout_ms={timeout_ms}): {e.value}"
        )
        assert 0 < struck[0] < x.nbytes, "the fault did not strike in the middle of the transfer"
        if fault == "sigstop":
            assert f"did not answer within {timeout_ms} ms" in str(e.value)
            assert timeout_ms / 1e3 - 0.05 <= took <= timeout_ms / 1e3 + SLACK_S
            assert tier.stats()["timeouts"] == 1
        else:
            assert took <= SLACK_S
            assert tier.stats()["timeouts"] == 0
    finally:
        redis_server.resume() if fault == "sigstop" else redis_server.restart()
    wait_for(lambda: works(tier), 5, "the tier to be back")
    if fault == "sigstop":  # the server kept the chunk: read whole this time
        out = poisoned(x)
        tier.get_into(key, out)
        assert_same_bytes(out, x)


# ------------------------------------------------------------------------------------------ killed or unreachable
def test_sigkill_then_restart_reconnects(redis_server, open_tier):
    tier = open_tier(redis_server.url, timeout_ms=500, retry_s=0.1, connections=2)
    key = new_key()
    x = random_chunk(shape_for("multi", torch.float16, key), torch.float16, 14)
    assert tier.put(key, x)
    redis_server.kill()
    t0 = time.monotonic()
    with pytest.raises(ChunkError):
        tier.get_into(key, poisoned(x))
    with pytest.raises(StoreUnavailableError):
        tier.put(key, x)
    assert tier.contains_many([key]) == [False]
    assert time.monotonic() - t0 < 0.5
    redis_server.restart()  # same port, data lost
    wait_for(lambda: works(tier), 5, "the tier to reconnect after the restart")
    with pytest.raises(ChunkError, match="not in redis"):
        tier.get_into(key, poisoned(x))  # the restart lost it: a miss, not an error
    assert tier.put(key, x) is True
    out = poisoned(x)
    tier.get_into(key, out)
    assert_same_bytes(out, x)
    assert tier.stats()["reconnects"] >= 1


def test_restart_while_idle_needs_no_downtime(redis_server, open_tier):
    """Idle pooled connections to a restarted server are seen to be closed and replaced, not used."""
    tier = open_tier(redis_server.url, retry_s=60)
    assert works(tier)
    redis_server.restart()
    assert works(tier)  # retry_s=60: had the node been marked down, this would fail


def test_restart_while_idle_tls(tmp_path, open_tier):
    """TLS connections cannot be checked while idle (session tickets make them readable): a dead one is
    found on use and the operation is run again on a fresh connection."""
    cert, key_file, tls_port = tls_files(tmp_path)
    with start_server(extra_args=tls_args(tls_port, cert, key_file)) as server:
        tier = open_tier(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}", retry_s=60)
        assert works(tier)
        server.restart()
        assert works(tier)


def test_down_at_open_then_up(caplog, open_tier):
    server = start_server()
    try:
        server.stop()
        caplog.set_level(logging.WARNING, logger="kvx")
        tier = open_tier(server.url, retry_s=0.1, lookup_wait_ms=1000)
        assert any("cannot reach" in r.getMessage() for r in caplog.records)
        assert_fails_at_once(tier, 0.1)
        server.start()
        wait_for(lambda: works(tier), 5, "the tier to connect once the server is up")
    finally:
        server.cleanup()


def test_wrong_password_is_down_with_a_clear_redacted_error(caplog, open_tier):
    with start_server(password="s3cret") as server:
        caplog.set_level(logging.WARNING, logger="kvx")
        bad = server.url.replace("s3cret", "wrong-pw")
        tier = open_tier(bad, retry_s=0.1)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "WRONGPASS" in text and "redis://:***@127.0.0.1" in text and "wrong-pw" not in text
        assert tier.contains_many([new_key()]) == [False]
        with pytest.raises(ChunkError):
            tier.get_into(new_key(), torch.empty(4))
        noauth = open_tier(f"redis://127.0.0.1:{server.port}/0")
        assert noauth.contains_many([new_key()]) == [False]
        assert works(open_tier(server.url))
        assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
