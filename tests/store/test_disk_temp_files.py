"""DiskTier temporary files: removed only once their writer is gone (dead pid, too old, another host's,
older kvx and safetensors names), files that are not kvx's left alone, a write in flight seen by other engines
(in this process and another), ``kill -9`` mid-write leaving only a temporary file that ``kvx store inspect``
reports and the next start removes, temporary files counting against the capacity, and the log of removals."""

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import kvx.store.disk.tier as disk_mod  # the tier's file I/O: tests patch its _write_all and open
from kvx.store.disk import DiskTier, directory, survey
from tests.store.disk_helpers import files_in, key_of, one_file_bytes, rand_chunk, set_mtime

OTHER_HOST = f"{(int(directory._HOST, 16) + 1) % 2**32:08x}"


OLD = directory._TMP_MAX_AGE_S + 60


TEMP_NAME = re.compile(r"\.(?P<key>[0-9a-f]+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


# (case, name of the temporary file given the pids, age in seconds, stale?)
TEMP_CASES = [
    ("writer dead", lambda k, p: f".{k}.{directory._HOST}.{p['dead']}.deadbeef.tmp", 0, True),
    ("writer alive", lambda k, p: f".{k}.{directory._HOST}.{p['live']}.deadbeef.tmp", 0, False),
    ("writer alive, too old", lambda k, p: f".{k}.{directory._HOST}.{p['live']}.deadbeef.tmp", OLD, True),
    ("this pid, not written by it", lambda k, p: f".{k}.{directory._HOST}.{os.getpid()}.deadbeef.tmp", 0, True),
    ("other host", lambda k, p: f".{k}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", 0, False),
    ("other host, old", lambda k, p: f".{k}.{OTHER_HOST}.{p['dead']}.deadbeef.tmp", OLD, True),
    ("older kvx name", lambda k, p: f".{k}.{p['dead']}.deadbeef.tmp", 0, False),
    ("older kvx name, old", lambda k, p: f".{k}.{p['dead']}.deadbeef.tmp", OLD, True),
    ("safetensors name", lambda k, p: ".tmpAb12Cd", 0, False),
    ("safetensors name, old", lambda k, p: ".tmpAb12Cd", OLD, True),
]


def in_child(body) -> int:
    """Run ``body(report)`` in a forked process (another engine's writer, sharing this host's pids
    without re-importing torch); ``report(bytes)`` writes to the pipe the parent reads. Returns the pid;
    the caller reads with :func:`child_says`, then kills and reaps it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            body(lambda msg: os.write(w, msg))
        finally:
            os._exit(0)
    os.close(w)
    in_child.pipes[pid] = r
    return pid


in_child.pipes = {}


def child_says(pid: int) -> bytes:
    r = in_child.pipes.pop(pid)
    try:
        return os.read(r, 4096)  # b"" if it exited without a word
    finally:
        os.close(r)


def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)  # no cleanup of any kind, as after kill -9
    os.waitpid(pid, 0)


def make_temp(path, key: str, name: str, nbytes: int, age_s: float = 0.0) -> str:
    d = os.path.join(path, key[:2])
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(b"\x00" * nbytes)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


@pytest.mark.parametrize("case, name_of, age, stale", TEMP_CASES, ids=[c[0] for c in TEMP_CASES])
def test_temporary_files_are_removed_only_when_their_writer_is_gone(tmp_path, pids, case, name_of, age, stale):
    key = key_of(case)
    p = make_temp(tmp_path, key, name_of(key, pids), 1000, age)
    sv = survey(str(tmp_path))  # read-only
    assert [(t.path, t.bytes, t.stale) for t in sv.temps] == [(p, 1000, stale)] and sv.chunks == []
    assert os.path.exists(p)
    s = DiskTier.at(tmp_path)  # start-up removes the stale ones
    assert os.path.exists(p) is not stale
    assert s.stats()["tmp_removed"] == int(stale)
    assert s.usage() == (0 if stale else 1000)  # counted until removed
    assert [t.path for t in s.temp_files()] == ([] if stale else [p])


def test_a_live_writers_temporary_file_is_removed_once_it_dies(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    key = key_of("w")
    p = make_temp(tmp_path, key, f".{key}.{directory._HOST}.{writer.pid}.0badf00d.tmp", 100)
    s = DiskTier.at(tmp_path)
    assert [t.reason for t in s.temp_files()] == [f"being written by pid {writer.pid}"]
    writer.stdin.close()
    writer.wait()
    assert s.usage() == 0 and not os.path.exists(p)  # the next scan removes it
    assert s.stats()["tmp_removed"] == 1


def test_files_that_are_not_kvx_files_are_left_alone(tmp_path):
    s = DiskTier.at(tmp_path)
    s.put(key_of(1), torch.ones(4))
    others = [
        tmp_path / "README",
        tmp_path / "ab" / "notes.txt",
        tmp_path / "ab" / ".hidden",
        tmp_path / "abc" / ".x.tmp",
    ]  # not a two-character subdirectory
    for p in others:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x" * 10)
        os.utime(p, (1, 1))  # very old
    assert s.usage() == os.path.getsize(s.file_of(key_of(1)))
    s.clear()
    assert all(p.exists() for p in others)


def test_put_writes_only_names_kvx_recognises(tmp_path, monkeypatch):
    """Mid-write, the only new name in the directory is kvx's temporary file: safetensors' save_file
    used its own .tmpXXXXXX name, which a crash leaked. Another engine starting meanwhile (in this
    process, and in another one) counts it as a write in flight and leaves it alone."""
    path = tmp_path / "kv"
    s = DiskTier.at(path, capacity_bytes=1 << 20)
    key = key_of("inflight")
    chunk = rand_chunk((64, 64), torch.float16, 1)
    real = disk_mod._write_all
    seen = {}

    def other_process(report):
        other = DiskTier.at(path)
        report(f"{len(other.temp_files())} {other.usage()}".encode())

    def write_with_others_looking(fd, bufs):
        real(fd, bufs[:1])  # the header
        seen["tmp"] = os.readlink(f"/proc/self/fd/{fd}")
        seen["names"] = files_in(path)
        other = DiskTier.at(path)
        seen["other"] = [(t.path, t.stale, t.reason) for t in other.temp_files()], other.usage()
        pid = in_child(other_process)
        seen["child"] = child_says(pid).decode()
        os.waitpid(pid, 0)
        seen["kept"] = os.path.exists(seen["tmp"])
        real(fd, bufs[1:])

    monkeypatch.setattr(disk_mod, "_write_all", write_with_others_looking)
    assert s.put(key, chunk)
    tmp = seen["tmp"]
    assert seen["names"] == [os.path.relpath(tmp, path)]
    m = TEMP_NAME.fullmatch(os.path.basename(tmp))
    assert m and m["key"] == key and m["host"] == directory._HOST and int(m["pid"]) == os.getpid()
    header = os.path.getsize(s.file_of(key)) - chunk.numel() * 2
    assert seen["other"] == ([(tmp, False, "being written by this process")], header)
    assert seen["child"] == f"1 {header}"  # another pid: alive, so in flight
    assert seen["kept"]
    assert files_in(path) == [os.path.relpath(s.file_of(key), path)]


@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_9_leaves_only_a_temporary_file_that_the_next_start_removes(tmp_path, capsys, where):
    from kvx.store import cli as store_cli

    path = tmp_path / "kv"
    chunk = torch.ones(1 << 20, dtype=torch.uint8)

    def writer(report):
        def pause(*args, **kwargs):
            report(b"ready")
            time.sleep(120)

        if where == "write":  # killed with the header written, the data not
            real = getattr(disk_mod, "_write_all", None)

            def half(fd, bufs):
                real(fd, bufs[:1])
                pause()

            disk_mod._write_all = half
        else:  # killed with the whole file written, before the rename
            os.replace = pause
        DiskTier.at(path).put("ab" * 16, chunk)
        report(b"done")

    pid = in_child(writer)
    try:
        said = child_says(pid)
    finally:
        kill_and_reap(pid)
    assert said == b"ready"
    left = files_in(path)
    assert len(left) == 1
    m = TEMP_NAME.fullmatch(os.path.basename(left[0]))
    assert m and m["host"] == directory._HOST and int(m["pid"]) == pid, left
    sv = survey(str(path))
    assert [(t.stale, t.reason) for t in sv.temps] == [(True, f"writer pid {pid} is gone")]
    assert store_cli.main(["inspect", str(path)]) == 0
    assert "0 in flight (0.0 MiB), 1 stale" in capsys.readouterr().out
    s = DiskTier.at(path)
    assert files_in(path) == [] and s.stats()["tmp_removed"] == 1 and s.usage() == 0


def test_temporary_files_count_against_the_capacity(tmp_path):
    size = one_file_bytes(tmp_path)
    path = tmp_path / "kv"
    # another host's write in flight, as large as two chunks
    tmp = make_temp(path, key_of("x"), f".{key_of('x')}.{OTHER_HOST}.1.deadbeef.tmp", 2 * size)
    s = DiskTier.at(path, capacity_bytes=5 * size, low_watermark=1.0)
    assert s.usage() == 2 * size
    base = time.time() - 3600
    for i in range(4):
        assert s.put(key_of(i), torch.zeros(2, 8, dtype=torch.float16))
        set_mtime(s, key_of(i), base + i)
    assert {c.key for c in s.scan()} == {key_of(1), key_of(2), key_of(3)}  # 3 chunks + the temp = 5
    assert s.usage() == 5 * size and os.path.exists(tmp)
    assert s.stats()["evicted"] == 1


def test_removing_stale_files_is_logged_by_the_modules_logger(tmp_path, caplog):
    key = key_of("log")
    make_temp(tmp_path, key, f".{key}.{OTHER_HOST}.1.deadbeef.tmp", 10, OLD)
    caplog.set_level(logging.INFO, logger="kvx")
    DiskTier.at(tmp_path)
    assert [(r.name, r.levelno) for r in caplog.records] == [("kvx.store.disk", logging.INFO)]
    assert "removed 1 stale temporary files" in caplog.records[0].getMessage()
