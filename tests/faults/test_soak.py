"""Soak: a few hundred requests on one engine whose tiers evict all the time, while chunks' part files are
damaged and chunk files (records and parts) deleted under it. Zero wrong tokens, zero leaked files, zero pinned
slots."""

from __future__ import annotations

import os
import random

import pytest

from tests.helpers import dir_bytes, store_objects

from .conftest import (
    CHUNK_BYTES,
    KV_HEADS,
    assert_store_sound,
    connector_sides,
    engine,
    shared_prefix_prompts,
    store_files,
    tiers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUESTS = int(os.environ.get("KVX_SOAK_REQUESTS", "300"))
MAX_TOKENS = 4


def pool() -> list[list[int]]:
    """12 prompts over 4 shared prefixes of 1-3 chunks, with tails of 1-3 chunks and odd lengths."""
    return shared_prefix_prompts(7, prefix_seed=200, tail_seed=300, tails=3, tail_chunks=(1, 4))


def test_soak_under_eviction_and_damaged_files(model, reference, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = pool()
    refs = reference(*prompts)
    store = tmp_path / "store"
    rng = random.Random(11)
    sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=MAX_TOKENS)
    chunk_bytes = None  # a chunk stored whole on disk: its record and a part per KV head
    wrong, served, deleted, damages = [], 0, 0, 0
    damaged: dict[str, int] = {}  # path -> its inode when the test damaged it
    # CPU tier: 3 chunks; disk: 10 chunks, of the ~40 the pool needs: both tiers evict all the time
    with engine(model, tiers(store, cpu=str(3 * CHUNK_BYTES))) as llm:
        sched, worker = connector_sides(llm)
        while served < REQUESTS:
            recs, prts = store_objects(store)
            if recs and prts and chunk_bytes is None:
                chunk_bytes = os.path.getsize(recs[0]) + KV_HEADS * os.path.getsize(prts[0])
                worker.tiers["disk"].capacity_bytes = sched.tiers["disk"].capacity_bytes = 10 * chunk_bytes
            files = recs + prts
            if prts and rng.random() < 0.25:  # damage a stored chunk: a flipped byte of a part ...
                f = rng.choice(prts)
                try:
                    with open(f, "r+b") as fh:
                        fh.seek(-rng.randrange(1, 4096), os.SEEK_END)
                        b = fh.read(1)
                        fh.seek(-1, os.SEEK_CUR)
                        fh.write(bytes([b[0] ^ 0x5A]))
                    damaged[f] = os.stat(f).st_ino
                    damages += 1
                except (FileNotFoundError, ValueError):
                    pass
            if files and rng.random() < 0.1:  # ... or a file (record or part) another engine evicted
                try:
                    os.unlink(rng.choice(files))
                    deleted += 1
                except FileNotFoundError:
                    pass
            if rng.random() < 0.7:
                llm.reset_prefix_cache()  # vLLM forgets: the tokens come from kvx or compute
            batch = rng.sample(range(len(prompts)), rng.choice((1, 1, 2, 3)))
            outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in batch], sp, use_tqdm=False)
            for i, out in zip(batch, outs):
                served += 1
                if list(out.outputs[0].token_ids) != refs[i][:MAX_TOKENS]:
                    wrong.append((served, i, out.num_cached_tokens))
        totals = dict(worker.totals)
        totals.update({k: totals.get(k, 0) + v for k, v in worker.stats.items()})
    print(
        f"soak: {served} requests, {len(wrong)} wrong; {damages} damaged files, {deleted} deleted; "
        f"{totals.get('load_errors', 0)} failed chunk loads, {totals.get('loaded_chunks', 0)} chunks loaded, "
        f"{totals.get('saves_dropped', 0)} saves dropped; evictions: CPU {sched.cpu.stats['evicted']}, "
        f"disk {worker.tiers['disk'].stats()['evicted']}"
    )
    assert not wrong, f"{len(wrong)} of {served} requests got wrong tokens: {wrong[:10]}"
    # the soak did what it claims: hits from both tiers, failed loads, evictions
    assert totals.get("load_errors", 0) > 0 and damages > 10 and deleted > 0
    # Damage no request read since is the test's, not kvx's: a file still there under the inode the test damaged
    # (a read that failed its check removed it; a save writes a new file). Not its mtime: a save of a chunk already
    # present only touches the file (LRU), without reading it. A good file that reuses the inode goes too: harmless.
    for f, ino in damaged.items():
        try:
            if os.stat(f).st_ino == ino:
                os.unlink(f)
        except FileNotFoundError:
            continue
    assert totals.get("loaded_chunks", 0) > 50
    assert sched.cpu.stats["evicted"] > 0
    assert worker.tiers["disk"].stats()["evicted"] > 0
    assert_store_sound(store)  # no stray or temporary files, every record and part verifies
    assert dir_bytes(store) <= 10 * chunk_bytes  # within the disk tier's capacity
    assert all(f.endswith(".safetensors") for f in store_files(store))
