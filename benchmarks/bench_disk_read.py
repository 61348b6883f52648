"""Disk-tier loads from a cold page cache, against a sequential direct-I/O read of the same bytes.

What a warm request pays when its prefix is only on disk and the kernel's page cache does not hold it
(another workload evicted it, or the machine restarted): kvx reads each chunk file with ``get_into``
straight into a CPU slot, as the worker does for a disk hit promoted into the CPU tier (``io_threads``
readers, header + payload + CRC32C check). The baseline is the device's sequential read speed for the
same number of bytes on the same file system: ``dd if=<one file> of=/dev/null bs=4M iflag=direct``.

The prompt is 4096 tokens: 16 chunks of 256 tokens of a bf16 model with 8 layers, 8 KV heads of 128
(8 MiB per chunk, 128 MiB in all: the demo's model). Before every timed read the page cache is dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``; without the right to do that, ``posix_fadvise(DONTNEED)``
on every file read, which the results then say). Each run times dd and kvx (1, 2 and 4 reader threads)
in a rotating order; the results give each run and the median ratio. ``--sealed``: also a sealed copy of
the same chunks (the tier's ``"encryption"``: AES-256-GCM, decrypted from a staging buffer into the slot as
the file is read) read by the same readers, in the same rotation: the cost of encryption on a disk hit.

    python benchmarks/bench_disk_read.py [--dir DIR] [--runs 5] [--quick] [--fadvise] [--sealed]

Writes benchmarks/results/disk_read_cpu.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvx.keys import chunk_keys
from kvx.store.disk import DiskTier
from kvx.testing.bench import machine
from kvx.testing.bench_timing import md_table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FINGERPRINT = "bench-disk-read"
LAYERS, HEADS, HEAD, TOKENS = 8, 8, 128, 256
FIO = "fio direct, libaio, 16 in flight"
SEALED = "kvx sealed"


def chunk_shape(tokens: int = TOKENS) -> tuple[int, ...]:
    return (LAYERS, 2, tokens, HEADS, HEAD)


def drop_page_cache(paths: list[str], fadvise_only: bool = False) -> str:
    """Empty the page cache of ``paths``; returns how."""
    os.sync()
    try:
        if fadvise_only:
            raise PermissionError
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def dd_direct(path: str) -> float:
    """Seconds for ``dd iflag=direct`` to read ``path`` (dd's own timing)."""
    out = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"], capture_output=True, text=True, check=True
    ).stderr
    m = re.search(r"copied, ([0-9.]+) s", out)
    if m is None:
        raise RuntimeError(f"dd: cannot parse its output: {out!r}")
    return float(m.group(1))


