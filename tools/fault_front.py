"""A faulty front of a real server: an HTTP peer that passes every request through to its upstream,
or answers the way a broken backend does, as its `mode` says at the time of each request.

Knows: the faults a router must survive, each a mode --
    pass            everything passes through (streams unbuffered)
    garbage         POST /v1/completions and /v1/chat/completions answer 200 with bytes that are
                    not JSON (/health, /v1/models and the rest still pass: a backend that looks up)
    garbage_stream  those routes answer 200 text/event-stream whose events are not JSON
    error_500       those routes answer 500 with a plain-text body
    hang            those routes answer nothing until the mode changes (or the front stops)
    stream_break    those routes pass a stream's first event through, then send garbage and stop
    status_garbage  GET /v1/cache/status answers 200 with bytes that are not UTF-8
and counts what it was sent and what it faked. `mode` may be changed from any thread at any time
(a plain attribute: one request sees the old mode or the new one).
Doesn't know: routing, or what the upstream is (any HTTP server; a tieredkv server in tests and
tools/bench_router_faults.py).

    with FaultFront("http://127.0.0.1:8001", mode="garbage") as front:
        ... front.url ...; front.mode = "pass"
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

GENERATION = {"/v1/completions", "/v1/chat/completions"}
MODES = ("pass", "garbage", "garbage_stream", "error_500", "hang", "stream_break", "status_garbage")
GARBAGE = b"\x89PNG\r\n\x1a\n<html>upstream reset</html>{{{"
NOT_UTF8 = b"\xff\xfe\xfa{\"kv_events\": \xc3\x28}"
DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultFront:
    def __init__(self, upstream: str, mode: str = "pass") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self.generation_requests = 0          # POSTs to a generation route, whatever the mode
        self.faked = 0                        # answers that were a fault, not the upstream's
        self._client: httpx.AsyncClient | None = None
        # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets whose proto says TCP; with it
        # on, each answer written in two parts waits for the peer's delayed ACK (40 ms a request).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE", "PUT"])])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "FaultFront":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fault front did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)

    def _fault(self, request: Request) -> Response | None:
        path, mode = request.url.path, self.mode
        if request.method == "POST" and path in GENERATION:
            self.generation_requests += 1
            if mode == "garbage":
                return Response(GARBAGE, 200, media_type="application/json")
            if mode == "garbage_stream":
                return Response(b"data: " + GARBAGE + b"\n\ndata: [DONE]\n\n", 200, media_type="text/event-stream")
            if mode == "error_500":
                return Response(b"Internal Server Error", 500, media_type="text/plain")
        if path == "/v1/cache/status" and mode == "status_garbage":
            return Response(NOT_UTF8, 200, media_type="application/json")
        return None

    async def _handle(self, request: Request) -> Response:
        fault = self._fault(request)
        if fault is not None:
            self.faked += 1
            return fault
        generation = request.method == "POST" and request.url.path in GENERATION
        if generation and self.mode == "hang":
            self.faked += 1
            while self.mode == "hang" and not self.server.should_exit:
                await asyncio.sleep(0.05)
            return Response(GARBAGE, 200, media_type="application/json")
        broken = generation and self.mode == "stream_break"
        if self._client is None:              # made on the server's own event loop
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP}
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        req = self._client.build_request(request.method, url, content=await request.body(), headers=headers)
        r = await self._client.send(req, stream=True)
        out = {k: v for k, v in r.headers.items() if k.lower() not in DROP}
        body = self._break(r.aiter_bytes()) if broken else r.aiter_raw()
        if broken:
            self.faked += 1
            out.pop("content-encoding", None)
        return StreamingResponse(body, status_code=r.status_code, headers=out, background=BackgroundTask(r.aclose))

    @staticmethod
    async def _break(chunks):
        """The upstream's first event, then garbage, then the end (no [DONE])."""
        buf = b""
        async for chunk in chunks:
            buf += chunk
            if b"\n\n" in buf:
                yield buf[:buf.index(b"\n\n") + 2]
                yield b"data: " + GARBAGE + b"\n\n"
                return
