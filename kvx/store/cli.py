"""``kvx store``: inspect, verify or clear a kvx disk store.

    kvx store inspect PATH        chunk count, bytes, formats/fingerprints, oldest and newest
    kvx store verify PATH [--delete-bad]   re-read every chunk, check format, key and checksum
    kvx store clear PATH [--yes]  delete every chunk file
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from safetensors import safe_open

from .disk import FORMAT_VERSION, DiskStore, checksum


def _check(path: str, key: str) -> str | None:
    """None if the chunk file is sound, else what is wrong with it."""
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            t = f.get_tensor("kv")
    except Exception as e:  # noqa: BLE001 - any read failure is a bad chunk
        return f"unreadable: {e}"
    if meta.get("kvx_format") != FORMAT_VERSION:
        return f"format {meta.get('kvx_format')!r}, expected {FORMAT_VERSION!r}"
    if meta.get("key") != key:
        return f"key {meta.get('key')!r} does not match the file name"
    if meta.get("crc32") != checksum(t):
        return "checksum mismatch"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx store", description="Inspect, verify or clear a kvx disk store.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("inspect", "verify", "clear"):
        p = sub.add_parser(name)
        p.add_argument("path")
        if name == "verify":
            p.add_argument("--delete-bad", action="store_true", help="delete chunks that fail verification")
        if name == "clear":
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.path):
        print(f"kvx store: path: expected an existing directory, got {args.path!r}", file=sys.stderr)
        return 2
    store = DiskStore(args.path)
    chunks = list(store.scan())
    if args.cmd == "inspect":
        fps: collections.Counter = collections.Counter()
        for c in chunks:
            try:
                with safe_open(c.path, framework="pt") as f:
                    meta = f.metadata() or {}
                fps[(meta.get("fingerprint", "?"), meta.get("format", "?"))] += 1
            except Exception:  # noqa: BLE001
                fps[("unreadable", "-")] += 1
        total = sum(c.bytes for c in chunks)
        print(f"{args.path}: {len(chunks)} chunks, {total / 2**20:.1f} MiB")
        for (fp, fmt), n in fps.most_common():
            print(f"  fingerprint {fp} format {fmt}: {n} chunks")
        if chunks:
            times = sorted(c.mtime for c in chunks)
            print(f"  least recently used {time.ctime(times[0])}, most recent {time.ctime(times[-1])}")
        return 0
    if args.cmd == "verify":
        bad = 0
        for c in chunks:
            problem = _check(c.path, c.key)
            if problem:
                bad += 1
                print(f"BAD {c.path}: {problem}")
                if args.delete_bad:
                    os.unlink(c.path)
        print(f"{len(chunks) - bad} good, {bad} bad{' (deleted)' if bad and args.delete_bad else ''}")
        return 1 if bad and not args.delete_bad else 0
    if not args.yes:
        if not sys.stdin.isatty():
            print("kvx store clear: refusing without --yes (no terminal to confirm on)", file=sys.stderr)
            return 2
        if input(f"delete {len(chunks)} chunks under {args.path}? [y/N] ").strip().lower() != "y":
            return 1
    print(f"deleted {store.clear()} chunks")
    return 0
