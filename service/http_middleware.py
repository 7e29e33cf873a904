"""The base of the service's ASGI middlewares: HTTP requests go to `http`, anything else
(lifespan, websockets) passes through untouched.

Knows: that one dispatch. Doesn't know: what any middleware does (service/app.py and
service/request_log.py define them).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


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