def fio_direct(path: str) -> float:
    """Seconds for fio to read ``path`` sequentially with direct I/O, 4 MiB requests, 16 in flight (libaio):
    what the device gives a reader that keeps it busy (dd keeps one request in flight)."""
    out = subprocess.run(
        [
            "fio",
            "--name=seq",
            f"--filename={path}",
            "--rw=read",
            "--bs=4M",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=16",
            "--readonly",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    job, size = json.loads(out[out.index("{") :])["jobs"][0]["read"], os.path.getsize(path)
    # fio reads whole 4 MiB requests: the tail past the last one (the chunk headers: a few KiB) is not read
    if not 0 <= size - job["io_bytes"] < 4 << 20 or job["runtime"] <= 0:
        raise RuntimeError(f"fio read {job['io_bytes']} bytes of {size} in {job['runtime']} ms")
    return job["runtime"] / 1e3 * size / job["io_bytes"]


def kvx_read(store: DiskTier, keys: list[str], slots: list[torch.Tensor], threads: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(store.get_into, keys, slots))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="file system to test (default: a new directory under the repo)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="4 chunks, 2 runs")
    ap.add_argument(
        "--fadvise",
        action="store_true",
        help="evict only the files read (posix_fadvise), not the machine's whole page cache",
    )
    ap.add_argument("--sealed", action="store_true", help="also read a sealed (AES-256-GCM) copy of the chunks")
    ap.add_argument("--out", default=os.path.join(RESULTS, "disk_read_cpu"))
    args = ap.parse_args(argv)
    if args.quick:
        args.chunks, args.runs = 4, 2
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".bench-disk-read")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvx-disk-read-", dir=base)
    try:
        store = DiskTier.at(os.path.join(work, "store"), None, FINGERPRINT)
        keys = chunk_keys(b"\0" * 16, list(range(3, 3 + args.chunks * TOKENS)), TOKENS)
        g = torch.Generator().manual_seed(0)
        sealed = None
        if args.sealed:
            with open(os.path.join(work, "key"), "w") as f:
                f.write(os.urandom(32).hex() + "\n")
            enc = {"key_file": os.path.join(work, "key")}
            sealed = DiskTier.at(os.path.join(work, "sealed"), None, FINGERPRINT, encryption=enc)
        for k in keys:
            chunk = torch.randint(-1000, 1000, chunk_shape(), generator=g, dtype=torch.int16).view(torch.bfloat16)
            store.put(k, chunk)
            if sealed is not None:
                sealed.put(k, chunk)
        files = [store.file_of(k) for k in keys]
        sealed_files = [sealed.file_of(k) for k in keys] if sealed is not None else []
        total = sum(os.path.getsize(f) for f in files)
        flat = os.path.join(work, "sequential.bin")
        with open(flat, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    out.write(src.read())
        slots = [torch.empty(chunk_shape(), dtype=torch.bfloat16) for _ in keys]
        for s in slots:
            s.view(torch.uint8).fill_(0)  # commit the slots' pages (the CPU tier does at start-up)
        methods = {"dd iflag=direct (baseline)": lambda: dd_direct(flat)}
        if shutil.which("fio"):
            methods[FIO] = lambda: fio_direct(flat)
        for n in (1, 2, 4):
            methods[f"kvx get_into, {n} reader{'s' if n > 1 else ''}"] = lambda n=n: kvx_read(store, keys, slots, n)
        if sealed is not None:
            for n in (1, 2):
                methods[f"{SEALED} get_into, {n} reader{'s' if n > 1 else ''}"] = lambda n=n: kvx_read(
                    sealed, keys, slots, n
                )
        names = list(methods)
        rows, how = [], set()
        for run in range(args.runs):
            order = names[run % len(names) :] + names[: run % len(names)]
            for name in order:
                how.add(drop_page_cache(files + sealed_files + [flat], args.fadvise))
                secs = methods[name]()
                rows.append({"run": run, "method": name, "seconds": secs, "bytes": total, "gb_s": total / secs / 1e9})
                print(f"run {run} {name:32s} {total / secs / 1e9:6.2f} GB/s", file=sys.stderr)
        # a full check that what kvx read is the data (CRC32C verified inside get_into as well)
        ok = all(
            torch.equal(store.get(k, chunk_shape(), torch.bfloat16).view(torch.int16), s.view(torch.int16))
            for k, s in zip(keys, slots)
        )
        if sealed is not None:
            ok = ok and all(
                torch.equal(sealed.get(k, chunk_shape(), torch.bfloat16).view(torch.int16), s.view(torch.int16))
                for k, s in zip(keys, slots)
            )
    finally:
        subprocess.run(["rm", "-rf", work], check=False)
    write(rows, args, total, sorted(how), ok, names)
    return 0 if ok else 1


def write(rows, args, total, how, ok, names) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    med = {n: statistics.median(r["gb_s"] for r in rows if r["method"] == n) for n in names}
    base = med[names[0]]
    flags = "".join(f" --{f}" for f in ("quick", "sealed", "fadvise") if getattr(args, f))
    lines = [
        f"# Disk-tier loads from a cold page cache vs a sequential direct-I/O read ({machine()})",
        "",
        f"`python benchmarks/bench_disk_read.py{flags}` — {args.chunks} chunks "
        f"of {TOKENS} tokens ({LAYERS} layers x K/V x {HEADS} heads x {HEAD}, bf16), "
        f"{total / 2**20:.1f} MiB; page cache emptied before every read ({', '.join(how)}); "
        f"{args.runs} runs, rotating order. Data check after the runs: {'ok' if ok else 'FAILED'}.",
        "",
    ]
    lines += md_table(
        ["method", "median GB/s", "x dd direct", "runs (GB/s)"],
        [
            (
                n,
                f"{med[n]:.2f}",
                f"{med[n] / base:.2f}",
                ", ".join(f"{r['gb_s']:.2f}" for r in rows if r["method"] == n),
            )
            for n in names
        ],
        "lrrl",
    )
    kvx = [n for n in names if n.startswith("kvx get_into")]
    best = max(kvx, key=lambda n: med[n])
    # the faster sequential read
    ref = max((n for n in names if not n.startswith("kvx")), key=lambda n: med[n])
    lines += [
        "",
        f"Target (issue 11): loading a 4096-token prompt's chunks from disk with the page cache dropped "
        f"reads at >= 0.8x a sequential direct-I/O read of the same bytes, here the faster one ({ref}, "
        f"{med[ref]:.2f} GB/s). Best kvx setting: {best}, {med[best] / med[ref]:.2f}x: "
        f"{'met' if med[best] / med[ref] >= 0.8 else 'NOT met'}; kvx's default (`io_threads: 2`): "
        f"{med['kvx get_into, 2 readers'] / med[ref]:.2f}x. kvx reads through the page cache (readahead keeps "
        "the device busy), "
        "the baselines bypass it.",
    ]
    for n in (1, 2):
        s, c = f"{SEALED} get_into, {n} reader{'s' if n > 1 else ''}", f"kvx get_into, {n} reader{'s' if n > 1 else ''}"
        if s in med:
            lines.append(
                f"Sealed (`encryption`, AES-256-GCM) against in the clear, {n} reader{'s' if n > 1 else ''}: "
                f"{med[s]:.2f} / {med[c]:.2f} GB/s = {med[s] / med[c]:.2f}x."
            )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
