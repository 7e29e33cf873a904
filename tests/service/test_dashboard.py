"""/dashboard in a real headless browser: Debian's chromium driven by playwright.

A real server on loopback (tiny engine), the page loaded from it: no console error, no request
to any other host (the page works offline), every number it shows equal to the JSON route it came
from (each carries data-k="<route>.<path>" and its raw data-value), and the numbers, the chart and
the prefix tree follow requests made after the page loaded. With API keys the page asks for a key,
sends no data request before it has one, and shows a user key only its own tenant.

Needs playwright (pip) and a chromium binary (`apt-get install chromium`): tools/setup.sh installs
both. Without them these tests fail and say so; they never skip.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, write_keys
from tests.service.tiny_engine import build_engine

PROMPT = ("A tiered KV cache keeps the prefixes of earlier prompts in device memory, host memory and "
          "on disk, so a later prompt that shares one only computes its suffix. ")
OTHER = "Tenants never share blocks: each one's hash chain starts from a namespace salted with its name. " * 2
ADMIN, BETA = "sk-admin-0001", "sk-beta-0001"
KEYS = {ADMIN: {"tenant": "ops", "role": "admin"}, BETA: {"tenant": "beta", "role": "user"}}


def chromium_path() -> str:
    path = os.environ.get("TIEREDKV_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if path is None:
        pytest.fail("no chromium binary: the dashboard's browser test needs one. Run tools/setup.sh "
                    "(apt-get install chromium on Debian/Ubuntu), or set TIEREDKV_CHROMIUM=/path/to/chrome",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run tools/setup.sh (pip install playwright; its own "
                    "browser download is not needed, the system chromium is used)", pytrace=False)
    executable = chromium_path()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True)
        yield b
        b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and requests recorded; any request to
    another origin is refused and recorded (the page must work offline)."""

    def __init__(self, browser, origin: str) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.foreign: list[str] = []
        self.requests: list[tuple[str, dict]] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append((r.url, r.headers)))

        def gate(route):
            if route.request.url.startswith(origin + "/") or route.request.url.startswith("data:"):
                route.continue_()
            else:
                self.foreign.append(route.request.url)
                route.abort()
        self.page.route("**/*", gate)

    def polls(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.polls || 0)"))

    def wait_polls(self, n: int, timeout_s: float = 30) -> None:
        # NOTE: polled from here: page.wait_for_function evaluates its predicate as a string,
        # which the page's Content-Security-Policy (no 'unsafe-eval') refuses, as it should.
        deadline = time.monotonic() + timeout_s
        while self.polls() < n:
            assert time.monotonic() < deadline, f"the page made {self.polls()} polls, not {n}: {self.errors}"
            time.sleep(0.1)

    def shown(self) -> list[tuple[str, str, str]]:
        """(data-k, data-value, text) of every number on the page that is visible."""
        return self.page.eval_on_selector_all(
            "[data-k]", "els => els.filter(e => e.offsetParent !== null)"
                        ".map(e => [e.dataset.k, e.dataset.value, e.textContent])")


def dig(doc: dict, path: list[str]):
    for part in path:
        doc = doc[part]
    return doc


def check_numbers(w: Watched, routes: dict[str, dict]) -> int:
    """Every number shown equals the value at its path in its route's JSON; returns how many."""
    compared = 0
    for k, value, text in w.shown():
        route, *path = k.split(".")
        expected = dig(routes[route], path)
        got = json.loads(value) if value else None
        assert got == expected, f"{k}: the page shows {got!r} ({text!r}), the route says {expected!r}"
        if isinstance(expected, int) and not isinstance(expected, bool) and not k.endswith("_bytes"):
            assert text.replace(",", "") == str(expected), f"{k}: shown as {text!r}, the route says {expected}"
        compared += 1
    return compared


