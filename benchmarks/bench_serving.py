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
import csv
import dataclasses
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from kvx.testing.bench_timing import percentile

CONFIGS = ("vllm", "kvx-cpu", "kvx-disk", "example", "kvx-cpu-admit")
DEFAULT_CONFIGS = CONFIGS[:4]
STAGE1 = ("vllm", "kvx-cpu", "kvx-cpu-admit")  # up together; the no-reuse runs alternate among them
# vLLM's CPU worker keeps cores for its other processes (the scheduler process polls): 1 on x86, 1 more when a
# KV connector is configured (meant for NIXL). On 2 cores that second one leaves none reserved, and the model's
# OpenMP threads then share both cores with the scheduler and API server processes: the no-connector server
# would run its model on 1 core beside them, every connector server on 2 cores among them. One reserved core for
# every configuration: the same cores for the model everywhere, vLLM's own choice without a connector.
DEFAULT_SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
DISK_CONFIGS = ("kvx-disk", "example")
PHASES = ("first", "warm")
CSV_FIELDS = [
    "workload",
    "config",
    "phase",
    "requests",
    "offered_rps",
    "duration_s",
    "throughput_rps",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "ttft_mean_s",
    "latency_p50_s",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "vllm_prefix_hit_tokens",
    "connector_hit_tokens",
    "kvx_hit_cpu_tokens",
    "kvx_hit_disk_tokens",
    "kvx_cpu_write_bytes",
    "kvx_saves",
    "kvx_saves_skipped_admission",
    "outputs_as_vllm",
    "page_cache",
    "error",
]
REQUEST_FIELDS = [
    "workload",
    "config",
    "phase",
    "run",
    "rid",
    "kind",
    "arrival_s",
    "prompt_tokens",
    "cached_tokens",
    "ttft_s",
    "latency_s",
]


# ------------------------------------------------------------------------------------------------ workload
@dataclasses.dataclass
class Spec:
    """Sizes of the workload (tokens) and the model / server settings."""

    system_tokens: int = 512
    docs: int = 6
    doc_tokens: int = 1536
    questions: int = 4  # per document: 1 in the first pass, the rest in the warm phase
    question_tokens: tuple[int, int] = (32, 96)
    convs: int = 8
    turns: int = 4  # per conversation: 1 in the first pass, the rest in the warm phase
    user_tokens: tuple[int, int] = (64, 192)
    reply_tokens: tuple[int, int] = (48, 128)
    unique_prompts: int = 12  # per no-reuse run
    unique_tokens: tuple[int, int] = (1024, 2048)
    vocab: int = 8192
    # model and server
    hidden: int = 512
    layers: int = 8
    max_model_len: int = 3072
    kv_cache_bytes: int = 64 << 20  # vLLM's KV cache: 4096 tokens of this model (16 KiB each)
    chunk_size: int = 256
    cpu_tier: str = "2GiB"


QUICK = dataclasses.replace(
    Spec(),
    docs=3,
    doc_tokens=1024,
    questions=2,
    convs=2,
    turns=2,
    unique_prompts=3,
    unique_tokens=(512, 768),
    vocab=1024,
    hidden=256,
    layers=2,
    max_model_len=2048,
    kv_cache_bytes=5 << 20,
    cpu_tier="256MiB",
)


