"""Noticing that an HTTP client went away, so its request can be aborted (engine/abort.py).

Knows: the two places a disconnect shows -- the ASGI `http.disconnect` message, which a route
awaits once it has read the body (`until_disconnected`), and the end of a streamed response,
however it ends (`ClosingStreamingResponse` closes its body iterator at once, so the body's
cleanup -- the abort -- runs now rather than when the garbage collector finds the generator).
Doesn't know: the engine, routes or what an abort bills.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


async def until_disconnected(request: Request) -> None:
    """Returns when the client has closed its connection. Await it only after the body was read
    (it takes the request's next ASGI messages), and cancel it before the response starts."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse whose async body iterator is closed as soon as the response ends --
    finished, or cut short by a client that disconnected (Starlette then cancels the sending
    and leaves the generator suspended at a yield)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
