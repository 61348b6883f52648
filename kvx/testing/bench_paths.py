"""The host <-> device paths the copy benchmarks time (:mod:`kvx.testing.bench`): which exist, a call of each, and
the bit-exact check before a row is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels import ops
from ..kernels.layout import KVLayout

KiB, MiB = 1 << 10, 1 << 20
HOST = "cuda<->pinned"  # the ``where`` of a table row whose contiguous side is pinned host memory


# ---------------------------------------------------------------------------------------- host paths
def staging_buffer(layout: KVLayout, op: str, num_ids: int) -> torch.Tensor:
    """A device staging buffer big enough for ``op`` of ``num_ids`` ids on ``layout`` (``ops.staging_bytes``)."""
    return torch.empty(ops.staging_bytes(layout, op, num_ids), dtype=torch.uint8, device=layout.device)


def host_paths(device: str | torch.device, op: str) -> list[str]:
    """The host <-> device paths to time for ``op`` on a cache on ``device``, in table order: on CUDA
    ``kernel`` (the UVA kernel), ``dma`` (raw pages only: a canonical chunk's runs are single rows),
    ``staged`` and ``auto`` (``path=None``); on CPU (a smoke run) ``staged`` and ``auto``."""
    cuda = torch.device(device).type == "cuda"
    out = ["kernel"] if cuda else []
    if cuda and op.endswith("_pages"):
        out.append("dma")
    return out + ["staged", "auto"]


def path_fn(op: str, layout: KVLayout, ids, buf: torch.Tensor, path: str, staging: torch.Tensor | None = None):
    """``ops.<op>`` on ``path`` (``auto``: ``path=None``): impl cuda on a CUDA cache, the default on CPU."""
    fn = getattr(ops, op)
    impl = "cuda" if layout.device.type == "cuda" else None
    if path == "auto":
        return lambda: fn(layout, ids, buf, impl=impl)
    if path == "staged":
        staging = staging if staging is not None else staging_buffer(layout, op, len(ids))
        return lambda: fn(layout, ids, buf, impl=impl, path="staged", staging=staging)
    return lambda: fn(layout, ids, buf, impl=impl, path=path)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_copy(op: str, layout: KVLayout, ids, buf: torch.Tensor, fn: Callable[[], None]) -> None:
    """Run ``fn`` (``op`` between ``layout``'s blocks ``ids`` and ``buf``) once and compare the bytes with impl
    ``reference``; raises ``RuntimeError`` naming the first differing byte."""
    gather = op.startswith("gather")
    if gather:
        want = getattr(ops, op)(layout, ids, impl="reference")
        _bytes_of(buf).fill_(0x5A)
        fn()
        got = buf
    else:
        want = buf
        fn()
        got = getattr(ops, "gather_" + op.split("_", 1)[1])(layout, ids, impl="reference")
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    a, b = _bytes_of(got).to(layout.device), _bytes_of(want).to(layout.device)
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0])
        raise RuntimeError(f"{op}: byte {i} of {a.numel()} differs from impl 'reference' ({int(a[i])} != {int(b[i])})")


def _random_(buf: torch.Tensor, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """Random bytes into ``buf`` (generated on ``device``: a GPU fills 1 GiB in milliseconds)."""
    flat = _bytes_of(buf)
    if device.type == "cuda":
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=device), non_blocking=False)
    else:
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    return buf


def _usable(named: list[tuple[str, Callable, Callable | None]], errors: list[str], where: str, log) -> list:
    """The ``(label, fn)`` of ``named`` whose check (or, without one, a first call) passes; the others are
    logged and listed in ``errors``."""
    out = []
    for label, fn, check in named:
        try:
            (check or (lambda f: f()))(fn)
            out.append((label, fn))
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            msg = f"{where} {label}: {type(e).__name__}: {e}"
            errors.append(msg)
            log(f"ERROR {msg}")
    return out
