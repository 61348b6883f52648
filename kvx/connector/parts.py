"""How a chunk lives in the byte tiers: parts that do not depend on how the engine that wrote it was split.

A chunk's KV is a rectangle of KV heads x model layers. Each worker holds a sub-rectangle of it: its
tensor-parallel rank's KV heads and its pipeline stage's layers (:class:`Share`). In a byte tier the chunk is
stored as **parts**, one object per KV head (of the model, not of a rank) per writer stage's layer range, each
under :func:`~kvx.keys.part_key` of the chunk key and its name ``h<head>/l<first>-<end>``. A rank of any TP size
reads exactly its heads' parts, and a stage of any PP size the parts whose layers overlap its own, whatever
split wrote them. Bytes stored per chunk do not depend on TP: a head replicated on several ranks (TP larger
than the number of KV heads) is written by the first of them; MLA's latent cache is one "head", written by TP
rank 0, read by every rank.

A chunk becomes visible only whole. Under the chunk key itself a tier holds the chunk's **record**
(:class:`Record`): the parts' layer ranges and head count. With several workers the scheduler writes it once every
worker reported its parts stored in that tier (:class:`kvx.connector.ledger.ChunkLedger`); an engine's only worker
writes it itself, after its parts (a chunk is then visible as soon as its bytes are, without an engine step).
Lookups ask for records only.
A reader reads the record, then its parts; a part that is missing or fails verification fails the chunk's
load (vLLM recomputes it) and removes the record, so the chunk is a miss until it is stored whole again.

Formats whose bytes cannot be cut by head (raw pages with tokens outside heads, a hybrid model's recurrent
state) are stored as one part per rank, named ``tp<rank>of<size>/l<first>-<end>``, and their namespace keeps the
TP size (:func:`kvx.connector.common.head_parts`).

Layer coordinates are the model's decoder layer indices (vLLM's layer names): a stage of layers 16-31 writes
``l16-32``. Reading a layer range other than the writer's needs the reader's KV layers to be contiguous in
those indices (checked: :attr:`Share.contiguous`); otherwise such a chunk fails to load and is recomputed.

Stateless helpers; :class:`PartIO` is per worker, immutable, used by reader and writer threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels.ops import host_copy
from ..keys import part_key
from ..store import ChunkError, StoreError, Tier

RECORD_VERSION = 1
_RECORD_LEN = 64  # int64 entries: version, heads, ranges, then (first, end) per range
MAX_STAGES = (_RECORD_LEN - 3) // 2


@dataclass(frozen=True)
class Share:
    """One worker's sub-rectangle of a chunk. ``heads``: its KV heads [first, end) of the model's ``total_heads``
    (MLA: (0, 1) of 1); ``layers``: its decoder layer indices [first, end); ``contiguous``: every index in that
    range is one of its KV layers, in order; ``writer``: it writes its heads' parts (False for a replica of another
    rank's heads); ``split``: parts per head (False: one part per rank, named by ``rank`` of ``ranks``)."""

    heads: tuple[int, int]
    total_heads: int
    layers: tuple[int, int]
    contiguous: bool = True
    writer: bool = True
    split: bool = True
    rank: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        a, b = self.heads
        if not 0 <= a < b <= self.total_heads:
            raise ValueError(f"heads: expected a range within [0, {self.total_heads}), got {self.heads}")
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers: expected a non-empty range of layer indices, got {self.layers}")

    def part_names(self, layers: tuple[int, int] | None = None) -> list[str]:
        """The names of this worker's parts of a writer stage's ``layers`` (default: its own)."""
        lo, hi = layers or self.layers
        if not self.split:
            return [f"tp{self.rank}of{self.ranks}/l{lo}-{hi}"]
        return [f"h{h}/l{lo}-{hi}" for h in range(*self.heads)]


@dataclass(frozen=True)
class Record:
    """A stored chunk's record: its parts' layer ranges (one per writer stage) and the model's KV head count."""

    ranges: tuple[tuple[int, int], ...]
    total_heads: int

    def encode(self) -> torch.Tensor:
        if not 1 <= len(self.ranges) <= MAX_STAGES:
            raise ValueError(f"ranges: expected 1 to {MAX_STAGES} layer ranges, got {len(self.ranges)}")
        out = torch.zeros(_RECORD_LEN, dtype=torch.int64)
        out[:3] = torch.tensor([RECORD_VERSION, self.total_heads, len(self.ranges)])
        out[3 : 3 + 2 * len(self.ranges)] = torch.tensor([x for r in self.ranges for x in r])
        return out

    @classmethod
    def decode(cls, t: torch.Tensor) -> Record:
        v = t.tolist()
        if v[0] != RECORD_VERSION or not 1 <= v[2] <= MAX_STAGES:
            raise ChunkError(f"record: expected version {RECORD_VERSION} with 1 to {MAX_STAGES} ranges, got {v[:3]}")
        ranges = tuple((v[3 + 2 * i], v[4 + 2 * i]) for i in range(v[2]))
        if any(not 0 <= a < b for a, b in ranges) or any(b > c for (_, b), (c, _) in zip(ranges, ranges[1:])):
            raise ChunkError(f"record: expected ordered disjoint layer ranges, got {ranges}")
        return cls(ranges, int(v[1]))

    @staticmethod
    def empty() -> torch.Tensor:
        return torch.empty(_RECORD_LEN, dtype=torch.int64)


