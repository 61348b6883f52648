"""``benchmarks/bench_serving.py``'s workload and what a phase measured: the seeded requests (a shared system
prompt, growing conversations, RAG documents asked several questions; no-reuse prompts of random tokens), their
Poisson arrivals, the working set's size, and :class:`Phase` (one configuration's phase: TTFT, throughput, hits).
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics

from kvx.testing.bench_timing import percentile

CONFIGS = ("vllm", "kvx-cpu", "kvx-disk", "example", "kvx-cpu-admit")
PHASES = ("first", "warm")


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


def _kv_bytes_per_token(spec: Spec) -> int:
    heads = spec.hidden // 64
    return spec.layers * max(1, heads // 2) * 64 * 2 * 4


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
