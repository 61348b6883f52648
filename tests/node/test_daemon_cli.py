"""``kvx node``'s subcommands (:mod:`kvx.node.cli`) against a running daemon: lookup, pin, unpin, evict, quota and
stats; their errors, each one line; and what the CLI says without a daemon or with bad sizes."""

from __future__ import annotations

import json
import os

import pytest

from kvx.keys import chunk_keys, request_root
from kvx.node import cli
from tests.node.daemon_helpers import NS_A, NS_C


def test_cli_subcommands(node, capsys):
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    eng = node.engine(NS_C, chunk_size=16)
    keys = chunk_keys(request_root(bytes.fromhex(NS_C), "salt", None, None), tokens, 16)
    for k in keys[:3]:
        eng.call("allocate", key=k)
        eng.call("commit", key=k)

    def run(*args: str) -> dict:
        assert cli.main([args[0], "--socket", node.socket, *args[1:]]) == 0
        return json.loads(capsys.readouterr().out)

    prompt = ["--namespace", NS_C, "--tokens", ",".join(map(str, tokens)), "--cache-salt", "salt"]
    assert run("lookup", *prompt) == {"namespace": NS_C, "tokens": len(tokens), "cached_tokens": 48}
    no_salt = ["--namespace", NS_C, "--tokens", ",".join(map(str, tokens))]
    assert run("lookup", *no_salt)["cached_tokens"] == 0  # another root: other keys
    tokens_file = node.root / "tokens.json"
    tokens_file.write_text(json.dumps(tokens[:40]))
    from_file = ["--namespace", NS_C, "--tokens-file", str(tokens_file), "--cache-salt", "salt"]
    assert run("lookup", *from_file) == {"namespace": NS_C, "tokens": 40, "cached_tokens": 32}
    assert run("pin", *prompt)["pinned_tokens"] == 48
    assert node.stats()["namespaces"][NS_C]["pinned"] == 3
    assert cli.main(["stats", "--socket", node.socket]) == 0
    table = capsys.readouterr().out
    assert "pool " in table and NS_C[:16] in table and "pinned" in table
    assert cli.main(["stats", "--socket", node.socket, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"][NS_C]["pinned"] == 3
    assert run("unpin", *prompt)["unpinned_tokens"] == 48
    assert run("evict", *from_file) == {"namespace": NS_C, "evicted": 2}
    assert run("lookup", *prompt)["cached_tokens"] == 0
    assert run("quota", "--namespace", NS_C, "--bytes", "8KiB") == {"namespace": NS_C, "quota": 8192}
    assert node.stats()["namespaces"][NS_C]["chunks"] <= 2
    assert run("quota", "--namespace", NS_C, "--bytes", "none") == {"namespace": NS_C, "quota": None}
    left = node.stats()["namespaces"][NS_C]["chunks"]
    assert left > 0
    assert run("evict", "--namespace", NS_C) == {"namespace": NS_C, "evicted": left}
    assert node.stats()["namespaces"][NS_C]["chunks"] == 0
    eng.close()


CLI_ERRORS = [  # (arguments after the subcommand, exit code, what the one line says)
    (["lookup", "--namespace", "ff" * 8, "--tokens", "1,2"], 2, "--namespace: expected one the daemon knows ("),
    (["lookup", "--namespace", "XYZ", "--tokens", "1,2"], 2, "argument --namespace: expected 8-128 lowercase hex"),
    (["lookup", "--namespace", NS_A, "--tokens", "1,b"], 2, "argument --tokens: expected comma-separated token ids"),
    (["lookup", "--namespace", NS_A], 2, "one of the arguments --tokens --tokens-file is required"),
    (["pin", "--namespace", NS_A, "--tokens-file", "/nonexistent"], 2, "argument --tokens-file: expected a JSON"),
    (["quota", "--namespace", NS_A, "--bytes", "lots"], 2, "argument --bytes: expected a size like '4GiB'"),
    (["quota", "--namespace", "ff" * 8, "--bytes", "1GiB"], 2, "namespace: expected a known namespace ("),
    (["evict", "--namespace", "ff" * 8], 2, "namespace: expected a known namespace ("),
]


@pytest.mark.parametrize(("args", "code", "error"), CLI_ERRORS)
def test_cli_errors_are_one_line(node, capsys, args, code, error):
    node.engine(NS_A).close()  # NS_A is known
    assert cli.main([args[0], "--socket", node.socket, *args[1:]]) == code
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_without_a_daemon_or_with_bad_sizes(short_dir, capsys):
    assert cli.main(["stats", "--socket", str(short_dir / "nobody")]) == 1
    err = capsys.readouterr().err
    assert "kvx node stats: --socket: expected a running kvx node, got" in err and err.count("\n") == 1
    sock = str(short_dir / "x")
    assert cli.main(["--socket", sock, "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--size: expected room for the table and at least one slot of --slot-size 65536 (" in err
    assert cli.main(["--socket", sock, "--size", "40MiB", "--slot-size", "64MiB"]) == 2
    err = capsys.readouterr().err
    assert "--size: expected room for the table and at least one slot of --slot-size 67108864 (" in err
    assert cli.main(["--socket", sock, "--size", "64GiB", "--quota", "nothex=1GiB"]) == 2
    assert "argument --quota: expected 8-128 lowercase hex digits, got 'nothex'" in capsys.readouterr().err
    assert cli.main(["--socket", sock, "--size", "-3"]) == 2
    assert "argument --size: expected" in capsys.readouterr().err
    assert not os.path.exists(sock)
