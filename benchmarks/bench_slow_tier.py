"""TTFT when the only tier holding a prompt is slower than recomputing it: kvx declines such hits.

A real redis-server behind a throttled link (:class:`kvx.testing.slow_proxy.SlowProxy`, ``--mib-per-s``); a first
engine stores the prompts' chunks in it at full speed. Then, one engine per case, each prompt once (TTFT =
vLLM's first_token_latency):

  vllm cold                no connector: the prompts computed
  kvx, decline on          a fresh engine reading Redis through the slow link; the first hit is read and measured
                           (reported apart, as "kvx first hit (measuring)"), later ones are declined and computed
  kvx, decline off         the same with ``decline_slow_hits: false``: every hit read through the slow link

Target: kvx, decline on <= 1.05x vllm cold (a cache never makes a request slower than no cache); decline off shows
what a cache without the rule costs.

    python benchmarks/bench_slow_tier.py [--prompts 4] [--tokens 4096] [--hidden 1024] [--layers 8] [--mib-per-s 20]

Writes benchmarks/results/slow_tier_cpu.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing.bench import cpu_name  # noqa: E402
from kvx.testing.bench_timing import md_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--mib-per-s", type=float, default=20.0, help="the link's rate from Redis to the engine")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "slow_tier_cpu"))
    args = ap.parse_args(argv)

    from kvx.testing.redis_server import RedisServer
    from kvx.testing.slow_proxy import SlowProxy

    load1 = os.getloadavg()[0]
    cache = os.path.expanduser(f"~/.cache/kvx/models/llama-h{args.hidden}-l{args.layers}-{args.dtype}")
    model = H.make_llama_of_width(cache, args.hidden, args.layers, args.dtype, max_pos=args.tokens + 512)
    prompts = [H.prompt_ids(args.tokens, seed=300 + i, vocab=8192) for i in range(args.prompts)]
    engines = iter(range(1, 100))
    kw = dict(kv_cache_bytes=2 << 30, max_model_len=args.tokens + 256, dtype=args.dtype)
    rows: dict[str, list[tuple[float, int]]] = {}

    def engine(ktc):
        llm = H.build_llm(model, ktc, **kw)
        # one-time costs of an engine's first long prefills (measured: the second still pays some); prompts of its
        # own (computed, never a hit): the first samples of the engine's prefill throughput
        for _ in range(2):
            H.generate(llm, H.prompt_ids(args.tokens, seed=next(engines), vocab=8192), 2)
        return llm

    def cfg(url, **extra):
        return H.kvx_transfer_config({"chunk_size": args.chunk_size, "tiers": [{"type": "redis", "url": url}], **extra})

    t0 = time.perf_counter()
    with RedisServer() as server, SlowProxy("127.0.0.1", server.port, bytes_per_s=args.mib_per_s * 2**20) as proxy:
        slow = f"redis://127.0.0.1:{proxy.port}"
        llm = engine(None)
        for ids in prompts:
            llm.reset_prefix_cache()
            r = H.generate(llm, ids, 4)
            rows.setdefault("vllm cold", []).append((r.ttft_s, r.num_cached_tokens))
        H.shutdown(llm)
        llm = engine(cfg(server.url))  # stores every prompt's chunks, at full speed
        for ids in prompts:
            H.generate(llm, ids, 4)
        H.shutdown(llm)
        for name, extra in (("kvx, decline on", {}), ("kvx, decline off", {"decline_slow_hits": False})):
            llm = engine(cfg(slow, **extra))
            for i, ids in enumerate(prompts):
                r = H.generate(llm, ids, 4)
                case = "kvx first hit (measuring)" if i == 0 and not extra else name
                rows.setdefault(case, []).append((r.ttft_s, r.num_cached_tokens))
            H.shutdown(llm)
    elapsed = time.perf_counter() - t0

    med = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
    lines = [
        "# TTFT with a tier slower than recompute: kvx declines such hits",
        "",
        f"Machine: {cpu_name()}; model: random Llama hidden {args.hidden} x {args.layers} layers ({args.dtype}); "
        f"prompt {args.tokens} tokens, chunk {args.chunk_size}; Redis behind a {args.mib_per_s:g} MiB/s link; "
        f"{args.prompts} prompts per case; load average at start {load1:.2f}; total {elapsed:.0f} s.",
        "",
        f"Reproduce: `python benchmarks/bench_slow_tier.py --prompts {args.prompts} --tokens {args.tokens} "
        f"--hidden {args.hidden} --layers {args.layers} --dtype {args.dtype} --mib-per-s {args.mib_per_s:g}`",
        "",
    ]
    lines += md_table(
        ["case", "median TTFT (s)", "prompts", "cached tokens (median)"],
        [(k, f"{med[k]:.3f}", len(v), int(statistics.median(c for _, c in v))) for k, v in rows.items()],
        "lrrr",
    )
    lines += [
        "",
        "| ratio (medians) | value | target |",
        "|---|---:|---|",
        f"| kvx, decline on / vllm cold | {med['kvx, decline on'] / med['vllm cold']:.3f} | <= 1.05 |",
        f"| kvx, decline off / vllm cold | {med['kvx, decline off'] / med['vllm cold']:.3f} | |",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "prompt", "ttft_s", "cached_tokens"])
        for k, v in rows.items():
            for i, (t, c) in enumerate(v):
                w.writerow([k, i, f"{t:.4f}", c])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