def complete(c, engine, prompt: str, user: str | None = None, headers: dict | None = None) -> dict:
    body = {"model": engine.model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    if user:
        body["user"] = user
    r = c.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def snapshot(c, headers: dict | None = None) -> dict[str, dict]:
    return {name: c.get(f"/v1/cache/{name}", headers=headers or {}).json() for name in ("status", "billing", "tree")}


def test_the_page_shows_what_status_says_and_follows_new_requests(server, engine, browser, tmp_path) -> None:
    with server.client() as c:
        complete(c, engine, PROMPT, user="acme")
        w = Watched(browser, server.url)
        w.page.goto(server.url + "/dashboard")
        w.wait_polls(1)
        assert w.page.is_visible("#tiers") and w.page.is_hidden("#login")
        routes = snapshot(c)
        n = check_numbers(w, routes)
        assert n > 40, f"only {n} numbers on the page"
        keys = {k for k, _, _ in w.shown()}
        for k in ("status.tiers.device.used_bytes", "status.tiers.device.capacity_bytes", "status.tiers.host.hit_tokens",
                  "status.tiers.disk.moved_aside", "status.tiers.disk.corrupt", "status.service.in_flight",
                  "status.engine.loading", "status.service.ttft_by_source.miss.p50_s", "billing.tenants.acme.cost_usd",
                  "tree.tenants.acme.blocks"):
            assert k in keys, f"{k} is not shown"
        assert routes["tree"]["tenants"]["acme"]["blocks"] > 0
        assert "tiered KV cache keeps the prefixes" in w.page.inner_text("#tree")
        device_hits = routes["status"]["tiers"]["device"]["hit_tokens"]

        # Requests after the page loaded: a device hit for acme, a new tenant.
        usage = complete(c, engine, PROMPT, user="acme")
        assert usage["prompt_cache_hit_tokens_by_tier"]["device"] > 0
        complete(c, engine, OTHER, user="beta")
        after = c.get("/v1/cache/status").json()["tiers"]["device"]["hit_tokens"]
        assert after > device_hits
        w.page.wait_for_selector(f'[data-k="status.tiers.device.hit_tokens"][data-value="{after}"]', timeout=30_000)
        w.wait_polls(w.polls() + 2)              # a poll that read the tree too (every other one)
        routes = snapshot(c)
        check_numbers(w, routes)
        assert routes["billing"]["tenants"]["acme"]["requests"] == 2
        assert w.page.is_visible('tr[data-tenant="beta"]')
        assert "Tenants never share blocks" in w.page.inner_text("#tree")
        assert w.page.eval_on_selector_all("#chart polyline", "els => els.length") == 4
        assert w.page.get_attribute('[data-k="status.service.ttft_by_source.device.requests"]', "data-value") == "1"
        # Like with like (issue 40): the device hit beside the miss of the same prompt's length.
        by_length = routes["status"]["service"]["ttft_by_length"]
        both = [k for k, b in by_length.items() if None not in (b["p50_s"]["device"], b["p50_s"]["miss"])]
        assert both, by_length
        assert w.page.is_visible(f'tr[data-length="{both[0]}"] [data-k="status.service.ttft_by_length.{both[0]}.p50_s.device"]')
        assert "only lengths where a miss and a hit both ran" in w.page.inner_text("#ttft-section")
        w.page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        if os.environ.get("TIEREDKV_DASHBOARD_SCREENSHOT"):       # how docs/dashboard.png is made
            w.page.screenshot(path=os.environ["TIEREDKV_DASHBOARD_SCREENSHOT"], full_page=True)
        assert w.errors == [], f"console errors: {w.errors}"
        assert w.foreign == [], f"the page asked another host: {w.foreign}"
        w.page.close()


def test_the_page_is_served_without_secrets_under_a_strict_policy(server) -> None:
    with server.client() as c:
        r = c.get("/dashboard")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert 'content="none"' in r.text          # no keys on this server: the page need not ask
        for name in ("dashboard.js", "dashboard.css"):
            assert c.get(f"/dashboard/{name}").status_code == 200
        assert c.get("/dashboard/../app.py").status_code == 404
        assert c.get("/dashboard/nope.js").status_code == 404
        assert "/dashboard" not in c.get("/openapi.json").json()["paths"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("dash-keys")
    settings = ServiceSettings(api_keys_file=write_keys(tmp / "keys.json", KEYS))
    with ServerThread(build_engine(tmp, tokenizer), settings) as s:
        yield s


def test_with_keys_the_page_asks_for_one_and_shows_what_it_may_see(keyed, browser) -> None:
    admin, beta = {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": f"Bearer {BETA}"}
    with keyed.client() as c:
        complete(c, keyed.engine, PROMPT, headers=admin)
        complete(c, keyed.engine, OTHER, headers=beta)
        w = Watched(browser, keyed.url)
        w.page.goto(keyed.url + "/dashboard")
        w.page.wait_for_selector("#login", state="visible")
        time.sleep(0.5)
        assert not [u for u, _ in w.requests if "/v1/" in u], "the page asked for data before it had a key"

        # A user key: its own tenant's usage and prefixes, no tier-wide numbers.
        w.page.fill("#key", BETA)
        w.page.click("#login button[type=submit]")
        w.wait_polls(1)
        assert w.page.is_hidden("#tiers-section") and w.page.is_visible("#scope-note")
        assert "tenant beta" in w.page.inner_text("#scope-note")
        check_numbers(w, snapshot(c, beta))
        assert set(c.get("/v1/cache/tree", headers=beta).json()["tenants"]) == {"beta"}
        tree = w.page.inner_text("#tree")
        assert "Tenants never share blocks" in tree and "tiered KV cache" not in tree
        sent = [h.get("authorization") for u, h in w.requests if "/v1/cache/status" in u]
        assert sent and all(s == f"Bearer {BETA}" for s in sent)

        # Forget it, then an admin key: the whole cache.
        w.page.click("#forget")
        w.page.wait_for_selector("#login", state="visible")
        assert w.page.evaluate("sessionStorage.length") == 0
        w.page.fill("#key", ADMIN)
        w.page.click("#login button[type=submit]")
        w.page.wait_for_selector("#tiers-section", state="visible")
        w.wait_polls(w.polls() + 2)
        check_numbers(w, snapshot(c, admin))
        tree = w.page.inner_text("#tree")
        assert "Tenants never share blocks" in tree and "tiered KV cache" in tree
        assert w.errors == [], f"console errors: {w.errors}"

        # A wrong key: the form again, saying why (the refused fetch is a console error: expected).
        w.page.click("#forget")
        w.page.fill("#key", "sk-wrong-0000")
        w.page.click("#login button[type=submit]")
        w.page.wait_for_selector("#login-error:has-text('invalid API key')")
        assert w.foreign == []
        w.page.close()


def test_the_first_paint_is_filled_from_the_servers_history(server, engine, browser, tmp_path) -> None:
    """Issue 31: a screenshot at load shows the cache, not "connecting...": without keys the page
    carries the status and the server's recent hit history; its own fetches are held back here,
    so what is drawn came with the page. The chart's axes read at a glance."""
    with server.client() as c:
        complete(c, engine, PROMPT, user="acme")
        complete(c, engine, PROMPT, user="acme")            # device hits
        deadline = time.monotonic() + 60
        while len(c.get("/v1/cache/status", params={"history": 1}).json()["service"]["hit_history"]["samples"]) < 3:
            assert time.monotonic() < deadline, "the server kept no hit history"
            time.sleep(0.2)
    w = Watched(browser, server.url)
    w.page.route("**/v1/cache/**", lambda route: None)     # never answered: the page has only itself
    w.page.goto(server.url + "/dashboard")
    shot = tmp_path / "first.png"
    w.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    assert "connecting" not in w.page.inner_text("#updated")
    assert w.page.is_visible("#tiers") and w.polls() == 0
    assert w.page.eval_on_selector_all("#chart polyline", "els => els.length") == 4
    labels = w.page.eval_on_selector_all("#chart text.axis", "els => els.map(e => e.textContent)")
    assert "-5 min" in labels and "now" in labels
    ticks = labels[:3]
    assert len(set(ticks)) == 3, ticks                     # distinct y ticks (it read "1, 1, 0")
    assert "(the last 5 minutes" in w.page.inner_text("#main")
    assert w.page.is_visible('[data-k="status.service.ttft_by_source.device.p50_per_1k_s"]')
    # Issue 40: the Tenants and Cached prefixes panels are filled at first paint, not empty headers.
    assert w.page.is_visible('tr[data-tenant="acme"]')
    assert "tiered KV cache keeps the prefixes" in w.page.inner_text("#tree")
    with server.client() as c:
        routes = snapshot(c)
    keys = {k for k, _, _ in w.shown()}
    assert {"billing.tenants.acme.requests", "tree.tenants.acme.blocks"} <= keys, keys
    check_numbers(w, {"billing": routes["billing"], "tree": routes["tree"], "status": routes["status"]})
    assert w.errors == [] and w.foreign == [], (w.errors, w.foreign)
    w.page.close()


def test_loading_the_page_and_its_polling_log_nothing_at_info(server, browser, caplog) -> None:
    """Issue 40: a dashboard left open must not bury the request log -- its page, files and
    fetches are DEBUG lines (INFO only under serve --log-probes)."""
    caplog.set_level(logging.DEBUG, logger="tieredkv.requests")
    w = Watched(browser, server.url)
    w.page.goto(server.url + "/dashboard")
    w.wait_polls(2)
    w.page.close()
    lines = [r for r in caplog.records if r.name == "tieredkv.requests"]
    paths = {r.request_fields["path"] for r in lines}
    assert {"/dashboard", "/dashboard/dashboard.js", "/v1/cache/status"} <= paths, paths
    info = [r.getMessage() for r in lines if r.levelno >= logging.INFO]
    assert info == [], f"a dashboard load logged at INFO: {info}"
