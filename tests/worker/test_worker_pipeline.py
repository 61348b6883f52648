"""The connector's worker racing a fake forward through a scripted engine run, checked bit-exact. No vLLM.

A :class:`kvx.connector.worker.KVXWorker` is built by hand (an ``EngineGeometry``, a ``KVXConfig`` with a
CPU tier, per-layer caches as vLLM >= 0.32 hands them to ``register_kv_caches``) and driven with
hand-written :class:`KVXMetadata` through vLLM's per-step hook order::

    handle_preemptions -> bind -> start_load_kv
      -> per layer: wait_for_layer_load, forward of the layer, save_kv_layer
    -> wait_for_save -> get_finished -> get_block_ids_with_load_errors -> build_worker_meta   ("save-first")
    -> get_finished -> get_block_ids_with_load_errors -> build_worker_meta -> wait_for_save   ("results-first":
                                                                          runners with speculative decoding)

(every case runs in both runner orders: :data:`kvx.testing.RUNNER_ORDERS`)

The forward is fake but real enough to race: per layer it writes the KV of the step's tokens into their
blocks, then reads every token of the request into an output tensor (what attention would read). KV is a
deterministic function of (whose token, position, layer, plane): a request that shares a prefix has
the same KV there, so every byte in a CPU slot, in an output and in the cache has one right value.

- ``cuda``: the forward runs on a compute stream made current for the whole run (markers and fences go
  on it; the worker's copies run on its own two streams). The host never synchronizes between steps
  (vLLM's async scheduling: the host runs ahead of the GPU), only at the end. Two timings, each with
  ``torch.cuda._sleep`` (``KVX_TEST_SLEEP_CYCLES``, default 1e7: ~5 ms on an H100, well above what the
  host needs to submit a step):
  ``slow_forward`` sleeps before each layer's forward, so a copy not ordered *after* a forward lands
  before it (rules 1 and 2 of :class:`kvx.engine.BlockOrder`); ``slow_copies`` sleeps before each copy
  job on its stream, so a copy the forward does not *wait for* lands after it (rules 3 and 4); the broken
  rule 5 case sleeps before the reshapes alone, so a staging DMA not ordered after them lands first. The steps
  run under ``torch.cuda.set_sync_debug_mode("warn")``: a synchronizing call in them fails the test.
- ``cpu``: the same scenario on the deferred copy queue (``KVX_COPY_QUEUE=deferred``, set by the test
  whatever the caller's environment), with the forward on its virtual compute stream
  (``engine.compute``): saves run as late and loads as early as their edges allow, forwards as lazily as
  a GPU's. CI proves the test logic here.

``test_scenario_detects_a_broken_rule`` switches one rule off (monkeypatched) and asserts that the
scenario then fails its bit-exact checks where the missing edge lets a copy race a forward: on CPU
rules 1, 3, 4 and 5 (rule 2 cannot show on a queue that runs saves late), on CUDA all five. Rule 5 (a staging
buffer reused before the copies using it ran) is the staged path's: on CUDA and on the deferred queue every host
<-> device copy of this scenario is staged (``copy_path`` "auto", canonical chunks), each layer a leg, four
layers through a ring of two buffers per direction.

The scenario (``STEPS``; chunks of 32 tokens = 2 blocks of 16; block 0 is vLLM's null block):

0. A prefills chunk a0 into blocks [1, 2] and saves it to CPU slot 0;
1. A prefills chunk a1 into [3, 4] (reading a0's blocks), saves it to slot 1, finishes (max_tokens=1);
2. race 1: B is given A's freed blocks [3, 4, 1, 2] and writes its own KV there; a1's save, not run yet
   at this point on the deferred queue, must read A's KV (fenced by ``handle_preemptions``);
3. C prefills [5..8] (saves to slots 4, 5), E prefills its first chunk into [10, 11] (slot 6);
4. race 2: D, a full hit on A's chunks (a chunk is served once its slot is reported stored), loads them
   into C's freed blocks [7, 8, 5, 6] while C's forward and C's saves have not run yet, then computes 8
   tokens into block 9 reading the loaded blocks layer by layer; in the same step E is preempted and F
   loads a0 into E's blocks [11, 10], sharing the last block with its first computed token;
5. decode: D writes token 72 into the last block of the loaded request, F token 32 into a new block;
6. E resumes: loads e0 from slot 6 into new blocks and computes the rest of its prompt.

Why race 2 uses C's blocks rather than B's: the load's source chunks must be reported stored first, as
the scheduler serves nothing else; on the deferred queue a1's save runs only once B's forward is forced
(it is fenced before it), so by then B's forward has run and only a donor one step later can still be
pending.

Run::

    python -m pytest tests/worker -q                   # CPU (deferred queue); CUDA cases skip without a GPU
    python -m pytest tests/worker -q -m gpu            # the CUDA cases
    compute-sanitizer --tool racecheck --error-exitcode 9 python -m pytest tests/worker -q -m gpu -k bit_exact
    compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest tests/worker -q -m gpu -k bit_exact

(racecheck looks for shared-memory hazards inside kernels, memcheck for out-of-bounds and misaligned
accesses, including the copy kernels' reads and writes of pinned host slots; the races between streams
are what the bit-exact checks catch. ``-k bit_exact`` leaves out the broken-rule cases, which need the
sanitizer-free timing and whose failures are expected.)
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from kvx import engine as kvx_engine
from kvx.connector.common import EngineGeometry
from kvx.connector.config import ConfigError, KVXConfig
from kvx.connector.metadata import ChunkLoad, ChunkSave, KVXMetadata, LoadSpec
from kvx.connector.worker import KVXWorker
from kvx.kernels import ops
from kvx.testing import RUNNER_ORDERS, ResultTally, end_step, make_kv_caches
from tests.helpers import same_bytes, wait_for

NUM_LAYERS = 4
BLOCK = 16
CHUNK = 32
HEADS = 2
HEAD_SIZE = 64
MLA_HEAD_SIZE = 40  # latent width of the MLA case (one plane, one head)
NUM_BLOCKS = 20
MAX_TOKENS = 80  # positions the KV tables cover
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SLEEP_CYCLES = int(float(os.environ.get("KVX_TEST_SLEEP_CYCLES", "1e7")))  # ~5 ms on an H100
POISON = -1  # int16 0xFFFF: a NaN in bf16 and fp16, never a KV value here

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")
LAYOUTS = ["LBNHC", "BLHNC", "mla"]
DTYPES = [torch.bfloat16, torch.float16]


# ------------------------------------------------------------------ the scenario
@dataclass(frozen=True)
class Req:
    """A request: ``src[p]`` is whose KV position ``p`` holds (a shared prefix holds the owner's KV)."""

    name: str
    src: tuple[str, ...]


def req(name: str, *parts: tuple[str, int]) -> Req:
    return Req(name, tuple(who for who, n in parts for _ in range(n)))


A = req("A", ("A", 64))
B = req("B", ("B", 64))
C = req("C", ("C", 64))
D = req("D", ("A", 64), ("D", 9))  # a hit on A's two chunks, 8 more prompt tokens, 1 decoded
E = req("E", ("E", 48))
# A's first chunk as F's prompt: a hit on all but the last token, which F recomputes; a recomputation need
# not be bit-identical (another batch shape), so it gets F's own KV and a load landing late shows up
F = req("F", ("A", 31), ("F", 2))
SOURCES = "ABCDEF"


@dataclass(frozen=True)
class Run:
    """One request's part of a step's forward: writes positions [start, end) into ``table``'s blocks,
    reads [0, end)."""

    req: Req
    table: tuple[int, ...]
    start: int
    end: int

    def written_blocks(self) -> list[int]:
        return list(self.table[self.start // BLOCK : -(-self.end // BLOCK)])


@dataclass
class Step:
    what: str
    runs: list[Run]
    saves: list[ChunkSave] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)  # blocks freed since the last step
    needs_stored: list[str] = field(default_factory=list)  # chunks a load reads: served once reported stored
    # deferred queue only: before the step, the copy or forward it races has not run yet (the race is live)
    not_yet: list[tuple[str, object]] = field(default_factory=list)

    def meta(self) -> KVXMetadata:
        written = [b for r in self.runs for b in r.written_blocks()]
        return KVXMetadata(
            loads=list(self.loads),
            saves=list(self.saves),
            preempted=list(self.preempted),
            finished=list(self.finished),
            forward_blocks=sorted(set(written) | set(self.freed)),
        )


TALLY = ResultTally()  # the transfer ids of the scenario's metadata (built by hand, no scheduler)


def save(r: Req, key: str, blocks, slot: int) -> ChunkSave:
    return ChunkSave(
        req_id=r.name, key=key, block_ids=list(blocks), tokens=CHUNK, slot=slot, slot_xfer=TALLY.id("slot", key)
    )


def load(r: Req, *chunks: ChunkLoad) -> LoadSpec:
    return LoadSpec(req_id=r.name, chunks=list(chunks), is_async=False, xfer=TALLY.id("load", r.name))


def from_slot(key: str, slot: int, blocks, **kw) -> ChunkLoad:
    return ChunkLoad(key=key, tier="cpu", slot=slot, block_ids=list(blocks), first_block=0, tokens=CHUNK, **kw)


# chunk key -> (slot, request, first position): what every CPU slot must hold at the end
SLOTS = {
    "a0": (0, A, 0),
    "a1": (1, A, 32),
    "b0": (2, B, 0),
    "b1": (3, B, 32),
    "c0": (4, C, 0),
    "c1": (5, C, 32),
    "e0": (6, E, 0),
}

STEPS = [
    Step("A prefills chunk a0", [Run(A, (1, 2), 0, 32)], saves=[save(A, "a0", [1, 2], 0)]),
    Step("A prefills chunk a1 and finishes", [Run(A, (1, 2, 3, 4), 32, 64)], saves=[save(A, "a1", [3, 4], 1)]),
    Step(
        "race 1: B writes A's freed blocks before A's last save ran",
        [Run(B, (3, 4, 1, 2), 0, 64)],
        saves=[save(B, "b0", [3, 4], 2), save(B, "b1", [1, 2], 3)],
        finished=["A"],
        freed=[1, 2, 3, 4],
        not_yet=[("a1's save into slot 1", ("slot", "a1"))],
    ),
    Step(
        "C prefills; E prefills its first chunk",
        [Run(C, (5, 6, 7, 8), 0, 64), Run(E, (10, 11), 0, 32)],
        saves=[save(C, "c0", [5, 6], 4), save(C, "c1", [7, 8], 5), save(E, "e0", [10, 11], 6)],
        finished=["B"],
        freed=[1, 2, 3, 4],
    ),
    Step(
        "race 2: D loads into C's freed blocks, F into preempted E's",
        [Run(D, (7, 8, 5, 6, 9), 64, 72), Run(F, (11, 10), 31, 32)],
        loads=[
            load(D, from_slot("a0", 0, [7, 8]), from_slot("a1", 1, [5, 6])),
            load(F, from_slot("a0", 0, [11, 10], before_forward=True, shared_tokens=15)),
        ],
        finished=["C"],
        preempted=["E"],
        freed=[5, 6, 7, 8, 10, 11],
        needs_stored=["a0", "a1"],
        not_yet=[
            ("C's forward into blocks 5-8", ("blocks", C, (5, 6, 7, 8), 64)),
            ("E's forward into blocks 10-11", ("blocks", E, (10, 11), 32)),
        ],
    ),
    Step(
        "decode: D into the last block of its loaded table, F into a new block",
        [Run(D, (7, 8, 5, 6, 9), 72, 73), Run(F, (11, 10, 12), 32, 33)],
    ),
    Step(
        "E resumes: loads e0 into new blocks",
        [Run(E, (13, 14, 15), 32, 48)],
        loads=[load(E, from_slot("e0", 6, [13, 14]))],
        needs_stored=["e0"],
    ),
]
# what the live requests' blocks hold at the end
FINAL_TABLES = [(D, (7, 8, 5, 6, 9), 73), (F, (11, 10, 12), 33), (E, (13, 14, 15), 48)]


# ------------------------------------------------------------------ the engine under test
class Pipeline:
    """A KVXWorker on real caches, its fake forward, and the record of what every forward read."""

    def __init__(
        self,
        device: str,
        layout: str,
        dtype: torch.dtype,
        slow: str | None = None,
        order: str = "save-first",
        staging_bytes: int | None = None,
    ):
        self.device = torch.device(device)
        self.order = order  # the runner order of the end-of-step hooks (kvx.testing.end_step)
        self.slow = slow
        self.mla = layout == "mla"
        self.planes = 1 if self.mla else 2
        self.heads = 1 if self.mla else HEADS
        self.head_size = MLA_HEAD_SIZE if self.mla else HEAD_SIZE
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        page_bytes = self.planes * BLOCK * self.heads * self.head_size * itemsize
        geom = EngineGeometry(
            block_size=BLOCK,
            num_layers=NUM_LAYERS,
            num_kv_heads=self.heads,
            head_size=self.head_size,
            dtype=dtype,
            use_mla=self.mla,
            opaque=False,
            isa="",
            page_bytes=page_bytes,
        )
        chunk_bytes = NUM_LAYERS * page_bytes * (CHUNK // BLOCK)
        extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": 8 * chunk_bytes}]}
        if staging_bytes is not None:
            extra["staging_bytes"] = staging_bytes
        config = KVXConfig.from_extra_config(extra)
        self.caches = make_kv_caches(
            layout,
            num_layers=NUM_LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            num_heads=self.heads,
            head_size=self.head_size,
            dtype=dtype,
            device=device,
        )
        self.worker = KVXWorker(config, geom, "canonical", "tests-gpu")
        self.worker.register_kv_caches(dict(zip(LAYER_NAMES, self.caches)), layout, NUM_BLOCKS)
        self.engine = self.worker.engine
        self.deferred = self.engine.mode == "deferred"
        self.pool = self.worker.pool
        for i in range(self.pool.num_slots):
            self.pool.slot(i).view(torch.int16).fill_(POISON)
        # the fake forward's own [B, N, H, D] views (independent of kvx.kernels.layout)
        self.views = [self._plane_views(t) for t in self.caches]
        # KV of every source at every position: [L, P, MAX_TOKENS, H, D], small integers (exact in bf16/fp16)
        shape = (NUM_LAYERS, self.planes, MAX_TOKENS, self.heads, self.head_size)
        self.kv = {}
        for who in SOURCES:
            g = torch.Generator().manual_seed(zlib.crc32(f"{who}/{layout}/{dtype}".encode()))
            self.kv[who] = torch.randint(-100, 100, shape, generator=g).to(dtype)
        self.reads: list[tuple[str, Run, torch.Tensor]] = []  # (step, run, what its forward read)
        self.stored = Counter()
        self.loads_done = Counter()
        self.unstored = Counter()
        self.failed_blocks: list[int] = []
        self.load_errors: set[int] = set()
        self.idle_steps = 0
        self._index: dict[bytes, tuple[str, int]] | None = None
        self.host_syncs: list[str] = []  # CUDA: synchronizing calls made during the steps
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if slow in ("copies", "reshapes"):
            self._slow_copies(kvx_engine.QUEUES if slow == "copies" else ("load", "save"))

    def _slow_copies(self, queues) -> None:
        """CUDA: every copy job on ``queues`` starts with a slow kernel on its stream (a backlog of copies), so a
        copy that the compute stream does not wait for lands after the forward that should have waited; with the
        reshapes alone slow, a staging DMA not ordered after the reshape still reading its buffer lands first."""
        submit = self.engine.submit

        def slow_submit(fn, *, queue="load", after=(), name=""):
            if queue not in queues:
                return submit(fn, queue=queue, after=after, name=name)

            def slow(stream):
                with kvx_engine.on_stream(stream, self.device):
                    torch.cuda._sleep(SLEEP_CYCLES)
                fn(stream)

            return submit(slow, queue=queue, after=after, name=name)

        self.engine.submit = slow_submit

    def _plane_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.mla:  # [B, N, D] -> [B, N, 1, D]
            return [t.unsqueeze(2)]
        D = self.head_size  # [B, H, N, 2D] (K|V packed) -> K, V as [B, N, H, D]
        return [t[..., :D].permute(0, 2, 1, 3), t[..., D:].permute(0, 2, 1, 3)]

    def expected(self, r: Req, positions) -> torch.Tensor:
        """[L, P, n, H, D] on the host: what ``r``'s tokens at ``positions`` hold."""
        return torch.stack([self.kv[r.src[p]][:, :, p] for p in positions], dim=2)

    # -------------------------------------------------------------- forward
    def _prepare(self, step_no: int, run: Run) -> dict:
        """Device tensors of one run, made before the scenario starts (no host-device copy on the way)."""

        def idx(positions):
            blocks = torch.tensor([run.table[p // BLOCK] for p in positions], dtype=torch.int64)
            offs = torch.tensor([p % BLOCK for p in positions], dtype=torch.int64)
            return blocks.to(self.device), offs.to(self.device)

        wb, wo = idx(range(run.start, run.end))
        rb, ro = idx(range(run.end))
        src = self.expected(run.req, range(run.start, run.end)).to(self.device)
        out = torch.empty(
            (NUM_LAYERS, self.planes, run.end, self.heads, self.head_size), dtype=self.dtype, device=self.device
        )
        out.view(torch.int16).fill_(POISON)
        self.reads.append((f"step {step_no} ({STEPS[step_no].what}): {run.req.name}", run, out))
        return {"wb": wb, "wo": wo, "src": src, "rb": rb, "ro": ro, "out": out}

    def _forward_layer(self, layer: int, runs: list[dict]) -> None:
        if self.slow == "forward":
            torch.cuda._sleep(SLEEP_CYCLES)  # a slow kernel: a copy not ordered after it lands first
        views = self.views[layer]
        for r in runs:  # write this step's tokens (reshape_and_cache)
            for p, v in enumerate(views):
                v.index_put_((r["wb"], r["wo"]), r["src"][layer, p])
        for r in runs:  # read the request's tokens (attention)
            for p, v in enumerate(views):
                r["out"][layer, p].copy_(v[r["rb"], r["ro"]])

    # -------------------------------------------------------------- steps
    def _finish_step(self, finished) -> None:
        w = self.worker

        def results():
            w.get_finished(set(finished))
            self.load_errors |= w.get_block_ids_with_load_errors()
            self._collect(w.build_worker_meta())

        end_step(self.order, results=results, wait_for_save=w.wait_for_save, clear=w.clear)

    def _collect(self, out) -> None:
        tally = TALLY.fresh()
        tally.collect(out)
        self.stored.update(tally.stored)
        self.unstored.update(tally.unstored)
        self.loads_done.update(tally.loads_done)
        self.failed_blocks += sorted(tally.failed_blocks)

    def step(self, step_no: int, prepared: list[dict]) -> None:
        st = STEPS[step_no]
        w = self.worker
        meta = st.meta()
        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        for layer, name in enumerate(LAYER_NAMES):
            w.wait_for_layer_load(name)
            if self.deferred:
                self.engine.compute(
                    lambda layer=layer: self._forward_layer(layer, prepared),
                    name=f"step {step_no} forward layer {layer}",
                )
            else:
                self._forward_layer(layer, prepared)
            w.save_kv_layer(name, self.caches[layer], None)
        self._finish_step(st.finished)

    def idle_step(self, count: bool = True) -> None:
        """A step with nothing scheduled (vLLM keeps stepping while kvx has results to report)."""
        meta = KVXMetadata()
        self.worker.handle_preemptions(meta)
        self.worker.bind(meta)
        self.worker.start_load_kv()
        self._finish_step([])
        self.idle_steps += count

    def wait_stored(self, keys: list[str], timeout_s: float = 30.0) -> None:
        """The scheduler serves a chunk from a CPU slot only once every worker reported it stored."""

        def stored() -> bool:
            if all(self.stored[k] for k in keys):
                return True
            assert not (self.deferred and self.idle_steps > 8), (
                f"chunks {keys} never reported stored (stored: {dict(self.stored)})"
            )
            self.idle_step()
            return False

        wait_for(
            stored,
            timeout_s,
            lambda: f"chunks {keys} to be reported stored (stored: {dict(self.stored)})",
            interval=0 if self.deferred else 0.0002,
        )

    def _warm_up(self) -> None:
        """CUDA: load every kernel the scenario launches (lazy module loading may synchronize) on the null
        block 0, which the scenario never uses."""
        pinned = torch.empty(self.worker.layout.canonical_shape(BLOCK), dtype=self.dtype, pin_memory=True)
        for a, b, sub in self.worker.groups:
            ops.gather_blocks(sub, [0], pinned[a:b])
            ops.scatter_blocks(sub, [0], pinned[a:b])
            ops.scatter_slots(sub, [0, 1], pinned[a:b].narrow(2, 0, 2))
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        run = {"wb": zero, "wo": zero, "rb": zero, "ro": zero}
        run["src"] = torch.zeros(
            (NUM_LAYERS, self.planes, 1, self.heads, self.head_size), dtype=self.dtype, device=self.device
        )
        run["out"] = run["src"].clone()
        self._forward_layer(0, [run])
        torch.cuda.synchronize(self.device)

    def _not_yet(self, probe) -> bool:
        """Deferred queue, before a step: the copy or forward ``probe`` names has not run yet."""
        if probe[0] == "slot":
            slot, r, first = SLOTS[probe[1]]
            got, want = self.worker.cache.slot(slot), self.expected(r, range(first, first + CHUNK))
        else:
            _, r, table, end = probe
            got, want = self.gather(table, end), self.expected(r, range(end))
        return not same_bytes(got.reshape(want.shape), want)

    def run(self) -> None:
        prepared = [[self._prepare(i, run) for run in st.runs] for i, st in enumerate(STEPS)]
        if self.device.type == "cuda":
            self._warm_up()
            # the compute stream: markers and fences go on it; nothing may synchronize the host
            with torch.cuda.stream(self.stream), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    self._run(prepared)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            self.host_syncs = host_syncs(caught)
            self.engine.flush()
            torch.cuda.synchronize(self.device)
        else:
            self._run(prepared)
            self.engine.flush()
        self.idle_step(count=False)  # collect what finished since the last step

    def _run(self, prepared) -> None:
        for i, st in enumerate(STEPS):
            # A race's chunks are waited for before the step before it: an idle step between the two would run
            # the work the race races (the deferred queue runs a step's forward at the next step's end). In vLLM
            # "results-first" order a save is reported a step later (its copies are queued after the results).
            race = STEPS[i + 1] if i + 1 < len(STEPS) and STEPS[i + 1].not_yet else None
            self.wait_stored(st.needs_stored + (race.needs_stored if race is not None else []))
            if self.deferred:
                for what, probe in st.not_yet:
                    assert self._not_yet(probe), (
                        f"step {i} ({st.what}): {what} already ran before the step; the race is not live, "
                        "so this test could not catch a missing fence"
                    )
            self.step(i, prepared[i])

    # -------------------------------------------------------------- checks
    def gather(self, table, end: int) -> torch.Tensor:
        """[L, P, end, H, D] on the host: tokens [0, end) of a block table, read from the cache."""
        blocks = torch.tensor([table[p // BLOCK] for p in range(end)], device=self.device)
        offs = torch.tensor([p % BLOCK for p in range(end)], device=self.device)
        return torch.stack([torch.stack([v[blocks, offs] for v in views]) for views in self.views]).cpu()

    def problems(self) -> list[str]:
        """Every place that does not hold the exact KV it must, described by whose KV it holds instead."""
        out = []
        for key, (slot, r, first) in SLOTS.items():
            got = self.worker.cache.slot(slot)
            out += self._diff(f"CPU slot {slot} (chunk {key} of {r.name})", got, r, range(first, first + CHUNK))
        for what, run, got in self.reads:
            out += self._diff(f"what the forward read at {what}", got.cpu(), run.req, range(run.end))
        for r, table, end in FINAL_TABLES:
            out += self._diff(
                f"the cache blocks {list(table)} of {r.name} at the end", self.gather(table, end), r, range(end)
            )
        return out

    def _diff(self, what: str, got: torch.Tensor, r: Req, positions) -> list[str]:
        want = self.expected(r, positions)
        g, w = got.reshape(want.shape).view(torch.int16), want.view(torch.int16)
        bad = (g != w).movedim(2, 0).reshape(len(positions), -1).any(dim=1)
        if not bad.any():
            return []
        index = self._token_index()
        runs = []  # [first, last, source, its first and last position]
        for i in (i for i in range(len(positions)) if bad[i]):
            who, p = index.get(g[:, :, i].contiguous().numpy().tobytes(), ("?", -1))
            if runs and runs[-1][1] == i - 1 and runs[-1][2] == who and (who == "?" or runs[-1][4] == p - 1):
                runs[-1][1], runs[-1][4] = i, p
            else:
                runs.append([i, i, who, p, p])
        pos = list(positions)
        parts = []
        for a, b, who, p0, p1 in runs:
            src = "bytes of no request (stale or never written)" if who == "?" else f"{who}'s tokens {p0}-{p1}"
            parts.append(f"tokens {pos[a]}-{pos[b]} hold {src}")
        return [f"{what}: {int(bad.sum())} of {len(pos)} tokens wrong: " + "; ".join(parts)]

    def _token_index(self) -> dict[bytes, tuple[str, int]]:
        """token bytes -> (source, position), to say whose KV a wrong token holds."""
        if self._index is None:
            self._index = {}
            for who in SOURCES:
                t = self.kv[who].view(torch.int16)
                for p in range(MAX_TOKENS):
                    self._index.setdefault(t[:, :, p].contiguous().numpy().tobytes(), (who, p))
        return self._index

    def close(self) -> None:
        self.worker.close()


# what torch's sync debug mode says when a synchronizing call is made ("called a synchronizing CUDA operation");
# its first use in a process also warns that the mode is a prototype, which names no call
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(caught) -> list[str]:
    """The warnings of ``torch.cuda.set_sync_debug_mode("warn")`` that name a synchronizing call."""
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if SYNC_WARNING in str(w.message)]


def test_host_syncs_count_only_synchronizing_calls():
    """The debug mode's own notice (the first set_sync_debug_mode("warn") of a process) is no host sync."""

    def caught(*messages):
        return [warnings.WarningMessage(UserWarning(m), UserWarning, "x.py", i) for i, m in enumerate(messages)]

    prototype = (
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
        "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)"
    )
    assert host_syncs(caught(prototype)) == []
    assert host_syncs(caught(prototype, "called a synchronizing CUDA operation (Triggered internally at x)")) == [
        "x.py:1: called a synchronizing CUDA operation (Triggered internally at x)"
    ]


def run_scenario(
    device: str,
    layout: str,
    dtype: torch.dtype,
    slow: str | None = None,
    order: str = "save-first",
    staging_bytes: int | None = None,
) -> Pipeline:
    """Run every step; raise AssertionError listing every wrong byte range (bit-exact checks)."""
    pipe = Pipeline(device, layout, dtype, slow, order, staging_bytes)
    try:
        if device == "cpu":
            assert pipe.deferred, f"expected the deferred copy queue on CPU, got {pipe.engine.mode!r}"
        pipe.run()
        problems = pipe.problems()
        assert not problems, "KV is not bit-exact:\n  " + "\n  ".join(problems)
        assert pipe.stored == Counter(dict.fromkeys(SLOTS, 1)), f"stored reports: {dict(pipe.stored)}"
        assert not pipe.unstored and not pipe.failed_blocks and not pipe.load_errors, (
            pipe.unstored,
            pipe.failed_blocks,
            pipe.load_errors,
        )
        assert pipe.loads_done == Counter({"D": 1, "F": 1, "E": 1}), f"loads reported done: {dict(pipe.loads_done)}"
        assert not pipe.host_syncs, "the steps synchronized the host:\n  " + "\n  ".join(pipe.host_syncs)
        return pipe
    finally:
        pipe.close()


@pytest.fixture
def copy_queue(monkeypatch):
    """The CPU cases run the deferred queue whatever the caller's environment says (CUDA ignores it)."""
    monkeypatch.setenv(kvx_engine.ENV, "deferred")


def cuda(slow: str):
    return pytest.param("cuda", slow, marks=[pytest.mark.gpu, needs_cuda], id=f"cuda-slow_{slow}")


# cpu: the deferred queue's schedule (loads early, saves late, forwards lazy). cuda, two timings: a slow
# forward (a copy not ordered after a forward lands before it), slow copies (a copy the forward does not
# wait for lands after it).
SCHEDULES = [pytest.param("cpu", None, id="cpu-deferred"), cuda("forward"), cuda("copies")]


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("order", RUNNER_ORDERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device, slow", SCHEDULES)
def test_worker_pipeline_is_bit_exact(device, slow, layout, dtype, order, copy_queue):
    run_scenario(device, layout, dtype, slow, order)


# four staging buffers of one block of one layer each: every block of every layer is a leg of its own, so a
# layer's copies are split and the two buffers of each direction are reused within a layer
ONE_BLOCK_STAGING = 4 * 2 * BLOCK * HEADS * HEAD_SIZE * 2


@pytest.mark.parametrize("order", RUNNER_ORDERS)
@pytest.mark.parametrize("device, slow", SCHEDULES)
def test_worker_pipeline_splits_a_step_larger_than_the_staging_budget(device, slow, order, copy_queue):
    pipe = run_scenario(device, "LBNHC", torch.bfloat16, slow, order, staging_bytes=ONE_BLOCK_STAGING)
    assert pipe.engine.ring("load").capacity == ONE_BLOCK_STAGING // 4 == pipe.worker.layout.page_bytes


def test_staging_budget_below_one_block_is_refused(copy_queue):
    with pytest.raises(ConfigError, match=r"staging_bytes: expected at least 32768 bytes \(four staging buffers"):
        Pipeline("cpu", "LBNHC", torch.bfloat16, staging_bytes=ONE_BLOCK_STAGING - 4096)


# ------------------------------------------------------------------ the checks can fail
def _load_without_edges(self, blocks, marker=None):
    """BlockOrder.load_edges without rule 1: no marker (the compute stream's earlier use of the blocks) and no
    edge to the queued saves reading them."""
    return []


def _save_without_marker(self, blocks, marker=None, loads=True):
    """BlockOrder.save_edges without rule 2's marker: not ordered after the forward that writes the blocks."""
    return self._live(self._writers, blocks) if loads else []


def _no_fence_before_forward(self, blocks):
    return []


_ring_init = kvx_engine.StagingRing.__init__


def _reuse_staging_at_once(self, *args, **kwargs):
    """A staging ring without rule 5: the compiled ring hands a buffer out without the job still using it."""
    _ring_init(self, *args, **kwargs)
    self.c.rule5 = False


def _no_layer_fence(self, layer_name):
    return None


# rule -> (what to patch, the replacement, the CUDA timing that exposes it)
BROKEN_RULES = {
    "rule1_load_after_last_use": ((kvx_engine.BlockOrder, "load_edges"), _load_without_edges, "forward"),
    "rule2_save_after_forward": ((kvx_engine.BlockOrder, "save_edges"), _save_without_marker, "forward"),
    "rule3_fence_before_forward": ((kvx_engine.BlockOrder, "before_forward"), _no_fence_before_forward, "copies"),
    "rule4_fence_before_layer_reads": ((KVXWorker, "wait_for_layer_load"), _no_layer_fence, "copies"),
    "rule5_staging_reuse": ((kvx_engine.StagingRing, "__init__"), _reuse_staging_at_once, "reshapes"),
}

# what the deferred queue reports, exactly (it is deterministic)
STEP4 = "what the forward read at step 4 (race 2: D loads into C's freed blocks, F into preempted E's)"
CPU_FAILURES = {
    "rule1_load_after_last_use": [
        f"{STEP4}: D: 64 of 72 tokens wrong: tokens 0-31 hold C's tokens 32-63; tokens 32-63 hold C's tokens 0-31",
        f"{STEP4}: F: 31 of 32 tokens wrong: tokens 0-15 hold E's tokens 16-31; tokens 16-30 hold E's tokens 0-14",
    ],
    "rule3_fence_before_forward": [
        "CPU slot 1 (chunk a1 of A): 32 of 32 tokens wrong: tokens 32-63 hold B's tokens 0-31",
        f"{STEP4}: D: 32 of 72 tokens wrong: tokens 32-63 hold B's tokens 0-31",
    ],
    "rule4_fence_before_layer_reads": [
        f"{STEP4}: D: 64 of 72 tokens wrong: tokens 0-31 hold C's tokens 32-63; tokens 32-63 hold C's tokens 0-31",
        f"{STEP4}: F: 31 of 32 tokens wrong: tokens 0-15 hold E's tokens 16-31; tokens 16-30 hold E's tokens 0-14",
    ],
    # four layers through a ring of two buffers per direction: layer 2's copy overwrites layer 0's bytes in the
    # staging buffer before they left it (a layer's bytes in another layer's place match no request's token)
    "rule5_staging_reuse": [
        "CPU slot 0 (chunk a0 of A): 32 of 32 tokens wrong: tokens 0-31 hold bytes of no request (stale or never "
        "written)",
        f"{STEP4}: D: 64 of 72 tokens wrong: tokens 0-63 hold bytes of no request (stale or never written)",
    ],
}
# on a GPU the timing decides how much is wrong; these places are wrong whatever it is
CUDA_FAILURES = {
    "rule1_load_after_last_use": [f"{STEP4}: D:"],
    "rule2_save_after_forward": ["CPU slot 0 (chunk a0 of A)"],
    "rule3_fence_before_forward": ["CPU slot 1 (chunk a1 of A)"],
    # which of the two loads racing at step 4 the forward catches first depends on the device's timing
    "rule4_fence_before_layer_reads": [(f"{STEP4}: D:", f"{STEP4}: F:")],
    "rule5_staging_reuse": [f"{STEP4}: D:"],  # the loads' DMAs run ahead of the slow reshapes
}

BROKEN_CASES = [
    pytest.param("cpu", "rule1_load_after_last_use", id="cpu-rule1"),
    pytest.param("cpu", "rule3_fence_before_forward", id="cpu-rule3"),
    # Rule 2 (a save that runs before the forward wrote) cannot show on a queue that runs saves as late as
    # allowed: only the CUDA slow-forward timing shows it.
    pytest.param("cpu", "rule4_fence_before_layer_reads", id="cpu-rule4"),
    pytest.param("cpu", "rule5_staging_reuse", id="cpu-rule5"),
    *[
        pytest.param("cuda", rule, marks=[pytest.mark.gpu, needs_cuda], id=f"cuda-{rule.split('_')[0]}")
        for rule in BROKEN_RULES
    ],
]


@pytest.mark.parametrize("order", RUNNER_ORDERS)
@pytest.mark.parametrize("device, rule", BROKEN_CASES)
def test_scenario_detects_a_broken_rule(device, rule, order, monkeypatch, copy_queue):
    """With one rule of kvx.engine.BlockOrder switched off, the scenario fails its bit-exact checks, at the
    place the missing edge lets a copy race a forward (rule 5: a staging buffer's bytes overwritten first)."""
    (owner, attr), replacement, slow = BROKEN_RULES[rule]
    monkeypatch.setattr(owner, attr, replacement)
    with pytest.raises(AssertionError, match="KV is not bit-exact") as e:
        run_scenario(device, "LBNHC", torch.bfloat16, slow if device == "cuda" else None, order)
    msg = str(e.value)
    for line in (CPU_FAILURES if device == "cpu" else CUDA_FAILURES).get(rule, []):
        either = line if isinstance(line, tuple) else (line,)
        assert any(one in msg for one in either), f"expected one of {either!r} among the failures:\n{msg}"
