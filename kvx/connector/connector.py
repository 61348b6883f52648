"""``KVXConnector``: the vLLM KV connector. A thin shell: each call goes to the scheduler-side
(:class:`~kvx.connector.scheduler.KVXScheduler`) or worker-side (:class:`~kvx.connector.worker.KVXWorker`)
object of its role.

Use it with ``--kv-transfer-config``::

    {"kv_connector": "KVXConnector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"chunk_size": 256,
                                   "tiers": [{"type": "cpu", "size": "4GiB"},
                                             {"type": "disk", "path": "/mnt/kv", "size": "100GiB"}]}}

``kv_load_failure_policy: "recompute"`` makes vLLM recompute a chunk kvx could not load (missing,
corrupt); with vLLM's default ("fail") such a request ends with an error instead.
After ``pip install kvx`` the name resolves through the ``vllm.general_plugins`` entry point; without
it, add ``"kv_connector_module_path": "kvx.connector"``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ..engine import copy_queue_mode
from ..kernels import ops
from ..log import attach_to_vllm, get_logger
from .common import (
    DEFAULT_CHUNK_TOKENS,
    chunk_format,
    engine_geometry,
    format_fingerprint,
    head_parts,
    hma_unsupported_reason,
    namespace,
    node_reason,
    resolve_chunk_size,
    worker_share,
)
from .config import ConfigError, KVXConfig, check_paths
from .events import event_groups
from .metadata import KVXMetadata
from .scheduler import KVXScheduler
from .stats import KVXStats, build_prom_metrics
from .worker import KVXWorker

log = get_logger(__name__)


def _layout_name(vllm_config, kv_cache_config) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        try:
            name = vllm_config.cache_config.get_resolved_kv_cache_layout()
        except Exception:  # noqa: BLE001 - not resolved in this process
            name = None
    name = getattr(name, "name", name)
    return str(name) if name else "LBNHC"


def state_pages_alias_attention(kv_caches: dict, state_layers: set[str], page_bytes: int) -> str | None:
    """Why the recurrent-state layers' tensors are not pages kvx can copy through the attention layers' views
    (None: they are). kvx copies page ``b`` of each attention layer's tensor; that holds a state group's state
    of block ``b`` only if every state tensor is a view of an attention layer's storage whose block ``b`` lies
    in that page (vLLM lays groups out so: layer ``i`` of every group aliases one tensor, pages of equal size)."""
    pages: dict[int, list[int]] = {}  # storage -> byte offsets of the attention layers' first pages
    for name, t in kv_caches.items():
        if name not in state_layers and isinstance(t, torch.Tensor):
            pages.setdefault(t.untyped_storage().data_ptr(), []).append(t.storage_offset() * t.element_size())
    for name in sorted(state_layers):
        views = kv_caches.get(name)
        views = [views] if isinstance(views, torch.Tensor) else list(views or ())
        if not views:
            return f"state layer {name} has no tensor"
        for v in views:
            at = v.storage_offset() * v.element_size()
            firsts = pages.get(v.untyped_storage().data_ptr(), [])
            off = min((at - f for f in firsts if at >= f), default=None)
            if off is None:
                return f"state layer {name}: a tensor of shape {tuple(v.shape)} aliases no attention layer's tensor"
            stride = v.stride(0) * v.element_size()
            if stride != page_bytes or not 0 <= off < page_bytes:
                return (
                    f"state layer {name}: a tensor of shape {tuple(v.shape)} with a block stride of {stride} bytes "
                    f"at byte {off} of the page (expected the {page_bytes}-byte pages of the attention layers)"
                )
    return None


class KVXConnector(KVConnectorBase_V1, SupportsHMA):
    """kvx's KV connector (see the module docstring). Supports vLLM's hybrid KV cache manager: models with
    full and sliding-window attention groups, and hybrid models' Mamba / linear-attention groups in vLLM's
    align mode, are served (:mod:`kvx.connector.common`); with groups kvx cannot hold it stays passive: no
    hits, no saves, one log line."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        attach_to_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = self.check_config(ktc)
        if kv_cache_config is None:
            raise ValueError("kv_cache_config: KVXConnector needs vLLM >= 0.32 (the 3-argument constructor)")
        self._scheduler: KVXScheduler | None = None
        self._worker: KVXWorker | None = None
        self._state_layers: set[str] = set()
        self.passive = hma_unsupported_reason(kv_cache_config)
        if self.passive is not None:
            # vLLM runs such models only with its hybrid manager, which needs SupportsHMA: serve nothing
            # rather than fail the engine or serve state kvx does not hold
            log.warning(
                "kvx: %s: this engine's KV cache is not something kvx can store (%s); kvx loads and "
                "saves nothing for it (every request is computed by vLLM)",
                role.name,
                self.passive,
            )
            return
        geom = engine_geometry(vllm_config, kv_cache_config)
        self.config, chosen = resolve_chunk_size(self.config, geom)
        if chosen and role == KVConnectorRole.SCHEDULER:  # once per engine (every process derives the same)
            log.info(
                "kvx: chunk_size not set: %d tokens, the smallest multiple of vLLM's block size %d of at least %d%s",
                self.config.chunk_size,
                geom.block_size,
                DEFAULT_CHUNK_TOKENS,
                " (a hybrid model: its block size)" if geom.hybrid else "",
            )
        self._state_layers = {n for g in geom.state_groups for n in kv_cache_config.kv_cache_groups[g].layer_names}
        self.geom = geom
        layout = _layout_name(vllm_config, kv_cache_config)
        fmt = chunk_format(self.config, geom)
        fingerprint = format_fingerprint(geom, fmt, layout)
        split = head_parts(geom, fmt, layout)
        ns = namespace(vllm_config, geom, fingerprint, split)
        self._layout_name = layout
        pc = vllm_config.parallel_config
        reason = node_reason(self.config, geom, split, int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size))
        if reason is not None:
            raise ConfigError(reason)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVXScheduler(
                self.config,
                geom,
                ns,
                fingerprint,
                num_workers=int(vllm_config.parallel_config.world_size),
                producer=bool(ktc.is_kv_producer),
                consumer=bool(ktc.is_kv_consumer),
                kv_events=bool(
                    getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)
                ),
                split=split,
                stages=int(vllm_config.parallel_config.pipeline_parallel_size),
                background_writes=not (ktc.is_kv_producer and not ktc.is_kv_consumer),
                model=str(vllm_config.model_config.model),
            )
            self._scheduler.events.set_groups(event_groups(kv_cache_config))
        else:
            # a kv_producer's chunks are the hand-off its consumer waits for (pd_wait_ms): written at normal
            # priority; otherwise writes only fill idle cores and never slow the forward
            self._worker = KVXWorker(
                self.config,
                geom,
                fmt,
                fingerprint,
                lambda names: worker_share(vllm_config, geom, split, names),
                fence_loads_at_start=not self.config.layerwise,
                background_writes=not (ktc.is_kv_producer and not ktc.is_kv_consumer),
            )
            self._worker.write_records = int(vllm_config.parallel_config.world_size) == 1
        log.info(
            "kvx: %s ready: chunk %d tokens, format %s, tiers %s",
            role.name,
            self.config.chunk_size,
            fmt,
            [t.type for t in self.config.tiers],
        )

    # ------------------------------------------------------------------ class-level hooks
    @classmethod
    def check_config(cls, kv_transfer_config) -> KVXConfig:
        """Validate ``kv_connector_extra_config`` and the tiers' paths for this role. Raises
        :class:`~kvx.connector.config.ConfigError` naming the key, what was expected and what was given.

        Runs as soon as vLLM resolves the connector class while validating its own config (in the
        front-end process, before any model is loaded; see :mod:`kvx.plugin`), and again in each
        constructor. The chunk size is checked against the block size in the constructors, the first place
        the block size is final."""
        config = KVXConfig.from_extra_config(kv_transfer_config.kv_connector_extra_config)
        check_paths(config, writes=bool(kv_transfer_config.is_kv_producer))
        try:
            copy_queue_mode("cpu")  # KVX_COPY_QUEUE: a bad value fails here, not in the worker
            ops.h2d_env_min_bytes()  # KVX_H2D_DMA_MIN_BYTES: likewise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return config

    @property
    def scheduler_side(self) -> KVXScheduler:
        """This connector's scheduler half (the scheduler process's connector; tests and tools read it)."""
        if self._scheduler is None:
            raise AttributeError(f"scheduler_side: this connector has role {self.role.name} and no scheduler half")
        return self._scheduler

    @property
    def worker_side(self) -> KVXWorker:
        """This connector's worker half (a worker process's connector; tests and tools read it)."""
        if self._worker is None:
            raise AttributeError(f"worker_side: this connector has role {self.role.name} and no worker half")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, never wrong output

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        return extra.get("kv_layout")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load fences each layer's load; FULL graph replay would skip it. vLLM asks this while
        # it validates its config, so a bad extra config fails here, before anything loads.
        return KVXConfig.from_extra_config(extra_config).layerwise

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        # vLLM >= 0.33 calls unregister_kv_caches before a sleep and restore_kv_caches after the wake-up
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVXStats | None:
        return KVXStats(data=dict(data)) if data else KVXStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(
                self._attention_views(kv_caches), self._layout_name, self._kv_cache_config.num_blocks
            )

    def _attention_views(self, kv_caches: dict | None) -> dict | None:
        """The attention layers' views; a hybrid model's state layers are copied through them (checked here)."""
        if kv_caches is None or not self._state_layers:
            return kv_caches
        why = state_pages_alias_attention(kv_caches, self._state_layers, self.geom.page_bytes)
        if why is not None:
            raise ValueError(f"kv_caches: kvx cannot copy this hybrid model's recurrent state: {why}")
        return {n: t for n, t in kv_caches.items() if n not in self._state_layers}

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before ``Worker.sleep`` (or a discard of the KV cache): copies drained, everything tied
        to the KV tensors' addresses dropped; the tiers and what they hold stay
        (:meth:`~kvx.connector.worker.KVXWorker.unregister_kv_caches`)."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """vLLM >= 0.33, after ``Worker.wake_up`` restored the KV cache: described again from vLLM's tensors
        (those registered before, whose memory vLLM's sleep backend mapped back), or from ``kv_caches`` where a
        caller hands new ones (a backend that moves them)."""
        if self._worker is not None:
            self._worker.restore_kv_caches(self._attention_views(kv_caches))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.handle_preemptions(
                kv_connector_metadata if isinstance(kv_connector_metadata, KVXMetadata) else None
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVXMetadata):
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids) if self._worker is not None else (None, None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As :meth:`get_finished`, plus the async loads that failed (``failed_recving``, also in
        ``finished_recving``): how a load failure reaches vLLM with several KV cache groups, where block ids
        (``get_block_ids_with_load_errors``) cannot name it."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()) | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVXStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return KVXStats.from_counts(side.take_stats()) if side is not None else None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVXMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Every group's blocks are freed at once (kvx never delays a free: its copies are fenced)."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        """BlockStored / BlockRemoved / AllBlocksCleared for chunks entering and leaving kvx's tiers (with
        vLLM's ``--kv-events-config``; see :mod:`kvx.connector.events`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        if self._scheduler is None:
            return None
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
