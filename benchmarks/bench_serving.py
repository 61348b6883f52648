"""Serving benchmark: ``vllm serve`` (the OpenAI server, real HTTP) with KVXConnector against vLLM alone and
against vLLM's ExampleConnector, on a synthetic but realistic workload sent at a fixed request rate.

Configurations, each a fresh server of the same model and engine settings:

  vllm        no connector: vLLM's own prefix cache only
  kvx-cpu     KVXConnector, CPU tier
  kvx-disk    KVXConnector, disk tier only; the page cache is dropped before the warm phase
              (``sync; echo 3 > /proc/sys/vm/drop_caches``, else posix_fadvise(DONTNEED) on the store's files)
  example     vLLM's ExampleConnector (``shared_storage_path``), page cache dropped the same way
  kvx-cpu-admit  kvx-cpu with admission (``admit_after``: ``--admit-after``, default 2; not run unless named
              in ``--configs``): a chunk is stored once that many requests covered it. It runs beside ``vllm`` and
              ``kvx-cpu`` (the no-reuse runs alternate among the three); the tables give the bytes kvx wrote
              into its CPU tier and the saves admission skipped

Workload (seeded, the same requests for every configuration):

- a shared system prompt; conversations that grow: turn k's prompt is the system prompt, the earlier turns
  (user messages and synthetic assistant replies) and a new user message;
- RAG: long documents, each asked several questions (system prompt + document + question);
- first pass: the first turn of every conversation and the first question on every document (every prefix
  seen once); warm phase: the later turns and questions, shuffled (each conversation's turns in order).
  vLLM's KV cache (``--kv-cache-memory-bytes``) holds a fraction of the working set, so by the warm phase
  most of it has been evicted from vLLM's prefix cache;
- no-reuse: prompts of random tokens, nothing shared, at a rate above what the server sustains, on ``vllm``
  and ``kvx-cpu`` (kvx saves every chunk and never hits): kvx's overhead. Runs alternate between the two
  servers (A B A B, fresh prompts each run) so drift of the machine hits both.

Requests are sent open-loop at Poisson arrival times (seeded) at ``--rate`` requests/s: greedy, ``ignore_eos``,
``--max-tokens`` output tokens, streamed. TTFT = send -> first token at the client. Throughput = requests /
(first send -> last completion) of the phase. Hit rate = cached prompt tokens (usage.prompt_tokens_details:
vLLM's prefix cache + connector) / prompt tokens; the split comes from /metrics (``vllm:prefix_cache_hits``,
``vllm:external_prefix_cache_hits``, ``vllm:kvx_hit_tokens_<tier>``).

Targets (issue 11): warm phase, kvx-cpu vs vllm: throughput >= 2x, TTFT p50 <= 0.3x; no-reuse: kvx-cpu
throughput >= 0.97x vllm.

    python benchmarks/bench_serving.py [--quick] [--out DIR] [--rate R] [--configs vllm,kvx-cpu,kvx-disk,example]

Writes ``serving_cpu.md``, ``serving_cpu.csv`` (one row per configuration and phase), ``serving_cpu_requests.csv``
(every request) and ``serving_cpu_*.png`` into ``--out`` (default benchmarks/results). ``--quick``: the test
model, a few requests, a smoke run (minutes: four server start-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import sys
import tempfile
import time

from kvx.testing.serving_bench import (
    CONFIGS,
    QUICK,
    Phase,
    Request,
    Spec,
    build_no_reuse,
    build_workload,
    merge_runs,
    tiny_model,
    working_set_tokens,
)
from kvx.testing.serving_bench_report import targets, write_results

DEFAULT_CONFIGS = CONFIGS[:4]
STAGE1 = ("vllm", "kvx-cpu", "kvx-cpu-admit")  # up together; the no-reuse runs alternate among them
# vLLM's CPU worker keeps cores for its other processes (the scheduler process polls): 1 on x86, 1 more when a
# KV connector is configured (meant for NIXL). On 2 cores that second one leaves none reserved, and the model's
# OpenMP threads then share both cores with the scheduler and API server processes: the no-connector server
# would run its model on 1 core beside them, every connector server on 2 cores among them. One reserved core for
# every configuration: the same cores for the model everywhere, vLLM's own choice without a connector.
DEFAULT_SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
DISK_CONFIGS = ("kvx-disk", "example")


# ------------------------------------------------------------------------------------------------ page cache
def drop_page_cache(paths: list[str], try_drop_caches: bool = True) -> str:
    """Evict ``paths``' files (recursively) from the page cache; returns how: ``"drop_caches"`` (``sync;
    echo 3 > /proc/sys/vm/drop_caches``), ``"fadvise(N files)"`` (``posix_fadvise(DONTNEED)`` after an
    fsync of each file) or ``"none (<why>)"``."""
    os.sync()
    if try_drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError as e:
            why = f"drop_caches: {e.strerror or e}"
    else:
        why = "drop_caches not tried"
    if not hasattr(os, "posix_fadvise"):
        return f"none ({why}; no posix_fadvise)"
    n = 0
    for root in paths:
        for d, _, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(d, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                except OSError:
                    pass
                finally:
                    os.close(fd)
    return f"fadvise({n} files; {why})"


# ------------------------------------------------------------------------------------------------ running
def server_args(spec: Spec, config: str, store: str, admit_after: int = 2) -> list[str]:
    from kvx.testing.vllm_server import kv_transfer_args, kvx_config, tiny_model_args

    args = [
        *tiny_model_args(spec.max_model_len),
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]
    if config in ("kvx-cpu", "kvx-cpu-admit"):
        extra = {"chunk_size": spec.chunk_size, "tiers": [{"type": "cpu", "size": spec.cpu_tier}]}
        if config == "kvx-cpu-admit":
            extra["admit_after"] = admit_after
        args += kv_transfer_args(kvx_config(extra))
    elif config == "kvx-disk":
        args += kv_transfer_args(
            kvx_config({"chunk_size": spec.chunk_size, "tiers": [{"type": "disk", "path": store}]})
        )
    elif config == "example":
        # vLLM 0.32's ExampleConnector loads a stored prompt's whole KV even when vLLM's prefix cache already
        # holds the first blocks of it, and the engine dies ("shape mismatch: value tensor of shape [896, ...]
        # cannot be broadcast to indexing result of shape [2048, ...]" in inject_kv_into_layer): it runs here
        # without vLLM's prefix cache, the one way it serves this workload
        args += ["--no-enable-prefix-caching"]
        args += kv_transfer_args(
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": store},
            }
        )
    elif config != "vllm":
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    return args


async def _send_all(url: str, model: str, reqs: list[Request], max_tokens: int) -> tuple[list[dict], float, float]:
    """Send ``reqs`` open-loop at their arrival times; returns (results, first send, last completion)."""
    import aiohttp

    from kvx.testing.vllm_server import acomplete

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(r: Request):
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                res = await acomplete(session, url, r.prompt, max_tokens, model=model, timeout_s=1800)
            except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
                res = {
                    "tokens": [],
                    "ttft_s": None,
                    "latency_s": float("nan"),
                    "prompt_tokens": None,
                    "cached_tokens": None,
                    "finish_reason": None,
                    "kv_transfer_params": None,
                    "usage": None,
                    "error": f"{type(e).__name__}: {e}",
                }
            return res, time.perf_counter()

        out = await asyncio.gather(*(one(r) for r in reqs))
    return [r for r, _ in out], t0, max(t for _, t in out)


def _wait_idle(srv, timeout_s: float = 120.0) -> None:
    """Until the server runs and waits for no request, then 1 s more (kvx's writes behind the step)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = srv.metrics()
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            break
        time.sleep(0.2)
    time.sleep(1.0)


def _wait_store_settled(store: str, timeout_s: float = 120.0) -> None:
    """Until the store directory has no temporary file and its file count holds still for 1 s."""
    end, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < end:
        files = [f for _, _, fs in os.walk(store) for f in fs]
        n = len(files)
        if n != last or any(f.endswith(".tmp") for f in files):
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return
        time.sleep(0.2)


_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:kvx_hit_tokens_cpu_total",
    "vllm:kvx_hit_tokens_disk_total",
    "vllm:prompt_tokens_total",
    "vllm:kvx_cpu_write_bytes_total",
    "vllm:kvx_saves_total",
    "vllm:kvx_saves_skipped_admission_total",
)


