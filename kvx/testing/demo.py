"""``kvx demo``: a long prompt, cold in one vLLM engine, then warm in a fresh engine from kvx's store.

Builds a random-weight Llama locally (nothing is downloaded), runs a long prompt through vLLM with
KVXConnector (CPU + disk tiers), shuts the engine down, starts a fresh one on the same disk store and
runs the prompt again. Prints TTFT cold vs warm, the hit size and whether the greedy tokens are
identical. Exits 1 if the warm run got no hit or different tokens.

What it prints is kvx's: its own lines, kvx's log at WARNING and above, and errors from anyone. vLLM's log
(about forty warnings of a CPU engine that say nothing about kvx), Python warnings from other packages,
torch's C++ warnings and the loaders' progress bars are held back unless ``--vllm-log`` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype; float32 keeps greedy decoding of a random model stable (default)",
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--store", default=None, help="disk tier directory (default: a fresh temporary one)")
    ap.add_argument(
        "--model-dir", default=None, help="where to build/reuse the model (default ~/.cache/kvx/models/...)"
    )
    ap.add_argument(
        "--vllm-log",
        action="store_true",
        help="show vLLM's log (at VLLM_LOGGING_LEVEL, default WARNING), other packages' warnings and the "
        "progress bars too; by default only kvx's lines and errors are printed",
    )
    args = ap.parse_args(argv)
    if args.tokens < 2 * args.chunk_size:
        ap.error(f"--tokens: expected >= 2 chunks ({2 * args.chunk_size}), got {args.tokens}")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not args.vllm_log:
        quiet_others()
    from . import harness as H

    model_dir = args.model_dir or os.path.join(
        os.path.expanduser("~/.cache/kvx/models"), f"llama-h{args.hidden}-l{args.layers}-{args.dtype}"
    )
    t0 = time.perf_counter()
    H.make_llama_of_width(model_dir, args.hidden, args.layers, args.dtype, max_pos=args.tokens + 512)
    print(
        f"kvx demo: random Llama (hidden {args.hidden}, {args.layers} layers, {args.dtype}) at {model_dir} "
        f"[{time.perf_counter() - t0:.1f} s]"
    )
    own_store = args.store is None
    store = args.store or tempfile.mkdtemp(prefix="kvx-demo-store-")
    extra = {
        "chunk_size": args.chunk_size,
        "tiers": [{"type": "cpu", "size": "2GiB"}, {"type": "disk", "path": store, "size": "20GiB"}],
    }
    ids = H.prompt_ids(args.tokens, seed=1234, vocab=8192)
    kv_bytes = 2 << 30
    max_len = args.tokens + args.max_tokens + 256
    try:
        results = []
        for label in ("cold (engine 1)", "warm (engine 2, fresh, from the kvx store)"):
            t0 = time.perf_counter()
            llm = H.build_llm(
                model_dir,
                H.kvx_transfer_config(extra),
                kv_cache_bytes=kv_bytes,
                max_model_len=max_len,
                dtype=args.dtype,
                use_tqdm_on_load=args.vllm_log,
            )
            start = time.perf_counter() - t0
            try:
                r = H.generate(llm, ids, args.max_tokens)
            finally:
                H.shutdown(llm)
            results.append(r)
            print(
                f"  {label:44s} TTFT {r.ttft_s:7.3f} s   cached {r.num_cached_tokens:5d} of {len(ids)} tokens"
                f"   (engine start {start:.1f} s)"
            )
        cold, warm = results
        files = [f for _, _, fs in os.walk(store) for f in fs if f.endswith(".safetensors")]
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
        same = cold.tokens == warm.tokens
        chunks = len(ids) // args.chunk_size
        print(
            f"  store: {chunks} chunks in {len(files)} files (a part per KV head and a record each), "
            f"{size / 2**20:.1f} MiB on disk at {store}"
        )
        print(
            f"  hit: {warm.num_cached_tokens} tokens; TTFT {cold.ttft_s:.3f} s -> {warm.ttft_s:.3f} s "
            f"({cold.ttft_s / max(warm.ttft_s, 1e-9):.1f}x faster)"
        )
        print(f"  greedy tokens identical: {'yes' if same else 'NO'}  {warm.tokens[:8]}")
        return 0 if same and warm.num_cached_tokens > 0 else 1
    finally:
        if own_store:
            shutil.rmtree(store, ignore_errors=True)


class _UnlessPrintedAbove(logging.Filter):
    """Pass a record of the ``kvx`` logger's own handler only where no handler of a logger above it (vLLM's,
    once :func:`kvx.log.attach_to_vllm` ran; the root's) prints it too: every line once."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger("kvx")
        while logger.propagate and logger.parent is not None:
            logger = logger.parent
            if any(record.levelno >= h.level for h in logger.handlers):
                return False
        return True


def quiet_others() -> None:
    """Hold back what is not kvx's and not an error: vLLM's log below ERROR (``VLLM_LOGGING_LEVEL``, read
    when vLLM is first imported: call this before), Python warnings raised outside kvx, transformers' and
    Hugging Face's progress bars and notices, torch's C++ warnings (``TORCH_CPP_LOG_LEVEL``, read when torch
    loads: ``scripts/demo.sh`` sets it, as here for any child process). kvx logs under vLLM's logger
    (:func:`kvx.log.attach_to_vllm`), whose handler then passes errors only, so kvx's warnings get a
    handler of their own on the ``kvx`` logger (errors still go through vLLM's handler). Explicit settings
    of these variables win."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # vLLM sets up its logging lazily, at the first engine: what it logs while importing would reach
    # Python's last-resort handler, at WARNING
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"kvx(\.|$)")  # inserted first: kvx's own still show
    kvx = logging.getLogger("kvx")
    if not any(isinstance(f, _UnlessPrintedAbove) for h in kvx.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_UnlessPrintedAbove())
        kvx.addHandler(handler)
    kvx.setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
