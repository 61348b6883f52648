"""Does a stalled tier block the forward? The simulated engine of the connector's tests (vLLM's real Scheduler,
worker-role KVXConnector on CPU caches: tests/connector/sim.py) as a kv_producer with only a Redis tier (every
save is staged in the worker's pool), a real redis-server SIGSTOPped after the first request; then batches of
fresh two-chunk prompts. Prints the slowest engine step and the total time.

    PYTHONPATH=. python benchmarks/bench_write_stall.py [--timeout-ms 15000] [--batches 3] [--backlog 1GiB]

Run it with PYTHONPATH pointing at another checkout to measure that one's kvx (``--backlog`` left out there if
it predates ``max_write_backlog``)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-ms", type=int, default=15000, help="the Redis tier's timeout_ms")
    ap.add_argument("--batches", type=int, default=3, help="batches of 4 requests while the server is stopped")
    ap.add_argument("--backlog", default=None, help="max_write_backlog (left out: the checkout's default)")
    args = ap.parse_args(argv)

    import kvx
    from kvx.testing.harness import make_tiny_llama
    from kvx.testing.redis_server import RedisServer
    from tests.connector.conftest import prompt
    from tests.connector.sim import Env
    from tests.helpers import stopped, wait_for

    model = make_tiny_llama(os.path.join(tempfile.mkdtemp(prefix="kvx-stall-"), "tiny"))
    with RedisServer() as srv:
        extra = {"chunk_size": 256, "tiers": [{"type": "redis", "url": srv.url, "timeout_ms": args.timeout_ms}]}
        if args.backlog is not None:
            extra["max_write_backlog"] = args.backlog
        env = Env(model, extra, role="kv_producer")
        try:
            env.request("warm", prompt(600, seed=1))
            env.run()
            srv.pause()
            wait_for(lambda: stopped(srv.pid), 10, "redis-server to stop")
            worst, t00 = 0.0, time.perf_counter()
            for b in range(args.batches):
                for i in range(4):
                    env.request(f"b{b}.{i}", prompt(600, seed=10 + b * 4 + i))
                while env.sched.requests:
                    t0 = time.perf_counter()
                    env.step()
                    worst = max(worst, time.perf_counter() - t0)
            total = time.perf_counter() - t00
            print(
                f"kvx at {os.path.dirname(os.path.dirname(kvx.__file__))}: {4 * args.batches} requests with Redis "
                f"stopped (timeout_ms={args.timeout_ms}): slowest step {worst:.2f} s, total {total:.2f} s; "
                f"scheduler counters {dict(env.sched_stats)}"
            )
        finally:
            srv.resume()
            env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