@dataclasses.dataclass
class Request:
    rid: str  # "chat3.t2", "doc1.q3", "u0.5"
    kind: str  # "chat", "rag", "unique"
    prompt: list[int]
    arrival_s: float  # offset from the start of its phase


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrival times (s from 0) of a Poisson process of ``rate`` per second; the first at 0."""
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def tiny_model(spec: Spec) -> str:
    """The random-weight Llama of ``spec`` (built once, cached under ~/.cache/kvx/models); its directory."""
    from kvx.testing import harness as H

    path = os.path.expanduser(f"~/.cache/kvx/models/llama-h{spec.hidden}-l{spec.layers}-float32")
    return H.make_llama_of_width(path, spec.hidden, spec.layers, "float32", spec.max_model_len, vocab=spec.vocab)


def build_workload(spec: Spec, seed: int, rate: float) -> dict[str, list[Request]]:
    """``{"first": [...], "warm": [...]}``: the reuse workload (see the module doc), deterministic in
    ``seed``; each phase's arrivals are a Poisson process of ``rate``."""
    rng = random.Random(seed)
    system = _tokens(rng, spec.system_tokens, spec.vocab)
    docs = [_tokens(rng, spec.doc_tokens, spec.vocab) for _ in range(spec.docs)]
    # every conversation's messages, drawn up front: user 1, reply 1, user 2, ... user T
    convs = []
    for _ in range(spec.convs):
        msgs = []
        for t in range(spec.turns):
            msgs.append(_tokens(rng, rng.randint(*spec.user_tokens), spec.vocab))
            if t < spec.turns - 1:
                msgs.append(_tokens(rng, rng.randint(*spec.reply_tokens), spec.vocab))
        convs.append(msgs)
    questions = [
        [_tokens(rng, rng.randint(*spec.question_tokens), spec.vocab) for _ in range(spec.questions)]
        for _ in range(spec.docs)
    ]

    def chat(c: int, turn: int) -> Request:  # turn 1-based: user messages 1..turn, replies 1..turn-1
        prompt = list(system)
        for m in convs[c][: 2 * turn - 1]:
            prompt += m
        return Request(f"chat{c}.t{turn}", "chat", prompt, 0.0)

    def rag(d: int, q: int) -> Request:
        return Request(f"doc{d}.q{q + 1}", "rag", system + docs[d] + questions[d][q], 0.0)

    first = [chat(c, 1) for c in range(spec.convs)] + [rag(d, 0) for d in range(spec.docs)]
    rng.shuffle(first)
    # warm: later turns and questions; a conversation's turns keep their order
    slots = [("chat", c) for c in range(spec.convs) for _ in range(spec.turns - 1)]
    slots += [("rag", d) for d in range(spec.docs) for _ in range(spec.questions - 1)]
    rng.shuffle(slots)
    nxt = {("chat", c): 2 for c in range(spec.convs)} | {("rag", d): 1 for d in range(spec.docs)}
    warm = []
    for key in slots:
        kind, i = key
        warm.append(chat(i, nxt[key]) if kind == "chat" else rag(i, nxt[key]))
        nxt[key] += 1
    for reqs in (first, warm):
        for r, t in zip(reqs, poisson_arrivals(len(reqs), rate, rng)):
            r.arrival_s = t
    return {"first": first, "warm": warm}


def build_no_reuse(spec: Spec, seed: int, rate: float) -> list[Request]:
    """``spec.unique_prompts`` prompts of random tokens (nothing shared), Poisson arrivals of ``rate``."""
    rng = random.Random(seed)
    reqs = [
        Request(f"u{seed}.{i}", "unique", _tokens(rng, rng.randint(*spec.unique_tokens), spec.vocab), 0.0)
        for i in range(spec.unique_prompts)
    ]
    for r, t in zip(reqs, poisson_arrivals(len(reqs), rate, rng)):
        r.arrival_s = t
    return reqs


# ------------------------------------------------------------------------------------------------ stats
@dataclasses.dataclass
class Phase:
    """What one phase of one configuration measured."""

    workload: str  # "reuse" or "no-reuse"
    config: str
    phase: str  # "first", "warm", or "run<i>" (no-reuse)
    offered_rps: float
    requests: list[Request]
    results: list[dict]  # kvx.testing.vllm_server result dicts, in request order
    start_s: float  # perf_counter of the first send
    end_s: float  # perf_counter of the last completion
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # /metrics deltas over the phase
    outputs_as_vllm: str = ""  # "n/N" requests with the same tokens as the vllm config's
    page_cache: str = ""
    error: str = ""  # why the phase failed (requests failed, server died); empty if it did not

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def row(self) -> dict:
        ok = [r for r in self.results if not r.get("error")]
        ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
        lat = [r["latency_s"] for r in ok]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        cached = sum(r["cached_tokens"] or 0 for r in ok)
        m = self.metrics
        return {
            "workload": self.workload,
            "config": self.config,
            "phase": self.phase,
            "requests": len(self.results),
            "offered_rps": self.offered_rps,
            "duration_s": self.duration_s,
            "throughput_rps": (len(ok) / self.duration_s if self.duration_s > 0 and not self.error else float("nan")),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
            "latency_p50_s": percentile(lat, 50),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else float("nan"),
            "vllm_prefix_hit_tokens": int(m.get("vllm:prefix_cache_hits_total", 0)),
            "connector_hit_tokens": int(m.get("vllm:external_prefix_cache_hits_total", 0)),
            "kvx_hit_cpu_tokens": int(m.get("vllm:kvx_hit_tokens_cpu_total", 0)),
            "kvx_hit_disk_tokens": int(m.get("vllm:kvx_hit_tokens_disk_total", 0)),
            "kvx_cpu_write_bytes": int(m.get("vllm:kvx_cpu_write_bytes_total", 0)),
            "kvx_saves": int(m.get("vllm:kvx_saves_total", 0)),
            "kvx_saves_skipped_admission": int(m.get("vllm:kvx_saves_skipped_admission_total", 0)),
            "outputs_as_vllm": self.outputs_as_vllm,
            "page_cache": self.page_cache,
            "error": self.error,
        }


