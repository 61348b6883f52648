"""The machinery of the chunk portability tests (``tests/worker/test_chunk_portability*.py``; what they prove is
told in ``test_chunk_portability.py``): :class:`Engine`, a real :class:`kvx.connector.worker.KVXWorker` on real
caches of one geometry (block size, page layout, dtype, MLA or not, a pipeline stage's layers) with a fake forward;
the scenario's two halves (A saves the prompt to a disk tier, B loads it); the bit-exact checks; the cases and the
copy queues. The ``runner_order`` and ``queue`` fixtures are in ``tests/worker/conftest.py``."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvx.connector.common import EngineGeometry, format_fingerprint, head_parts, namespace, worker_share
from kvx.connector.config import KVXConfig
from kvx.connector.metadata import ChunkLoad, ChunkSave, KVXMetadata, LoadSpec
from kvx.connector.parts import PartIO, Share, record_of
from kvx.connector.worker import KVXWorker
from kvx.keys import chunk_keys, request_root
from kvx.store import DiskTier
from kvx.testing import ResultTally, end_step, make_kv_caches, random_fill_
from tests.helpers import wait_for

TALLY = ResultTally()  # the transfer ids of the hand-built metadata (no scheduler here)

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

    order = "save-first"  # the runner order of the end-of-step hooks (kvx.testing.end_step; set per test: conftest.py)

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
