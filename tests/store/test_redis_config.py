"""RedisTier configuration: TLS (``rediss://`` URLs verified against a CA or not; a certificate nobody vouches for
is refused), sizes and the tier registry, missing TLS files named by ``check_config``, and bad settings named by
their key, with passwords redacted."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvx.store.redis import RedisTier, RedisTierConfig
from kvx.store.tier import parse_tier_config
from tests.helpers import assert_same_bytes
from tests.store.conftest import new_key, poisoned, random_chunk, shape_for
from tests.store.redis_helpers import start_server, tls_args, tls_files


@pytest.mark.parametrize("verify", ["ca", "none"])
def test_tls(verify, tmp_path, open_tier):
    cert, key_file, tls_port = tls_files(tmp_path)
    with start_server(password="pw", extra_args=tls_args(tls_port, cert, key_file)):
        query = f"ssl_ca_certs={cert}" if verify == "ca" else "ssl_cert_reqs=none"
        tier = open_tier(f"rediss://:pw@127.0.0.1:{tls_port}/0?{query}")
        key = new_key()
        x = random_chunk(shape_for("multi", torch.float32, key), torch.float32, 22)
        assert tier.put(key, x) and tier.contains_many([key]) == [True]
        for _ in range(3):  # pooled TLS connections are reused
            out = poisoned(x)
            tier.get_into(key, out)
            assert_same_bytes(out, x)
        assert tier.usage() > 0
    if verify == "ca":  # a certificate nobody vouches for: refused, tier down
        with start_server(extra_args=tls_args(tls_port, cert, key_file)):
            tier = open_tier(f"rediss://127.0.0.1:{tls_port}/0")
            assert tier.contains_many([new_key()]) == [False]


def test_config_accepts_sizes_and_registry(redis_server):
    cfg = parse_tier_config({"type": "redis", "url": redis_server.url, "max_value_size": "4MiB"})
    assert isinstance(cfg, RedisTierConfig) and cfg.max_value_size == 4 << 20
    assert RedisTierConfig(type="redis", url="rediss://:pw@h:6380/0?ssl_cert_reqs=none").url.startswith("rediss")


def test_check_config_names_missing_tls_files(tmp_path):
    cfg = RedisTierConfig(type="redis", url=f"rediss://:pw@h:6380/0?ssl_ca_certs={tmp_path}/ca.pem")
    problems = RedisTier.check_config(cfg, "tiers.1", writes=True)
    assert len(problems) == 1 and "tiers.1.url" in problems[0] and "ssl_ca_certs" in problems[0]
    assert "pw@" not in problems[0]
    (tmp_path / "ca.pem").write_text("x")
    assert RedisTier.check_config(cfg, "tiers.1", writes=True) == []
    assert RedisTier.check_config(RedisTierConfig(type="redis", url="redis://h:1/0"), "tiers.1", True) == []


BAD_CONFIG = [
    ({"url": "http://127.0.0.1:6379"}, "url"),
    ({"url": "redis://:pw@"}, "url"),
    ({"url": "unix://"}, "url"),
    ({"url": 6379}, "url"),
    ({"cluster": True, "url": "unix:///tmp/x.sock"}, "cluster"),
    ({"cluster": True, "url": "redis://h:1/3"}, "cluster"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"timeout_ms": True}, "timeout_ms"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"ttl_s": float("nan")}, "ttl_s"),
    ({"connections": 0}, "connections"),
    ({"connections": 1000}, "connections"),
    ({"max_value_size": "1KiB"}, "max_value_size"),
    ({"max_value_size": "1GB"}, "max_value_size"),
    ({"max_value_size": "lots"}, "max_value_size"),
    ({"lookup_wait_ms": -1}, "lookup_wait_ms"),
    ({"retry_s": 0}, "retry_s"),
    ({"pool": 3}, "pool"),
]


@pytest.mark.parametrize("bad,name", BAD_CONFIG, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_CONFIG)])
def test_bad_config_names_the_key(bad, name):
    raw = {"type": "redis", "url": "redis://127.0.0.1:6379/0", **bad}
    with pytest.raises(ValidationError, match=name) as e:
        RedisTierConfig.model_validate(raw)
    assert "pw@" not in str(e.value)