def run_phase(
    srv, workload: str, config: str, name: str, reqs: list[Request], rate: float, max_tokens: int, log=print
) -> Phase:
    before = srv.metrics()
    results, t0, t1 = asyncio.run(_send_all(srv.url, srv.model, reqs, max_tokens))
    failed = [r["error"] for r in results if r.get("error")]
    after = {}
    if srv.alive and srv.healthy():
        _wait_idle(srv)
        after = srv.metrics()
    p = Phase(
        workload,
        config,
        name,
        rate,
        reqs,
        results,
        t0,
        t1,
        {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS} if after else {},
    )
    if failed:
        from kvx.testing.vllm_server import _logged_exceptions

        causes = _logged_exceptions(srv.log_text(), limit=2)
        p.error = (
            f"{len(failed)} of {len(results)} requests failed ({failed[0][:120]})"
            + (f"; server log: {' / '.join(c[:300] for c in causes)}" if causes else "")
            + ("" if srv.alive and srv.healthy() else "; the server died")
        )
        log(f"  {workload:8s} {config:8s} {name:6s} FAILED: {p.error}")
        return p
    r = p.row()
    log(
        f"  {workload:8s} {config:8s} {name:6s} {r['requests']:3d} req {r['throughput_rps']:.3f} req/s  TTFT p50 "
        f"{r['ttft_p50_s']:.3f} p90 {r['ttft_p90_s']:.3f} s  hit rate {r['hit_rate']:.2f}"
    )
    return p


