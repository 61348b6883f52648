"""The GPU targets, judged from the CSVs one GPU run's benchmarks wrote: met / MISSED / NOT MEASURED, each with
its number and the baseline it is a ratio to (measured in the same run).

    python benchmarks/gpu_targets.py [--results benchmarks/results] [--gpu NAME] [--out PATH]

Reads from ``--results`` (each file optional; a target whose rows are missing is NOT MEASURED):
  copy_cuda_quick.csv         bench_copy --quick table (kvx.testing.bench: cache<->pinned and on-device rows)
  copy_cuda_quick_layer.csv   bench_copy layer section (one layer's copy of a step; the worker's batch)
  copy_cuda_quick_bidir.csv   bench_copy bidir section (a load and a save at once)
  copy_h2d_cuda.csv           bench_copy --h2d-only (per-layer batches of pages: auto vs dma and staged)
  pipeline_cuda.csv           bench_pipeline (layer-wise loads and saves of the worker, host time of its hooks)
Writes ``--out`` (default ``<results>/gpu_targets_<gpu>.md``, ``<gpu>`` as ``h100``) and prints the same table.

The judged rows are kvx's defaults: path ``auto`` (``path=None``) for host copies, impl ``cuda`` on device,
the worker's default config in the pipeline; the other paths are named in the details.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import re
import sys

MiB = 1 << 20
HOST = "cuda<->pinned"
FILES = {
    "copy": "copy_cuda_quick.csv",
    "layer": "copy_cuda_quick_layer.csv",
    "bidir": "copy_cuda_quick_bidir.csv",
    "h2d": "copy_h2d_cuda.csv",
    "pipeline": "pipeline_cuda.csv",
}
HOST_OPS = ("gather_blocks", "scatter_blocks", "gather_pages", "scatter_pages")  # canonical chunks, raw pages
MET, MISSED, NOT_MEASURED, SMOKE = "met", "MISSED", "NOT MEASURED", "n/a (smoke run)"


@dataclasses.dataclass
class Target:
    name: str
    limit: str
    measured: str = ""
    baseline: str = ""
    verdict: str = NOT_MEASURED
    detail: str = ""


def load_csv(path: str) -> list[dict] | None:
    """The rows of ``path`` (None if it does not exist)."""
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(row: dict, key: str) -> float | None:
    v = row.get(key, "")
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _smoke(rows: list[dict]) -> bool:
    return any(str(r.get("smoke", "")).lower() == "true" for r in rows)


def _verdict(ok: bool, rows: list[dict]) -> str:
    return SMOKE if _smoke(rows) else MET if ok else MISSED


def _case(r: dict) -> str:
    return f"{r['op']} {r['layout']} bs{r['block_size']} T{r['tokens']} L{r['layers']}"


# ---------------------------------------------------------------------------------------- copy table
def _host_cases(copy: list[dict]) -> dict[tuple, dict[str, dict]]:
    """cache<->pinned rows of canonical chunk and raw page ops of >= 8 MiB: (op, layout, ...) -> impl -> row."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in copy:
        if r["device"] == HOST and r["op"] in HOST_OPS and int(r["bytes"]) >= 8 * MiB:
            cases.setdefault(_case(r), {})[r["impl"]] = r
    return cases


def _pinned(copy: list[dict] | None, load: bool) -> Target:
    key, limit = ("load_pct_roof", 85.0) if load else ("pct_roof", 90.0)
    t = Target(
        f"host<->device chunk sets >= 8 MiB, canonical and pages, every layout, both directions, path auto"
        f"{' while a bf16 GEMM loop runs' if load else ''}",
        f">= {limit:g}% of a pinned copy{' under the same load' if load else ''}",
    )
    if not copy:
        return t
    cases = _host_cases(copy)
    judged = [(c, rs["kvx-cuda auto"]) for c, rs in cases.items() if "kvx-cuda auto" in rs]
    judged = [(c, r, _num(r, key)) for c, r in judged if _num(r, key) is not None]
    if not judged:
        return t
    worst = min(judged, key=lambda x: x[2])
    misses = [f"{c} {p:.0f}%" for c, _, p in judged if p < limit]
    roof = cases[worst[0]].get("memcpy (roof)")
    gbs = "load_GB/s" if load else "GB/s"
    t.measured = f"worst {worst[2]:.0f}% ({_num(worst[1], gbs):.1f} GB/s, {worst[0]})"
    t.baseline = f"pinned copy {_num(roof, gbs):.1f} GB/s" if roof and _num(roof, gbs) else ""
    t.verdict = _verdict(not misses, copy)
    staged = [_num(rs["kvx-cuda staged"], key) for rs in cases.values() if "kvx-cuda staged" in rs]
    staged = [p for p in staged if p is not None]
    t.detail = f"{len(judged) - len(misses)}/{len(judged)} cases met" + (
        f"; below: {', '.join(misses[:6])}{' ...' if len(misses) > 6 else ''}" if misses else ""
    )
    t.detail += f"; path staged: worst {min(staged):.0f}%" if staged else "; path staged: not measured"
    return t


