"""Every loopback HTTP server the tests start, and `tieredkv serve`'s, answers with Nagle off.

asyncio turns Nagle off (TCP_NODELAY) on an accepted connection only when the listening
socket's proto is IPPROTO_TCP (asyncio.base_events._set_nodelay). A socket made as
socket.socket(AF_INET, SOCK_STREAM) has proto 0: then every response uvicorn writes in two parts
(headers, then body) waits for the client's delayed ACK, ~40 ms a request, /health included
(issue 31: the in-process test servers answered every request in 44 ms, the suite's thousands of
requests paying it). Checked on the live connections as the server holds them, after a request.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.service.router.harness import RouterThread
from tieredkv.cli_serve import bind_socket
from tools.fault_front import FaultFront


def nodelay_of(server: uvicorn.Server) -> list[int]:
    """TCP_NODELAY of each connection the server holds open."""
    return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for c in list(server.server_state.connections)]


def held_open(url: str, server: uvicorn.Server) -> list[int]:
    with httpx.Client(base_url=url, timeout=60) as c:          # keep-alive: the connection stays
        assert c.get("/health").status_code == 200
        return nodelay_of(server)


def test_the_in_process_server_the_router_and_the_fault_front_turn_nagle_off(server) -> None:
    assert held_open(server.url, server.server) == [1]
    with RouterThread(server.url) as router:
        assert held_open(router.url, router.server) == [1]
    with FaultFront(server.url) as front:
        assert held_open(front.url, front.server) == [1]


def test_the_socket_serve_binds_turns_nagle_off_under_uvicorn() -> None:
    sock = bind_socket("127.0.0.1", 0)
    app = Starlette(routes=[Route("/health", lambda request: JSONResponse({"ok": True}))])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        assert held_open(f"http://127.0.0.1:{sock.getsockname()[1]}", server) == [1]
    finally:
        server.should_exit = True
        thread.join(timeout=60)
