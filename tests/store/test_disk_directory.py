"""What is in a disk store's directory (kvx.store.disk.directory.survey) alone, without a DiskTier: chunk files,
temporary files sorted into in flight and stale by their writer (this process, a live or dead pid of this host,
another host, an older kvx) and their age, other files left alone; the names the tier writes are the ones the
survey recognises."""

from __future__ import annotations

import os
import time

from kvx.store.disk.directory import (
    _HOST,
    _LIVE_TMP,
    _TMP_MAX_AGE_S,
    chunk_file,
    classify_temp,
    is_temp_name,
    survey,
    temp_name,
)

OTHER_HOST = f"{(int(_HOST, 16) + 1) % 2**32:08x}"
OLD = _TMP_MAX_AGE_S + 60
# (name of a temporary file given the pids, age in seconds, stale?, its reason)
TEMPS = [
    (lambda p: f".{'a1' * 16}.{_HOST}.{p['dead']}.deadbeef.tmp", 0, True, "writer pid {dead} is gone"),
    (lambda p: f".{'a2' * 16}.{_HOST}.{p['live']}.deadbeef.tmp", 0, False, "being written by pid {live}"),
    (lambda p: f".{'a3' * 16}.{_HOST}.{p['live']}.deadbeef.tmp", OLD, True, "more than 3600 s"),
    (lambda p: f".{'a4' * 16}.{_HOST}.{os.getpid()}.deadbeef.tmp", 0, True, "left by an earlier process"),
    (lambda p: f".{'a5' * 16}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", 0, False, "another host or an older kvx"),
    (lambda p: f".{'a6' * 16}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", OLD, True, "more than 3600 s"),
    (lambda p: f".{'a7' * 16}.{p['dead']}.deadbeef.tmp", 0, False, "another host or an older kvx"),
    (lambda p: ".tmpAb12Cd", 0, False, "another host or an older kvx"),
    (lambda p: ".tmpXy34Ef", OLD, True, "more than 3600 s"),
]
NOT_KVX = ["README", "ab/notes.txt", "ab/.hidden", "abc/.x.tmp", "abc/x.safetensors"]


def write(path: str, nbytes: int, age_s: float = 0.0) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\0" * nbytes)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_survey_sorts_every_file(tmp_path, pids):
    root = str(tmp_path)
    chunks = {k: write(chunk_file(root, k), 100 + i) for i, k in enumerate(["ab" * 16, "abcd" * 8, "0f" * 16])}
    temps = {}
    for i, (name_of, age, stale, reason) in enumerate(TEMPS):
        p = write(os.path.join(root, f"{i:02x}", name_of(pids)), 10 + i, age)
        temps[p] = (10 + i, stale, reason.format(**pids))
    for rel in NOT_KVX:
        write(os.path.join(root, rel), 5, OLD)
    sv = survey(root)  # read-only
    assert {c.key: c.path for c in sv.chunks} == chunks and sv.chunk_bytes == 100 + 101 + 102
    assert sv.removed == [] and len(sv.temps) == len(TEMPS)
    for t in sv.temps:
        nbytes, stale, reason = temps[t.path]
        assert (t.bytes, t.stale) == (nbytes, stale) and reason in t.reason, (t, temps[t.path])
    assert all(os.path.exists(p) for p in temps)
    sv = survey(root, remove_stale=True)
    assert sorted(t.path for t in sv.removed) == sorted(p for p, (_, stale, _) in temps.items() if stale)
    assert sorted(t.path for t in sv.temps) == sorted(p for p, (_, stale, _) in temps.items() if not stale)
    assert all(os.path.exists(p) is not temps[p][1] for p in temps)
    assert all(os.path.exists(os.path.join(root, rel)) for rel in NOT_KVX)  # not kvx's: left alone


def test_names_the_tier_writes_are_the_ones_the_survey_knows(tmp_path):
    key = "0123456789abcdef" * 2
    final = chunk_file(str(tmp_path), key)
    assert final == os.path.join(str(tmp_path), "01", key + ".safetensors")
    tmp = temp_name(final)
    assert os.path.dirname(tmp) == os.path.dirname(final) and is_temp_name(os.path.basename(tmp))
    assert tmp != temp_name(final)  # two writers of one key never share a temporary file
    now = time.time()
    _LIVE_TMP.add(tmp)
    try:
        assert classify_temp(tmp, os.path.basename(tmp), now, now) == (False, "being written by this process")
    finally:
        _LIVE_TMP.discard(tmp)
    stale, reason = classify_temp(tmp, os.path.basename(tmp), now, now)  # this pid, not being written: a leftover
    assert stale and reason == f"left by an earlier process with pid {os.getpid()}"


def test_a_sealed_chunks_name_carries_its_key_id(tmp_path):
    key, kid = "0123456789abcdef" * 2, "fedcba9876543210"
    final = chunk_file(str(tmp_path), key, kid)
    assert final == os.path.join(str(tmp_path), "01", f"{key}-{kid}.safetensors")
    tmp = temp_name(final)
    assert os.path.basename(tmp).startswith(f".{key}-{kid}.{_HOST}.{os.getpid()}.")
    write(final, 10)
    write(chunk_file(str(tmp_path), key), 20)  # the same chunk in the clear: another file
    got = sorted((c.key, c.kid, c.bytes) for c in survey(str(tmp_path)).chunks)
    assert got == [(key, "", 20), (key, kid, 10)]
    stale, reason = classify_temp(tmp, os.path.basename(tmp), time.time(), time.time())
    assert stale and "earlier process" in reason  # a sealed chunk's temporary file is judged as any other


def test_survey_of_a_missing_directory_is_empty(tmp_path):
    sv = survey(str(tmp_path / "gone"))
    assert sv.chunks == [] and sv.temps == [] and sv.removed == [] and sv.chunk_bytes == sv.temp_bytes == 0
