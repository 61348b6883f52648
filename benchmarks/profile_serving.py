"""Where a kvx-cpu server's CPU goes under the no-reuse workload: kvx's share of every vLLM process, sampled.

The no-reuse throughput ratio of ``bench_serving.py`` (kvx-cpu / vllm, target >= 0.97) is a difference of
two noisy throughputs: on this shared 2-core machine runs of the same prompts on the same server spread by
+-10%. This measures kvx's cost directly instead: a ``vllm serve`` with kvx's CPU tier (the same server,
model and prompts as ``bench_serving.py``'s ``kvx-cpu``) serves one no-reuse run of random prompts while
py-spy samples every process of the server (API server, engine core, worker; every thread, idle ones
left out). A sample counts as kvx's when a kvx frame is on its stack: the connector's hooks called by vLLM,
kvx's copy threads and I/O threads. Their share of the worker process (the model's forward) and of the
engine core (the scheduler) is what kvx takes from serving.

    pip install py-spy
    python benchmarks/profile_serving.py [--rate 200] [--out benchmarks/results/serving_cpu_profile]

Writes ``<out>.md`` and the raw samples ``<out>.txt.gz`` (py-spy's ``--format raw``: a flame graph's input).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# it profiles bench_serving.py's own servers and workload (server_args, _send_all), so imports that script
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as S  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_KVX_FRAME = re.compile(r"\(kvx/")


def aggregate(raw_lines) -> dict:
    """Samples per process, per thread, and with a kvx frame on the stack, from py-spy's raw output."""
    procs, kvx, threads, where = (collections.Counter() for _ in range(4))
    total = 0
    for line in raw_lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        named = [f for f in frames if f.startswith("process ")]
        proc = named[-1].split(":", 1)[1].strip('"')[:40] if named else "?"
        thread = next((re.sub(r" \(\d+\)", "", f) for f in frames if f.startswith("thread ")), "thread ?")
        procs[proc] += n
        threads[(proc, thread)] += n
        ours = [f for f in frames if _KVX_FRAME.search(f)]
        if ours and not proc.startswith("/"):  # the API server's process is `python -m kvx.testing.vllm_server`
            kvx[proc] += n
            where[(proc, ours[0][:80])] += n
    return {"total": total, "procs": procs, "kvx": kvx, "threads": threads, "where": where}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--seed", type=int, default=1001, help="seed of the no-reuse prompts")
    ap.add_argument("--out", default=os.path.join(RESULTS, "serving_cpu_profile"))
    args = ap.parse_args(argv)
    spy_bin = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy_bin):
        print("profile_serving: needs py-spy (pip install py-spy)", file=sys.stderr)
        return 2

    from kvx.testing.bench import cpu_name
    from kvx.testing.vllm_server import VllmServer

    spec = S.Spec()
    model = S.tiny_model(spec)
    tmp = tempfile.mkdtemp(prefix="kvx-profile-serving-")
    raw = os.path.join(tmp, "samples.txt")
    srv = VllmServer(
        model,
        S.server_args(spec, "kvx-cpu", os.path.join(tmp, "store")),
        log_path=os.path.join(tmp, "server.log"),
        wait=False,
        timeout_s=600,
        env=dict(S.DEFAULT_SERVER_ENV),
    )
    try:
        srv.wait_healthy()
        asyncio.run(S._send_all(srv.url, srv.model, S.build_no_reuse(spec, 0, 4.0)[:3], 8))  # warm-up
        reqs = S.build_no_reuse(spec, args.seed, 4.0)
        spy = subprocess.Popen(
            [
                spy_bin,
                "record",
                "--pid",
                str(srv.pid),
                "--subprocesses",
                "--threads",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                str(args.rate),
                "-o",
                raw,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.0)  # py-spy attached to every process
        results, t0, t1 = asyncio.run(S._send_all(srv.url, srv.model, reqs, 8))
        spy.send_signal(2)
        spy.wait(120)
        kvx_stats = {k: v for k, v in srv.metrics().items() if k.startswith("vllm:kvx_") and k.endswith("_total")}
    finally:
        srv.stop()
    failed = [r for r in results if r.get("error")]
    if failed or not os.path.exists(raw):
        print(f"profile_serving: {len(failed)} requests failed or py-spy wrote nothing", file=sys.stderr)
        return 1
    with open(raw) as f:
        agg = aggregate(f)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(raw, "rb") as src, gzip.open(args.out + ".txt.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.rmtree(tmp, ignore_errors=True)

    procs, kvx = agg["procs"], agg["kvx"]
    lines = [
        "# kvx's share of a vllm serve's CPU (no-reuse workload, kvx CPU tier)",
        "",
        f"Machine: {cpu_name()}; py-spy at {args.rate} Hz over one no-reuse run ({len(reqs)} prompts of "
        f"{spec.unique_tokens[0]}-{spec.unique_tokens[1]} random tokens, seed {args.seed}, 8 output tokens, "
        f"offered 4 req/s; served at {len(reqs) / (t1 - t0):.3f} req/s). Same server and model as "
        "`bench_serving.py`'s `kvx-cpu`. {n} samples of non-idle threads.".replace("{n}", str(agg["total"])),
        "",
        "Reproduce: `python benchmarks/profile_serving.py`",
        "",
        "| process | samples | with a kvx frame | kvx share |",
        "|---|---:|---:|---:|",
    ]
    for p, n in procs.most_common():
        share = (
            f"{kvx[p] / n:.2%}" if not p.startswith("/") else "(the API server: `python -m kvx.testing.vllm_server`)"
        )
        lines.append(f"| {p} | {n} | {kvx[p]} | {share} |")
    lines += ["", "Threads:", "", "| process | thread | samples |", "|---|---|---:|"]
    lines += [f"| {p} | {t} | {n} |" for (p, t), n in agg["threads"].most_common(10)]
    lines += [
        "",
        "Where kvx's samples are (outermost kvx frame):",
        "",
        "| process | frame | samples |",
        "|---|---|---:|",
    ]
    lines += [f"| {p} | `{w}` | {n} |" for (p, w), n in agg["where"].most_common(12)]
    lines += [
        "",
        "kvx counters after the run: " + ", ".join(f"`{k}` {v:g}" for k, v in sorted(kvx_stats.items()) if v),
        "",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
