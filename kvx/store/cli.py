"""``kvx store``: inspect, verify or clear a kvx disk store.

    kvx store inspect PATH        chunk count, bytes, formats/fingerprints, oldest and newest, temporary files
    kvx store verify PATH [--delete-bad] [--key-file F ...]   re-read every chunk, check format, key and
                                  checksum; list temporary files (--delete-bad also removes the stale ones).
                                  Sealed chunks (a tier's "encryption") are authenticated with the secrets
                                  of --key-file; without them only their header is checked (never deleted)
    kvx store clear PATH [--yes]  delete every chunk file (and stale temporary files)

inspect and verify change nothing (without --delete-bad): they list stale temporary files rather than
remove them as an engine's store does when it starts.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from safetensors import safe_open

from . import codec
from .disk import DiskTier, TempInfo, survey
from .errors import ChunkError
from .seal import SEALED_VERSION, EncryptionConfig, Sealer, load_secrets


def _check_sealed(path: str, key: str, secrets: list[bytes] | None, kid: str) -> str | None:
    """A sealed chunk file: its header (and, with the secrets, its tag: every byte) for ``key``; ``kid``: the
    key id its name says it was sealed with ("": a name without one, written before kvx named files by it)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(codec.PREFIX_BYTES)
            h = codec.decode_header(prefix + f.read(codec.header_length(prefix)))
            fp = h.meta.get("fingerprint", "")
            if h.key != key:
                return f"key {h.key!r} does not match the file name"
            if kid and h.meta.get("kid") != kid:
                return f"key id {h.meta.get('kid')!r} does not match the file name"
            if h.dtype is None or not secrets:
                problems = codec.check(h, key, fp, versions=(SEALED_VERSION,))
                for field in ("seal", "kid", "nonce", "tag"):
                    if field not in h.meta:
                        problems.append(f"sealed without its {field!r}")
                if os.path.getsize(path) != h.total:
                    problems.append(f"{os.path.getsize(path)} bytes, its header says {h.total}")
                return "; ".join(problems) or None
            sealer = Sealer(secrets, fp)
            problems = sealer.problems(h, key)
            if problems:
                return "; ".join(problems)
            import torch

            out = torch.empty(h.shape, dtype=h.dtype)
            opening = sealer.opening(h, key, out, path)
            while opening.pos < h.nbytes:
                n = f.readinto(opening.buffer())
                if not n:
                    return f"truncated ({opening.pos} of {h.nbytes} payload bytes)"
                opening.advance(n)
            opening.finish()
    except ChunkError as e:
        return str(e)
    except OSError as e:
        return f"unreadable: {e}"
    return None