def _same_tokens(phase: Phase, ref: Phase | None) -> str:
    if ref is None:
        return ""
    n = sum(a["tokens"] == b["tokens"] for a, b in zip(phase.results, ref.results))
    return f"{n}/{len(phase.results)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the test model and a few requests (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--turns", type=int, default=None, help="turns per conversation (default 4; quick 2)")
    ap.add_argument("--questions", type=int, default=None, help="questions per document (default 4; quick 2)")
    ap.add_argument("--admit-after", type=int, default=2, help="kvx-cpu-admit's admit_after (default 2)")
    ap.add_argument("--rate", type=float, default=None, help="requests/s of the reuse workload (default 3; quick 4)")
    ap.add_argument("--no-reuse-rate", type=float, default=None, help="requests/s of the no-reuse runs (default 4)")
    ap.add_argument("--no-reuse-runs", type=int, default=4, help="runs per server (alternating vllm / kvx-cpu)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for a server to become healthy")
    ap.add_argument("--keep-logs", default=None, metavar="DIR", help="copy the servers' logs into DIR")
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every server (repeatable)",
    )
    args = ap.parse_args(argv)
    spec = QUICK if args.quick else Spec()
    if args.turns is not None or args.questions is not None:
        spec = dataclasses.replace(
            spec,
            turns=args.turns if args.turns is not None else spec.turns,
            questions=args.questions if args.questions is not None else spec.questions,
        )
    rate = args.rate or (4.0 if args.quick else 3.0)
    nr_rate = args.no_reuse_rate or (8.0 if args.quick else 4.0)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown {c!r}; known: {', '.join(CONFIGS)}")
    shown = list(argv if argv is not None else sys.argv[1:])
    if "--keep-logs" in shown:  # where logs were copied changes no result
        i = shown.index("--keep-logs")
        del shown[i : i + 2]
    shown = [a for a in shown if not a.startswith("--keep-logs=")]
    command = ("python benchmarks/bench_serving.py " + " ".join(shown)).strip()
    server_env = dict(DEFAULT_SERVER_ENV)
    for item in args.server_env:
        if "=" not in item:
            ap.error(f"--server-env: expected NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        server_env[k] = v

    from kvx.testing.bench import cpu_name
    from kvx.testing.vllm_server import VllmServer

    t_start = time.perf_counter()
    load1 = os.getloadavg()[0]
    model = tiny_model(spec)
    work = build_workload(spec, args.seed, rate)
    tmp = tempfile.mkdtemp(prefix="kvx-bench-serving-")
    phases: list[Phase] = []
    notes: list[str] = []
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)

    def start(config: str) -> VllmServer:
        store = os.path.join(tmp, f"store-{config}")
        log_path = os.path.join(logs, f"{config}.log")
        return VllmServer(
            model,
            server_args(spec, config, store, args.admit_after),
            log_path=log_path,
            wait=False,
            timeout_s=args.timeout,
            env=server_env,
        )

    def reuse(srv, config: str) -> None:
        store = os.path.join(tmp, f"store-{config}")
        print(f"{config}: reuse workload")
        first = run_phase(srv, "reuse", config, "first", work["first"], rate, args.max_tokens)
        if first.error and not (srv.alive and srv.healthy()):
            phases.append(first)
            return
        how = ""
        if config in DISK_CONFIGS:
            _wait_store_settled(store)
            how = drop_page_cache([store])
            print(f"  page cache before the warm phase: {how}")
        warm = run_phase(srv, "reuse", config, "warm", work["warm"], rate, args.max_tokens)
        warm.page_cache = how
        phases.extend([first, warm])

    started: list = []
    try:
        # stage 1: vllm and kvx-cpu up together (the no-reuse runs alternate between them)
        pair = [c for c in STAGE1 if c in configs]
        servers = {c: start(c) for c in pair}
        started += servers.values()
        for s in servers.values():
            s.wait_healthy()
        if len(pair) >= 2 and args.no_reuse_runs > 0:
            print("no-reuse workload")
            runs: dict[str, list[Phase]] = {c: [] for c in pair}
            for i in range(args.no_reuse_runs):
                # the same prompts and arrivals to both (each server sees them once: no reuse), so a pair of
                # runs differs in the server alone; A B, B A, ...
                reqs = build_no_reuse(spec, 1000 + i, nr_rate)
                for c in pair if i % 2 == 0 else pair[::-1]:
                    p = run_phase(servers[c], "no-reuse", c, f"run{i}", reqs, nr_rate, args.max_tokens)
                    for res in p.results:
                        res["run"] = i
                    runs[c].append(p)
            phases.extend(merge_runs(runs[c], "all") for c in pair)
            order = [
                (p.config, p.row()["throughput_rps"])
                for i in range(args.no_reuse_runs)
                for p in sorted((runs[c][i] for c in pair), key=lambda p: p.start_s)
            ]
            notes.append(
                "No-reuse runs in the order they ran (req/s): "
                + ", ".join(f"{c} {x:.3f}" for c, x in order)
                + ". The merged rows divide all requests by the time of all runs."
            )
        for c in pair:
            reuse(servers[c], c)
            servers[c].stop()
        # stage 2: the disk-backed configurations, up together
        servers = {c: start(c) for c in configs if c not in pair}
        started += servers.values()
        for s in servers.values():
            s.wait_healthy()
        for c, s in servers.items():
            reuse(s, c)
            s.stop()
    finally:
        for s in started:
            s.stop()
        if args.keep_logs:
            shutil.copytree(logs, args.keep_logs, dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    ref = {(p.workload, p.phase): p for p in phases if p.config == "vllm"}
    for p in phases:
        if p.config != "vllm":
            p.outputs_as_vllm = _same_tokens(p, ref.get((p.workload, p.phase)))
        else:
            p.outputs_as_vllm = f"{len(p.results)}/{len(p.results)}"
    for p in phases:
        n, _, total = p.outputs_as_vllm.partition("/")
        if total and n != total:
            notes.append(
                f"{p.config}, {p.phase}: {p.outputs_as_vllm} requests have the no-connector server's greedy "
                "tokens (float32 model; the kvx end-to-end tests see equal tokens between cold, prefix-cache "
                "and kvx-loaded KV); the other requests' tokens differ."
            )
    if "example" in configs:
        notes.append(
            "ExampleConnector runs with `--no-enable-prefix-caching`: with vLLM's prefix cache on, it loads a "
            "stored prompt's whole KV into a request whose first blocks vLLM already holds, and vLLM 0.32's "
            "engine dies (`shape mismatch` in `inject_kv_into_layer`; seen in this benchmark's warm phase). "
            "It keys a stored prompt by all its block-aligned tokens: a later prompt hits only when its own "
            "block-aligned tokens are exactly those (here: a question shorter than a block after a stored "
            "document), never on a shorter shared prefix such as the system prompt or earlier turns."
        )
    if "kvx-cpu-admit" in configs:
        notes.append(
            f"kvx-cpu-admit: kvx-cpu with `admit_after={args.admit_after}` (a chunk is stored once "
            f"{args.admit_after} requests' prompts covered it). `kvx CPU writes`: bytes kvx wrote into its CPU "
            "tier over the phase (`vllm:kvx_cpu_write_bytes_total`); `kvx saves`: chunk saves planned "
            "(`vllm:kvx_saves_total`), and in parentheses those admission skipped "
            "(`vllm:kvx_saves_skipped_admission_total`)."
        )
    notes.append(
        "Every server runs with " + ", ".join(f"`{k}={v}`" for k, v in server_env.items()) + ". vLLM's CPU "
        "worker reserves cores for its scheduler and API processes: 1 on x86, plus 1 when a KV connector "
        "is configured; on 2 cores the connector servers would reserve none and run the model's OpenMP "
        "threads on both cores beside those processes, the no-connector server on one. Reserving 1 core "
        "everywhere gives every configuration the same cores for the model (vLLM's own choice without a "
        "connector)."
    )
    info = {
        "machine": cpu_name(),
        "vllm": _vllm_version(),
        "load": f"load average at start {load1:.2f}",
        "elapsed_s": time.perf_counter() - t_start,
        "seed": args.seed,
        "rate": rate,
        "no_reuse_rate": nr_rate,
        "no_reuse_runs": args.no_reuse_runs,
        "admit_after": args.admit_after if "kvx-cpu-admit" in configs else None,
        "max_tokens": args.max_tokens,
        "first_requests": len(work["first"]),
        "warm_requests": len(work["warm"]),
        "first_tokens": sum(len(r.prompt) for r in work["first"]),
        "warm_tokens": sum(len(r.prompt) for r in work["warm"]),
        "working_set_tokens": working_set_tokens(work),
        "notes": notes,
    }
    paths = write_results(phases, args.out, command=command.strip(), spec=spec, info=info, smoke=args.quick)
    print("wrote " + ", ".join(paths))
    for name, value, want, met in targets([p.row() for p in phases]):
        print(f"{name}: {value:.3f} (wanted {want}): {'met' if met else 'MISSED'}")
    return 0


def _vllm_version() -> str:
    try:
        import importlib.metadata as md

        try:
            return md.version("vllm")
        except md.PackageNotFoundError:
            return md.version("vllm-cpu") + " (vllm-cpu)"
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    sys.exit(main())
