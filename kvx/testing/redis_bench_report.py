"""``benchmarks/bench_redis.py``'s results: the CSV, and the markdown report (its tables, the verdicts against the
targets, what each section means) of a full run and of a sealed-only run.
"""

from __future__ import annotations

import csv
import platform
import statistics

import torch

from kvx.store import codec
from kvx.testing.bench import cpu_name
from kvx.testing.bench_timing import percentile
from kvx.testing.redis_bench import (
    B2B_CALLS,
    CSV_FIELDS,
    GET_BASE,
    GET_KVX,
    GET_METHODS,
    GET_TARGET_GBS,
    LOOKUP_KEYS,
    LOOKUP_KVX,
    LOOKUP_TARGET_MS,
    LOOKUP_WAIT_MS,
    PIECES,
    PUT_BASE,
    PUT_KVX,
    PUT_METHODS,
    PUT_TARGET_GBS,
    ROOF_OF,
    SEALED_METHODS,
    SEALED_TARGET,
    SEND_BUFFERS,
    TARGET_MIB,
    X_TARGET,
    MiB,
    Result,
    _attach,
    _fmt,
    _piece_name,
    _sndbuf_name,
    fmt6,
    l3_size,
    n_values,
    verdict,
)


# ------------------------------------------------------------------------------------------ results
def per_run(index, case, method, runs, stat=lambda r: r.median) -> list[float]:
    return [stat(index[(case, method, run)]) for run in range(1, runs + 1) if (case, method, run) in index]


def ratios(index, case, method, base, runs) -> list[float]:
    return [b / a for a, b in zip(per_run(index, case, method, runs), per_run(index, case, base, runs))]


def cell(xs: list[float], fmt: str = ".2f") -> str:
    """The median over the runs, then [every run]."""
    if not xs:
        return ""
    return f"{statistics.median(xs):{fmt}}" + (f" [{' / '.join(f'{x:{fmt}}' for x in xs)}]" if len(xs) > 1 else "")