def _check(path: str, key: str, secrets: list[bytes] | None = None, kid: str = "") -> str | None:
    """None if the chunk file is sound, else what is wrong with it (``secrets``: to authenticate sealed ones;
    ``kid``: the key id in its name)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(codec.PREFIX_BYTES)
            sealed = codec.decode_header(prefix + f.read(codec.header_length(prefix))).meta.get("kvx_format")
    except (ChunkError, OSError):
        sealed = None
    if sealed == SEALED_VERSION:
        return _check_sealed(path, key, secrets, kid)
    if kid:
        return f"in the clear (format {sealed!r}) under the name of a chunk sealed with key id {kid!r}"
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            t = f.get_tensor("kv")
    except Exception as e:  # noqa: BLE001 - any read failure is a bad chunk
        return f"unreadable: {e}"
    if meta.get("kvx_format") not in codec.READABLE_VERSIONS:
        return f"format {meta.get('kvx_format')!r}, expected one of {codec.READABLE_VERSIONS}"
    if meta.get("key") != key:
        return f"key {meta.get('key')!r} does not match the file name"
    header = codec.Header(meta, t.dtype, tuple(t.shape), t.numel() * t.element_size(), 0)
    if not codec.check_crc(header, t.contiguous()):
        return "checksum mismatch"
    return None


def _temps_line(temps: list[TempInfo]) -> str:
    stale = [t for t in temps if t.stale]
    live = [t for t in temps if not t.stale]
    return (
        f"temporary files: {len(live)} in flight ({sum(t.bytes for t in live) / 2**20:.1f} MiB), "
        f"{len(stale)} stale ({sum(t.bytes for t in stale) / 2**20:.1f} MiB)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx store", description="Inspect, verify or clear a kvx disk store.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("inspect", "verify", "clear"):
        p = sub.add_parser(name)
        p.add_argument("path")
        if name == "verify":
            p.add_argument(
                "--delete-bad",
                action="store_true",
                help="delete chunks that fail verification, and stale temporary files",
            )
            p.add_argument(
                "--key-file",
                action="append",
                default=[],
                help="a secret of the tier's encryption (repeatable): sealed chunks are authenticated with them",
            )
        if name == "clear":
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.path):
        print(f"kvx store: path: expected an existing directory, got {args.path!r}", file=sys.stderr)
        return 2
    return {"inspect": _inspect, "verify": _verify, "clear": _clear}[args.cmd](args)


def _inspect(args) -> int:
    sv = survey(args.path)  # read-only: stale temporary files are listed, not removed
    fps: collections.Counter = collections.Counter()
    for c in sv.chunks:
        try:
            with safe_open(c.path, framework="pt") as f:
                meta = f.metadata() or {}
            fps[(meta.get("fingerprint", "?"), meta.get("format", "?"))] += 1
        except Exception:  # noqa: BLE001
            fps[("unreadable", "-")] += 1
    print(f"{args.path}: {len(sv.chunks)} chunks, {sv.chunk_bytes / 2**20:.1f} MiB")
    print(f"  {_temps_line(sv.temps)}")
    for (fp, fmt), n in fps.most_common():
        print(f"  fingerprint {fp} format {fmt}: {n} chunks")
    for kid, n in collections.Counter(c.kid for c in sv.chunks if c.kid).most_common():
        print(f"  sealed with key id {kid} (in the file names): {n} chunks")
    if sv.chunks:
        times = sorted(c.mtime for c in sv.chunks)
        print(f"  least recently used {time.ctime(times[0])}, most recent {time.ctime(times[-1])}")
    return 0


def _verify(args) -> int:
    secrets = None
    if args.key_file:
        try:
            secrets = load_secrets(EncryptionConfig(key_files=args.key_file), "--key-file")
        except ValueError as e:
            print(f"kvx store: {e}", file=sys.stderr)
            return 2
    sv = survey(args.path)
    bad = 0
    for c in sv.chunks:
        problem = _check(c.path, c.key, secrets, c.kid)
        if problem:
            bad += 1
            print(f"BAD {c.path}: {problem}")
            if args.delete_bad:
                _remove(c.path)
    for t in sv.temps:
        gone = t.stale and args.delete_bad and _remove(t.path)
        print(
            f"TMP {t.path}: {t.bytes / 2**20:.1f} MiB, {'stale' if t.stale else 'in flight'} ({t.reason})"
            f"{' (deleted)' if gone else ''}"
        )
    print(
        f"{len(sv.chunks) - bad} good, {bad} bad{' (deleted)' if bad and args.delete_bad else ''}; "
        f"{_temps_line(sv.temps)}"
    )
    return 1 if bad and not args.delete_bad else 0


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # another engine removed it first
    except OSError as e:
        print(f"  cannot delete {path}: {e.strerror}")
        return False
    return True


def _clear(args) -> int:
    store = DiskTier.at(args.path)  # removes stale temporary files on start-up
    n = sum(1 for _ in store.scan())
    if not args.yes:
        if not sys.stdin.isatty():
            print("kvx store clear: refusing without --yes (no terminal to confirm on)", file=sys.stderr)
            return 2
        if input(f"delete {n} chunks under {args.path}? [y/N] ").strip().lower() != "y":
            return 1
    print(f"deleted {store.clear()} chunks")
    return 0