def _on_device(copy: list[dict] | None) -> Target:
    t = Target("on device (HBM), chunk sets >= 64 MiB, impl cuda", ">= 90% of a device copy")
    if not copy:
        return t
    rows = [r for r in copy if r["device"] == "cuda" and int(r["bytes"]) >= 64 * MiB]
    judged = [(r, _num(r, "pct_roof")) for r in rows if r["impl"] == "kvx-cuda" and _num(r, "pct_roof") is not None]
    if not judged:
        return t
    worst = min(judged, key=lambda x: x[1])
    roof = next((r for r in rows if r["impl"] == "memcpy (roof)" and _case(r) == _case(worst[0])), None)
    misses = [r for r, p in judged if p < 90.0]
    triton = [_num(r, "pct_roof") for r in rows if r["impl"] == "kvx-triton" and _num(r, "pct_roof") is not None]
    t.measured = f"worst {worst[1]:.0f}% ({_num(worst[0], 'GB/s'):.0f} GB/s, {_case(worst[0])})"
    t.baseline = f"device copy {_num(roof, 'GB/s'):.0f} GB/s" if roof else ""
    t.verdict = _verdict(not misses, copy)
    t.detail = f"{len(judged) - len(misses)}/{len(judged)} cases met" + (
        f"; impl triton: worst {min(triton):.0f}%" if triton else ""
    )
    return t


# ---------------------------------------------------------------------------------------- bench_copy sections
def _bidir(bidir: list[dict] | None) -> Target:
    t = Target("both directions at once (a load and a save, 256 MiB each), path auto", ">= 80 GB/s together")
    if not bidir:
        return t
    by = {r["path"]: r for r in bidir}
    auto, roof = by.get("auto"), by.get("plain copies (roof)")
    if auto is None or _num(auto, "GB/s") is None:
        return t
    gbs = _num(auto, "GB/s")
    t.measured = f"{gbs:.1f} GB/s ({_num(auto, 'pct_roof'):.0f}% of the plain copies)"
    t.baseline = f"two plain copies at once {_num(roof, 'GB/s'):.1f} GB/s" if roof else ""
    t.verdict = _verdict(gbs >= 80.0, bidir)
    t.detail = "; ".join(f"{p} {_num(r, 'GB/s'):.1f} GB/s" for p, r in by.items() if p not in ("auto",))
    return t


def _layer_ratio(layer: list[dict] | None) -> Target:
    t = Target("one layer's copy of a step (>= 1 MiB), path staged, GPU time", "<= 1.5x a plain copy of the bytes")
    if not layer:
        return t
    rows = [r for r in layer if r["row"] == "staged" and int(r["bytes"]) >= MiB and _num(r, "x_plain") is not None]
    if not rows:
        return t
    worst = max(rows, key=lambda r: _num(r, "x_plain"))
    plain = next(
        (
            r
            for r in layer
            if r["row"] == "plain copy" and (r["chunks"], r["direction"]) == (worst["chunks"], worst["direction"])
        ),
        None,
    )
    misses = [r for r in rows if _num(r, "x_plain") > 1.5]
    mib = int(worst["bytes"]) // MiB
    t.measured = (
        f"worst {_num(worst, 'x_plain'):.2f}x ({worst['direction']}, {mib} MiB: {_num(worst, 'gpu_us'):.0f} us)"
    )
    t.baseline = f"plain copy {_num(plain, 'gpu_us'):.0f} us" if plain else ""
    t.verdict = _verdict(not misses, layer)
    t.detail = ", ".join(f"{r['direction']} {int(r['bytes']) // MiB} MiB {_num(r, 'x_plain'):.2f}x" for r in rows)
    return t


def _layer_host(layer: list[dict] | None) -> Target:
    t = Target("host time of one layer's batch of copies (the worker's compiled plan, 1-8 chunks)", "<= 15 us")
    if not layer:
        return t
    rows = [r for r in layer if r["row"] == "batch" and _num(r, "host_us") is not None]
    if not rows:
        return t
    worst = max(rows, key=lambda r: _num(r, "host_us"))
    plain = [_num(r, "host_us") for r in layer if r["row"] == "plain copy" and _num(r, "host_us") is not None]
    t.measured = f"worst {_num(worst, 'host_us'):.1f} us ({worst['direction']}, {worst['chunks']} chunk(s))"
    t.baseline = f"a plain copy's host time {max(plain):.1f} us" if plain else ""
    t.verdict = _verdict(all(_num(r, "host_us") <= 15.0 for r in rows), layer)
    t.detail = ", ".join(f"{r['direction']} x{r['chunks']} {_num(r, 'host_us'):.1f} us" for r in rows)
    ops = [r for r in layer if r["row"] in ("staged", "auto") and _num(r, "host_us") is not None]
    if ops:
        hs = [_num(r, "host_us") for r in ops]
        t.detail += f"; one op (staged/auto): {min(hs):.1f}-{max(hs):.1f} us"
    return t


