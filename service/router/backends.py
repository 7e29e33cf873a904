"""The backend set: which servers are up, what the router has in flight on each, and their event streams.

Knows: health -- every `health_interval_s` each backend's GET /health is asked; a refused
connection, a non-200 answer (503: shutting down, engine stopped) or two failed checks in a row
take a backend out of rotation, and one good check brings it back. Its real answers judge it too
(ejection.py): garbage, a 5xx, a timeout or a failed connection on a request, or bytes that are
not a JSON object from /health or /v1/cache/status, eject it, and only a probe after a cool-down
readmits it. A restart -- /health's `instance` changed, or a backend that
does not report one came back after being down -- drops the backend's index entries (its caches
are not the ones the router knew) and starts a fresh subscriber, which replays the new
publisher's buffer from seq 0. The events endpoint comes from the backend's GET /v1/cache/status
(`kv_events`; it needs an admin key where the backend has keys: `api_key`); a `*`/0.0.0.0 host
there means the backend's own host. Where that status names a `server_key` (the backend's
sockets take CURVE), the subscriber connects with the router's keypair and that key -- unless the
router has no keypair, or pins the backends' keys and this one is not among them: then the
backend is routed by predictions only, said once. A backend without events is routed by
predictions only.
Doesn't know: routing (policy.py), proxying (proxy.py) or what an answer must look like (answers.py).
NOTE: everything here runs on the event loop; counts need no lock.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx
import zmq.asyncio

from service.router import answers
from service.router.ejection import SPARE_LIMIT, Ejector
from service.router.index import PrefixIndex
from service.router.subscriber import CurveClient, EventSubscriber
from storage.kv_events.keys import CurveKeypair, check_key

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
    ejected: bool = False                 # out until a probe passes (ejection.py)
    ejections: dict[str, int] = field(default_factory=dict)   # by reason label
    dropped: int = 0                      # connections dropped before an answer, in a row
    refused_in_row: int = 0               # requests whose answer was refused, since one was good
    spared: int = 0                       # request failures that would have ejected the last backend up
    readmissions: int = 0
    probes: dict[str, int] = field(default_factory=dict)      # "passed" / "failed"
    readmit_at: float = 0.0               # the clock's time of the next probe, while ejected
    cooldown_s: float = 0.0

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
                "instance": self.instance, "last_error": self.last_error, "ejected": self.ejected,
                "ejections": dict(self.ejections), "spared": self.spared, "readmissions": self.readmissions,
                "probes": dict(self.probes),
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
                 replay_timeout_s: float = 2.0, eject_cooldown_s: float = 5.0, eject_cooldown_max_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, curve_keypair: CurveKeypair | None = None,
                 pinned_server_keys: frozenset[bytes] = frozenset()) -> None:
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
        self.curve_keypair = curve_keypair
        self.pinned_server_keys = pinned_server_keys
        self.ejector = Ejector(client, cooldown_s=eject_cooldown_s, max_cooldown_s=eject_cooldown_max_s,
                               timeout_s=health_timeout_s, api_key=api_key, clock=clock)
        self._zmq = zmq.asyncio.Context()
        self._task: asyncio.Task | None = None
        self.on_out: list[Callable[[Backend], None]] = []    # told when a backend leaves rotation

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
        await asyncio.gather(*(self._check_safely(b) for b in self.backends))

    async def _check_safely(self, b: Backend) -> None:
        """One backend's check; whatever it answered, an error here is a verdict on it, never on the router."""
        try:
            await self.check(b)
        except Exception as e:
            log.exception("router: checking backend %s failed", b.url)
            self._failed(b, f"the health check failed: {type(e).__name__}: {e}")

    def mark_down(self, b: Backend, reason: str) -> None:
        """No more traffic to `b` until a health check finds it up (its /health failed)."""
        if b.healthy:
            log.warning("router: backend %s is down: %s", b.url, reason)
        b.healthy = False
        b.was_down = True
        b.last_error = reason
        self._left(b)

    def eject(self, b: Backend, reason: str, label: str, *, request: bool = False) -> None:
        """Out of rotation until a probe passes (ejection.py). A request's failure (`request`)
        spares the last backend in rotation -- counted, its answer refused, but it stays in --
        unless it is the SPARE_LIMIT-th request in a row it failed (then it is broken, not the request)."""
        if request:
            b.refused_in_row += 1
        if request and b.refused_in_row < SPARE_LIMIT and b.healthy and \
                not any(o.healthy for o in self.backends if o is not b):
            b.spared += 1
            b.last_error = reason
            b.warn_once("spared", "router: backend %s failed a request (%s: %s) but is the last backend up; "
                        "it stays in rotation", b.url, label, reason)
            return
        self.ejector.eject(b, reason, label)
        self._left(b)

    def _left(self, b: Backend) -> None:
        for tell in self.on_out:
            tell(b)

    async def check(self, b: Backend) -> None:
        if b.ejected and not self.ejector.due(b):
            return
        try:
            r = await self.client.get(f"{b.url}/health", timeout=self.health_timeout_s)
        except httpx.ConnectError as e:
            self._failed(b, f"cannot connect: {e}")
            return
        except httpx.HTTPError as e:
            b.failures += 1
            b.last_error = f"{type(e).__name__}: {e}"
            if b.failures >= 2 or b.ejected:
                self._failed(b, f"{b.failures} health checks failed: {b.last_error}")
            return
        if r.status_code != 200:
            self._failed(b, f"/health answered {r.status_code}")
            return
        b.failures = 0
        body = answers.json_object(r.content)
        if body is None:
            self._garbage(b, f"/health answered 200 with {answers.quoted(r.content)}, not a JSON object", "bad_health")
            return
        instance = body.get("instance")
        instance = instance if isinstance(instance, str) else None
        restarted = (instance is not None and b.instance is not None and instance != b.instance) or \
            (instance is None and b.was_down)
        if restarted:
            log.warning("router: backend %s restarted; its index entries are dropped", b.url)
            await self._reset_events(b)
        b.instance = instance
        if b.events is None:
            bad = await self._learn_events(b)
            if bad is not None:
                self._garbage(b, bad, "bad_status")
                return
        if b.ejected:
            bad = await self.ejector.probe(b)
            if bad is not None:
                self.ejector.probe_failed(b, bad)
                return
            self.ejector.readmit(b)
        if not b.healthy:
            log.info("router: backend %s is up", b.url)
            b.last_error, b.refused_in_row = None, 0
        b.healthy, b.was_down = True, False       # last_error stays while up: a spared failure

    def _failed(self, b: Backend, reason: str) -> None:
        """A failed health check: down (or, ejected, its next probe later)."""
        if b.ejected:
            self.ejector.probe_failed(b, reason)
        else:
            self.mark_down(b, reason)

    def _garbage(self, b: Backend, reason: str, label: str) -> None:
        """A JSON route answered bytes that are not JSON: ejected (or, ejected, its next probe later)."""
        if b.ejected:
            self.ejector.probe_failed(b, reason)
        else:
            self.ejector.eject(b, reason, label)
            self._left(b)

    async def _reset_events(self, b: Backend) -> None:
        if b.subscriber is not None:
            await b.subscriber.stop()
            b.subscriber = None
        b.events = None
        self.index.clear(b.name)

    async def _learn_events(self, b: Backend) -> str | None:
        """Subscribe to `b`'s KV events, as its /v1/cache/status says. None, unless that status
        was a 200 whose body is not a JSON object (then what was wrong: `b` answers garbage)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await self.client.get(f"{b.url}/v1/cache/status", headers=headers, timeout=self.health_timeout_s)
        except httpx.HTTPError as e:
            b.warn_once("status", "router: backend %s: /v1/cache/status failed (%s); routing it by predictions "
                        "until it answers", b.url, e)
            return None
        body = answers.json_object(r.content)
        if r.status_code == 200 and body is None:
            return f"/v1/cache/status answered 200 with {answers.quoted(r.content)}, not a JSON object"
        if r.status_code != 200 or body is None or "kv_events" not in body:
            b.warn_once("status-" + str(r.status_code), "router: backend %s: /v1/cache/status does not say where its "
                        "KV events are (HTTP %d%s); routing it by predictions only", b.url, r.status_code,
                        "; pass an admin key with --api-key" if r.status_code in (401, 403) or "note" in r.text else "")
            b.events = {"enabled": False}
            return None
        events = body["kv_events"]
        b.events = events if isinstance(events, dict) and events else {"enabled": False}
        if not b.events.get("enabled") or not isinstance(b.events.get("endpoint"), str):
            b.warn_once("no-events", "router: backend %s publishes no KV events (serve --kv-events); routing it by "
                        "predictions only", b.url)
            return None
        curve = self._curve(b)
        if curve is False:
            return None
        replay, topic = b.events.get("replay_endpoint"), b.events.get("topic")
        b.subscriber = EventSubscriber(b.name, connect_address(b.events["endpoint"], b.url),
                                       connect_address(replay, b.url) if isinstance(replay, str) and replay else None,
                                       topic if isinstance(topic, str) else "", self.index, self._zmq,
                                       replay_timeout_s=self.replay_timeout_s, curve=curve)
        b.subscriber.start()
        log.info("router: backend %s: subscribed to its KV events at %s%s", b.url, b.subscriber.endpoint,
                 " (CURVE)" if curve else "")
        return None

    def _curve(self, b: Backend) -> CurveClient | None | bool:
        """How to subscribe to `b`: None (its sockets take no key), a CurveClient, or False (we
        cannot: no keypair of ours, or its key is not one we pin; said once)."""
        key = b.events.get("server_key") if b.events else None
        if key is None:
            return None
        try:
            server_key = check_key(key, "server_key")
        except ValueError:
            b.warn_once("bad-key", "router: backend %s: its status names a KV-event server_key that is not a "
                        "CURVE key (%r); routing it by predictions only", b.url, key)
            return False
        if self.curve_keypair is None:
            b.warn_once("no-key", "router: backend %s: its KV events take CURVE keys; give the router its key "
                        "(--kv-events-key FILE, from `tieredkv kv-events-keys`) and the backend its public half "
                        "(serve --kv-events-allow-keys); routing it by predictions only", b.url)
            return False
        if self.pinned_server_keys and server_key not in self.pinned_server_keys:
            b.warn_once("unpinned", "router: backend %s: its KV-event key %s is not one --kv-events-server-key "
                        "names; not subscribing (routing it by predictions only)", b.url, key)
            return False
        return CurveClient(self.curve_keypair, server_key)
