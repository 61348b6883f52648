"""The pool file's directory (:class:`kvx.node.protocol.Directory`): where a key's probe starts. Keys that share
their first 8 bytes (a crafted client, or keys like ``f"{i:032x}"``) once all started at one home, so a lookup or a
change walked past every one of them; then a multiply-add of the halves still put a crafted set (second halves
``k * MIX^-1``) at one home for every epoch; the home is now a keyed fmix64 of each half."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from kvx.node.directory import Directory
from kvx.node.protocol import dir_home, dir_seed
from kvx.testing.node_bench import directory_holding

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
    d = directory_holding(keys, len(keys), SLOT, epoch)
    assert d.ready("".join(keys)) == [True] * len(keys)
    return d


@pytest.mark.parametrize("seed", range(3))
def test_keys_sharing_their_first_8_bytes_probe_as_few_entries_as_random_keys(seed):
    epoch = os.urandom(16)
    rand = [os.urandom(16).hex() for _ in range(N)]
    counting = [f"{i:032x}" for i in range(N)]  # the first 8 bytes zero, the last byte counting
    prefix = os.urandom(8).hex()
    crafted = [prefix + os.urandom(8).hex() for _ in range(N)]  # one shared first half
    inv = pow(0x9E3779B97F4A7C15, -1, 1 << 64)  # pool version 2's multiplier: these all shared its one home
    mixinv = [prefix + struct.pack("<Q", k * inv % (1 << 64)).hex() for k in range(N)]
    base = sum(probes(stored(rand, epoch), rand))
    for keys in (counting, crafted, mixinv):
        assert sum(probes(stored(keys, epoch), keys)) <= 2 * base, (base, keys[:2])


def test_the_home_depends_on_the_pool_epoch():
    k = bytes(range(16))
    homes = {dir_home(k, 1 << 16, dir_seed(os.urandom(16))) for _ in range(16)}
    assert len(homes) > 8  # a crafted collision in one pool is none in the next


def test_bench_node_directory_quick(tmp_path):
    """The benchmark's smoke run: crafted key sets take as few probes per key as random keys, within 2x (probes,
    not the printed lookup times: a count, the same on a busy machine)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", "bench_node_directory.py"), "--quick", "--slots", "512"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": repo},
    )
    assert out.returncode == 0, out.stderr
    probes = {line.split()[0]: float(line.split()[2]) for line in out.stdout.splitlines() if "probes/key" in line}
    assert set(probes) == {"random", "shared8", "counting", "mixinv"}, out.stdout
    assert all(p < 2 * probes["random"] for p in probes.values()), out.stdout
