"""Faults in one engine's store: damaged, vanished, full, read-only or deleted stores, aborts. Each case:
greedy tokens equal to an engine without kvx, no crash, stored chunks verify, nothing leaked."""

from __future__ import annotations

import os
import shutil

import pytest

from kvx.testing import harness as H
from tests.helpers import flip_byte, stored_chunk_keys

from .conftest import (
    CHUNK,
    CHUNK_BYTES,
    KV_HEADS,
    MAX_TOKENS,
    assert_store_sound,
    connector_sides,
    engine,
    full_hit,
    parts,
    records,
    settle,
    tiers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# A stores 3 chunks; B shares them and adds 8 chunks and a tail: 3 + 8 chunks + 17 = 2833 tokens, the
# shape of the report (a long prompt whose prefix is damaged, the rest computed in the same step).
A = H.prompt_ids(3 * CHUNK + 40, seed=101)
B = A[: 3 * CHUNK] + H.prompt_ids(8 * CHUNK + 17, seed=102)


def damage(files, how):
    """Damage ``files``: one part of each chunk (the same KV head's), in chain order."""
    if how == "flip":  # one byte of each part's data
        for f in files:
            flip_byte(f)
    elif how == "truncate":
        for f in files:
            os.truncate(f, os.path.getsize(f) // 2)
    elif how == "swap":  # each file holds another chunk's (valid) part of the same head
        data = [open(f, "rb").read() for f in files]
        for f, d in zip(files, data[1:] + data[:1]):
            with open(f, "wb") as fh:
                fh.write(d)
    elif how == "missing":  # the chain breaks in the middle: a chunk whose record is there lacks a part
        os.unlink(files[len(files) // 2])


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "missing"])
def test_damaged_prefix_never_poisons_the_chunks_computed_with_it(model, reference, tmp_path, how):
    store = tmp_path / "store"
    ref_a, ref_b = reference(A, B)
    with engine(model, tiers(store, cpu=None)) as llm:
        H.generate(llm, A, MAX_TOKENS)
        disk = connector_sides(llm)[1].tiers["disk"]
        chunks = [(disk.file_of(k), [disk.file_of(p) for p in ps]) for k, ps in stored_chunk_keys(llm, A, CHUNK)]
    assert records(store) == sorted(r for r, _ in chunks)
    assert parts(store) == sorted(p for _, ps in chunks for p in ps) and len(parts(store)) == 3 * KV_HEADS
    damage([ps[-1] for _, ps in chunks], how)
    with engine(model, tiers(store)) as llm:
        r = H.generate(llm, B, MAX_TOKENS)  # claims A's chunks (their records), fails to load them, computes the rest
        assert r.tokens == ref_b
        sched, worker = connector_sides(llm)
        assert worker.totals["load_errors"] + worker.stats["load_errors"] >= 1
        llm.reset_prefix_cache()  # vLLM forgets; the CPU tier has the recomputed chunks
        again = H.generate(llm, B, MAX_TOKENS)
        assert again.num_cached_tokens == full_hit(len(B))
        assert again.tokens == ref_b
    assert_store_sound(store, min_chunks=len(B) // CHUNK)
    with engine(model, tiers(store, cpu=None)) as llm:  # a fresh engine: everything from disk
        assert H.generate(llm, A, MAX_TOKENS).tokens == ref_a  # (would restore A's chunks if lost)
        settle(llm)
        llm.reset_prefix_cache()
        fresh = H.generate(llm, B, MAX_TOKENS)
        assert fresh.num_cached_tokens == full_hit(len(B))
        assert fresh.tokens == ref_b


def test_a_chunk_evicted_between_lookup_and_read(model, reference, tmp_path, monkeypatch):
    """Another engine evicts a part of a chunk after this engine's lookup found the chunk's record: the load
    fails, vLLM recomputes (and stores the chunk again)."""
    from kvx.store import disk as disk_mod

    store = tmp_path / "store"
    ref_b = reference(B)
    with engine(model, tiers(store, cpu=None)) as llm:
        H.generate(llm, A, MAX_TOKENS)
        part_keys = {p for _, ps in stored_chunk_keys(llm, A, CHUNK) for p in ps}
    get, gone = disk_mod.DiskTier.get_into, []

    def get_after_eviction(self, key, *a, **k):
        if not gone and key in part_keys:
            path = self.file_of(key)
            os.unlink(path)
            gone.append(path)
        return get(self, key, *a, **k)

    monkeypatch.setattr(disk_mod.DiskTier, "get_into", get_after_eviction)
    with engine(model, tiers(store, cpu=None)) as llm:
        assert H.generate(llm, B, MAX_TOKENS).tokens == ref_b
        monkeypatch.setattr(disk_mod.DiskTier, "get_into", get)
        settle(llm)  # the disk writes are asynchronous
        llm.reset_prefix_cache()
        again = H.generate(llm, B, MAX_TOKENS)
        assert again.num_cached_tokens == full_hit(len(B)) and again.tokens == ref_b
    assert gone and os.path.exists(gone[0])  # the recomputed chunk's part was stored again
    assert_store_sound(store, min_chunks=len(B) // CHUNK)


def test_store_on_a_full_file_system(model, reference, tmp_path, tmpfs):
    """A 2 MiB file system holds a few of the 16 chunks served: saves hit ENOSPC, kvx evicts and retries,
    then backs off; serving goes on with right tokens, and what fits is served from disk."""
    store = tmpfs("2m") / "store"
    prompts = [H.prompt_ids(4 * CHUNK + 9, seed=110 + i) for i in range(4)]
    refs = reference(*prompts)
    with engine(model, tiers(store, cpu=None)) as llm:
        for _ in range(2):
            for p, ref in zip(prompts, refs):
                llm.reset_prefix_cache()
                assert H.generate(llm, p, MAX_TOKENS).tokens == ref
        _, worker = connector_sides(llm)
        stats = worker.tiers["disk"].stats()
        assert stats["evicted"] > 0  # ENOSPC relieved by evicting, not just failing
    assert 0 < len(records(store)) < 4 * 4  # some of the 16 chunks, not all: the disk filled up
    assert_store_sound(store)
    with engine(model, tiers(store, cpu=None)) as llm:
        for p, ref in zip(prompts, refs):
            llm.reset_prefix_cache()
            assert H.generate(llm, p, MAX_TOKENS).tokens == ref


def test_store_turning_read_only_while_serving(model, reference, tmp_path, tmpfs):
    from tests.helpers import remount

    mnt = tmpfs("16m")
    store = mnt / "store"
    old, new = H.prompt_ids(3 * CHUNK + 5, seed=120), H.prompt_ids(3 * CHUNK + 5, seed=121)
    ref_old, ref_new = reference(old, new)
    with engine(model, tiers(store, cpu=None)) as llm:
        assert H.generate(llm, old, MAX_TOKENS).tokens == ref_old
        settle(llm)
        remount(mnt, "ro")
        try:
            llm.reset_prefix_cache()
            hit = H.generate(llm, old, MAX_TOKENS)  # loads still work
            assert hit.num_cached_tokens == full_hit(len(old)) and hit.tokens == ref_old
            assert H.generate(llm, new, MAX_TOKENS).tokens == ref_new  # saves fail (EROFS), serving goes on
            _, worker = connector_sides(llm)
            worker.saves.poll(block=True)
            assert worker.totals["disk_write_errors"] + worker.stats["disk_write_errors"] >= 1
        finally:
            remount(mnt, "rw")
    assert len(records(store)) == 3 and len(parts(store)) == 3 * KV_HEADS  # the old prompt's chunks only
    assert_store_sound(store)


def test_store_directory_deleted_while_serving(model, reference, tmp_path):
    store = tmp_path / "store"
    a2 = H.prompt_ids(2 * CHUNK + 30, seed=130)
    ref_a, ref_a2 = reference(A, a2)
    with engine(model, tiers(store, cpu=None)) as llm:
        assert H.generate(llm, A, MAX_TOKENS).tokens == ref_a
        settle(llm)
        shutil.rmtree(store)
        llm.reset_prefix_cache()
        assert H.generate(llm, A, MAX_TOKENS).tokens == ref_a  # a miss now; saved again
        assert H.generate(llm, a2, MAX_TOKENS).tokens == ref_a2
        settle(llm)
        llm.reset_prefix_cache()
        hit = H.generate(llm, A, MAX_TOKENS)
        assert hit.num_cached_tokens == full_hit(len(A)) and hit.tokens == ref_a
    assert_store_sound(store, min_chunks=3 + 2)


def test_abort_mid_prefill(model, reference, tmp_path):
    """Requests aborted between prefill chunks (and one before its first step) leave no pins, no
    half-written chunks; the engine goes on serving right tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    store = tmp_path / "store"
    long_ = H.prompt_ids(8 * CHUNK + 3, seed=140)
    ref_long, ref_a = reference(long_, A)
    sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=MAX_TOKENS)
    with engine(model, tiers(store, cpu=str(4 * CHUNK_BYTES)), max_num_batched_tokens=CHUNK) as llm:
        eng = llm.llm_engine
        for i in range(3):
            eng.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=long_), sp)
            for _ in range(2 + i):  # a few prefill chunks in, then abort
                eng.step()
            eng.abort_request([f"abort-{i}"])
        eng.add_request("never-ran", TokensPrompt(prompt_token_ids=A), sp)
        eng.abort_request(["never-ran"])
        while eng.has_unfinished_requests():
            eng.step()
        assert H.generate(llm, long_, MAX_TOKENS).tokens == ref_long
        settle(llm)
        llm.reset_prefix_cache()
        hit = H.generate(llm, long_, MAX_TOKENS)
        assert hit.tokens == ref_long and hit.num_cached_tokens > 0
        assert H.generate(llm, A, MAX_TOKENS).tokens == ref_a
    assert_store_sound(store, min_chunks=8)
