"""service/router/answers.py: what a backend's answer must look like before the router passes it on.

The verdicts on the shapes a real tieredkv server answers with (service/responses.py's own
writers make the good ones) and on bytes a broken backend sends.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

from service.responses import ChunkWriter, SSE_DONE, chat_body, completion_body
from service.router import answers
from service.router.answers import CHAT, COMPLETION, MODEL, MODELS, EventStream, check_body, check_error, check_event

USAGE = SimpleNamespace(prompt_tokens=3, completion_tokens=2, prompt_cache_hit_tokens=0, prompt_cache_miss_tokens=3,
                        hit_tokens_by_tier={})
OUT = SimpleNamespace(request_id="cmpl-ab12", index=0, text="hi", finish_reason="length", usage=USAGE)


def test_a_servers_own_bodies_pass_and_garbage_does_not() -> None:
    assert check_body(COMPLETION, json.dumps(completion_body(OUT, "m", 1)).encode()) is None
    assert check_body(CHAT, json.dumps(chat_body(OUT, "m", 1)).encode()) is None
    assert check_body(CHAT, json.dumps(completion_body(OUT, "m", 1)).encode()) is not None     # the wrong route's
    assert check_body(MODELS, b'{"object": "list", "data": [{"id": "m"}]}') is None
    assert check_body(MODEL, b'{"id": "m"}') is None
    for garbage in (b"\x89PNG\r\n", b"\xff\xfe{}", b"[1]", b"[" * 5000, b'{"choices": []}', b"", b"null",
                    b'{"object": "text_completion", "choices": [{"text": 5}]}', b"1" * 5000):
        assert check_body(COMPLETION, garbage) is not None, garbage
    assert "not a JSON object" in check_body(COMPLETION, b"\xff" * 500)
    assert len(check_body(COMPLETION, b"x" * 10_000)) < 300                                   # quoted short


def test_an_error_must_be_openais_error_object() -> None:
    assert check_error(b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}') is None
    for garbage in (b"Internal Server Error", b'{"detail": "Not Found"}', b'{"error": "bad"}', b"\xc3\x28"):
        assert check_error(garbage) is not None, garbage


def test_a_servers_own_stream_events_pass_and_broken_ones_do_not() -> None:
    for chat in (False, True):
        w = ChunkWriter("cmpl-1", "m", 1, chat=chat, include_usage=True)
        kind = CHAT if chat else COMPLETION
        events = ([w.role()] if chat else []) + [w.text("a"), w.text("b", "length"), w.usage(USAGE), SSE_DONE]
        verdicts = [check_event(kind, e) for e in events]
        assert verdicts == [(None, False)] * (len(events) - 1) + [(None, True)]
    error = b'data: {"error": {"message": "engine failed", "type": "server_error", "param": null, "code": null}}\n\n'
    assert check_event(COMPLETION, error) == (None, False)            # the backend's own error event passes
    assert check_event(COMPLETION, b": keep-alive\n\n") == (None, False)
    for bad in (b"data: \x89PNG\n\n", b"garbage\n\n", b'data: {"object": "chat.completion.chunk", "choices": []}\n\n',
                b'data: {"object": "text_completion", "choices": [{"delta": {}}]}\n\n'):
        assert check_event(COMPLETION, bad)[0] is not None, bad


def test_events_are_cut_whole_across_chunks_and_crlf() -> None:
    s = EventStream()
    assert s.feed(b"data: {\"a\"") == [] and s.pending == b"data: {\"a\""
    assert s.feed(b": 1}\r\n\r\ndata: [DO") == [b'data: {"a": 1}\n\n']
    assert s.feed(b"NE]\n\n") == [b"data: [DONE]\n\n"] and s.pending == b""
    big = EventStream(limit=10)
    big.feed(b"data: " + b"x" * 20)
    assert big.overflowed
    assert answers.kind_of("POST", "/v1/chat/completions") == CHAT and answers.kind_of("GET", "/v1/models/m") == MODEL
