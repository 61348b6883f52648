"""The host <-> device rule of the copy ops: the copy kernel or DMA, and the measurement that draws the line.

Host <-> device copies of impl ``cuda`` (the contiguous side in pinned host memory) move their bytes one of two
ways: the copy kernel reading/writing the mapped host memory over PCIe (capped at :data:`H2D_MAX_CTAS` = 8
thread blocks, so at most 8 SMs, whatever ``max_ctas`` says above that), or DMA on the copy engines (no
SM): the copy listed as runs of bytes contiguous on both sides (adjacent rows and blocks merged), issued
with ``cudaMemcpyBatchAsync`` (CUDA >= 12.8, on any stream but the legacy default one) or one
``cudaMemcpyAsync`` per run. Each DMA run has a fixed cost, so small pieces go faster through the kernel
and large ones through DMA. Per call, ``path=None`` takes DMA when the copy's runs average at least
:func:`h2d_dma_min_bytes` bytes, else the kernel. That threshold is measured once per device and process
(:func:`calibrate_h2d`: both paths timed with CUDA events on runs of 4 KiB .. 1 MiB, each direction, about
20 ms and one sync of its own stream, lazily at the first such copy unless called before) and chosen by
:func:`choose_dma_min_bytes`; ``KVX_H2D_DMA_MIN_BYTES`` (bytes, ``0`` = always DMA) replaces the
measurement. ``path="kernel"`` or ``path="dma"`` of the ops forces one (:func:`dma_min_run_bytes`).

Who runs what: :mod:`kvx.kernels.ops` asks :func:`dma_min_run_bytes` on every copy of impl ``cuda``, on the
thread issuing the copy. The calibration is measured once per device and process, under a lock (two threads
asking at once measure once), and cached; the connector's worker calls :func:`calibrate_h2d` when it registers
its caches, which keeps the measurement off the first copy.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence

import torch

from .._ext import require as _require_ext
from .layout import Op

PATHS = ("kernel", "dma")  # host <-> device paths of impl "cuda" (the ops' ``path=``); None = by the measured rule
H2D_MAX_CTAS = 8  # thread blocks (so SMs) the copy kernel may use for a host <-> device copy
DMA_NEVER = 2**63 - 1  # a DMA threshold no copy reaches: always the kernel
H2D_ENV = "KVX_H2D_DMA_MIN_BYTES"

_DIRECTIONS = ("gather", "scatter")  # index = Op.c_direction


def dma_min_run_bytes(device: torch.device, op: Op, path: str | None, host: bool) -> int:
    """The mean run size in bytes from which one copy of impl ``cuda`` goes by DMA (the ``min_run_bytes`` of
    ``kvx._C.cuda_copy_dma``, which declines below it); :data:`DMA_NEVER`: the kernel.

    ``path="dma"``: 0 (always); ``path="kernel"``, or ``None`` with the contiguous side on the device
    (``host`` False): never; ``None`` with it in pinned host memory: :func:`h2d_dma_min_bytes` of the op's
    direction.
    """
    if path == "dma":
        return 0
    if path is None and host:
        return h2d_dma_min_bytes(device, _DIRECTIONS[op.c_direction])
    return DMA_NEVER


@dataclasses.dataclass(frozen=True)
class H2DCalibration:
    """What :func:`calibrate_h2d` measured on one device: milliseconds per copy of ``runs[i]`` runs of
    ``run_bytes[i]`` bytes each (device memory <-> pinned host), by the kernel (``H2D_MAX_CTAS`` CTAs) and
    by DMA, for ``gather`` (device -> host) and ``scatter`` (host -> device), and the thresholds
    :func:`choose_dma_min_bytes` drew from them.

    ``kernel_ms[d][i]`` / ``dma_ms[d][i]``: direction ``d`` (0 gather, 1 scatter), size ``i``.
    ``dma_min_bytes[d]``: DMA from this mean run size on (:data:`DMA_NEVER`: never).
    ``batched``: DMA went through ``cudaMemcpyBatchAsync`` (else one ``cudaMemcpyAsync`` per run).
    """

    device: torch.device
    run_bytes: tuple[int, ...]
    runs: tuple[int, ...]
    kernel_ms: tuple[tuple[float, ...], tuple[float, ...]]
    dma_ms: tuple[tuple[float, ...], tuple[float, ...]]
    dma_min_bytes: tuple[int, int]
    batched: bool


def choose_dma_min_bytes(run_bytes: Sequence[int], kernel_ms: Sequence[float], dma_ms: Sequence[float]) -> int:
    """The DMA threshold from timings of both paths over increasing run sizes.

    Returns the smallest measured size from which DMA is at least as fast as the kernel at that size and
    every larger one (a tie goes to DMA: it uses no SM), or :data:`DMA_NEVER` when the kernel wins at the
    largest size. Sizes below the smallest measured one stay with the kernel. A size where the kernel wins
    above one where DMA won (noise near the crossover) moves the threshold up past it.

    Args:
        run_bytes: ``[n]`` strictly increasing run sizes in bytes.
        kernel_ms, dma_ms: ``[n]`` time per copy of each path at each size (any unit, the same for both).
    """
    sizes, k_ms, d_ms = list(run_bytes), list(kernel_ms), list(dma_ms)
    if not sizes:
        raise ValueError("run_bytes: expected at least one run size, got none")
    if len(k_ms) != len(sizes) or len(d_ms) != len(sizes):
        raise ValueError(
            f"kernel_ms, dma_ms: expected one time per run size ({len(sizes)}), got {len(k_ms)} and {len(d_ms)}"
        )
    for i, b in enumerate(sizes):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or (i and b <= sizes[i - 1]):
            raise ValueError(f"run_bytes: expected strictly increasing positive ints, got {sizes}")
    for name, ts in (("kernel_ms", k_ms), ("dma_ms", d_ms)):
        if any(not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0 for t in ts):
            raise ValueError(f"{name}: expected positive finite times, got {ts}")
    threshold = DMA_NEVER
    for b, k, d in reversed(list(zip(sizes, k_ms, d_ms))):
        if d > k:
            break
        threshold = b
    return threshold


def h2d_env_min_bytes() -> int | None:
    """``KVX_H2D_DMA_MIN_BYTES`` as bytes (None when unset); ValueError naming it when malformed."""
    raw = os.environ.get(H2D_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{H2D_ENV}: expected a non-negative integer (the mean run size in bytes from which "
            f"host <-> device copies use DMA; 0 = always), got {raw!r}"
        )
    return value


def _cuda_device(device) -> torch.device:
    try:
        dev = torch.device("cuda" if device is None else device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device: expected a CUDA device, got {device!r} ({e})") from None
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    return dev


def h2d_dma_min_bytes(device: str | torch.device | None = None, direction: str = "scatter") -> int:
    """Mean run size in bytes from which a host <-> device copy of impl ``cuda`` uses DMA (``path=None``).

    ``KVX_H2D_DMA_MIN_BYTES`` when set, else the threshold :func:`calibrate_h2d` measured on ``device``
    (measuring it on first use). ``direction``: ``"gather"`` (device -> host) or ``"scatter"`` (host ->
    device). :data:`DMA_NEVER` means the kernel always.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(
            f"direction: expected 'gather' (device -> host) or 'scatter' (host -> device), got {direction!r}"
        )
    dev = _cuda_device(device)
    env = h2d_env_min_bytes()
    if env is not None:
        return env
    return calibrate_h2d(dev).dma_min_bytes[_DIRECTIONS.index(direction)]


