"""Host <-> device copies checked bit-exact in a loop, by variant: a regression check of the host paths on a GPU.

On an H100 (2026-11-27, ``benchmarks/results/h100-2026-11-27-run_gpu/``) the ops' staged path over pinned host
memory gave wrong bytes in 5-7 of ~200 test cases per run, different ones in each run, both directions, while
the tests shared the GPU with other processes; the worker's pipeline was bit-exact in every test. The cause, found
afterwards in torch's source: a copy issued on the legacy default stream has stream handle 0, and the staged
reshape entered ``torch.cuda.ExternalStream(0)`` to upload its ids (and to run a Triton reshape), which torch
answers with a new stream of its pool, not the default stream: the upload raced the kernel on handle 0.
:func:`kvx.engine.torch_stream` now maps handle 0 to the default stream. This loop runs the variants that tell
the paths apart, to confirm that on the device and to catch the next such race:

  staged        ``ops.gather_*/scatter_*(path="staged")``: the op allocates its staging buffer and batch and
                drops both when it returns (the failing tests' path)
  staged-held   the same with a caller-owned ``staging=`` buffer, kept until the check
  staged-sync   as ``staged``, the stream synchronized right after each kvx op
  batch         a compiled plan (:class:`kvx.kernels.plan.Copies`) and its staging buffer, both kept until the check
  dma, kernel   the other host paths, as controls

each on the default (legacy) stream and on a side stream (batched DMA), with and without a bf16 GEMM loop on
another stream. Every round draws a layout, dtype, op kind and ids, copies paged -> pinned and pinned -> paged,
and compares with the reference implementation on a twin cache.

    python benchmarks/gpu_staged_stress.py [--seconds 4] [--out benchmarks/results/staged_stress_<dev>.md]

On a CPU cache the same loop runs (the paths' CPU twins), as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
import zlib

import torch

from kvx.kernels import ops  # noqa: E402
from kvx.kernels.layout import KVLayout  # noqa: E402
from kvx.kernels.plan import Copies  # noqa: E402
from kvx.testing import make_kv_caches, random_fill_  # noqa: E402

VARIANTS = ("staged", "staged-held", "staged-sync", "batch", "dma", "kernel")
LAYOUT_NAMES = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "mla", "flash")
DTYPES = (torch.bfloat16, torch.float32, torch.uint8)


def _case(g: torch.Generator, device: torch.device):
    name = LAYOUT_NAMES[int(torch.randint(len(LAYOUT_NAMES), (1,), generator=g))]
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=g))]
    geom = dict(
        num_layers=int(torch.randint(1, 4, (1,), generator=g)),
        num_blocks=8,
        block_size=(16, 32)[int(torch.randint(2, (1,), generator=g))],
        num_heads=1 if name == "mla" else int(torch.randint(1, 4, (1,), generator=g)),
        head_size=(5, 64, 576)[int(torch.randint(3, (1,), generator=g))],
    )
    seed = int(torch.randint(1 << 30, (1,), generator=g))
    padded = bool(seed % 2)
    a, b = (
        KVLayout.from_tensors(
            make_kv_caches(
                name, **geom, dtype=dtype, device=device, padded=padded, generator=torch.Generator().manual_seed(seed)
            ),
            name,
        )
        for _ in range(2)
    )
    kind = ("blocks", "slots", "pages")[int(torch.randint(3, (1,), generator=g))]
    if kind == "pages" and (a.opaque or a.page is None):
        kind = "blocks"
    bs = geom["block_size"]
    if kind == "slots":
        ids = torch.randperm(8 * bs, generator=g)[:37]
        ids[::5] = -1
        shape, dt = a.canonical_shape(37), dtype
    else:
        ids = torch.randperm(8, generator=g)[:4]
        shape, dt = (a.page_shape(4), torch.uint8) if kind == "pages" else (a.canonical_shape(4 * bs), dtype)
    return a, b, kind, ids, shape, dt, f"{name} {str(dtype)[6:]} bs{bs} hs{geom['head_size']} L{geom['num_layers']}"


def _copy(variant: str, lay: KVLayout, op: str, ids, buf, sync) -> None:
    """One kvx copy by ``variant``; whatever it allocated is dropped before it returns unless the variant holds it."""
    impl = "cuda" if lay.device.type == "cuda" else None
    if variant in ("staged", "staged-sync"):
        getattr(ops, op)(lay, ids, buf, impl=impl, path="staged")
        if variant == "staged-sync":
            sync()
        return
    if variant in ("dma", "kernel"):
        if variant == "kernel" and lay.device.type != "cuda":
            variant = None  # the UVA kernel is CUDA's; on CPU the default path
        getattr(ops, op)(lay, ids, buf, impl=impl, path=variant)
        return
    batch = Copies(lay, path="staged", impl=impl)
    batch.add(op, ids, buf)
    staging = torch.empty(max(batch.nbytes, 16), dtype=torch.uint8, device=lay.device)
    if variant == "staged-held":
        getattr(ops, op)(lay, ids, buf, impl=impl, path="staged", staging=staging)
        return None, staging
    plan = batch.plan(capacity=staging.numel())
    plan.run(staging)
    return plan, staging  # held by the caller until its check


def _host(shape, dt, g: torch.Generator, head_major: bool) -> torch.Tensor:
    """A host buffer of ``shape``, filled with noise; a canonical one head-major when asked (a worker's buffers
    when it holds several KV heads)."""
    if head_major and len(shape) == 5:
        return random_fill_(torch.empty((shape[3], *shape[:3], shape[4]), dtype=dt), g).movedim(0, 3)
    return random_fill_(torch.empty(shape, dtype=dt), g)


def _round(variant: str, g: torch.Generator, device: torch.device, sync) -> str | None:
    """One gather and one scatter, each checked; a line naming the first mismatch, or None."""
    a, ref, kind, ids, shape, dt, what = _case(g, device)
    head_major = bool(torch.randint(2, (1,), generator=g))
    what += " head-major" if head_major and len(shape) == 5 else ""
    out = _host(shape, dt, g, head_major)
    out = out.pin_memory() if device.type == "cuda" else out
    expected = out.to(device, copy=True)  # (strides kept)
    held = _copy(variant, a, f"gather_{kind}", ids, out, sync)
    getattr(ops, f"gather_{kind}")(ref, ids, expected, impl="reference")
    sync()
    del held
    if not torch.equal(out.to(device).view(torch.uint8), expected.view(torch.uint8)):
        bad = int((out.to(device).view(torch.uint8) != expected.view(torch.uint8)).sum())
        return f"gather_{kind} {what}: {bad} of {expected.numel() * expected.element_size()} bytes differ"
    src = _host(shape, dt, g, head_major)
    src = src.pin_memory() if device.type == "cuda" else src
    held = _copy(variant, a, f"scatter_{kind}", ids, src, sync)
    getattr(ops, f"scatter_{kind}")(ref, ids, src.to(device), impl="reference")
    sync()
    del held
    for x, y in zip(a.layers, ref.layers):
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return f"scatter_{kind} {what}: layer bytes differ"
    return None


def _sync_of(device: torch.device):
    """Wait for the current stream's work (CPU: nothing to wait for)."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return lambda: None


