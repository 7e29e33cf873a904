"""Noticing that an HTTP client went away, so its request can be aborted (engine/abort.py).

Knows: the two places a disconnect shows -- the ASGI `http.disconnect` message, which a route
awaits once it has read the body (`until_disconnected`), and the end of a streamed response,
however it ends (`ClosingStreamingResponse` closes its body iterator at once, so the body's
cleanup -- the abort -- runs now rather than when the garbage collector finds the generator).
And what a disconnect is to the operator (issue 41): a client's event, never a server error --
`ClientGone`, a 499 nobody reads (nginx's "client closed request"), logged as one INFO line and
counted by the phase it left in (`PHASES`): "body" (before its body was read), "queued" (after it,
before the response began: waiting in the queue or for a non-streamed answer), "streaming" (after
a stream's first chunk was sent: its line keeps the 200 the client got).
Doesn't know: the engine, routes or what an abort bills.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.abort import CLIENT_DISCONNECTED
from service.errors import APIError

PHASES = ("body", "queued", "streaming")
CLIENT_CLOSED = 499           # nginx's status for a client that closed the connection first


class ClientGone(APIError):
    """The client closed its connection before its response began: a 499 (which it never reads)
    whose message is the request log's reason; `phase` is one of PHASES."""

    def __init__(self, phase: str, message: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES}, got {phase!r}")
        super().__init__(CLIENT_CLOSED, message, code=CLIENT_DISCONNECTED)
        self.phase = phase


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
