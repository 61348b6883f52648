"""Lookup cost of tenant names (issue 36): ``contains_many`` on the disk and Redis tiers, this tree against a
baseline revision of kvx, in one run.

Since the tenant is part of a sealed chunk's identity, a sealed tier looks a chunk up under its name with the
key id of each secret it holds (``<key>-<kid>.safetensors``, ``kvx:1:{<key>}-<kid>``): one name with one
secret (as before: one stat / one EXISTS per chunk), and during a rotation one stat per secret for the chunks
not found under a newer one, and on Redis one ``EXISTS name1 name2`` per chunk (the same command count). This
measures what that costs against the baseline (a revision before it, ``--baseline``; default ``main``),
whose sealed tiers looked every chunk up under its name in the clear.

Cases, per tier: ``clear`` (no encryption), ``sealed`` (one secret), ``rotation`` (two secrets, the chunks
sealed with the older one: the worst case, every hit under the second name); each a lookup of 256 stored
chunks (hits) and of 256 chunks never stored (misses). Each implementation runs in its own process (the
baseline's kvx from ``git archive``), alternating, ``--rounds`` times; a round takes the median of
``--repeats`` lookups; the table gives the median over the rounds. Redis: one ``redis-server`` on loopback TCP
shared by both (``lookup_wait_ms`` 1000, so a lookup answers), disk: a tmpfs or the working directory's file
system, page cache warm.

    python benchmarks/bench_tenant_lookup.py [--baseline main] [--rounds 3] [--repeats 200] [--quick]

Writes benchmarks/results/tenant_lookup_cpu.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
KEYS = 256
CASES = ("clear", "sealed", "rotation")
TIERS = ("disk", "redis")
FP = "bench-tenant-lookup"


# ------------------------------------------------------------------------------------------ one process
def measure(label: str, work: str, url: str, repeats: int) -> dict:
    """In a worker process (``kvx`` is the implementation under test): median seconds of one lookup of
    ``KEYS`` chunks, per (tier, case, hits|misses)."""
    import torch

    from kvx.store.disk import DiskTier
    from kvx.store.redis import RedisTier, RedisTierConfig
    from kvx.store.tier import TierContext

    secrets = {}
    for name in ("new", "old"):
        p = os.path.join(work, f"{name}.key")
        if not os.path.exists(p):
            with open(p, "w") as f:
                f.write(hashlib.sha256(name.encode()).hexdigest() + "\n")
            os.chmod(p, 0o600)
        secrets[name] = p
    encryption = {
        "clear": (None, None),
        "sealed": ({"key_file": secrets["new"]}, {"key_file": secrets["new"]}),
        "rotation": ({"key_file": secrets["old"]}, {"key_files": [secrets["new"], secrets["old"]]}),
    }
    chunk = torch.zeros(64, dtype=torch.uint8)  # the size of a chunk does not enter a lookup
    out, tiers = {}, []

    def open_tier(kind, case, enc):
        if kind == "disk":
            t = DiskTier.at(os.path.join(work, f"disk-{label}-{case}"), fingerprint=FP, encryption=enc)
        else:
            cfg = RedisTierConfig(type="redis", url=url, encryption=enc, lookup_wait_ms=1000)
            t = RedisTier.open(cfg, TierContext(FP))
        tiers.append(t)
        return t

    try:
        for kind in TIERS:
            for case in CASES:
                writer_enc, reader_enc = encryption[case]
                writer, reader = open_tier(kind, case, writer_enc), open_tier(kind, case, reader_enc)
                keys = [hashlib.md5(f"{label}/{kind}/{case}/{i}".encode()).hexdigest() for i in range(2 * KEYS)]
                hits, misses = keys[:KEYS], keys[KEYS:]
                if not reader.contains_many(hits[:1])[0]:
                    for k in hits:
                        writer.put(k, chunk)
                for what, ks, want in (("hits", hits, True), ("misses", misses, False)):
                    got = reader.contains_many(ks)
                    if got != [want] * KEYS:
                        raise RuntimeError(f"{label} {kind} {case} {what}: lookup answered {got[:4]}...")
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        reader.contains_many(ks)
                        times.append(time.perf_counter() - t0)
                    out[f"{kind}/{case}/{what}"] = statistics.median(times)
    finally:
        for t in tiers:
            t.close()
    return out


# ------------------------------------------------------------------------------------------ the run
def baseline_tree(rev: str, into: str) -> str:
    """``kvx/`` of revision ``rev`` (git archive) under ``into``; its path (to put on PYTHONPATH)."""
    tar = os.path.join(into, "baseline.tar")
    subprocess.run(["git", "-C", REPO, "archive", "-o", tar, rev, "kvx"], check=True)
    root = os.path.join(into, "baseline")
    with tarfile.open(tar) as t:
        t.extractall(root, filter="data")
    return root


def run_worker(tree: str, label: str, work: str, url: str, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", label, work, url, str(repeats)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    if p.returncode != 0:
        raise RuntimeError(f"{label} worker failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if not got["kvx"].startswith(tree):
        raise RuntimeError(f"{label} worker imported kvx from {got['kvx']}, not {tree}")
    return got["times"]


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        label, work, url, repeats = sys.argv[2:6]
        import kvx

        print(json.dumps({"kvx": kvx.__file__, "times": measure(label, work, url, int(repeats))}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision whose kvx is the baseline (default main)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=200, help="lookups per case and round (the median is kept)")
    ap.add_argument("--quick", action="store_true", help="1 round of 20 lookups")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    rounds, repeats = (1, 20) if args.quick else (args.rounds, args.repeats)
    if rounds < 1 or repeats < 1:
        ap.error(f"--rounds and --repeats: expected >= 1, got {rounds} and {repeats}")
    from kvx.testing.bench import machine
    from kvx.testing.redis_server import RedisServer

    rev = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", args.baseline], check=True, capture_output=True, text=True
    ).stdout.strip()
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "kvx"], capture_output=True, text=True)
    this = head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    impls = {f"baseline {rev}": None, f"this tree {this}": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in impls}
    with tempfile.TemporaryDirectory(prefix="kvx-bench-tenant-") as work, RedisServer() as server:
        impls[f"baseline {rev}"] = baseline_tree(args.baseline, work)
        for r in range(rounds):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for name in order:
                runs[name].append(run_worker(impls[name], f"r{r}-{name.split()[0]}", work, server.url, repeats))
                print(f"round {r + 1}/{rounds} {name}: done", flush=True)
    base, new = list(impls)
    rows = []
    for kind in TIERS:
        for case in CASES:
            for what in ("hits", "misses"):
                k = f"{kind}/{case}/{what}"
                b = statistics.median(x[k] for x in runs[base]) * 1e6
                n = statistics.median(x[k] for x in runs[new]) * 1e6
                rows.append((kind, case, what, b, n, n / b))
    lines = [
        f"# Lookup cost of tenant names: contains_many of {KEYS} chunks ({machine()})",
        "",
        f"Reproduce: `python benchmarks/bench_tenant_lookup.py --baseline {args.baseline} --rounds {rounds} "
        f"--repeats {repeats}`. Both implementations in one run, alternating processes; median over {rounds} "
        f"rounds of the median of {repeats} lookups. Disk: {work_fs()}; Redis: one redis-server on loopback TCP.",
        "",
        f"| tier | case | lookup | {base} (us) | {new} (us) | new / baseline |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {c} | {w} | {b:.0f} | {n:.0f} | {r:.2f} |" for k, c, w, b, n, r in rows]
    lines += [
        "",
        "`rotation`: the reader holds `[new, old]`, every chunk sealed with `old`. The baseline's sealed tier looked "
        "chunks up under their name in the clear whatever sealed them (another tenant's chunk was a hit that "
        "then failed to load); this tree looks up the name of each secret it holds.",
    ]
    for line in lines[6 : 6 + len(rows)]:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tenant_lookup_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "tenant_lookup_cpu.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tier", "case", "lookup", "baseline_us", "new_us", "ratio", "baseline", "new"])
        w.writerows([(*row[:3], f"{row[3]:.1f}", f"{row[4]:.1f}", f"{row[5]:.6f}", base, new) for row in rows])
    return 0


def work_fs() -> str:
    """The file system of the temporary directory (where the disk tier's files are)."""
    try:
        out = subprocess.run(["df", "-T", tempfile.gettempdir()], capture_output=True, text=True).stdout
        return f"{out.splitlines()[1].split()[1]} at {tempfile.gettempdir()}"
    except (IndexError, OSError):
        return tempfile.gettempdir()


if __name__ == "__main__":
    sys.exit(main())