def _h2d(h2d: list[dict] | None) -> Target:
    t = Target(
        "per-layer batches of 16 and 128 pages of 4 KiB-1 MiB: path auto", "within 5% of the faster of dma and staged"
    )
    if not h2d:
        return t
    rows = [r for r in h2d if r["path"] == "auto" and r.get("auto_within_5pct", "") != ""]
    if not rows:
        return t
    bad = [r for r in rows if r["auto_within_5pct"].lower() != "true"]
    worst = max(rows, key=lambda r: _num(r, "auto_x_best") or 0.0)
    t.measured = f"{len(rows) - len(bad)}/{len(rows)} points; worst {_num(worst, 'auto_x_best'):.2f}x"
    t.baseline = "the faster of dma and staged at each point"
    t.verdict = _verdict(not bad, h2d)
    t.detail = ", ".join(
        f"{r['direction']} {r['pieces']} x {int(r['piece_bytes']) // 1024} KiB {_num(r, 'auto_x_best'):.2f}x"
        for r in bad[:8]
    ) + (" ..." if len(bad) > 8 else "")
    return t


# ---------------------------------------------------------------------------------------- pipeline
def _pipe(pipe: list[dict] | None, section: str, mode: str, compute: str | None = None) -> list[dict]:
    return [
        r
        for r in pipe or []
        if r["section"] == section and r["mode"] == mode and (compute is None or r["compute"] == compute)
    ]


def _loads(pipe: list[dict] | None) -> Target:
    t = Target("layer-wise loads behind an equal-length matmul forward (1 and 8 chunks)", ">= 80% of the copy hidden")
    rows = [r for r in _pipe(pipe, "load", "layerwise", "matmul") if _num(r, "hidden_frac") is not None]
    if not rows:
        return t
    worst = min(rows, key=lambda r: _num(r, "hidden_frac"))
    base = {(r["shape"], r["chunks"]): _num(r, "hidden_frac") for r in _pipe(pipe, "load", "all at start", "matmul")}
    t.measured = f"worst {100 * _num(worst, 'hidden_frac'):.0f}% ({worst['shape']}, {worst['chunks']} chunk(s))"
    b = base.get((worst["shape"], worst["chunks"]))
    t.baseline = f"loads fenced at start: {100 * b:.0f}% hidden" if b is not None else ""
    t.verdict = _verdict(all(_num(r, "hidden_frac") >= 0.8 for r in rows), rows)
    t.detail = ", ".join(f"x{r['chunks']} {100 * _num(r, 'hidden_frac'):.0f}%" for r in rows) + _paths(rows)
    return t


def _saves(pipe: list[dict] | None) -> Target:
    t = Target("layer-wise saves (save_layerwise) during a matmul forward", "slow the forward <= 5%")
    rows = [r for r in _pipe(pipe, "save", "save_layerwise", "matmul") if _num(r, "slowdown_pct") is not None]
    if not rows:
        return t
    worst = max(rows, key=lambda r: _num(r, "slowdown_pct"))
    once = {
        (r["shape"], r["chunks"], r["compute_factor"]): _num(r, "slowdown_pct")
        for r in _pipe(pipe, "save", "all at once", "matmul")
    }
    t.measured = (
        f"worst {_num(worst, 'slowdown_pct'):+.1f}% ({worst['shape']}, {worst['chunks']} chunk(s), compute "
        f"{worst['compute_factor']}x the copy)"
    )
    t.baseline = f"forward without saves {_num(worst, 'fwd_nosave_ms'):.2f} ms"
    o = once.get((worst["shape"], worst["chunks"], worst["compute_factor"]))
    if o is not None:
        t.baseline += f"; all at once {o:+.1f}%"
    t.verdict = _verdict(all(_num(r, "slowdown_pct") <= 5.0 for r in rows), rows)
    t.detail = ", ".join(
        f"x{r['chunks']} compute {r['compute_factor']}x {_num(r, 'slowdown_pct'):+.1f}%" for r in rows
    ) + _paths(rows)
    return t


