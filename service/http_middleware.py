"""The base of the service's ASGI middlewares: HTTP requests go to `http`, anything else
(lifespan, websockets) passes through untouched.

Knows: that one dispatch, and `StatusSend`, the send wrapper that remembers a response's status
(the request log and the request counter both need it after the app is done). Doesn't know: what any middleware does (service/app.py and
service/request_log.py define them).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMiddleware:
    """An ASGI middleware that acts on HTTP requests (`http`); anything else passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class StatusSend:
    """`send` for the app, remembering whether a response has started and its status: 500 until
    one starts (an app that raises before it has sent one is counted and logged as a 500, as the
    server answers)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.status = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started, self.status = True, message["status"]
        await self._send(message)
