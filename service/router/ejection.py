"""Passive health: a backend judged by its real answers is ejected, and readmitted only by a probe.

Knows: the verdicts. A backend is ejected -- out of rotation, counted by reason, `last_error`
set -- when an answer it gave is garbage (a 200 whose body is not the route's JSON or whose
stream is not the route's SSE events; an error status without OpenAI's error body), a 5xx, a
timeout or a connection that fails, and when one of its JSON routes (/health,
/v1/cache/status, /v1/cache/block_hashes) answers bytes that are not a JSON object. It stays
out for a cool-down (`cooldown_s`, doubled after each failed probe up to `max_cooldown_s`);
then the health loop probes it: GET /health and GET /v1/models must answer good JSON and a
real one-token completion (POST /v1/completions, `user` "tieredkv-router-probe", with the
router's --api-key where given) must answer a good completion. Only then does it get traffic
again. A probe is a real request: a backend bills it to the probe's tenant (or the key's).
A request's own failure does not eject the last backend in rotation unless it is the third
request in a row that backend failed (SPARE_LIMIT): one request that breaks every
backend (a server bug it triggers) would otherwise take the whole fleet out. A spared failure is
counted and its answer still never reaches the client.
Doesn't know: when answers are judged (proxy.py, relay.py, backends.py) or what a route's
answer looks like (answers.py).
NOTE: runs on the event loop, as the backend set does; no lock.
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol

import httpx

from service.router import answers

log = logging.getLogger("tieredkv.router")
SPARE_LIMIT = 3         # requests failed in a row that eject even the last backend up
PROBE_USER = "tieredkv-router-probe"
PROBE_PROMPT = "Hello"


class Ejectable(Protocol):
    """What ejection reads and writes of a backend (backends.py's Backend)."""
    url: str
    healthy: bool
    ejected: bool
    ejections: dict[str, int]
    last_error: str | None
    probes: dict[str, int]
    readmissions: int
    readmit_at: float
    cooldown_s: float


class Ejector:
    def __init__(self, client: httpx.AsyncClient, *, cooldown_s: float, max_cooldown_s: float,
                 timeout_s: float, api_key: str | None, clock: Callable[[], float]) -> None:
        self.client = client
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.clock = clock

    def eject(self, b: Ejectable, reason: str, label: str) -> None:
        """Out of rotation until a probe after the cool-down passes; counted under `label`."""
        if not b.ejected:
            log.warning("router: backend %s ejected (%s): %s", b.url, label, reason)
            b.cooldown_s = self.cooldown_s
            b.readmit_at = self.clock() + b.cooldown_s
        b.ejected, b.healthy, b.last_error = True, False, reason
        b.ejections[label] = b.ejections.get(label, 0) + 1

    def due(self, b: Ejectable) -> bool:
        """An ejected backend's cool-down is over: probe it now."""
        return self.clock() >= b.readmit_at

    def probe_failed(self, b: Ejectable, reason: str) -> None:
        b.probes["failed"] = b.probes.get("failed", 0) + 1
        b.cooldown_s = min(self.max_cooldown_s, max(b.cooldown_s, self.cooldown_s) * 2)
        b.readmit_at = self.clock() + b.cooldown_s
        b.last_error = f"probe failed: {reason}"
        log.info("router: backend %s stays ejected (%s); next probe in %.1f s", b.url, reason, b.cooldown_s)

    def readmit(self, b: Ejectable) -> None:
        b.probes["passed"] = b.probes.get("passed", 0) + 1
        b.readmissions += 1
        b.ejected = False
        b.cooldown_s = 0.0
        log.warning("router: backend %s readmitted: a probe completion was good", b.url)

    async def probe(self, b: Ejectable) -> str | None:
        """A real tiny completion on `b`, after GET /v1/models names its model: None when every
        answer was good, else what was wrong."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await self.client.get(f"{b.url}/v1/models", headers=headers, timeout=self.timeout_s)
            if r.status_code != 200 or (bad := answers.check_body(answers.MODELS, r.content)) is not None:
                return f"/v1/models answered {r.status_code}" + ("" if r.status_code != 200 else f": {bad}")
            models = [m.get("id") for m in answers.json_object(r.content)["data"] if isinstance(m, dict)]
            model = next((m for m in models if isinstance(m, str)), None)
            if model is None:
                return "/v1/models names no model"
            body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0, "user": PROBE_USER}
            r = await self.client.post(f"{b.url}/v1/completions", json=body, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"the probe completion answered {r.status_code}: {answers.quoted(r.content)}"
        return answers.check_body(answers.COMPLETION, r.content)