_CAL_RUN_BYTES = tuple(4096 << k for k in range(9))  # 4 KiB .. 1 MiB
_CAL_BYTES = 2 << 20  # bytes per timed copy: 4 .. 256 runs of a size
_CAL_REPEATS = 3
_CALIBRATIONS: dict[torch.device, H2DCalibration] = {}
_CAL_LOCK = threading.Lock()


def calibrate_h2d(device: str | torch.device | None = None, *, force: bool = False) -> H2DCalibration:
    """Measure the kernel-or-DMA threshold of host <-> device copies on ``device`` (cached per process).

    Times, on a stream of its own, copies of ``n`` runs of each size in 4 KiB .. 1 MiB (2 MiB per copy, 4 to
    256 runs) between device memory and pinned host memory, through the kernel (``H2D_MAX_CTAS`` CTAs) and
    through DMA, in both directions, with CUDA events; about 20 ms, and it synchronizes its own stream. The
    ops call it on their first host <-> device copy with ``path=None`` (unless ``KVX_H2D_DMA_MIN_BYTES`` is
    set); call it earlier to keep that out of the first copy. ``force=True`` measures again.
    """
    dev = _cuda_device(device)
    ext = _require_ext()
    if not getattr(ext, "has_cuda", False):
        raise RuntimeError(
            "calibrate_h2d: kvx._C was built without the CUDA kernels; rebuild with nvcc on PATH (KVX_CUDA=1)"
        )
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _CAL_LOCK:
        cal = None if force else _CALIBRATIONS.get(dev)
        if cal is None:
            cal = _measure_h2d(ext, dev)
            _CALIBRATIONS[dev] = cal
    return cal