@contextlib.contextmanager
def _gemm_load(device: torch.device, on: bool):
    """A bf16 GEMM loop on a stream of its own while the block runs (nothing on CPU or when ``on`` is False)."""
    if not on or device.type != "cuda":
        yield
        return
    stop = threading.Event()

    def loop():
        s = torch.cuda.Stream(device)
        x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        with torch.cuda.stream(s):
            while not stop.is_set():
                for _ in range(8):
                    x = (x @ x).clamp_(-1, 1)
                s.synchronize()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def run(device: torch.device, seconds: float, variants=VARIANTS) -> list[dict]:
    """Each variant on each stream, with and without load, for ``seconds`` each: rows of rounds and mismatches."""
    rows = []
    streams = ("default", "side") if device.type == "cuda" else ("cpu",)
    for load in (False, True) if device.type == "cuda" else (False,):
        for stream_name in streams:
            for variant in variants:
                side = torch.cuda.Stream(device) if stream_name == "side" else None
                ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
                sync = (
                    (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else lambda: None
                )
                g = torch.Generator().manual_seed(zlib.crc32(f"{variant}/{stream_name}/{load}".encode()))
                rounds, bad, first = 0, 0, []
                with _gemm_load(device, load), ctx:
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        line = _round(variant, g, device, sync)
                        rounds += 1
                        if line:
                            bad += 1
                            if len(first) < 3:
                                first.append(line)
                rows.append(dict(variant=variant, stream=stream_name, load=load, rounds=rounds, bad=bad, first=first))
                print(f"{variant:12s} {stream_name:8s} load={load!s:5s} rounds {rounds:5d} bad {bad:4d} {first[:1]}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", type=float, default=4.0, help="per variant, stream and load (default 4)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None, help="markdown table (default: benchmarks/results/staged_stress_<dev>.md)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: expected names from {VARIANTS}, got {sorted(unknown)}")
    rows = run(device, args.seconds, variants)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"staged_stress_{device.type}.md"
    )
    with open(out, "w") as f:
        f.write(f"# Host <-> device copies checked in a loop, by variant ({name})\n\n")
        f.write(f"`python benchmarks/gpu_staged_stress.py --seconds {args.seconds:g}`\n\n")
        f.write(
            "| variant | stream | GEMM load | rounds | mismatched | first mismatches |\n|---|---|---|---:|---:|---|\n"
        )
        for r in rows:
            f.write(
                f"| {r['variant']} | {r['stream']} | {'yes' if r['load'] else 'no'} | {r['rounds']} | {r['bad']} | "
                f"{'; '.join(r['first'])} |\n"
            )
    print(f"wrote {out}")
    bad = sum(r["bad"] for r in rows)
    where = ", ".join(
        f"{r['variant']}/{r['stream']}{'/load' if r['load'] else ''} {r['bad']}" for r in rows if r["bad"]
    )
    print(f"staged stress: {bad} failed of {sum(r['rounds'] for r in rows)} rounds ({where or 'none'})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
