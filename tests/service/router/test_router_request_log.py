"""Issue 40, item 4: the router logs one line per proxied request in the server's format, with
the request id the backend made, the tenant and the backend that answered; uvicorn's access
line is off; a successful probe is DEBUG.

A real router in front of one real tiny-engine server on loopback.
"""
from __future__ import annotations

import logging

import pytest

from tests.service.conftest import ServerThread
from tests.service.router.harness import MODEL, RouterThread, complete, events_kw
from tests.service.tiny_engine import build_engine


@pytest.fixture(scope="module")
def backend(tmp_path_factory, tokenizer):
    with ServerThread(build_engine(tmp_path_factory.mktemp("rlog") / "a", tokenizer, **events_kw())) as a:
        yield a


def router_lines(caplog, path: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tieredkv.router.requests" and f" {path} " in r.getMessage()]


def test_one_line_per_proxied_request_with_id_tenant_and_backend(backend, caplog) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    caplog.set_level(logging.DEBUG, logger="tieredkv.router.requests")     # last: the handler's level
    with RouterThread(backend.url) as r, r.client() as c:      # lines are all written once it stops
        got = complete(c, "the router logs this request " * 4, user="alice")
        assert got.status_code == 200
        body_id = got.json()["id"]
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "stream me"}],
                            "max_tokens": 3, "stream": True, "user": "bob"}) as s:
            assert s.status_code == 200
            stream_id = s.headers["x-request-id"]
            "".join(s.iter_text())
        assert c.get("/health").status_code == 200

    lines = router_lines(caplog, "/v1/completions")
    assert len(lines) == 1, [x.getMessage() for x in lines]
    msg = lines[0].getMessage()
    assert msg.startswith(f"id={body_id} tenant=alice POST /v1/completions 200 backend={backend.url} "), msg
    assert lines[0].levelno == logging.INFO
    fields = lines[0].request_fields
    assert fields["prompt_tokens"] > 0 and fields["time_ms"] >= 0

    chat = router_lines(caplog, "/v1/chat/completions")
    assert len(chat) == 1
    assert chat[0].getMessage().startswith(f"id={stream_id} tenant=bob POST /v1/chat/completions 200 "
                                           f"backend={backend.url}")

    health = router_lines(caplog, "/health")
    assert [x.levelno for x in health] == [logging.DEBUG]
    assert not [x for x in caplog.records if x.name == "uvicorn.access"], "uvicorn's access line is on"


def test_an_answer_of_the_routers_own_is_logged_with_no_backend(backend, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tieredkv.router.requests")
    with RouterThread(backend.url) as r, r.client() as c:
        got = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json",
                                                                        "x-request-id": "client-42"})
        assert got.status_code == 400
    [line] = router_lines(caplog, "/v1/completions")
    assert line.getMessage().startswith("id=client-42 tenant=- POST /v1/completions 400 backend=- "), line.getMessage()
