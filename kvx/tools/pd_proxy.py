"""``kvx pd-proxy``: prefill/decode disaggregation through a shared kvx tier, as a small HTTP proxy.

Each OpenAI completion or chat completion is sent first to a prefill instance (a ``vllm serve`` with kvx as
``kv_producer``) with ``max_tokens=1``: it computes the prompt and stores its chunks in the shared tier (a disk
path both instances mount, or Redis). Its response carries ``kv_transfer_params`` naming those chunks
(``kvx_pd_chunks``, ``kvx_pd_key``). The proxy then sends the original request, with those params added, to a
decode instance (kvx as ``kv_consumer`` on the same tier), which loads the chunks instead of computing them,
waiting up to its ``pd_wait_ms`` for writes still landing, and streams its answer back to the client.

A prefill instance that is down, slow (``--prefill-timeout``) or answers with an error costs the request its
prefill shortcut only: the proxy logs it and sends the request to the decode instance without params, which
computes the prompt itself. The client's own ``kv_transfer_params`` (``kvx_namespace``, ...) reach both.

Usage::

    kvx pd-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Across hosts without a shared tier: each instance's first tier is its host's ``kvx node`` in a cluster, and
``--decode-node HOST:PORT`` (one per ``--decode``, in order) names the ``--listen`` address of that decode
instance's node. The proxy then picks the decode instance first and asks the prefill instance to push the prompt's
chunks straight into that node (``kvx_push_to``), where the decode instance waits for them.

Several ``--prefill`` / ``--decode`` URLs are used round robin. Built on aiohttp (a vLLM dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time

import aiohttp
from aiohttp import web

log = logging.getLogger("kvx.pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class PDProxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        prefill_timeout_s: float = 60.0,
        decode_nodes: list[str] | None = None,
    ):
        if not prefill or not decode:
            raise ValueError(f"prefill, decode: expected at least one URL each, got {prefill!r} and {decode!r}")
        if decode_nodes and len(decode_nodes) != len(decode):
            raise ValueError(
                f"--decode-node: expected one per --decode ({len(decode)}), got {len(decode_nodes)}: {decode_nodes!r}"
            )
        for node in decode_nodes or ():
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--decode-node: expected HOST:PORT (a kvx node's --listen), got {node!r}")
        self.prefill, self.decode = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
        nodes = decode_nodes or [None] * len(self.decode)
        self._next_p, self._next_d = itertools.cycle(self.prefill), itertools.cycle(list(zip(self.decode, nodes)))
        self.prefill_timeout_s = prefill_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.counts = {"requests": 0, "prefill_ok": 0, "prefill_failed": 0}

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def _close(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.counts})

    async def models(self, request: web.Request) -> web.StreamResponse:
        async with self.session.get(next(self._next_d)[0] + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    # ------------------------------------------------------------------ one request
    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return web.json_response({"error": {"message": f"request body: expected JSON: {e}"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "request body: expected a JSON object"}}, status=400)
        self.counts["requests"] += 1
        decode, node = next(self._next_d)
        params = await self._prefill(request.path, body, node)
        out = dict(body)
        if params:
            out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        return await self._forward(request, decode + request.path, out)

    async def _prefill(self, path: str, body: dict, push_to: str | None = None) -> dict | None:
        """Run the prompt on a prefill instance (``push_to``: pushing its chunks into that node); its
        ``kv_transfer_params``, or None when it failed."""
        url = next(self._next_p) + path
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        if push_to is not None:
            pre["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "kvx_push_to": push_to}
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre["stream"] = False
        t0 = time.monotonic()
        try:
            async with self.session.post(
                url, json=pre, timeout=aiohttp.ClientTimeout(total=self.prefill_timeout_s)
            ) as r:
                text = await r.text()
                if r.status != 200:
                    if 400 <= r.status < 500:
                        log.warning("pd-proxy: prefill %s refused the request (%d): %s", url, r.status, text[:300])
                    raise RuntimeError(f"HTTP {r.status}")
                params = json.loads(text).get("kv_transfer_params")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, json.JSONDecodeError) as e:
            self.counts["prefill_failed"] += 1
            log.warning(
                "pd-proxy: prefill at %s failed after %.1f s (%s: %s); the decode instance computes the prompt",
                url,
                time.monotonic() - t0,
                type(e).__name__,
                e,
            )
            return None
        self.counts["prefill_ok"] += 1
        return params if isinstance(params, dict) else None

    async def _forward(self, request: web.Request, url: str, body: dict) -> web.StreamResponse:
        """Send ``body`` to ``url`` and stream the answer back as it comes (SSE or JSON)."""
        try:
            upstream = await self.session.post(url, json=body)
        except aiohttp.ClientError as e:
            return web.json_response({"error": {"message": f"decode instance {url}: {e}"}}, status=502)
        async with upstream:
            resp = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS},
            )
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionError):
                # the client went away (before the end, or once it had read the last event and before the
                # final empty chunk): closing the upstream connection makes vLLM abort a request still running
                pass
            return resp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvx pd-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill (kv_producer) server URL; repeatable")
    ap.add_argument("--decode", action="append", required=True, help="decode (kv_consumer) server URL; repeatable")
    ap.add_argument(
        "--decode-node",
        action="append",
        help="the --listen HOST:PORT of the kvx node of each --decode instance, in order: the prefill instance "
        "pushes the prompt's chunks there (nodes in a cluster, no shared tier needed)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--prefill-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a prefill before the decode instance computes the prompt itself",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        proxy = PDProxy(args.prefill, args.decode, args.prefill_timeout, args.decode_node)
    except ValueError as e:
        ap.error(str(e))
    log.info("pd-proxy on http://%s:%d: prefill %s -> decode %s", args.host, args.port, proxy.prefill, proxy.decode)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
