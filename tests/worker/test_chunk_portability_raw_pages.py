"""Chunk portability with raw pages (the CPU backend's format, ``format: pages``; see ``test_chunk_portability.py``
for the scenario): a worker holding several KV heads writes and reads each head's part in place, without a copy; raw
pages name the block size, so they never cross block sizes (a miss, and a forced load refused and reported), while
an engine of the writer's own kind loads them bit-exact."""

from __future__ import annotations

import pytest
import torch

from kvx.connector import parts as parts_module
from kvx.connector.metadata import ChunkLoad, KVXMetadata, LoadSpec
from kvx.store import DiskTier
from tests.worker.portability_helpers import (
    CHUNK,
    DISK,
    HEAD_SIZE,
    HEADS,
    QUEUES,
    TALLY,
    Engine,
    Side,
    assert_same,
    prompt_kv,
    save_prompt,
    shuffled_table,
)

pytestmark = pytest.mark.usefixtures("runner_order")  # every test in each runner order (conftest.py)


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