def _host_step(pipe: list[dict] | None) -> Target:
    t = Target(
        "host time of the hooks, a step loading or saving 8 chunks (32 layers)", "<= 1 ms over the step without kvx"
    )
    rows = [
        r
        for r in _pipe(pipe, "load", "layerwise") + _pipe(pipe, "save", "save_layerwise")
        if r["chunks"] == "8" and _num(r, "host_over_ms") is not None
    ]
    if not rows:
        return t
    worst = max(rows, key=lambda r: _num(r, "host_over_ms"))
    t.measured = f"worst {_num(worst, 'host_over_ms'):.3f} ms ({worst['section']}, {worst['compute']})"
    t.baseline = f"the step without kvx: {_num(worst, 'host_nokvx_ms'):.3f} ms of host time"
    t.verdict = _verdict(all(_num(r, "host_over_ms") <= 1.0 for r in rows), rows)
    t.detail = ", ".join(f"{r['section']} {r['compute']} {_num(r, 'host_over_ms'):.3f} ms" for r in rows)
    return t


def _host_idle(pipe: list[dict] | None) -> Target:
    t = Target("host time of the hooks, a step with nothing to copy", "<= 5 us per layer over the step without kvx")
    rows = [
        r
        for r in _pipe(pipe, "load", "compute only") + _pipe(pipe, "save", "no saves")
        if _num(r, "host_over_ms") is not None
    ]
    if not rows:
        return t

    def per_layer(r: dict) -> float:
        return 1e3 * _num(r, "host_over_ms") / int(r["layers"])

    worst = max(rows, key=per_layer)
    t.measured = f"worst {per_layer(worst):.1f} us per layer ({worst['section']}, {worst['compute']})"
    t.baseline = f"the step without kvx: {_num(worst, 'host_nokvx_ms'):.3f} ms of host time"
    t.verdict = _verdict(all(per_layer(r) <= 5.0 for r in rows), rows)
    t.detail = ", ".join(f"{r['section']} x{r['chunks']} {r['compute']} {per_layer(r):.1f} us" for r in rows)
    return t


def _paths(rows: list[dict]) -> str:
    paths = sorted({r.get("copy_path", "") for r in rows} - {""})
    return f" (copy_path {', '.join(paths)})" if paths else ""


# ---------------------------------------------------------------------------------------- all of them
def evaluate(results: dict[str, list[dict] | None]) -> list[Target]:
    """Every target from the rows of each file (keys of :data:`FILES`; None or absent = not measured)."""
    copy, pipe = results.get("copy"), results.get("pipeline")
    return [
        _pinned(copy, load=False),
        _pinned(copy, load=True),
        _bidir(results.get("bidir")),
        _on_device(copy),
        _layer_ratio(results.get("layer")),
        _layer_host(results.get("layer")),
        _h2d(results.get("h2d")),
        _loads(pipe),
        _saves(pipe),
        _host_step(pipe),
        _host_idle(pipe),
    ]


def gpu_name(results: dict[str, list[dict] | None]) -> str:
    """The device named in the results (the ``machine`` column bench_copy writes), or ''."""
    for rows in results.values():
        for r in rows or []:
            if r.get("machine"):
                return r["machine"]
    return ""


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; a name without a model number: its words, lower case."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def render(targets: list[Target], gpu: str, sources: list[str]) -> str:
    counts = {v: sum(t.verdict == v for t in targets) for v in (MET, MISSED, NOT_MEASURED, SMOKE)}
    lines = [
        f"# kvx GPU targets on {gpu or 'an unnamed device'}",
        "",
        "Each figure is judged against a baseline measured in the same run (`benchmarks/gpu_targets.py`, from "
        f"{', '.join(f'`{s}`' for s in sources) or 'no result files'}).",
        "",
        f"**{counts[MET]} met, {counts[MISSED]} missed, {counts[NOT_MEASURED]} not measured**"
        + (f", {counts[SMOKE]} from smoke runs" if counts[SMOKE] else "")
        + f" (of {len(targets)}).",
        "",
        "| # | target | limit | measured | baseline (same run) | verdict | details |",
        "|---:|---|---|---|---|---|---|",
    ]
    for i, t in enumerate(targets, 1):
        lines.append(
            f"| {i} | {t.name} | {t.limit} | {t.measured} | {t.baseline} | "
            f"{'**' + t.verdict + '**' if t.verdict != MET else t.verdict} | {t.detail} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--gpu", default=None, help="the device's name (default: from the CSVs)")
    ap.add_argument("--out", default=None, help="markdown path (default <results>/gpu_targets_<gpu>.md)")
    args = ap.parse_args(argv)
    results = {k: load_csv(os.path.join(args.results, f)) for k, f in FILES.items()}
    gpu = args.gpu or gpu_name(results)
    targets = evaluate(results)
    text = render(targets, gpu, [f for k, f in FILES.items() if results[k] is not None])
    out = args.out or os.path.join(args.results, f"gpu_targets_{device_slug(gpu)}.md")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