def merge_runs(phases: list[Phase], name: str) -> Phase:
    """The no-reuse runs of one configuration as one phase: requests and results concatenated, duration
    the sum of the runs' durations (so throughput = all requests / time spent serving them)."""
    first = phases[0]
    merged = Phase(
        first.workload,
        first.config,
        name,
        first.offered_rps,
        [r for p in phases for r in p.requests],
        [x for p in phases for x in p.results],
        0.0,
        sum(p.duration_s for p in phases),
    )
    for p in phases:
        for k, v in p.metrics.items():
            merged.metrics[k] = merged.metrics.get(k, 0.0) + v
    merged.outputs_as_vllm = first.outputs_as_vllm
    merged.error = "; ".join(f"{p.phase}: {p.error}" for p in phases if p.error)
    return merged


# ------------------------------------------------------------------------------------------------ targets
def targets(rows: list[dict]) -> list[tuple[str, float, str, bool]]:
    """``(name, value, target, met)`` for the issue's targets, from the summary rows."""
    by = {(r["workload"], r["config"], r["phase"]): r for r in rows}
    out = []
    w_v, w_k = by.get(("reuse", "vllm", "warm")), by.get(("reuse", "kvx-cpu", "warm"))
    if w_v and w_k:
        x = w_k["throughput_rps"] / w_v["throughput_rps"]
        out.append(("warm phase: kvx-cpu / vllm throughput", x, ">= 2", x >= 2.0))
        x = w_k["ttft_p50_s"] / w_v["ttft_p50_s"]
        out.append(("warm phase: kvx-cpu / vllm TTFT p50", x, "<= 0.3", x <= 0.3))
    n_v, n_k = by.get(("no-reuse", "vllm", "all")), by.get(("no-reuse", "kvx-cpu", "all"))
    if n_v and n_k:
        x = n_k["throughput_rps"] / n_v["throughput_rps"]
        out.append(("no-reuse: kvx-cpu / vllm throughput", x, ">= 0.97 (kvx costs <= 3%)", x >= 0.97))
    return out


def ratios(rows: list[dict]) -> list[tuple[str, float]]:
    """Informational ratios against vllm and example in the warm phase."""
    by = {(r["workload"], r["config"], r["phase"]): r for r in rows}
    out = []
    for base in ("vllm", "example"):
        b = by.get(("reuse", base, "warm"))
        for c in ("kvx-cpu", "kvx-disk"):
            r = by.get(("reuse", c, "warm"))
            if b and r:
                out.append((f"warm: {c} / {base} throughput", r["throughput_rps"] / b["throughput_rps"]))
                out.append((f"warm: {c} / {base} TTFT p50", r["ttft_p50_s"] / b["ttft_p50_s"]))
    return out


