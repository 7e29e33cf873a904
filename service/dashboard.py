"""/dashboard: a live page of the cache, served as static files shipped in the package.

Knows: where the page's files are (service/static/, package data), and how they are served: the
script and stylesheet hold no secret and no data, the HTML none on a server with keys (without
keys, where every caller is an admin, it carries the cache status for the first paint), so they are served to anyone, under a
Content-Security-Policy that allows this origin only (no CDN, no inline script, no other host),
which also keeps any prompt text the page shows from running as script. The data comes from the
JSON routes (/v1/cache/status, /tree, /billing, /health), each authenticated as it always is: on
a server with keys the page asks for a key, keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer` on its fetches (a navigation cannot carry that header).
Doesn't know: what the page draws (service/static/dashboard.js does).
"""
from __future__ import annotations

import json
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.context import ctx

router = APIRouter()

_FILES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("service").joinpath("static", name).read_bytes()


@router.get("/dashboard", include_in_schema=False)
async def dashboard(request: Request) -> Response:
    # The page is told whether to ask for a key before its first fetch (a fetch refused 401 is
    # an error in the browser's console); which keys exist is not said.
    c = ctx(request)
    auth = "none" if c.keys is None else "keys"
    html = _read("dashboard.html").replace(b"{{AUTH}}", auth.encode())
    return Response(html.replace(b"{{INITIAL}}", await _initial(c)), media_type="text/html; charset=utf-8",
                    headers=_HEADERS)


async def _initial(c: Any) -> bytes:
    """The page's first paint: without keys (every caller is an admin, on loopback), what the
    page's first poll would read -- `status` (/v1/cache/status?history=1), `billing`
    (/v1/cache/billing) and `tree` (/v1/cache/tree) -- as JSON data inside the page (a script of
    type application/json is data, never run; "</" escaped so it cannot close its element), so
    the Tenants and Cached prefixes panels are not empty headers until then. With keys: nothing
    (the page asks for a key first); on a failed status read: nothing (the page polls); a
    billing or tree that cannot be read is null (its panel waits for the polls)."""
    if c.keys is not None:
        return b""
    try:
        status = await run_in_threadpool(c.engine.cache_status)
    except Exception:
        return b""
    body = {"status": {**status, "service": {"in_flight": c.dispatcher.in_flight,
                                             "ttft_by_source": c.metrics.recent_ttft.summary(),
                                             "ttft_by_length": c.metrics.recent_ttft.by_length(),
                                             "hit_history": c.history.snapshot()}},
            "billing": await _optional(getattr(getattr(c.engine, "ledger", None), "summary", None)),
            "tree": await _optional(getattr(c.engine, "prefix_tree", None), None, depth=8, width=8)}
    return json.dumps(body).replace("</", "<\\/").encode()


async def _optional(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in the thread pool; None without fn or when it fails (a first paint
    shows what it can)."""
    if fn is None:
        return None
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except Exception:
        return None


@router.get("/dashboard/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media = _FILES.get(name)
    if media is None:
        return Response("not found\n", status_code=404, media_type="text/plain")
    return Response(_read(name), media_type=media, headers=_HEADERS)
