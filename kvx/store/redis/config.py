"""The Redis tier's config (:class:`RedisTierConfig`, ``{"type": "redis", ...}``) and its url: parsing and
checking ``redis://``, ``rediss://``, ``unix://`` and ``redis+sentinel://`` urls, redacting their passwords
for logs and errors, and what a data connection is opened with (:class:`RedisTarget`: credentials, db, TLS).

Pure functions and immutable values: the config is validated once (any thread); the tier reads the url's
parts when it is constructed.
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import ConfigDict, Field, field_validator, model_validator

from ..seal import EncryptionConfig
from ..tier import TierConfig

_MIN_VALUE, _MAX_VALUE = 64 << 10, 512 * 10**6  # proto-max-bulk-len is 512 MB: a larger value resets us
_SENTINEL_SCHEME = "redis+sentinel"
_SENTINEL_PORT = 26379  # Sentinel's default port


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _no_bool(name: str, v: Any) -> Any:
    if isinstance(v, bool):  # pydantic's lax mode reads true as 1: a typo, not a value
        raise ValueError(f"{name}: expected a number, got {v!r}")
    return v


@dataclass(frozen=True)
class SentinelSpec:
    """A ``redis+sentinel://`` url, parsed: where the sentinels are and what to open on the master."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None


def is_sentinel(url: Any) -> bool:
    return isinstance(url, str) and url.lower().startswith(_SENTINEL_SCHEME + "://")


def sentinel_url(url: str) -> SentinelSpec:
    """Parse ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]`` (the
    password is the data servers', as in a redis:// url; a port left out is 26379). ValueError naming
    ``url`` if it is not one."""
    shown = redact(url)
    rest = url[len(_SENTINEL_SCHEME) + 3 :]
    if "?" in rest or "#" in rest:
        raise ValueError(f"url: a redis+sentinel:// url takes no query or fragment, got {shown!r}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(pw) if colon else None)
    sentinels = []
    for item in hosts.split(","):
        if item.startswith("["):  # [v6 address]:port
            host, close, port = item[1:].partition("]")
            if not close or (port and not port.startswith(":")):
                raise ValueError(f"url: expected sentinel addresses host[:port], got {item!r} in {shown!r}")
            port = port[1:]
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ValueError(
                f"url: expected one or more sentinels host[:port],host[:port],... before the "
                f"service name, got {shown!r}"
            )
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"url: expected sentinel addresses host[:port] with a port in [1, 65535], got {item!r} in {shown!r}"
            )
        sentinels.append((host, int(port) if port else _SENTINEL_PORT))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(
            f"url: expected the service name after the sentinels "
            f"(redis+sentinel://host:26379/<service_name>/<db>), got {shown!r}"
        )
    db = db.rstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"url: expected a db number after the service name, got {db!r} in {shown!r}")
    return SentinelSpec(tuple(sentinels), unquote(service), int(db or 0), username, password)