def record_of(layer_ranges: Sequence[tuple[int, int]], total_heads: int) -> Record:
    """The record of a chunk every worker stored: its workers' layer ranges (several workers per stage), ordered."""
    return Record(tuple(sorted(set(map(tuple, layer_ranges)))), total_heads)


class PartIO:
    """A worker's reads and writes of its parts of chunks (see the module docstring). ``fmt``: the chunk format
    ("canonical" ``[L, P, T, H, D]``, "pages" ``[L, S, n, bytes]`` with each page head-major when ``share.split``)."""

    def __init__(self, share: Share, fmt: str, records: bool = False):
        """``records``: this worker is its engine's only one, so it writes a chunk's record itself, after its parts
        (no round trip through the scheduler: the chunk is visible as soon as its bytes are)."""
        self.share, self.fmt, self.records = share, fmt, records

    def heads_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` (this worker's) as ``[heads, L, ...]``: one view per part (whole chunk when not split)."""
        if not self.share.split:
            return chunk.unsqueeze(0)
        n = self.share.heads[1] - self.share.heads[0]
        if self.fmt == "pages" and chunk.dim() == 4:  # a head-major page: each head's bytes are one run of the page
            return chunk.unflatten(-1, (n, chunk.shape[-1] // n)).movedim(-2, 0)
        return chunk.movedim(3, 0)  # canonical [L, P, T, H, D]; raw pages split by head [L, S, n, H, run]

    def part_keys(self, key: str, layers: tuple[int, int] | None = None) -> list[str]:
        return [part_key(key, name) for name in self.share.part_names(layers)]

    # ------------------------------------------------------------------ writes (a writer thread)
    def write(self, tier: Tier, key: str, chunk: torch.Tensor, extra: dict[str, str]) -> tuple[bool, list[str]]:
        """Store this worker's parts of chunk ``key`` (``chunk``: its tensor). Returns (whether any new bytes were
        written, the parts' keys). A replica writes nothing."""
        if not self.share.writer:
            return False, []
        keys = self.part_keys(key)
        wrote = False
        for k, part in zip(keys, self.heads_view(chunk)):
            if not part.is_contiguous():  # a head of several: its own buffer (one thread: ops.host_copy)
                dense = torch.empty(part.shape, dtype=part.dtype)
                host_copy(dense, part)
                part = dense
            wrote |= tier.put(k, part, extra)
        if self.records:
            tier.put(key, Record((self.share.layers,), self.share.total_heads).encode(), {"kind": "record"})
        return wrote, keys

    # ------------------------------------------------------------------ reads (a reader thread)
    def read(self, tier: Tier, key: str, out: torch.Tensor) -> None:
        """Read this worker's share of chunk ``key`` into ``out`` (its tensor), verified: the record, then the parts
        of every writer stage that overlap this worker's layers. Raises :class:`ChunkError`; when a part is gone
        (evicted, deleted, dropped as corrupt) the chunk's record is removed from ``tier`` too, so the chunk is a
        miss until stored whole again (a part that is only slow to come leaves it)."""
        raw = Record.empty()
        tier.get_into(key, raw)
        rec = Record.decode(raw)
        sh = self.share
        if sh.split and rec.total_heads != sh.total_heads:
            raise ChunkError(f"chunk {key}: parts of {rec.total_heads} KV heads, this model has {sh.total_heads}")
        lo, hi = sh.layers
        covered = 0
        views = self.heads_view(out)
        for a, b in rec.ranges:
            if (a, b) == (lo, hi):  # the writer's stage is this worker's: each part is a head's whole share
                for k, view in zip(self.part_keys(key, (a, b)), views):
                    self._get_part(tier, key, k, view)
                covered += hi - lo
                continue
            first, end = max(a, lo), min(b, hi)
            if first >= end:
                continue
            if not sh.contiguous:
                raise ChunkError(
                    f"chunk {key}: stored in layer ranges {rec.ranges}, and this worker's KV layers are not the "
                    f"contiguous range {sh.layers}"
                )
            covered += end - first
            for k, view in zip(self.part_keys(key, (a, b)), views):
                part = torch.empty((b - a, *view.shape[1:]), dtype=view.dtype)
                self._get_part(tier, key, k, part)
                host_copy(view.narrow(0, first - lo, end - first), part.narrow(0, first - a, end - first))
        if covered != hi - lo:
            raise ChunkError(f"chunk {key}: its layer ranges {rec.ranges} do not cover this worker's {sh.layers}")

    @staticmethod
    def _get_part(tier: Tier, key: str, part: str, out: torch.Tensor) -> None:
        """Read part ``part`` of chunk ``key`` into ``out`` (straight in when contiguous)."""
        dst = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        try:
            tier.get_into(part, dst)
        except ChunkError:
            try:
                if tier.contains_many([part]) == [False]:
                    tier.delete(key)  # the chunk is no longer whole: its record goes (best effort)
            except (StoreError, OSError):
                pass
            raise
        if dst is not out:
            host_copy(out, dst)
