"""Chunk portability across pipeline-parallel splits (see ``test_chunk_portability.py`` for the scenario): chunks
written by the stages of one PP split (all 4 layers; 2 + 2; 1 + 3, an uneven ``VLLM_PP_LAYER_PARTITION``), each stage
storing its layers' parts and the record listing every stage's layer range (:mod:`kvx.connector.parts`), load
bit-exact into the stages of another split, with another block size and page layout too."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.worker.portability_helpers import (
    CASES,
    HEAD_SIZE,
    HEADS,
    NUM_LAYERS,
    PROMPT,
    QUEUES,
    Engine,
    check_loaded,
    commit,
    load_prompt,
    save_prompt,
)

pytestmark = pytest.mark.usefixtures("runner_order")  # every test in each runner order (conftest.py)


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