# ------------------------------------------------------------------------------------------ config
class RedisTierConfig(TierConfig):
    """``{"type": "redis", "url": "redis://host:6379/0", ...}``: one Redis server, a cluster, or the master
    of a Sentinel deployment (``"url": "redis+sentinel://host1:26379,host2:26379/mymaster/0"``)."""

    # a url may carry a password: errors quote values themselves (redacted), never pydantic's raw input
    model_config = ConfigDict(hide_input_in_errors=True)  # merged with StrictConfig's

    type: Literal["redis"]
    url: str = Field(
        description="redis://[:password@]host:port/db, rediss:// (TLS; ssl_* query parameters as "
        "redis-py reads them), unix:///path/redis.sock?db=0, or "
        "redis+sentinel://[:password@]host:26379[,host:port...]/service_name/db (the "
        "master Redis Sentinel names; the password is the data servers')"
    )
    cluster: bool = Field(default=False, description="the url names one node of a Redis Cluster")
    timeout_ms: int = Field(
        default=1000,
        description=(
            "deadline of one whole get / put / lookup (a 64 MiB chunk over loopback takes a small part of it: "
            "benchmarks/results/redis_cpu.md)"
        ),
    )
    ttl_s: float | None = Field(
        default=None, description="expiry of stored chunks (None: none; eviction by the server's maxmemory-policy)"
    )
    connections: int = Field(default=4, description="data connections per server node")
    max_value_size: int = Field(
        default=4 << 20,
        description="most bytes of a Redis value (codec header included); larger chunks are split into "
        "parts, sized to the allocator's classes (values of 1-4 MiB moved fastest: benchmarks/results/redis_cpu.md)",
    )
    lookup_wait_ms: float = Field(
        default=2.0, description="how long a lookup may block the caller before answering 'not known yet'"
    )
    retry_s: float = Field(default=2.0, description="interval of reconnection attempts while a server is down")
    encryption: EncryptionConfig | None = Field(
        default=None,
        description='{"key_file": PATH} or {"key_files": [newest, ..., oldest]}: seal every chunk with '
        "AES-256-GCM (kvx.store.seal); read only chunks sealed with one of these secrets",
    )
    sentinel_password: str | None = Field(
        default=None,
        description="password of the sentinels themselves "
        "(their requirepass; redis-py's sentinel_kwargs), if they have one",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if is_sentinel(v):
            sentinel_url(v)
            return v
        scheme = urlsplit(v).scheme if isinstance(v, str) else None
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"url: expected a redis://, rediss://, unix:// or redis+sentinel:// url, got {redact(v)!r}"
            )
        try:
            from redis.connection import parse_url

            parsed = parse_url(v)
        except ValueError as e:
            raise ValueError(f"url: expected a valid redis url, got {redact(v)!r} ({e})") from None
        if scheme == "unix" and not parsed.get("path"):
            raise ValueError(f"url: expected a socket path in the unix:// url, got {redact(v)!r}")
        if scheme != "unix" and not parsed.get("host"):
            raise ValueError(f"url: expected a host in the url, got {redact(v)!r}")
        return v

    @field_validator("sentinel_password")
    @classmethod
    def _sentinel_password(cls, v):
        if v is not None and not v:
            raise ValueError("sentinel_password: expected a non-empty string or None (no AUTH), got ''")
        return v

    @field_validator("timeout_ms", mode="before")
    @classmethod
    def _timeout(cls, v):
        v = _no_bool("timeout_ms", v)
        if isinstance(v, (int, float)) and not (math.isfinite(v) and v > 0):
            raise ValueError(f"timeout_ms: expected a positive number of milliseconds, got {v!r}")
        return v

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _ttl(cls, v):
        v = _no_bool("ttl_s", v)
        if v is not None and isinstance(v, (int, float)) and not (math.isfinite(v) and v >= 0.001):
            raise ValueError(f"ttl_s: expected None or a number of seconds >= 0.001, got {v!r}")
        return v

    @field_validator("connections", mode="before")
    @classmethod
    def _connections(cls, v):
        v = _no_bool("connections", v)
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError(f"connections: expected an int in [1, 256], got {v!r}")
        return v

    @field_validator("max_value_size", mode="before")
    @classmethod
    def _max_value_size(cls, v):
        from ..tier import parse_size  # the parser kvx.connector.config uses for every size

        try:
            n = parse_size(v)
        except ValueError as e:
            raise ValueError(f"max_value_size: {e}") from None
        if not _MIN_VALUE <= n <= _MAX_VALUE:
            raise ValueError(
                f"max_value_size: expected a size in [64KiB, 512MB] (Redis' proto-max-bulk-len), got {v!r} = {n} bytes"
            )
        return n

    @field_validator("lookup_wait_ms", "retry_s", mode="before")
    @classmethod
    def _nonneg(cls, v, info):
        v = _no_bool(info.field_name, v)
        positive = info.field_name == "retry_s"
        if isinstance(v, (int, float)) and not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(
                f"{info.field_name}: expected a {'positive' if positive else 'non-negative'} number, got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _cluster_url(self):
        if is_sentinel(self.url):
            if self.cluster:
                raise ValueError(
                    f"cluster: a Sentinel deployment has one master, not a Redis Cluster's slots, "
                    f"got cluster=true with {redact(self.url)!r}"
                )
            return self
        if self.sentinel_password is not None:
            raise ValueError(f"sentinel_password: only for a redis+sentinel:// url, got the url {redact(self.url)!r}")
        if self.cluster:
            from redis.connection import parse_url

            if urlsplit(self.url).scheme == "unix":
                raise ValueError(
                    f"cluster: a Redis Cluster is reached over TCP, got cluster=true with the unix url "
                    f"{redact(self.url)!r}"
                )
            if parse_url(self.url).get("db", 0):
                raise ValueError(f"cluster: a Redis Cluster has only db 0, got {redact(self.url)!r}")
        return self


# ------------------------------------------------------------------------------------------ data connections
@dataclass(frozen=True)
class RedisTarget:
    """How to open a data connection (from the url): everything but the address."""

    username: str | None
    password: str | None
    db: int
    ssl_context: ssl.SSLContext | None


def parse_target(url: str) -> tuple[RedisTarget, dict]:
    """(how to open a data connection, redis-py's parse of the url; {} for a Sentinel url)."""
    from redis.connection import parse_url

    if is_sentinel(url):
        spec = sentinel_url(url)
        return RedisTarget(spec.username, spec.password, spec.db, None), {}
    p = parse_url(url)
    ctx = None
    if urlsplit(url).scheme == "rediss":
        try:
            ctx = _tls_context(p)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"url: cannot load the TLS files of {redact(url)} ({e})") from None
    return RedisTarget(p.get("username"), p.get("password"), int(p.get("db", 0) or 0), ctx), p


def _tls_context(p: dict) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` url's ssl_* parameters, read as redis-py reads them."""
    reqs = str(p.get("ssl_cert_reqs", "required")).lower()
    ctx = ssl.create_default_context(cafile=p.get("ssl_ca_certs"), capath=p.get("ssl_ca_path"))
    if p.get("ssl_certfile"):
        ctx.load_cert_chain(p["ssl_certfile"], p.get("ssl_keyfile"))
    if reqs == "none":
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.check_hostname = str(p.get("ssl_check_hostname", "true")).lower() not in ("false", "0", "no")
        ctx.verify_mode = ssl.CERT_OPTIONAL if reqs == "optional" else ssl.CERT_REQUIRED
    return ctx


is_sentinel_url = is_sentinel  # public names: kvx node's membership reads the same urls
parse_sentinel_url = sentinel_url