# ------------------------------------------------------------------------------------------------ report
def _fmt(v, digits=3) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def write_results(
    phases: list[Phase], out_dir: str, *, command: str, spec: Spec, info: dict, smoke: bool, stem: str = "serving_cpu"
) -> list[str]:
    """Write ``<stem>.csv``, ``<stem>_requests.csv``, ``<stem>.md`` and ``<stem>_*.png`` into ``out_dir``;
    returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    rows = [p.row() for p in phases]
    paths = []
    path = os.path.join(out_dir, f"{stem}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    paths.append(path)
    path = os.path.join(out_dir, f"{stem}_requests.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_FIELDS)
        for p in phases:
            for req, res in zip(p.requests, p.results):
                w.writerow(
                    [
                        p.workload,
                        p.config,
                        p.phase,
                        res.get("run", ""),
                        req.rid,
                        req.kind,
                        f"{req.arrival_s:.4f}",
                        res["prompt_tokens"],
                        res["cached_tokens"],
                        _fmt(res["ttft_s"], 4) if res["ttft_s"] is not None else "",
                        f"{res['latency_s']:.4f}",
                    ]
                )
    paths.append(path)
    paths += plot(phases, out_dir, stem)

    tg = targets(rows)
    title = "Serving on vllm-cpu: kvx vs vLLM's prefix cache vs ExampleConnector"
    lines = [
        f"# SMOKE RUN, not a measurement (--quick): {title}" if smoke else f"# {title}",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    lines += [
        f"Machine: {info.get('machine', '?')}; vllm {info.get('vllm', '?')}; {info.get('load', '')}; "
        f"total {info.get('elapsed_s', float('nan')):.0f} s. Timings on a shared 2-core machine (other "
        "work ran beside it) are noisy; the ratios compare configurations measured in the same run.",
        "",
        f"Model: random Llama, hidden {spec.hidden} x {spec.layers} layers, float32 ({spec.hidden // 64} "
        f"heads, {max(1, spec.hidden // 128)} KV heads; {_kv_bytes_per_token(spec) // 1024} KiB of KV per "
        f"token). Server: `--kv-cache-memory-bytes {spec.kv_cache_bytes}` "
        f"({spec.kv_cache_bytes // _kv_bytes_per_token(spec)} "
        f"tokens), `--max-model-len {spec.max_model_len}`, eager, prefix caching on; kvx chunk "
        f"{spec.chunk_size} tokens, CPU tier {spec.cpu_tier}. Requests: streamed, greedy, "
        f"{info.get('max_tokens', '?')} output tokens, `ignore_eos`.",
        "",
        f"Workload (seed {info.get('seed', '?')}): system prompt {spec.system_tokens} tokens; {spec.convs} "
        f"conversations x {spec.turns} turns (user {spec.user_tokens[0]}-{spec.user_tokens[1]}, replies "
        f"{spec.reply_tokens[0]}-{spec.reply_tokens[1]} tokens); {spec.docs} documents of {spec.doc_tokens} "
        f"tokens x {spec.questions} questions ({spec.question_tokens[0]}-{spec.question_tokens[1]} tokens). "
        f"First pass: turn 1 of each conversation and question 1 of each document "
        f"({info.get('first_requests', '?')} requests, {info.get('first_tokens', '?')} prompt tokens); warm "
        f"phase: the rest ({info.get('warm_requests', '?')} requests, {info.get('warm_tokens', '?')} prompt "
        f"tokens, working set {info.get('working_set_tokens', '?')} distinct tokens against vLLM's "
        f"{spec.kv_cache_bytes // _kv_bytes_per_token(spec)}). Poisson arrivals at "
        f"{info.get('rate', '?')} requests/s. No-reuse: {info.get('no_reuse_runs', '?')} runs per server "
        f"(alternating among vllm, kvx-cpu and kvx-cpu-admit, those run) of {spec.unique_prompts} prompts of "
        f"{spec.unique_tokens[0]}-"
        f"{spec.unique_tokens[1]} random tokens at {info.get('no_reuse_rate', '?')} requests/s "
        "(above what either server sustains: throughput = capacity); run i sends both servers the same "
        "prompts at the same arrival times (each server sees them once).",
        "",
        "Throughput = requests / (first send -> last completion). TTFT = send -> first streamed token at "
        "the client. Hit rate = cached prompt tokens reported in `usage` (vLLM prefix cache + connector) / "
        "prompt tokens; the split from /metrics. `outputs = vllm`: requests whose greedy tokens equal the "
        "no-connector server's.",
        "",
    ]
    if tg:
        lines += ["## Targets", "", "| target | value | wanted | |", "|---|---:|---|---|"]
        for name, value, want, met in tg:
            verdict = "(smoke run)" if smoke else ("met" if met else "MISSED")
            lines.append(f"| {name} | {value:.3f} | {want} | {verdict} |")
        lines.append("")
    lines += [
        "## Results",
        "",
        "| workload | config | phase | requests | offered req/s | req/s | TTFT p50 (s) | p90 | p99 | hit rate | "
        "vLLM prefix hits | connector hits | kvx cpu / disk | kvx CPU writes (MiB) | kvx saves (skipped: "
        "admission) | outputs = vllm | page cache |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|---|",
    ]
    for r in rows:
        failed = " (FAILED)" if r.get("error") else ""
        lines.append(
            f"| {r['workload']} | {r['config']}{failed} | {r['phase']} | {r['requests']} | "
            f"{_fmt(r['offered_rps'], 1)} | {_fmt(r['throughput_rps'])} | {_fmt(r['ttft_p50_s'])} | "
            f"{_fmt(r['ttft_p90_s'])} | "
            f"{_fmt(r['ttft_p99_s'])} | {_fmt(r['hit_rate'], 2)} | {r['vllm_prefix_hit_tokens']} | "
            f"{r['connector_hit_tokens']} | {r['kvx_hit_cpu_tokens']} / {r['kvx_hit_disk_tokens']} | "
            f"{r['kvx_cpu_write_bytes'] / 2**20:.1f} | {r['kvx_saves']} ({r['kvx_saves_skipped_admission']}) | "
            f"{r['outputs_as_vllm']} | {r['page_cache']} |"
        )
    rs = ratios(rows)
    if rs:
        lines += ["", "| ratio (warm phase) | value |", "|---|---:|"] + [f"| {n} | {v:.3f} |" for n, v in rs]
    pngs = [os.path.basename(p) for p in paths if p.endswith(".png")]
    if pngs:
        lines += [""] + [f"![{p}]({p})" for p in pngs]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "## Failures", ""] + [
            f"- {r['workload']} / {r['config']} / {r['phase']}: {r['error']}" for r in failed
        ]
    for note in info.get("notes", []):
        lines += ["", note]
    path = os.path.join(out_dir, f"{stem}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    paths.append(path)
    return paths


def _kv_bytes_per_token(spec: Spec) -> int:
    heads = spec.hidden // 64
    return spec.layers * max(1, heads // 2) * 64 * 2 * 4


def plot(phases: list[Phase], out_dir: str, stem: str) -> list[str]:
    """TTFT CDFs per configuration (first pass, warm phase) and throughput bars; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    paths = []
    reuse = [p for p in phases if p.workload == "reuse"]
    if reuse:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, ph in zip(axes, PHASES):
            for p in reuse:
                if p.phase != ph:
                    continue
                xs = sorted(r["ttft_s"] for r in p.results if r.get("ttft_s") is not None)
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=p.config)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("TTFT (s, log)")
            ax.set_title("first pass" if ph == "first" else "warm phase")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[1].legend(loc="lower right")
        fig.suptitle("TTFT CDF, vllm serve on CPU (reuse workload)")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}_ttft_cdf.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    groups = [("reuse", "first"), ("reuse", "warm"), ("no-reuse", "all")]
    configs = [c for c in CONFIGS if any(p.config == c for p in phases)]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        ys = []
        for wl, ph in groups:
            p = next((p for p in phases if (p.workload, p.config, p.phase) == (wl, c, ph)), None)
            y = p.row()["throughput_rps"] if p else float("nan")
            ys.append(0.0 if math.isnan(y) else y)
        xs = [g + (i - (len(configs) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, ys, width, label=c)
        ax.bar_label(bars, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=7)
    for g, (wl, ph) in enumerate(groups):  # the offered rate, over its group
        p = next((p for p in phases if (p.workload, p.phase) == (wl, ph)), None)
        if p is not None:
            ax.hlines(
                p.offered_rps,
                g - 0.45,
                g + 0.45,
                colors="gray",
                linestyles="dashed",
                label="offered rate" if g == 0 else None,
            )
    ax.set_xticks(range(len(groups)), ["reuse: first pass", "reuse: warm phase", "no-reuse"])
    ax.set_ylabel("requests / s")
    ax.set_title("Throughput, vllm serve on CPU")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


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


def working_set_tokens(work: dict[str, list[Request]], block: int = 128) -> int:
    """Distinct prompt tokens of the reuse workload, in full 128-token blocks (a block is distinct when its
    prefix is: what a prefix cache keys on)."""
    seen = set()
    for reqs in work.values():
        for r in reqs:
            h = 0
            for i in range(len(r.prompt) // block):
                h = hash((h, tuple(r.prompt[i * block : (i + 1) * block])))
                seen.add(h)
    return len(seen) * block


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