def write_csv(path: str, results: list[Result]) -> None:
    index = _attach(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            base = index.get((r.case(), r.baseline, r.run)) if r.baseline else None
            roof = index.get((r.case(), ROOF_OF[r.section], r.run)) if r.section in ROOF_OF else None
            is_bytes = r.section != "lookup"
            w.writerow(
                [
                    r.section,
                    r.transport,
                    r.deployment,
                    r.chunk_bytes,
                    "" if r.part_bytes is None else r.part_bytes,
                    r.method,
                    r.baseline or "",
                    r.run,
                    len(r.times),
                    fmt6(r.median),
                    fmt6(percentile(r.times, 90)),
                    fmt6(percentile(r.times, 99)),
                    fmt6(statistics.fmean(r.times)),
                    fmt6(r.chunk_bytes / (float(fmt6(r.median)) * 1e-3) / 1e9) if is_bytes else "",
                    fmt6(base.median) if base else "",
                    fmt6(float(fmt6(base.median)) / float(fmt6(r.median))) if base else "",
                    fmt6(roof.median) if roof else "",
                    fmt6(100 * float(fmt6(roof.median)) / float(fmt6(r.median))) if roof else "",
                ]
            )


class _Report:
    """``bench_redis.py``'s markdown report, section by section: each method returns its section's lines."""

    def __init__(self, results: list[Result], info: dict, args, quick: bool):
        self.results, self.info, self.args, self.quick = results, info, args, quick
        self.index = _attach(results)
        self.runs = max(r.run for r in results)
        self.gp = [r for r in results if r.section in ("get", "put")]
        self.transports = list(dict.fromkeys(r.transport for r in self.gp))
        self.sizes = sorted({r.chunk_bytes for r in self.gp})
        self.dflt = info.get("default_part")

    def parts(self) -> tuple:
        """What every section reads: the results, info, their index, the runs, the median, the GET/PUT results,
        their transports and chunk sizes, the tier's default part size."""
        return (
            self.results,
            self.info,
            self.index,
            self.runs,
            statistics.median,
            self.gp,
            self.transports,
            self.sizes,
            self.dflt,
        )

    def header(self, cmd: str) -> list[str]:
        """The title, the machine and the run, how to reproduce it, what the columns mean."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        args, quick = self.args, self.quick
        lines = (
            ["# SMOKE RUN, not a measurement (--quick): kvx Redis tier vs redis-py + hiredis", ""]
            if quick
            else ["# kvx Redis tier vs redis-py + hiredis", ""]
        )
        lines += [
            f"Machine: {cpu_name()}; kernel {platform.release()}; redis-server {info['server_version']}; "
            f"redis-py {info['redis_py']} with hiredis {info['hiredis']}; torch {torch.__version__}; "
            f"Python {platform.python_version()}. {info['date']}. {runs} run(s), {info['repeats_desc']} after "
            f"{args.warmup} warm-up, interleaved (the order shuffled every repeat); load average at start "
            f"{info['load']:.2f}, at the end {info.get('load_end', float('nan')):.2f} (other work on the machine "
            f"shows here); total {info['elapsed']:.0f} s.",
            "",
            f"Reproduce: `{cmd}`",
            "",
            "One local `redis-server` (started by the benchmark through `kvx.testing.redis_server`: no persistence, "
            "noeviction), the client on the same 2-core VM (the server takes one core). GB/s = payload bytes "
            "(the chunk; the ~"
            f"{max(info['header_bytes'].values()) if info.get('header_bytes') else 300}-byte codec header is "
            "not counted) / median time. GET: into a CPU-pool slot, verified (header, key, fingerprint, shape, "
            "CRC32C); PUT: encoded (header with CRC32C), every put a new key. `% roof` = the time of the roof "
            "(`socket GET into slot` / `socket SET`: one plain socket, the same value received into / sent "
            "from the slot's memory, nothing parsed or checked) over the method's, same run. `x baseline` = "
            "the baseline's median time / the method's in the same run (> 1: faster than redis-py + hiredis "
            "doing the same work). Each cell: the median over the runs, then [every run]; GB/s from the "
            f"median over the runs. Destinations and sources rotate over {args.rotate_mib} MiB of slots and keys "
            f"(L3: {l3_size()}), one step per call: every call finds its chunk cold.",
            "",
        ]

        return lines

    def targets(self) -> tuple[dict, list[str]]:
        """The targets table, and the judged targets: {(target, transport): (value, met)}."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        quick = self.quick
        tb = TARGET_MIB * MiB
        tgt = {}
        lines = []
        lines += [
            "## Targets",
            "",
            f"{TARGET_MIB} MiB values; lookup = `contains_many` of {LOOKUP_KEYS} keys.",
            "",
            "| target | transport | measured | verdict |",
            "|---|---|---:|---|",
        ]
        for t in transports:
            if tb not in sizes:
                continue
            for how, sfx in (("shuffled", ""), ("back to back", "-b2b")):
                g_case, p_case = ("get" + sfx, t, "standalone", tb), ("put" + sfx, t, "standalone", tb)
                if (g_case, GET_KVX, 1) not in index:
                    continue
                g = med(per_run(index, g_case, GET_KVX, runs, lambda r: r.gbs))
                p = med(per_run(index, p_case, PUT_KVX, runs, lambda r: r.gbs))
                gx = med(ratios(index, g_case, GET_KVX, GET_BASE, runs))
                px = med(ratios(index, p_case, PUT_KVX, PUT_BASE, runs))
                for name, val, ok, unit in (
                    (f"GET >= {GET_TARGET_GBS} GB/s into the slot", g, g >= GET_TARGET_GBS, "GB/s"),
                    (f"PUT >= {PUT_TARGET_GBS} GB/s", p, p >= PUT_TARGET_GBS, "GB/s"),
                    (f"GET >= {X_TARGET}x redis-py + hiredis", gx, gx >= X_TARGET, "x"),
                    (f"PUT >= {X_TARGET}x redis-py + hiredis", px, px >= X_TARGET, "x"),
                ):
                    name = f"{name}, {how}"
                    tgt[(name, t)] = (val, ok)
                    lines.append(f"| {name} | {t} | {val:.2f} {unit} | {'n/a (smoke run)' if quick else verdict(ok)} |")
        for r in results:
            if r.section == "lookup" and r.method == LOOKUP_KVX:
                ok = r.median <= LOOKUP_TARGET_MS
                tgt[(f"lookup <= {LOOKUP_TARGET_MS} ms p50", r.deployment)] = (r.median, ok)
                lines.append(
                    f"| {LOOKUP_KEYS}-chunk lookup <= {LOOKUP_TARGET_MS:g} ms p50 | {r.transport} "
                    f"({r.deployment}) | {r.median:.3f} ms | {'n/a (smoke run)' if quick else verdict(ok)} |"
                )

        return tgt, lines

    def get_put_table(self, sfx: str) -> list[str]:
        """GET and PUT of every method, transport and chunk size (``sfx``: ``-b2b``, back to back)."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        lines.extend(
            [
                "| transport | chunk | op | method | median ms | p90 ms | GB/s | % roof | x baseline |",
                "|---|---:|---|---|---:|---:|---:|---:|---|",
            ]
        )
        for t in transports:
            for nb in sizes:
                for sec, methods, base in (("get" + sfx, GET_METHODS, GET_BASE), ("put" + sfx, PUT_METHODS, PUT_BASE)):
                    case = (sec, t, "standalone", nb)
                    if (case, base, 1) not in index:
                        continue
                    for m in methods:
                        ms = med(per_run(index, case, m, runs))
                        p90 = med(per_run(index, case, m, runs, lambda r: percentile(r.times, 90)))
                        x = cell(ratios(index, case, m, base, runs))
                        roof = med(ratios(index, case, m, ROOF_OF[sec], runs))
                        lines.append(
                            f"| {t} | {nb // MiB} MiB | {sec.split('-')[0].upper()} | {m} | {ms:.3f} | "
                            f"{p90:.3f} | {nb / (ms * 1e-3) / 1e9:.2f} | {100 * roof:.0f}% | "
                            f"{x}{'x' if x else ''} |"
                        )

        return lines

    def shuffled(self) -> list[str]:
        """GET and PUT, each call after another method; the notes on the roof and on the parts."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        lines += ["", "## GET into a slot and PUT (shuffled: each call after another method)", ""]
        lines += self.get_put_table("")

        over = sorted(
            {
                r.chunk_bytes // MiB
                for r in gp
                if r.method in (GET_KVX, PUT_KVX)
                and med(ratios(index, r.case(), r.method, ROOF_OF[r.section], runs)) > 1.0
            }
        )
        if over:
            lines += [
                "",
                f"`% roof` above 100 ({', '.join(f'{m} MiB' for m in over)}): the roof moves the chunk as one "
                "Redis value, kvx as parts of `max_value_size` (below); Redis serves one large value more slowly "
                "than several smaller ones (see the part-size sweep).",
            ]
        if dflt and info.get("header_bytes"):
            per = [f"{mib} MiB: {n_values(mib * MiB, h, dflt)}" for mib, h in sorted(info["header_bytes"].items())]
            lines += [
                "",
                f"Redis values kvx writes per chunk at its default `max_value_size` ({_fmt(dflt)}; the limit "
                "counts chunk bytes, the codec header rides along; a chunk of several values also has a manifest "
                f"under its key and is published by a script): {', '.join(per)}.",
            ]

        return lines

    def back_to_back(self) -> list[str]:
        """GET and PUT, each method's calls in a row; the server's wake-up."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        if any(r.section == "get-b2b" for r in results):
            wake = info.get("wake") or {}
            lines += [
                "",
                "## GET into a slot and PUT, back to back (each method's calls in a row)",
                "",
                f"The same methods, runs and chunks, each method's calls in blocks of {B2B_CALLS + 1} in a row "
                "(the first untimed), the blocks of all methods in a shuffled order: every timed call follows "
                "the method's own previous call, as when a connector loads or saves a prefix chunk after "
                "chunk. The shuffled table above puts another method before every call, and on this machine "
                "what came before changes the next call's time: kvx's GET ends as the last byte lands and its "
                "PUT as the server answers, so back to back the server never idles, while a redis-py GET spends "
                "its last millisecond on the client (building, decoding, checksumming, copying the value) "
                "with the server idle, back to back or not."
                + (
                    " A server that idled answers later: a PING right after the server was busy, after 1 ms "
                    "and after 3 ms idle (the client spinning meanwhile), median: "
                    + " / ".join(f"{wake[g]:.0f} us" for g in sorted(wake))
                    + " (same run)."
                    if wake
                    else ""
                ),
                "",
            ]
            lines += self.get_put_table("-b2b")

        return lines

    def part_sweep(self) -> list[str]:
        """The part-size sweep and its best part size (also ``info['best_part']``)."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        sw = [r for r in results if r.section.startswith("sweep")]
        if sw:
            parts = sorted({r.part_bytes for r in sw})
            chunks = sorted({r.chunk_bytes for r in sw})
            bname = f"part {_fmt(dflt)}"
            lines += [
                "",
                "## Part size (`max_value_size`)",
                "",
                f"`RedisTier` opened with each part size, the same chunks; the tier's default is {_fmt(dflt)}. "
                "`values` = Redis values per chunk (header + payload cut into parts; a chunk of several also has "
                "a manifest). `x default` = the default's median time / this one's (same run). Best = the least "
                "GET + PUT time, summed over the transports.",
                "",
                "| chunk | transport | part | values | GET ms | GET GB/s | GET x default | PUT ms | PUT GB/s | "
                "PUT x default | GET + PUT ms |",
                "|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|",
            ]
            score: dict[int, float] = {}
            verdicts = []
            for nb in chunks:
                total: dict[int, float] = {}
                for t in dict.fromkeys(r.transport for r in sw):
                    for p in parts:
                        m = f"part {_fmt(p)}"
                        gc, pc = ("sweep-get", t, "standalone", nb), ("sweep-put", t, "standalone", nb)
                        gms, pms = med(per_run(index, gc, m, runs)), med(per_run(index, pc, m, runs))
                        total[p] = total.get(p, 0.0) + gms + pms
                        gx = cell(ratios(index, gc, m, bname, runs)) if dflt in parts else ""
                        px = cell(ratios(index, pc, m, bname, runs)) if dflt in parts else ""
                        lines.append(
                            f"| {nb // MiB} MiB | {t} | {_fmt(p)} | "
                            f"{n_values(nb, info['sweep_header_bytes'][nb], p)} | {gms:.3f} | "
                            f"{nb / (gms * 1e-3) / 1e9:.2f} | {gx}{'x' if gx else ''} | {pms:.3f} | "
                            f"{nb / (pms * 1e-3) / 1e9:.2f} | {px}{'x' if px else ''} | {gms + pms:.3f} |"
                        )
                best = min(total, key=total.get)
                close = sorted(p for p in total if p != best and total[p] <= total[best] * 1.05)
                line = (
                    f"{nb // MiB} MiB chunk: best **{_fmt(best)}** (GET + PUT {total[best]:.2f} ms over the "
                    f"transports" + (f"; within 5%: {', '.join(_fmt(p) for p in close)}" if close else "") + ")"
                )
                if dflt in total and dflt != best:
                    line += f"; the default takes {total[dflt] / total[best]:.2f}x the best time"
                verdicts.append(line + ".")
                for p in parts:
                    score[p] = score.get(p, 0.0) + total[p] / total[best] / len(chunks)
            overall = min(score, key=score.get)
            info["best_part"] = overall
            lines += [
                "",
                *[f"- {v}" for v in verdicts],
                "- Over the chunk sizes (each part size's time over the best one's, averaged): "
                + ", ".join(f"{_fmt(p)} {score[p]:.2f}" for p in parts)
                + f"; best **{_fmt(overall)}**.",
            ]

        return lines

    def knob_table(self, section: str, title: str, text: str, knob: str, op: str, methods: list[str]) -> list[str]:
        """One knob's sweep (the GET receive step, the PUT send buffer): none when it was not run."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        rows = [r for r in results if r.section == section]
        if not rows:
            return []
        lines.extend(
            [
                "",
                f"## {title}",
                "",
                text + " `x default` = the median time of the tier's own choice for "
                "the transport / this one's (same run).",
                "",
                f"| transport | chunk | {knob} | {op} ms | GB/s | x default |",
                "|---|---:|---|---:|---:|---|",
            ]
        )
        for t in dict.fromkeys(r.transport for r in rows):
            for nb in sorted({r.chunk_bytes for r in rows}):
                case = (section, t, "standalone", nb)
                base = next(r.method for r in rows if r.baseline is None and r.case() == case)
                for m in methods:
                    ms = med(per_run(index, case, m, runs))
                    x = cell(ratios(index, case, m, base, runs))
                    lines.append(
                        f"| {t} | {nb // MiB} MiB | {m} | {ms:.3f} | {nb / (ms * 1e-3) / 1e9:.2f} | "
                        f"{x}{'x' if x else ''} |"
                    )

        return lines

    def knobs(self) -> list[str]:
        """The GET receive-step and PUT send-buffer sweeps."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        lines += self.knob_table(
            "pieces-get",
            "GET: bytes received per checksum step",
            "kvx receives a value's payload straight into the slot and checksums what each receive brought "
            "while it is still in cache; a step caps the bytes one receive may take (`whole value`: no cap, "
            "the kernel hands over what it holds; the tier's choice: `RedisTier.piece`).",
            "step",
            "GET",
            [_piece_name(p) for p in PIECES],
        )
        lines += self.knob_table(
            "sndbuf-put",
            "PUT: socket send buffer",
            "kvx put through data connections opened with each SO_SNDBUF (`RedisTier.send_buffer`; Linux "
            "doubles the size asked for and caps it at `net.core.wmem_max`, here "
            f"{info.get('wmem_max', '?')} bytes; `kernel default`: not set, which over TCP leaves the "
            "kernel's autotuning on).",
            "send buffer",
            "PUT",
            [_sndbuf_name(b) for b in SEND_BUFFERS],
        )

        return lines

    def lookups(self) -> list[str]:
        """The lookup of a prefix, kvx vs a redis-py pipeline."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        lk = [r for r in results if r.section == "lookup"]
        if lk:
            lines += [
                "",
                f"## Lookup of a {LOOKUP_KEYS}-chunk prefix",
                "",
                f"`contains_many({LOOKUP_KEYS} keys)` (`lookup_wait_ms` {LOOKUP_WAIT_MS}) vs a redis-py pipeline "
                f"(transaction=False) of {LOOKUP_KEYS} `EXISTS`, every key present; each repeat asks for keys "
                "not asked for before. Loopback TCP. `x baseline` = the baseline's p50 / this one's.",
                "",
                "| deployment | method | repeats | p50 ms | p90 ms | p99 ms | x baseline (p50) |",
                "|---|---|---:|---:|---:|---:|---:|",
            ]
            lix = _attach(lk)
            for r in lk:
                b = lix.get((r.case(), r.baseline, r.run)) if r.baseline else None
                lines.append(
                    f"| {r.deployment} | {r.method} | {len(r.times)} | {r.median:.3f} | {percentile(r.times, 90):.3f} "
                    f"| {percentile(r.times, 99):.3f} | {f'{b.median / r.median:.2f}x' if b else ''} |"
                )
        if info.get("cluster_skipped"):
            lines += ["", f"Cluster lookup not measured: {info['cluster_skipped']}"]

        return lines

    def time_goes(self) -> list[str]:
        """Where the time goes: memcpy and CRC32C next to what kvx adds to the roof."""
        results, info, index, runs, med, gp, transports, sizes, dflt = self.parts()
        lines = []
        tb = TARGET_MIB * MiB
        cc = info.get("cpu_costs")
        if cc:
            lines += [
                "",
                "## Where the time goes (same run)",
                "",
                f"memcpy {cc['memcpy']:.2f} GB/s and CRC32C ({codec.CRC32C_IMPL}) {cc['crc32']:.2f} GB/s over "
                f"a {TARGET_MIB} MiB chunk (cache-cold, single thread): the verified GET and the encoding PUT each "
                "pay one CRC32 "
                "pass over the payload (kvx's GET piece by piece as the bytes land, its PUT while the server "
                "answers the EXISTS that precedes it), redis-py's GET one more copy (bytes -> slot) and its SET "
                "one more (the join).",
            ]
            if tb in sizes:
                crc_ms = tb / (cc["crc32"] * 1e9) * 1e3
                lines += [
                    "",
                    f"{TARGET_MIB} MiB: what kvx adds to the bare transfer (kvx - roof), next to one cold "
                    "CRC32C pass over the payload (an upper bound of the checksum's share: data just received is "
                    "partly still in cache).",
                    "",
                    "| transport | op | kvx ms | roof ms | kvx - roof ms | CRC32C pass ms |",
                    "|---|---|---:|---:|---:|---:|",
                ]
                for t in transports:
                    for sec, kvx_m in (("get", GET_KVX), ("put", PUT_KVX)):
                        case = (sec, t, "standalone", tb)
                        k_ms = med(per_run(index, case, kvx_m, runs))
                        r_ms = med(per_run(index, case, ROOF_OF[sec], runs))
                        lines.append(
                            f"| {t} | {sec.upper()} | {k_ms:.3f} | {r_ms:.3f} | {k_ms - r_ms:.3f} | {crc_ms:.3f} |"
                        )
        return lines


def write_md(path: str, results: list[Result], info: dict, args, cmd: str, quick: bool) -> dict:
    """The markdown report; returns the judged targets (also for the caller's summary)."""
    rep = _Report(results, info, args, quick)
    tgt, targets = rep.targets()
    lines = rep.header(cmd) + targets + rep.shuffled() + rep.back_to_back() + rep.part_sweep() + rep.knobs()
    lines += rep.lookups() + rep.time_goes()
    if info.get("notes"):
        lines += ["", *info["notes"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return tgt


def write_sealed_md(path: str, results: list[Result], info: dict, cmd: str, quick: bool) -> list[tuple]:
    """``redis_sealed_cpu.md``: sealed against in-the-clear GET / PUT; returns (transport, op, ratio, met)."""
    index = _attach(results)
    runs = max(r.run for r in results)
    clear, sealed = SEALED_METHODS
    lines = [
        "# SMOKE RUN, not a measurement\n" if quick else "",
        "# Redis tier: sealed chunks (AES-256-GCM) against chunks in the clear\n",
        f"Reproduce: `{cmd}`\n",
        f"Machine: {cpu_name()}; redis-server {info.get('server_version', '?')}; "
        f"{info.get('date', '')}; load average {info.get('load', 0):.2f} at the start.\n",
        'Two `RedisTier`s on the same server, one opened with `"encryption": {"key_file": ...}`, the other '
        "without; GET into and PUT from the same CPU-pool slots (rotating over `--rotate-mib`), the two methods in a "
        "shuffled order every repeat (`time_interleaved`), in the same run. Sealed GET: the header checked, the "
        "ciphertext received into a 256 KiB staging buffer and decrypted from there into the slot as it lands, "
        "the GCM tag checked at the end (instead of the CRC32C). Sealed PUT: AES-GCM into a new buffer (instead "
        "of the CRC32C pass), then the same SET. Throughput ratio = the in-the-clear median time / the sealed "
        "one (1.00: free), the median over the runs, then [every run].\n",
        f"Target: sealed GET throughput >= {SEALED_TARGET:.0%} of in the clear at {TARGET_MIB} MiB"
        + (" (not judged in a smoke run)." if quick else "."),
        "",
        "| transport | chunk | op | clear ms | sealed ms | clear GB/s | sealed GB/s | sealed / clear throughput |"
        + ("" if quick else " target |"),
        "|---|---|---|---|---|---|---|---|" + ("" if quick else "---|"),
    ]
    judged = []
    cases = sorted({(r.transport, r.chunk_bytes, r.section) for r in results if r.section.startswith("sealed-")})
    for t, nb, sec in cases:
        case = (sec, t, "standalone", nb)
        rs = ratios(index, case, sealed, clear, runs)
        if not rs:
            continue
        op = "GET" if sec.endswith("get") else "PUT"
        tc, ts = per_run(index, case, clear, runs), per_run(index, case, sealed, runs)
        row = (
            f"| {t} | {nb // MiB} MiB | {op} | {cell(tc, '.3f')} | {cell(ts, '.3f')} | "
            f"{nb / statistics.median(tc) / 1e6:.2f} | {nb / statistics.median(ts) / 1e6:.2f} | {cell(rs)} |"
        )
        ok = statistics.median(rs) >= SEALED_TARGET
        if op == "GET" and nb == TARGET_MIB * MiB:
            judged.append((t, op, statistics.median(rs), ok))
            row += "" if quick else f" {verdict(ok)} |"
        elif not quick:
            row += " |"
        lines.append(row)
    if "cpu_costs" in info:
        c = info["cpu_costs"]
        lines += [
            "",
            f"Same run, one core, {TARGET_MIB} MiB in cache-cold memory: memcpy {c['memcpy']:.1f} GB/s, CRC32C "
            f"{c['crc32']:.1f} GB/s, AES-256-GCM encrypt {c.get('aes_gcm_encrypt', float('nan')):.1f} GB/s, "
            f"decrypt (staged) {c.get('aes_gcm_decrypt', float('nan')):.1f} GB/s.",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return judged
