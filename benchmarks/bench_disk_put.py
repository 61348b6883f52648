"""Disk-tier put: kvx's own safetensors writer against ``safetensors.torch.save_file``, in the same run.

Why this exists: kvx's disk tier writes its chunk files itself (:mod:`kvx.store.disk.tier`, ``_write_all``,
``_WRITE_PIECE``) instead of calling the library. This benchmark is the measurement behind that choice.
For each file system and chunk size it times, interleaved (the order rotates every repeat, so drift of
the machine hits every method alike), the median of ``--repeats`` after ``--warmup``:

  save_file (baseline)   what kvx's put did before: metadata + CRC32 of the chunk, then
                         ``safetensors.torch.save_file({"kv": t}, tmp, metadata=meta)`` + ``os.replace(tmp, final)``
  kvx DiskTier.put      ``DiskTier.at(path).put(key, t, extra)`` (no capacity): the same metadata and CRC32,
                         header + chunk written ``_WRITE_PIECE`` bytes per ``os.write``, then a rename
  os.write, 1 call       no library, no CRC: header, then the chunk's bytes in one ``os.write`` + rename
  os.write, 1 MiB calls  the same bytes in ``_WRITE_PIECE``-sized calls (kvx's ``_write_all``) + rename

The two ``os.write`` rows isolate the size of the write calls, the one thing kvx changed in how the
bytes reach the kernel. Every method writes the same tensor (bf16 KV chunk of 8 layers x K/V x tokens x
8 heads x 128) into a file of the same size, and every put creates a new file (a new key). ``--files
kept``: the files of a case stay until its end, as in a cache, so each put takes new page-cache pages;
``--files deleted``: each file is deleted (untimed) right after its put, so the next put reuses the
freed pages. The most Dirty and Writeback memory seen after a put is reported (/proc/meminfo): a case
is shorter than the kernel's 30 s dirty expiry, so normally nothing is written back during it and the
puts time the page cache, not the device. Bytes = the file's size (header + chunk). Once per file
system and size, the kvx file and a save_file file of the same key and metadata are read back through
``safetensors.safe_open`` and must agree (tensor bytes, dtype, shape, metadata): a sanity check, not a
timing.

The whole measurement is done ``--runs`` times back to back; the results give each run's median and
ratio, so the run-to-run spread is in the file. Default: 2 file systems x 2 file modes x 3 sizes x 4
methods x 3 runs x 20 puts, under a minute on a 2-core VM.

    python benchmarks/bench_disk_put.py [--quick] [--dir DIR] [--tmpfs /dev/shm] [--files kept,deleted]
                                        [--sizes 1,4,16] [--runs 3] [--repeats 20]

Writes benchmarks/results/disk_put_cpu.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvx.store import codec
from kvx.store.disk import DiskTier
from kvx.store.disk import tier as kvx_disk
from kvx.testing.bench_timing import percentile, time_interleaved

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINGERPRINT = "0123456789abcdef"
METHODS = ["save_file (baseline)", "kvx DiskTier.put", "os.write, 1 call", "os.write, 1 MiB calls"]
BASELINE = METHODS[0]
KEY_PREFIX = "ab"


# ------------------------------------------------------------------------------------------ machine
def machine() -> str:
    model, vm = "?", False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and " hypervisor" in line:
                    vm = True
    except OSError:
        pass
    return f"{model}, {os.cpu_count()}-core CPU{' VM' if vm else ''}"


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(esc, ch)
    return field


def file_system(path: str) -> str:
    """``<type> (<device> on <mount point>[, options])`` of the mount holding ``path``, from /proc/mounts."""
    real = os.path.realpath(path)
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                dev, mnt, fstype, opts = _unescape(parts[0]), _unescape(parts[1]), parts[2], parts[3]
                if real == mnt or real.startswith(mnt.rstrip("/") + "/"):
                    if best is None or len(mnt) >= len(best[1]):
                        best = (dev, mnt, fstype, opts)
    except OSError:
        pass
    if best is None:
        return "unknown"
    dev, mnt, fstype, opts = best
    keep = [o for o in opts.split(",") if o in ("discard", "sync", "dirsync", "data=journal", "nodelalloc")]
    return f"{fstype} ({dev} on {mnt}{', ' + ','.join(keep) if keep else ''})"


def fs_type(path: str) -> str:
    return file_system(path).split(" ", 1)[0]


# ------------------------------------------------------------------------------------------ the methods
def make_chunk(mib: int, g: torch.Generator) -> torch.Tensor:
    """A bf16 KV chunk of ``mib`` MiB: 8 layers x K/V x tokens x 8 KV heads x 128 (32 KiB per token)."""
    tokens = mib * 2**20 // (8 * 2 * 8 * 128 * 2)
    return torch.randn(8, 2, tokens, 8, 128, generator=g).to(torch.bfloat16)


class Target:
    """One directory to write into: a DiskTier for kvx, a sibling directory for the other methods."""

    def __init__(self, root: str):
        self.root = root
        self.fs = file_system(root)
        self.store = DiskTier.at(os.path.join(root, "kvx"), capacity_bytes=None, fingerprint=FINGERPRINT)
        self.other = os.path.join(root, "other")
        # every key starts with KEY_PREFIX: one subdirectory each, made here, so no put times a mkdir
        for d in (self.store.path, self.other):
            os.makedirs(os.path.join(d, KEY_PREFIX), exist_ok=True)

    def final(self, key: str) -> str:
        # same two-level layout as the store (<dir>/<key[:2]>/<key>.safetensors)
        return os.path.join(self.other, key[:2], key + ".safetensors")


def _meta(key: str, t: torch.Tensor, extra: dict[str, str]) -> dict[str, str]:
    # what DiskTier.put stores (and what kvx's put stored before it wrote its own files)
    return {
        **extra,
        "kvx_format": codec.FORMAT_VERSION,
        "key": key,
        "fingerprint": FINGERPRINT,
        "length": str(t.numel() * t.element_size()),
        "crc32c": codec.crc32c(t),
        "created": f"{time.time():.3f}",
    }


def put_save_file(tg: Target, key: str, t: torch.Tensor, extra: dict[str, str]) -> str:
    """kvx's put before it wrote its own files (commit a450b11), less the argument checks."""
    meta = _meta(key, t, extra)
    final = tg.final(key)
    d = os.path.dirname(final)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    save_file({"kv": t}, tmp, metadata=meta)
    os.replace(tmp, final)
    return final


