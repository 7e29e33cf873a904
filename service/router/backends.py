"""The backend set: which servers are up, what the router has in flight on each, and their event streams.

Knows: health -- every `health_interval_s` each backend's GET /health is asked; a refused
connection, a non-200 answer (503: shutting down, engine stopped) or two failed checks in a row
take a backend out of rotation, as does a connection the proxy could not make (`mark_down`), and
one good check brings it back. A restart -- /health's `instance` changed, or a backend that
does not report one came back after being down -- drops the backend's index entries (its caches
are not the ones the router knew) and starts a fresh subscriber, which replays the new
publisher's buffer from seq 0. The events endpoint comes from the backend's GET /v1/cache/status
(`kv_events`; it needs an admin key where the backend has keys: `api_key`); a `*`/0.0.0.0 host
there means the backend's own host. A backend without events is routed by predictions only.
Doesn't know: routing (policy.py) or proxying (proxy.py).
NOTE: everything here runs on the event loop; counts need no lock.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq.asyncio

from service.router.index import PrefixIndex
from service.router.subscriber import EventSubscriber

log = logging.getLogger("tieredkv.router")
ANY_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}


@dataclass
class Backend:
    url: str
    healthy: bool = False
    in_flight: int = 0
    pending_tokens: int = 0               # predicted prefill of its requests not answering yet
    routed: int = 0
    instance: str | None = None
    failures: int = 0                     # consecutive failed health checks
    was_down: bool = False                # down since the router last saw it healthy
    last_error: str | None = None
    events: dict[str, Any] | None = None  # the backend's kv_events status; None: not learnt yet
    subscriber: EventSubscriber | None = None
    notes: set[str] = field(default_factory=set)     # warnings logged once

    @property
    def name(self) -> str:
        return self.url

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self.notes:
            self.notes.add(key)
            log.warning(message, *args)

    def view(self, index: PrefixIndex) -> dict[str, Any]:
        sub = self.subscriber
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "pending_tokens": self.pending_tokens, "routed": self.routed,
                "instance": self.instance, "last_error": self.last_error,
                "index_blocks": index.blocks(self.name), "predicted_blocks": index.predicted(self.name),
                "events": None if sub is None else {"endpoint": sub.endpoint, "last_seq": sub.last_seq,
                                                    **vars(sub.stats)}}


def connect_address(endpoint: str, backend_url: str) -> str:
    """A publisher's bind address as a subscriber connects to it: tcp://*:5557 on the backend at
    http://10.0.0.5:8000 is tcp://10.0.0.5:5557."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    host, _, port = rest.rpartition(":")
    if host in ANY_HOSTS:
        backend_host = urlsplit(backend_url).hostname or "127.0.0.1"
        host = f"[{backend_host}]" if ":" in backend_host else backend_host
    return f"tcp://{host}:{port}"


class BackendSet:
    def __init__(self, urls: list[str], index: PrefixIndex, client: httpx.AsyncClient, *,
                 health_interval_s: float = 2.0, health_timeout_s: float = 5.0, api_key: str | None = None,
                 replay_timeout_s: float = 2.0) -> None:
        if not urls:
            raise ValueError("backends: give at least one backend URL")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        if len({b.url for b in self.backends}) != len(self.backends):
            raise ValueError(f"backends: a URL is given twice: {urls}")
        self.index = index
        self.client = client
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.api_key = api_key
        self.replay_timeout_s = replay_timeout_s
        self._zmq = zmq.asyncio.Context()
        self._task: asyncio.Task | None = None

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def by_name(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    async def start(self) -> None:
        await self.check_all()              # a router that starts with live backends routes at once
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="router health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for b in self.backends:
            if b.subscriber is not None:
                await b.subscriber.stop()
                b.subscriber = None
        self._zmq.term()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:       # one bad tick must not end health checking
                log.exception("router: health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    def mark_down(self, b: Backend, reason: str) -> None:
        """No more traffic to `b` until a health check finds it up (the proxy could not reach it)."""
        if b.healthy:
            log.warning("router: backend %s is down: %s", b.url, reason)
        b.healthy = False
        b.was_down = True
        b.last_error = reason

    async def check(self, b: Backend) -> None:
        try:
            r = await self.client.get(f"{b.url}/health", timeout=self.health_timeout_s)
        except httpx.ConnectError as e:
            self.mark_down(b, f"cannot connect: {e}")
            return
        except httpx.HTTPError as e:
            b.failures += 1
            b.last_error = f"{type(e).__name__}: {e}"
            if b.failures >= 2:
                self.mark_down(b, f"{b.failures} health checks failed: {b.last_error}")
            return
        if r.status_code != 200:
            self.mark_down(b, f"/health answered {r.status_code}")
            return
        b.failures = 0
        try:
            instance = r.json().get("instance")
        except ValueError:
            instance = None
        restarted = (instance is not None and b.instance is not None and instance != b.instance) or \
            (instance is None and b.was_down)
        if restarted:
            log.warning("router: backend %s restarted; its index entries are dropped", b.url)
            await self._reset_events(b)
        b.instance = instance
        if b.events is None:
            await self._learn_events(b)
        if not b.healthy:
            log.info("router: backend %s is up", b.url)
        b.healthy, b.was_down, b.last_error = True, False, None

    async def _reset_events(self, b: Backend) -> None:
        if b.subscriber is not None:
            await b.subscriber.stop()
            b.subscriber = None
        b.events = None
        self.index.clear(b.name)

    async def _learn_events(self, b: Backend) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await self.client.get(f"{b.url}/v1/cache/status", headers=headers, timeout=self.health_timeout_s)
        except httpx.HTTPError as e:
            b.warn_once("status", "router: backend %s: /v1/cache/status failed (%s); routing it by predictions "
                        "until it answers", b.url, e)
            return
        if r.status_code != 200 or "kv_events" not in (body := r.json()):
            b.warn_once("status-" + str(r.status_code), "router: backend %s: /v1/cache/status does not say where its "
                        "KV events are (HTTP %d%s); routing it by predictions only", b.url, r.status_code,
                        "; pass an admin key with --api-key" if r.status_code in (401, 403) or "note" in r.text else "")
            b.events = {"enabled": False}
            return
        b.events = body["kv_events"] or {"enabled": False}
        if not b.events.get("enabled") or not b.events.get("endpoint"):
            b.warn_once("no-events", "router: backend %s publishes no KV events (serve --kv-events); routing it by "
                        "predictions only", b.url)
            return
        replay = b.events.get("replay_endpoint")
        b.subscriber = EventSubscriber(b.name, connect_address(b.events["endpoint"], b.url),
                                       connect_address(replay, b.url) if replay else None,
                                       b.events.get("topic") or "", self.index, self._zmq,
                                       replay_timeout_s=self.replay_timeout_s)
        b.subscriber.start()
        log.info("router: backend %s: subscribed to its KV events at %s", b.url, b.subscriber.endpoint)
