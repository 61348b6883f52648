"""The pool file's directory (:class:`kvx.node.protocol.Directory`): where a key's probe starts. Keys that share
their first 8 bytes (a crafted client, or keys like ``f"{i:032x}"``) once all started at one home, so a lookup or a
change walked past every one of them; the home now mixes the whole key with the pool's random epoch."""

from __future__ import annotations

import os

import pytest

from kvx.node.daemon import NodeState
from kvx.node.directory import Directory
from kvx.node.protocol import VERSION, PoolGeometry, dir_home

SLOT = 4096
N = 256


def probes(d: Directory, keys: list[str]) -> list[int]:
    """Per READY key, the directory entries a lookup of it reads (1: found at its home)."""
    out = []
    for k in keys:
        raw = bytes.fromhex(k)
        pos, n = dir_home(raw, d.geom.dir_entries, d.seed), 1
        while bytes(d.dir[pos]["a"].tobytes() + d.dir[pos]["b"].tobytes()) != raw:
            assert d.dir[pos]["slot"] != 0, f"{k}: not in the directory"
            pos, n = (pos + 1) & d.mask, n + 1
        out.append(n)
    return out


def stored(keys: list[str], epoch: bytes) -> Directory:
    geom = PoolGeometry(len(keys), SLOT)
    state = NodeState(geom, bytearray(geom.data_offset), "/dev/shm/test.pool", epoch)
    state.open(1, pid=1)
    hello = {"version": VERSION, "role": "engine", "namespace": "a1" * 8, "model": "m", "chunk_size": 16}
    assert state.request(1, {"op": "hello", "id": 0, "pid": 1, "slot_bytes": SLOT, **hello})[0]["ok"]
    for i, k in enumerate(keys):
        for op in ("allocate", "commit"):
            reply = state.request(1, {"op": op, "id": 2 * i + 1 + (op == "commit"), "key": k})[0]
            assert reply["ok"], reply
    d = Directory(state.table, geom, epoch)
    assert d.ready("".join(keys)) == [True] * len(keys)
    return d


@pytest.mark.parametrize("seed", range(3))
def test_keys_sharing_their_first_8_bytes_probe_as_few_entries_as_random_keys(seed):
    epoch = os.urandom(16)
    rand = [os.urandom(16).hex() for _ in range(N)]
    counting = [f"{i:032x}" for i in range(N)]  # the first 8 bytes zero, the last byte counting
    prefix = os.urandom(8).hex()
    crafted = [prefix + os.urandom(8).hex() for _ in range(N)]  # one shared first half
    base = sum(probes(stored(rand, epoch), rand))
    for keys in (counting, crafted):
        assert sum(probes(stored(keys, epoch), keys)) <= 2 * base, (base, keys[:2])


def test_the_home_depends_on_the_pool_epoch():
    k = bytes(range(16))
    homes = {dir_home(k, 1 << 16, int.from_bytes(os.urandom(8), "little")) for _ in range(16)}
    assert len(homes) > 8  # a crafted collision in one pool is none in the next