def put_kvx(tg: Target, key: str, t: torch.Tensor, extra: dict[str, str]) -> str:
    if not tg.store.put(key, t, extra):
        raise RuntimeError(f"DiskTier.put({key}) found the chunk already there: the file was not deleted")
    return tg.store.file_of(key)


def _write_one_call(fd: int, bufs) -> None:
    for b in bufs:
        v = memoryview(b).cast("B")
        while len(v):  # one call; the loop only finishes a short write
            v = v[os.write(fd, v) :]


def _put_raw(write: Callable[[int, tuple], None]):
    def put(tg: Target, key: str, t: torch.Tensor, extra: dict[str, str]) -> str:
        header, payload = codec.encode(t, key, FINGERPRINT, extra, created=time.time())
        final = tg.final(key)
        tmp = os.path.join(os.path.dirname(final), f".{key}.raw.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            write(fd, (header, payload))
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return final

    return put


PUTS = {
    METHODS[0]: put_save_file,
    METHODS[1]: put_kvx,
    METHODS[2]: _put_raw(_write_one_call),
    METHODS[3]: _put_raw(kvx_disk._write_all),
}


def _new_key() -> str:
    return KEY_PREFIX + uuid.uuid4().hex


def _remove(tg: Target, method: str, key: str) -> None:
    if method == METHODS[1]:
        tg.store.delete(key)
    else:
        os.unlink(tg.final(key))


# ------------------------------------------------------------------------------------------ checks
def check_readback(tg: Target, t: torch.Tensor, extra: dict[str, str]) -> tuple[str, int]:
    """The same chunk written by DiskTier.put and by save_file (with the metadata kvx wrote) must read
    back identically through safe_open. Returns (a line for the output, the file's size); raises if they
    differ."""
    key = _new_key()
    kvx_path = put_kvx(tg, key, t, extra)
    with safe_open(kvx_path, framework="pt") as f:
        meta = f.metadata()
    final = tg.final(key)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = final + ".tmp"
    save_file({"kv": t}, tmp, metadata=meta)
    os.replace(tmp, final)
    got = []
    for path in (kvx_path, final):
        with safe_open(path, framework="pt") as f:
            got.append((f.metadata(), list(f.keys()), f.get_tensor("kv")))
    (m1, k1, t1), (m2, k2, t2) = got
    problems = []
    if k1 != k2 or k1 != ["kv"]:
        problems.append(f"tensor names {k1} vs {k2}")
    if m1 != m2:
        problems.append(f"metadata {m1} vs {m2}")
    if t1.dtype != t2.dtype or t1.shape != t2.shape or t1.dtype != t.dtype or t1.shape != t.shape:
        problems.append(f"dtype/shape {t1.dtype}{tuple(t1.shape)} vs {t2.dtype}{tuple(t2.shape)}")
    elif not (
        torch.equal(t1.view(torch.uint8), t2.view(torch.uint8))
        and torch.equal(t1.view(torch.uint8), t.view(torch.uint8))
    ):
        problems.append("tensor bytes differ")
    s1, s2 = os.path.getsize(kvx_path), os.path.getsize(final)
    if s1 != s2:
        problems.append(f"file sizes {s1} vs {s2}")
    heads = []
    for path in (kvx_path, final):
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            head = fh.read(n)
            heads.append((head, json.loads(head), fh.read()))
    if heads[0][1] != heads[1][1]:
        problems.append("JSON headers differ")
    if heads[0][2] != heads[1][2]:
        problems.append("data sections differ")
    if heads[0][0] == heads[1][0]:
        same = "byte-identical files"
    elif len(heads[0][0]) == len(heads[1][0]):
        same = "not byte-identical: save_file orders the metadata keys differently in the JSON header"
    else:
        same = "not byte-identical: the JSON headers differ in length (equal once parsed)"
    # and kvx's own reader accepts both (format, key, fingerprint, checksum)
    tg.store.get(key, t.shape, t.dtype)
    DiskTier.at(tg.other, fingerprint=FINGERPRINT).get(key, t.shape, t.dtype)
    tg.store.delete(key)
    os.unlink(final)
    if problems:
        raise AssertionError(f"kvx and save_file files differ on {tg.fs}: {'; '.join(problems)}")
    return (
        f"same tensor bytes, dtype, shape and metadata through safe_open, equal JSON headers and data "
        f"sections; DiskTier.get accepts both; {s1} B each; {same}"
    ), s1


# ------------------------------------------------------------------------------------------ timing
def _meminfo_mib(field: str) -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def time_puts(
    tg: Target, t: torch.Tensor, extra: dict[str, str], repeats: int, warmup: int, keep: bool
) -> tuple[dict[str, list[float]], float, float]:
    """Milliseconds of every put of every method (:func:`kvx.testing.bench_timing.time_interleaved`, repeat r
    running the methods rotated by r). Every put writes a new file (a new key, drawn before the timing);
    ``keep``: the files stay until the end of the case, else each is deleted right after its put. Also returns
    the most Dirty and Writeback MiB (/proc/meminfo) seen after a timed put (untimed): whether the kernel was
    writing back during the case."""
    keys = [_new_key() for _ in range((warmup + repeats) * len(METHODS))]
    seen = {"Dirty": 0.0, "Writeback": 0.0}
    written = []

    def after(m: str, i: int) -> None:
        if keep:
            written.append((m, keys[i]))
        else:
            _remove(tg, m, keys[i])
        if i >= warmup * len(METHODS):
            for k in seen:
                seen[k] = max(seen[k], _meminfo_mib(k))

    fns = {m: (lambda i, m=m: PUTS[m](tg, keys[i], t, extra)) for m in METHODS}
    try:
        times = time_interleaved(fns, repeats, warmup, after, order="rotate")
    finally:
        for m, key in written:
            _remove(tg, m, key)
    return times, seen["Dirty"], seen["Writeback"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir",
        default=None,
        help="directory to write in (a temporary directory is made inside it and removed); default: "
        "the temp dir if it is on the repository's file system, else the repository",
    )
    ap.add_argument(
        "--tmpfs", default="/dev/shm", help="a tmpfs directory to measure too ('' = none; skipped if it is not a tmpfs)"
    )
    ap.add_argument("--sizes", default=None, help="chunk sizes in MiB, comma-separated (default 1,4,16)")
    ap.add_argument(
        "--files",
        default="kept,deleted",
        help="kept: a case's files stay until its end, as in a cache (the writeback of earlier puts "
        "runs meanwhile); deleted: each file is deleted right after its put. Default: both",
    )
    ap.add_argument("--runs", type=int, default=None, help="whole measurements back to back (default 3; quick 1)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed puts per method, case and run (default 20; quick 5)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed puts per method, case and run")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 run of 5 repeats, sizes 1 and 16 MiB")
    ap.add_argument(
        "--out",
        default=os.path.join(REPO, "benchmarks", "results", "disk_put_cpu"),
        help="results path stem (.md and .csv)",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([1, 16] if args.quick else [1, 4, 16])
    except ValueError:
        ap.error(f"--sizes: expected MiB as integers, comma-separated, got {args.sizes!r}")
    modes = [m.strip() for m in args.files.split(",") if m.strip()]
    if not modes or any(m not in ("kept", "deleted") for m in modes):
        ap.error(f"--files: expected kept, deleted or both, got {args.files!r}")
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    if runs < 1 or repeats < 1 or args.warmup < 0 or any(x < 1 for x in sizes):
        ap.error("--runs, --repeats and --sizes must be >= 1, --warmup >= 0")
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir: not a directory: {args.dir}")

    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        print(f"warning: load average {load1:.2f}: timings will be noisy", file=sys.stderr)

    if args.dir is not None:
        parent = args.dir
    else:
        parent = tempfile.gettempdir()
        if os.stat(parent).st_dev != os.stat(REPO).st_dev:
            parent = REPO
    roots = [tempfile.mkdtemp(prefix=".kvx-bench-disk-put-", dir=parent)]
    skipped = ""
    if args.tmpfs:
        if os.path.isdir(args.tmpfs) and fs_type(args.tmpfs) == "tmpfs":
            if os.stat(args.tmpfs).st_dev != os.stat(roots[0]).st_dev:
                roots.append(tempfile.mkdtemp(prefix=".kvx-bench-disk-put-", dir=args.tmpfs))
        else:
            where = file_system(args.tmpfs) if os.path.isdir(args.tmpfs) else "missing"
            skipped = f"{args.tmpfs} is not a tmpfs ({where}): no tmpfs case"
            print(f"note: {skipped}", file=sys.stderr)

    g = torch.Generator().manual_seed(0)
    chunks = {mib: make_chunk(mib, g) for mib in sizes}
    extras = {mib: {"tokens": str(chunks[mib].shape[2]), "format": "pages"} for mib in sizes}  # as the connector
    # raw[(fs, files, mib, method)] = [every put's ms, one list per run]; pressure[(fs, files, mib)] =
    # [(max Dirty MiB, max Writeback MiB) per run]
    raw: dict[tuple, list[list[float]]] = {}
    pressure: dict[tuple, list[tuple[float, float]]] = {}
    nbytes: dict[int, int] = {}
    checks: list[str] = []
    t_start = time.perf_counter()
    try:
        targets = [Target(r) for r in roots]
        labels = {tg.root: fs_type(tg.root) for tg in targets}
        if len(set(labels.values())) < len(labels):  # --dir on another tmpfs: tell them apart
            labels = {r: f"{fs} {'(--dir)' if i == 0 else '(--tmpfs)'}" for i, (r, fs) in enumerate(labels.items())}
        for tg in targets:
            print(f"dir {tg.root}: {tg.fs}")
        for tg in targets:
            for mib in sizes:
                line, size = check_readback(tg, chunks[mib], extras[mib])
                nbytes[mib] = size
                checks.append(f"{labels[tg.root]} {mib} MiB: {line}")
                print("check " + checks[-1])
        for run in range(runs):
            for tg in targets:
                for mode in modes:
                    for mib in sizes:
                        times, dirty, wb = time_puts(tg, chunks[mib], extras[mib], repeats, args.warmup, mode == "kept")
                        case = (labels[tg.root], mode, mib)
                        pressure.setdefault(case, []).append((dirty, wb))
                        base = statistics.median(times[BASELINE])
                        for m in METHODS:
                            ts = times[m]
                            raw.setdefault(case + (m,), []).append(ts)
                            ms = statistics.median(ts)
                            print(
                                f"run {run + 1}/{runs} {case[0]:5s} files {mode:7s} {mib:2d} MiB {m:22s} "
                                f"median {ms:6.2f} ms {nbytes[mib] / (ms * 1e-3) / 1e9:5.2f} GB/s {ms / base:5.2f} x "
                                f"save_file; p90 {percentile(ts, 90):6.2f} mean {statistics.fmean(ts):6.2f} ms"
                            )
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    elapsed = time.perf_counter() - t_start

    cases = [(labels[tg.root], mode, mib) for tg in targets for mode in modes for mib in sizes]
    kvx = METHODS[1]

    def per_run(case, m, stat):
        return [stat(ts) for ts in raw[case + (m,)]]

    def ratios(case, m, stat):
        return [a / b for a, b in zip(per_run(case, m, stat), per_run(case, BASELINE, stat))]

    def cell(xs):  # median of the runs [each run]
        return f"{statistics.median(xs):.2f}" + (f" [{' / '.join(f'{x:.2f}' for x in xs)}]" if len(xs) > 1 else "")

    med, mean = statistics.median, statistics.fmean
    fs_lines = [f"{labels[tg.root]} = {tg.fs}" for tg in targets]
    cmd = "python benchmarks/bench_disk_put.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Disk-tier put: kvx's own safetensors writer vs safetensors.torch.save_file",
        "",
        f"Machine: {machine()}; kernel {platform.release()}; safetensors {safetensors.__version__}; torch "
        f"{torch.__version__}. File systems: {'; '.join(fs_lines)}{'; ' + skipped if skipped else ''}. "
        f"{runs} run(s) x {repeats} puts per method and case after {args.warmup} warm-up, interleaved (the "
        f"order rotates every repeat); load average at start {load1:.2f}; total {elapsed:.0f} s.",
        "",
        f"Reproduce: `{cmd.strip()}`",
        "",
        "Every put writes a new file. Files `kept`: a case's files stay until its end, as in a cache; "
        "`deleted`: each file is deleted (untimed) right after its put. Bytes = the file's size (safetensors "
        "header + bf16 chunk), the same for every method. `save_file` = kvx's put before it wrote its own "
        "files (metadata + CRC32, `save_file` to a temporary name, `os.replace`); `kvx DiskTier.put` = the "
        f"same metadata and checksum, {kvx_disk._WRITE_PIECE >> 20} MiB per `os.write`, rename; the two "
        "`os.write` rows write the same bytes with no CRC32 and no library, in one call or in 1 MiB calls "
        "(they show where a difference comes from). `/ save_file` = that statistic over save_file's in the "
        "same run (< 1: faster). Each cell: the median over the runs, then [every run]; GB/s from the "
        "median.",
        "",
        "kvx DiskTier.put / save_file, median time per put and mean time per put (the mean counts the "
        "occasional stalls a median can hide):",
        "",
        "| fs | files | " + " | ".join(f"{mib} MiB median | {mib} MiB mean" for mib in sizes) + " |",
        "|---|---|" + "---:|---:|" * len(sizes),
    ]
    for fs in dict.fromkeys(c[0] for c in cases):
        for mode in modes:
            lines.append(
                f"| {fs} | {mode} | "
                + " | ".join(
                    f"{cell(ratios((fs, mode, mib), kvx, med))} | {cell(ratios((fs, mode, mib), kvx, mean))}"
                    for mib in sizes
                )
                + " |"
            )
    lines += [
        "",
        "| fs | files | chunk | method | median ms | p90 ms | mean ms | GB/s | median / save_file | mean / save_file |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    rows_csv = []
    for case in cases:
        fs, mode, mib = case
        for m in METHODS:
            ms, p90 = med(per_run(case, m, med)), med(per_run(case, m, lambda ts: percentile(ts, 90)))
            lines.append(
                f"| {fs} | {mode} | {mib} MiB | {m} | {ms:.2f} | {p90:.2f} | "
                f"{med(per_run(case, m, mean)):.2f} | {nbytes[mib] / (ms * 1e-3) / 1e9:.2f} | "
                f"{cell(ratios(case, m, med))} | "
                f"{cell(ratios(case, m, mean))} |"
            )
            base = raw[case + (BASELINE,)]
            for run, ts in enumerate(raw[case + (m,)]):
                dirty, wb = pressure[case][run]
                rows_csv.append(
                    [
                        fs,
                        mode,
                        mib,
                        nbytes[mib],
                        m,
                        run + 1,
                        len(ts),
                        f"{med(ts):.4f}",
                        f"{percentile(ts, 25):.4f}",
                        f"{percentile(ts, 75):.4f}",
                        f"{percentile(ts, 90):.4f}",
                        f"{min(ts):.4f}",
                        f"{max(ts):.4f}",
                        f"{mean(ts):.4f}",
                        f"{nbytes[mib] / (med(ts) * 1e-3) / 1e9:.3f}",
                        f"{med(ts) / med(base[run]):.4f}",
                        f"{mean(ts) / mean(base[run]):.4f}",
                        f"{dirty:.0f}",
                        f"{wb:.0f}",
                    ]
                )
    dirty = max(d for v in pressure.values() for d, _ in v)
    wb = max(w for v in pressure.values() for _, w in v)
    lines += [
        "",
        f"Page cache during the cases (/proc/meminfo after each put): at most {dirty:.0f} MiB Dirty and "
        f"{wb:.0f} MiB under Writeback.",
    ]
    lines += [
        "",
        "Read-back check (once per file system and size, not timed): the same chunk written by "
        "DiskTier.put and by save_file (same key, same metadata), opened with `safetensors.safe_open`:",
        "",
    ]
    lines += [f"- {c}" for c in checks]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "fs",
                "files",
                "chunk_mib",
                "bytes",
                "method",
                "run",
                "repeats",
                "median_ms",
                "p25_ms",
                "p75_ms",
                "p90_ms",
                "min_ms",
                "max_ms",
                "mean_ms",
                "GB/s",
                "median_over_save_file",
                "mean_over_save_file",
                "max_dirty_mib",
                "max_writeback_mib",
            ]
        )
        w.writerows(rows_csv)
    print("\n".join(lines))
    print(f"wrote {args.out}.md and {args.out}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
