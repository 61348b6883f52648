"""What the Redis benchmarks share (``bench_redis.py``, ``bench_redis_faults.py``): the chunk they move,
how they open kvx's Redis tier, the redis-server version, and their percentile and number formats.

A plain module next to the scripts: each benchmark puts its own directory on ``sys.path`` (as running a
script does) and imports it by name.
"""

from __future__ import annotations

import os
import statistics
import subprocess

from kvx.store.redis import RedisTier, RedisTierConfig
from kvx.store.tier import TierContext

FINGERPRINT = "bench-redis-0123456789abcdef"
TOKEN_BYTES = 8 * 2 * 8 * 128 * 2  # one token of the chunk: 8 layers x K/V x 8 heads x 128 x bf16


def fmt6(x: float) -> str:
    """6 significant digits: enough that ratios recomputed from the CSV agree with the ones in it."""
    return f"{x:.6g}"


def pct(xs: list[float], p: int) -> float:
    """The p-th percentile (inclusive method) of ``xs``."""
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


def new_key() -> str:
    return os.urandom(16).hex()


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def open_tier(url: str, part: int | None = None, **kw):
    """A ``RedisTier`` on ``url`` (``part``: its ``max_value_size``; None: the tier's default)."""
    fields = {"type": "redis", "url": url, **kw}
    if part is not None:
        fields["max_value_size"] = part
    return RedisTier.open(RedisTierConfig(**fields), TierContext(fingerprint=FINGERPRINT))


def server_version() -> str:
    """``redis-server --version``'s v=... (the binary kvx.testing.redis_server starts)."""
    from kvx.testing.redis_server import binary_env, redis_server_binary

    try:
        out = subprocess.run(
            [redis_server_binary(), "--version"], capture_output=True, text=True, timeout=10, env=binary_env()
        ).stdout
        return next(w.split("=", 1)[1] for w in out.split() if w.startswith("v="))
    except (OSError, RuntimeError, StopIteration, subprocess.SubprocessError):
        return "?"


def chunk_shape(nbytes: int) -> tuple[int, ...]:
    """A bf16 KV chunk of ``nbytes``: 8 layers x K/V x tokens x 8 KV heads x 128 (32 KiB per token)."""
    if nbytes % TOKEN_BYTES:
        raise ValueError(f"chunk: expected a multiple of {TOKEN_BYTES} bytes, got {nbytes}")
    return (8, 2, nbytes // TOKEN_BYTES, 8, 128)