def _time_copy(fn, stream) -> float:
    """Milliseconds per call of ``fn`` (which enqueues one copy on ``stream``), back to back after a warm-up,
    from an idle stream so that the host's cost of issuing the copies is timed too."""
    fn()
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(_CAL_REPEATS):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / _CAL_REPEATS


def _measure_h2d(ext, dev: torch.device) -> H2DCalibration:
    runs = tuple(max(4, min(256, _CAL_BYTES // b)) for b in _CAL_RUN_BYTES)
    most = max(n * b for n, b in zip(runs, _CAL_RUN_BYTES))
    kernel_ms: tuple[list[float], list[float]] = ([], [])
    dma_ms: tuple[list[float], list[float]] = ([], [])
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(dev)  # not the legacy default stream: DMA may batch, as on kvx's copy stream
        with torch.cuda.stream(stream):
            # runs of b bytes: every other b-byte piece of `paged` (never adjacent), dense in `host`
            paged = torch.empty(2 * most, dtype=torch.uint8, device=dev)
            host = torch.empty(most, dtype=torch.uint8, pin_memory=True)
            host_alias = ext.cuda_host_device_pointer(host.data_ptr())
            ids = torch.arange(max(runs), dtype=torch.int64)
            ids_dev = ids.to(dev)
            layers = torch.tensor([paged.data_ptr()], dtype=torch.int64)
            layers_dev = layers.to(dev)
            for b, n in zip(_CAL_RUN_BYTES, runs):
                pd = ext.PagedDesc(
                    plane_stride=0,
                    block_stride=2 * b,
                    token_stride=0,
                    head_stride=0,
                    num_blocks=n,
                    num_planes=1,
                    block_size=1,
                    num_heads=1,
                )
                cd = ext.ContigDesc(layer_stride=n * b, plane_stride=0, token_stride=b, head_stride=b)
                for op in (Op.GATHER_BLOCKS, Op.SCATTER_BLOCKS):

                    def kernel(op=op, n=n, b=b, pd=pd, cd=cd):
                        ext.cuda_copy(
                            layers.data_ptr(),
                            layers_dev.data_ptr(),
                            1,
                            ids_dev.data_ptr(),
                            n,
                            host_alias,
                            pd,
                            cd,
                            b,
                            op.c_mode,
                            op.c_direction,
                            stream.cuda_stream,
                            H2D_MAX_CTAS,
                        )

                    def dma(op=op, n=n, b=b, pd=pd, cd=cd):
                        ext.cuda_copy_dma(
                            layers.data_ptr(),
                            1,
                            ids.data_ptr(),
                            n,
                            host.data_ptr(),
                            True,
                            pd,
                            cd,
                            b,
                            op.c_mode,
                            op.c_direction,
                            stream.cuda_stream,
                            0,
                        )

                    kernel_ms[op.c_direction].append(_time_copy(kernel, stream))
                    dma_ms[op.c_direction].append(_time_copy(dma, stream))
    k = (tuple(kernel_ms[0]), tuple(kernel_ms[1]))
    m = (tuple(dma_ms[0]), tuple(dma_ms[1]))
    return H2DCalibration(
        dev,
        _CAL_RUN_BYTES,
        runs,
        k,
        m,
        (choose_dma_min_bytes(_CAL_RUN_BYTES, k[0], m[0]), choose_dma_min_bytes(_CAL_RUN_BYTES, k[1], m[1])),
        bool(ext.cuda_batch_memcpy()),
    )
