"""The host <-> device rule of the copy ops: DMA straight into the blocks, or staged, and the measurement that
draws the line.

Host <-> device copies (the contiguous side in pinned host memory, a CUDA cache) cross PCIe on the copy engines,
never on SMs by default: a copy kernel reading host memory over UVA on a few SMs moves a fraction of what the
copy engines move and slows further beside the forward's GEMMs, while DMA stays near a pinned copy's rate
(benchmarks/results/h100-2026-11-27/README.md). Two ways:

- ``"dma"``: the copy listed as runs of bytes contiguous on both sides (adjacent rows and blocks merged), issued
  straight between host memory and the blocks with ``cudaMemcpyBatchAsync`` (CUDA >= 12.8, on any stream but the
  legacy default one) or one ``cudaMemcpyAsync`` per run. Each run costs the copy engines a descriptor (a fixed
  cost per entry, as in LMCache's cost model), so it wins for large pieces (raw pages of tens of KiB and up).
- ``"staged"`` (:mod:`kvx.kernels.plan`): one DMA of the whole piece set between host memory and a device
  staging buffer, and the copy kernel between that buffer and the blocks inside HBM (microseconds of GPU time).

A plan of path ``"auto"`` (the default for a CUDA cache's host buffers, :mod:`kvx.kernels.plan`) takes ``"dma"``
when every copy's runs average at least :func:`dma_threshold` bytes, else ``"staged"``. The threshold is measured
once per device and process (:func:`calibrate_h2d`: both paths timed with CUDA events on what the worker issues per
layer, batches of 16 and 128 pieces (one and eight chunks of 16 blocks) of 4 KiB .. 512 KiB each, in each
direction; a fraction of a second and one sync of its own stream, lazily at the first such copy unless called
before) and chosen by :func:`choose_dma_min_bytes`; ``KVX_H2D_DMA_MIN_BYTES`` (bytes, ``0`` = always DMA) replaces
the measurement.
``path="kernel"`` forces the copy kernel over mapped host memory (capped at :data:`H2D_MAX_CTAS` thread blocks): it
stays for measurements that show it winning somewhere; no default takes it. On a CPU cache (the deferred copy
queue runs the CUDA code path there) the rule uses :data:`CPU_DMA_MIN_BYTES`.

Who runs what: :meth:`kvx.kernels.plan.Copies.plan` asks :func:`dma_threshold` once per plan of path ``"auto"``, on
the thread planning it. The calibration is measured once per device and process, under a lock (two threads asking at
once measure once), and cached; the worker calls :func:`calibrate_h2d` when it registers its caches, which keeps the
measurement off the first copy.
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

H2D_MAX_CTAS = 8  # thread blocks (so SMs) the copy kernel may use for a host <-> device copy (path "kernel")
DMA_NEVER = 2**63 - 1  # a DMA threshold no copy reaches: always staged
H2D_ENV = "KVX_H2D_DMA_MIN_BYTES"
CPU_DMA_MIN_BYTES = 64 << 10  # CPU caches (no PCIe to measure): direct runs from 64 KiB, vLLM's line-rate size on H100
CAL_PIECES = (16, 128)  # pieces per copy the calibration times: a layer of 1 and of 8 chunks of 16 blocks

_DIRECTIONS = ("gather", "scatter")  # index = Op.c_direction


def dma_threshold(device: torch.device | str, direction: str, pieces: int) -> int:
    """The mean run size in bytes from which a batch of ``pieces`` pieces per layer in ``direction`` (``"gather"``
    or ``"scatter"``) goes by DMA straight into the blocks rather than staged: the measured rule on CUDA
    (:func:`h2d_dma_min_bytes`), :data:`CPU_DMA_MIN_BYTES` (or the variable) on CPU. Asked once per plan."""
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cuda":
        return h2d_dma_min_bytes(dev, direction, pieces)
    if H2D_ENV not in os.environ:  # the common case: no variable to parse (a miss of .get raises inside: slower)
        return CPU_DMA_MIN_BYTES
    env = h2d_env_min_bytes()
    return CPU_DMA_MIN_BYTES if env is None else env


@dataclasses.dataclass(frozen=True)
class H2DCalibration:
    """What :func:`calibrate_h2d` measured on one device: milliseconds per copy of ``pieces[k]`` pieces of
    ``run_bytes[i]`` bytes each (device blocks <-> pinned host), by DMA straight into the pieces and staged (one DMA
    of the pieces' bytes to a device buffer + the copy kernel), for ``gather`` (device -> host) and ``scatter``
    (host -> device), and the thresholds :func:`choose_dma_min_bytes` drew from them.

    ``dma_ms[d][k][i]`` / ``staged_ms[d][k][i]``: direction ``d`` (0 gather, 1 scatter), ``pieces[k]``, size
    ``run_bytes[k][i]``.
    ``dma_min_bytes[d][k]``: DMA from this mean run size on (:data:`DMA_NEVER`: never).
    ``batched``: DMA went through ``cudaMemcpyBatchAsync`` (else one ``cudaMemcpyAsync`` per run).
    """

    device: torch.device
    run_bytes: tuple[tuple[int, ...], ...]  # [k]: the sizes measured for pieces[k] (at most _CAL_MAX_BYTES a copy)
    pieces: tuple[int, ...]
    dma_ms: tuple[tuple[tuple[float, ...], ...], ...]
    staged_ms: tuple[tuple[tuple[float, ...], ...], ...]
    dma_min_bytes: tuple[tuple[int, ...], tuple[int, ...]]
    batched: bool


def choose_dma_min_bytes(run_bytes: Sequence[int], staged_ms: Sequence[float], dma_ms: Sequence[float]) -> int:
    """The DMA threshold from timings of both paths over increasing run sizes.

    Returns the smallest measured size from which DMA is at least as fast as staged at that size and every larger
    one (a tie goes to DMA: it uses no SM), or :data:`DMA_NEVER` when staged wins at the largest size. Sizes below
    the smallest measured one stay staged. A size where staged wins above one where DMA won (noise near the
    crossover) moves the threshold up past it.

    Args:
        run_bytes: ``[n]`` strictly increasing run sizes in bytes.
        staged_ms, dma_ms: ``[n]`` time per copy of each path at each size (any unit, the same for both).
    """
    sizes, k_ms, d_ms = list(run_bytes), list(staged_ms), list(dma_ms)
    if not sizes:
        raise ValueError("run_bytes: expected at least one run size, got none")
    if len(k_ms) != len(sizes) or len(d_ms) != len(sizes):
        raise ValueError(
            f"staged_ms, dma_ms: expected one time per run size ({len(sizes)}), got {len(k_ms)} and {len(d_ms)}"
        )
    for i, b in enumerate(sizes):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or (i and b <= sizes[i - 1]):
            raise ValueError(f"run_bytes: expected strictly increasing positive ints, got {sizes}")
    for name, ts in (("staged_ms", k_ms), ("dma_ms", d_ms)):
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
            f"host <-> device copies go by DMA straight into the blocks; 0 = always), got {raw!r}"
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


def h2d_dma_min_bytes(
    device: str | torch.device | None = None, direction: str = "scatter", pieces: int = CAL_PIECES[0]
) -> int:
    """Mean run size in bytes from which a host <-> device copy of impl ``cuda`` goes by DMA straight into the
    blocks (``path=None``), for a copy of ``pieces`` pieces per layer.

    ``KVX_H2D_DMA_MIN_BYTES`` when set, else the threshold :func:`calibrate_h2d` measured on ``device`` for the
    measured batch size nearest ``pieces`` (measuring it on first use). ``direction``: ``"gather"`` (device ->
    host) or ``"scatter"`` (host -> device). :data:`DMA_NEVER` means staged always.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(
            f"direction: expected 'gather' (device -> host) or 'scatter' (host -> device), got {direction!r}"
        )
    dev = _cuda_device(device)
    env = h2d_env_min_bytes()
    if env is not None:
        return env
    cal = calibrate_h2d(dev)
    k = min(range(len(cal.pieces)), key=lambda j: abs(math.log(max(pieces, 1) / cal.pieces[j])))
    return cal.dma_min_bytes[_DIRECTIONS.index(direction)][k]


_CAL_RUN_BYTES = tuple(4096 << k for k in range(8))  # 4 KiB .. 512 KiB
_CAL_MAX_BYTES = 16 << 20  # bytes per timed copy: 16 pieces up to 512 KiB, 128 up to 128 KiB (DMA wins above)
_CAL_REPEATS = 3
_CALIBRATIONS: dict[torch.device, H2DCalibration] = {}
_CAL_LOCK = threading.Lock()


def calibrate_h2d(device: str | torch.device | None = None, *, force: bool = False) -> H2DCalibration:
    """Measure the DMA-or-staged threshold of host <-> device copies on ``device`` (cached per process).

    Times, on a stream of its own, copies of 16 and 128 pieces of each size in 4 KiB .. 512 KiB (at most 16 MiB a
    copy) between device memory and pinned host memory, by DMA straight into the pieces and staged, in both
    directions, with CUDA events; a fraction of a second and 48 MiB of device memory (freed), and it synchronizes
    its own stream.
    The ops call it on their first host <-> device copy with ``path=None`` (unless ``KVX_H2D_DMA_MIN_BYTES`` is
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
    sizes = tuple(tuple(b for b in _CAL_RUN_BYTES if n * b <= _CAL_MAX_BYTES) for n in CAL_PIECES)
    dma_ms = ([], [])
    staged_ms = ([], [])
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(dev)  # not the legacy default stream: DMA may batch, as on kvx's copy streams
        with torch.cuda.stream(stream):
            # pieces of b bytes: every other b-byte piece of `paged` (never adjacent), dense in `host` and `stage`
            paged = torch.empty(2 * _CAL_MAX_BYTES, dtype=torch.uint8, device=dev)
            stage = torch.empty(_CAL_MAX_BYTES, dtype=torch.uint8, device=dev)
            host = torch.empty(_CAL_MAX_BYTES, dtype=torch.uint8, pin_memory=True)
            ids = torch.arange(max(CAL_PIECES), dtype=torch.int64)
            ids_dev = ids.to(dev)
            layers = torch.tensor([paged.data_ptr()], dtype=torch.int64)
            layers_dev = layers.to(dev)
            for d, op in enumerate((Op.GATHER_BLOCKS, Op.SCATTER_BLOCKS)):
                for n, run_bytes in zip(CAL_PIECES, sizes):
                    row_dma, row_staged = [], []
                    for b in run_bytes:
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
                        shared = dict(
                            num_layers=1,
                            num_ids=n,
                            paged=pd,
                            contig_strides=cd,
                            row_bytes=b,
                            mode=op.c_mode,
                            direction=op.c_direction,
                            stream=stream.cuda_stream,
                        )

                        def dma(shared=shared):
                            ext.cuda_copy_dma(
                                layer_ptrs_host=layers.data_ptr(),
                                ids=ids.data_ptr(),
                                contig=host.data_ptr(),
                                contig_on_host=True,
                                min_run_bytes=0,
                                **shared,
                            )

                        def kernel(shared=shared):
                            ext.cuda_copy(
                                layer_ptrs_host=layers.data_ptr(),
                                layer_ptrs_dev=layers_dev.data_ptr(),
                                ids=ids_dev.data_ptr(),
                                contig=stage.data_ptr(),
                                max_ctas=0,
                                **shared,
                            )

                        def staged(n=n, b=b, kernel=kernel, gather=op.gather):
                            flat_h, flat_d = host[: n * b], stage[: n * b]
                            if gather:
                                kernel()
                                flat_h.copy_(flat_d, non_blocking=True)
                            else:
                                flat_d.copy_(flat_h, non_blocking=True)
                                kernel()

                        row_dma.append(_time_copy(dma, stream))
                        row_staged.append(_time_copy(staged, stream))
                    dma_ms[d].append(tuple(row_dma))
                    staged_ms[d].append(tuple(row_staged))
    thresholds = tuple(
        tuple(choose_dma_min_bytes(sizes[k], staged_ms[d][k], dma_ms[d][k]) for k in range(len(CAL_PIECES)))
        for d in range(2)
    )
    return H2DCalibration(
        dev,
        sizes,
        CAL_PIECES,
        (tuple(dma_ms[0]), tuple(dma_ms[1])),
        (tuple(staged_ms[0]), tuple(staged_ms[1])),
        thresholds,
        bool(ext.cuda_batch_memcpy()),
    )
