"""One backend's answer, judged before the client sees a byte of it, then relayed.

Knows: how much of an answer is held back. An error status (4xx/5xx) and a 200 that is not a
stream are read whole (they arrive whole anyway: a non-streamed completion is sent when it is
done) and checked (answers.py); a stream is held back until its first event is whole and good.
Until then nothing has reached the client and `receive` can refuse the answer (`Refused`): the
proxy ejects the backend and tries another. After that, a stream is relayed event by event as
events complete, each checked: a bad event, a stream that stops without `data: [DONE]`, or a
backend lost mid-stream ends the client's stream with an OpenAI error event (what a tieredkv
server itself sends then) and the backend is ejected (`on_broken`).
A client that leaves mid-stream ends the relay at once (the stream's iterator is closed, the
backend's connection with it: the backend aborts the request) and is `on_gone()`: a client's
event, not the backend's.
Answers are read decoded (httpx undoes a Content-Encoding), so Content-Encoding and
Content-Length are not passed on.
Doesn't know: which backend to try next (proxy.py) or ejection's rules (ejection.py).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio
import httpx
from fastapi.responses import Response

from service.disconnect import ClosingStreamingResponse

from service.request_body import read_bounded
from service.router import answers
from service.router.answers import EventStream

log = logging.getLogger("tieredkv.router")
MAX_ANSWER_BYTES = 64 << 20        # a whole (non-stream) answer past this is refused: no completion is that big
DROP_FROM_ANSWER = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                    "transfer-encoding", "upgrade", "server", "date", "content-length", "content-encoding"}


@dataclass(frozen=True, slots=True)
class Refused:
    """An answer that must not reach the client: why, and the label its ejection is counted under."""
    reason: str
    label: str


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_failed"}}
    return f"data: {json.dumps(body)}\n\n".encode()


async def _read_whole(upstream: httpx.Response) -> bytes | None:
    return await read_bounded(upstream.aiter_bytes(), MAX_ANSWER_BYTES)


async def receive(upstream: httpx.Response, kind: str, sse: bool, headers: dict[str, str],
                  on_started: Callable[[], None], on_broken: Callable[[str, str], None],
                  on_done: Callable[[], None], on_gone: Callable[[], None] = lambda: None) -> Response | Refused:
    """The client's response for `upstream`, or Refused. `headers` go on the response;
    `on_started` runs once the answer has begun, `on_broken(reason, label)` if a stream breaks
    after its first event was sent, `on_done` when the answer is over (sent, refused or dropped),
    `on_gone` when the client left before a relayed stream's end.
    Raises httpx.HTTPError if the backend fails before the answer is judged (the caller retries)."""
    status = upstream.status_code
    answer = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_FROM_ANSWER}
    answer.update(headers)
    streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
    if status != 200 or not sse:
        raw = await _read_whole(upstream)
        on_started()
        await upstream.aclose()
        on_done()
        if raw is None:
            return Refused(f"an answer larger than {MAX_ANSWER_BYTES} bytes", "garbage")
        if status >= 400:
            bad = answers.check_error(raw)
        elif status == 200 and not streamed:
            bad = answers.check_body(kind, raw)
        else:
            bad = f"HTTP {status}{' as a stream' if streamed else ''} to a request that is not a stream"
        if bad is not None:
            return Refused(bad, f"http_{status}" if status >= 500 else "garbage")
        return Response(raw, status_code=status, headers=answer)
    if not streamed:
        await upstream.aclose()
        on_done()
        return Refused(f"a 200 to a stream request that is {upstream.headers.get('content-type')!r}, "
                       "not text/event-stream", "garbage")
    events = EventStream()
    chunks = upstream.aiter_bytes()
    held: list[bytes] = []
    judged = data = False
    try:
        while not data:             # comments (keep-alives) alone judge nothing: wait for a data event
            chunk = await anext(chunks, None)
            if chunk is None:
                return Refused("a stream that ended before its first event", "garbage")
            for event in events.feed(chunk):
                bad, _ = answers.check_event(kind, event)
                if bad is not None:
                    return Refused(bad, "garbage")
                held.append(event)
                data = data or b"\ndata" in b"\n" + event
            if events.overflowed:
                return Refused(f"a stream event longer than {events.limit} bytes", "garbage")
        judged = True
    finally:
        if not judged:              # refused, or the backend failed: the stream is not relayed
            await upstream.aclose()
            on_done()
    on_started()
    return ClosingStreamingResponse(_relay(kind, upstream, held, events, chunks, on_broken, on_done, on_gone),
                                    status_code=status, headers=answer)


async def _relay(kind: str, upstream: httpx.Response, held: list[bytes], events: EventStream,
                 chunks: AsyncIterator[bytes], on_broken: Callable[[str, str], None],
                 on_done: Callable[[], None], on_gone: Callable[[], None]) -> AsyncIterator[bytes]:
    done = ended = False
    try:
        for event in held:
            done = done or answers.check_event(kind, event)[1]
            yield event
        async for chunk in chunks:
            for event in events.feed(chunk):
                bad, finished = answers.check_event(kind, event)
                if bad is not None:
                    on_broken(bad, "garbage")
                    ended = True
                    yield error_event("the backend sent a broken stream event")
                    return
                done = done or finished
                yield event
            if events.overflowed:
                on_broken(f"a stream event longer than {events.limit} bytes", "garbage")
                ended = True
                yield error_event("the backend sent a broken stream event")
                return
        ended = True
        if not done:
            on_broken("a stream that ended without data: [DONE]", "garbage")
            yield error_event("the backend's stream ended early")
    except httpx.HTTPError as e:
        log.warning("router: a backend failed mid-stream: %s: %s", type(e).__name__, e)
        on_broken(f"failed mid-stream: {type(e).__name__}: {e}", "timeout" if isinstance(e, httpx.TimeoutException)
                  else "mid_stream")
        ended = True
        yield error_event(f"the backend failed mid-stream: {type(e).__name__}")
    finally:
        on_done()
        if not ended:               # closed or cancelled before the end: the client left
            on_gone()
        # NOTE: shielded: a client gone cancels the relay's task (anyio: every await in its scope is
        # cancelled again), and an unclosed connection would leave the backend generating for nobody.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
