"""Chunks stored as parts (:mod:`kvx.connector.parts`) on real tiers (disk and Redis): written by workers of one
TP / PP split and read, bit-exact, by workers of another; every rank reads exactly its heads; a chunk is served
only whole; bytes stored do not depend on the split."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kvx.connector.parts import MAX_STAGES, PartIO, Record, Share, record_of
from kvx.keys import part_key
from kvx.store import ChunkError, DiskTier
from tests.helpers import same_bytes

L, P, T, H, D = 6, 2, 32, 4, 16  # a chunk of 6 layers, K and V, 32 tokens, 4 KV heads of 16
KEY = "0123456789abcdef0123456789abcdef"


def full_chunk(seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """The model's whole chunk ``[L, P, T, H, D]`` (canonical), random."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((L, P, T, H, D), generator=g).to(dtype)


def stage_ranges(pp: int) -> list[tuple[int, int]]:
    """vLLM's even split of ``L`` layers in ``pp`` stages (the first ones take the remainder last, as vLLM)."""
    per, rest = divmod(L, pp)
    sizes = [per] * pp
    for i in range(2, rest + 2):
        sizes[-i] += 1
    bounds = list(itertools.accumulate([0] + sizes))
    return list(zip(bounds, bounds[1:]))


def shares(tp: int, pp: int) -> list[Share]:
    """Every worker's share of an engine of ``tp`` x ``pp`` (as :func:`kvx.connector.common.worker_share`)."""
    out = []
    for layers in stage_ranges(pp):
        for rank in range(tp):
            if tp > H:
                per = tp // H
                out.append(Share((rank // per, rank // per + 1), H, layers, writer=rank % per == 0))
            else:
                n = H // tp
                out.append(Share((rank * n, (rank + 1) * n), H, layers))
    return out


def worker_view(chunk: torch.Tensor, sh: Share) -> torch.Tensor:
    """What a worker's buffer holds of the model's chunk: its layers and heads (contiguous, as a slot)."""
    (a, b), (h0, h1) = sh.layers, sh.heads
    return chunk[a:b, :, :, h0:h1].contiguous()


def store(tier, chunk: torch.Tensor, tp: int, pp: int, key: str = KEY) -> int:
    """Every worker of ``tp`` x ``pp`` writes its parts, then the record is written (as the scheduler does once
    every worker reported); returns the parts written."""
    written = 0
    for sh in shares(tp, pp):
        wrote, keys = PartIO(sh, "canonical").write(tier, key, worker_view(chunk, sh), {})
        written += len(keys)
    tier.put(key, record_of([sh.layers for sh in shares(tp, pp)], H).encode())
    return written


def read_all(tier, chunk: torch.Tensor, tp: int, pp: int, key: str = KEY) -> None:
    for sh in shares(tp, pp):
        out = torch.empty_like(worker_view(chunk, sh))
        PartIO(sh, "canonical").read(tier, key, out)
        assert same_bytes(out, worker_view(chunk, sh)), f"tp={tp} pp={pp} heads {sh.heads} layers {sh.layers}"


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier.at(tmp_path / "store", None, "tests-parts")
    yield tier
    tier.close()


SPLITS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 3), (4, 2)]


@pytest.mark.parametrize("writer", SPLITS, ids=[f"w-tp{t}pp{p}" for t, p in SPLITS])
@pytest.mark.parametrize("reader", SPLITS, ids=[f"r-tp{t}pp{p}" for t, p in SPLITS])
def test_any_split_reads_what_any_split_wrote_bit_exact(disk, writer, reader):
    chunk = full_chunk(seed=sum(writer) * 10 + sum(reader))
    store(disk, chunk, *writer)
    read_all(disk, chunk, *reader)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_bytes_stored_do_not_depend_on_the_tp_size_and_replicas_write_nothing(tmp_path, tp):
    """One part per KV head per stage, whatever the TP size: TP=8 over 4 heads writes each head once."""
    tier = DiskTier.at(tmp_path / f"tp{tp}", None, "tests-parts")
    chunk = full_chunk()
    assert store(tier, chunk, tp, 1) == H
    sizes = {c.key: os.path.getsize(c.path) for c in tier.scan()}
    parts = {part_key(KEY, f"h{h}/l0-{L}") for h in range(H)}
    assert set(sizes) == parts | {KEY}
    assert sum(sizes[k] for k in parts) - chunk.nbytes < 4 * 1024  # the bytes once, and a header per part
    tier.close()


def test_a_rank_reads_only_its_heads_parts(disk):
    chunk = full_chunk()
    store(disk, chunk, 1, 1)
    asked = []
    get = disk.get_into

    def spy(key, out):
        asked.append(key)
        return get(key, out)

    disk.get_into = spy
    sh = shares(2, 1)[1]  # heads 2, 3
    out = torch.empty_like(worker_view(chunk, sh))
    PartIO(sh, "canonical").read(disk, KEY, out)
    assert asked == [KEY] + [part_key(KEY, f"h{h}/l0-{L}") for h in (2, 3)]


def test_head_major_raw_pages_split_by_head(disk):
    """Raw pages whose heads are outermost in a page (vLLM's CPU backend, LBHNC): a head's bytes are one run."""
    n, page = 4, H * 2 * 8 * 16  # 4 blocks; a page holds H heads of [2 * 8 tokens, 16] bytes
    g = torch.Generator().manual_seed(5)
    pages = torch.randint(0, 256, (L, 1, n, page), generator=g, dtype=torch.uint8)
    for rank in range(2):
        sh = Share((2 * rank, 2 * rank + 2), H, (0, L))
        mine = pages.unflatten(-1, (H, -1))[..., 2 * rank : 2 * rank + 2, :].flatten(-2).contiguous()
        PartIO(sh, "pages").write(disk, KEY, mine, {})
    disk.put(KEY, record_of([(0, L)], H).encode())
    out = torch.empty_like(pages)
    PartIO(Share((0, H), H, (0, L)), "pages").read(disk, KEY, out)
    assert same_bytes(out, pages)


def test_a_chunk_missing_a_part_fails_and_loses_its_record(disk):
    """Item 3: a reader that finds part of a chunk fails its load (vLLM recomputes), and the chunk is a miss from
    then on (its record removed), until stored whole again."""
    chunk = full_chunk()
    store(disk, chunk, 2, 1)
    disk.delete(part_key(KEY, f"h3/l0-{L}"))
    sh = shares(1, 1)[0]
    with pytest.raises(ChunkError, match="not on disk"):
        PartIO(sh, "canonical").read(disk, KEY, torch.empty_like(worker_view(chunk, sh)))
    assert disk.contains_many([KEY]) == [False]
    store(disk, chunk, 2, 1)
    read_all(disk, chunk, 1, 1)


def test_a_damaged_part_fails_and_loses_its_record(disk):
    chunk = full_chunk()
    store(disk, chunk, 1, 1)
    path = disk.file_of(part_key(KEY, f"h1/l0-{L}"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    sh = shares(2, 1)[0]  # heads 0, 1
    with pytest.raises(ChunkError, match="checksum"):
        PartIO(sh, "canonical").read(disk, KEY, torch.empty_like(worker_view(chunk, sh)))
    assert disk.contains_many([KEY]) == [False]


def test_no_record_is_a_miss_even_with_every_part(disk):
    chunk = full_chunk()
    for sh in shares(2, 1):
        PartIO(sh, "canonical").write(disk, KEY, worker_view(chunk, sh), {})
    sh = shares(1, 1)[0]
    with pytest.raises(ChunkError, match="not on disk"):
        PartIO(sh, "canonical").read(disk, KEY, torch.empty_like(worker_view(chunk, sh)))


def test_a_worker_with_non_contiguous_layers_reads_only_its_own_ranges(disk):
    chunk = full_chunk()
    store(disk, chunk, 1, 2)  # ranges (0, 3), (3, 6)
    odd = Share((0, H), H, (0, 6), contiguous=False)
    with pytest.raises(ChunkError, match="not the contiguous range"):
        PartIO(odd, "canonical").read(disk, KEY, torch.empty_like(chunk))


def test_a_record_of_another_head_count_is_refused(disk):
    chunk = full_chunk()
    store(disk, chunk, 1, 1)
    sh = Share((0, 2), 2, (0, L))
    with pytest.raises(ChunkError, match="parts of 4 KV heads, this model has 2"):
        PartIO(sh, "canonical").read(disk, KEY, torch.empty((L, P, T, 2, D), dtype=chunk.dtype))


def test_mla_is_one_part_written_by_rank_zero():
    sh = [Share((0, 1), 1, (0, L), writer=r == 0) for r in range(4)]
    assert [s.part_names() for s in sh] == [[f"h0/l0-{L}"]] * 4
    assert [s.writer for s in sh] == [True, False, False, False]


def test_records_round_trip_and_refuse_bad_ones():
    rec = record_of([(3, 6), (0, 3), (0, 3)], 8)
    assert rec == Record(((0, 3), (3, 6)), 8)
    assert Record.decode(rec.encode()) == rec
    bad = rec.encode()
    bad[0] = 99
    with pytest.raises(ChunkError, match="version"):
        Record.decode(bad)
    overlapping = Record(((0, 4), (3, 6)), 8).encode()
    with pytest.raises(ChunkError, match="disjoint"):
        Record.decode(overlapping)
    with pytest.raises(ValueError, match="^ranges: "):
        Record(tuple((i, i + 1) for i in range(MAX_STAGES + 1)), 8).encode()


@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(heads=(2, 2)), "heads"),
        (dict(heads=(0, 5)), "heads"),
        (dict(heads=(-1, 1)), "heads"),
        (dict(layers=(3, 3)), "layers"),
        (dict(layers=(-1, 2)), "layers"),
    ],
)
def test_bad_shares_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=f"^{arg}: "):
        Share(**{"heads": (0, 2), "total_heads": 4, "layers": (0, 2), **kw})


def test_redis_any_split_reads_what_another_wrote(redis_server, open_tier):
    tier = open_tier(redis_server.url)
    chunk = full_chunk(seed=3)
    store(tier, chunk, 2, 1)
    read_all(tier, chunk, 1, 1)
    read_all(tier, chunk, 4, 2)
    tier.delete(part_key(KEY, f"h0/l0-{L}"))
    sh = shares(1, 1)[0]
    with pytest.raises(ChunkError):
        PartIO(sh, "canonical").read(tier, KEY, torch.empty_like(worker_view(chunk, sh)))
