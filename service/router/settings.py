"""RouterSettings: the knobs of `tieredkv route`, validated once.

Knows: defaults and their reasons; the KV-event keys read from their files here (a bad file fails
the start, not a subscription): the router's keypair (`kv_events_key`, its secret certificate)
and the backends' public keys it pins (`kv_events_server_keys`; none: each backend's own, as its
/v1/cache/status names it). Doesn't know: what uses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from service.router.policy import default_weights
from storage.kv_events.keys import CurveKeypair, read_keypair, read_public_keys

DEFAULT_MAX_BODY_BYTES = 8 << 20       # a backend's default limit: a bigger body would be refused there anyway


@dataclass(frozen=True)
class RouterSettings:
    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None           # an admin key of the backends, to read their /v1/cache/status
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    in_flight_tokens: float = 64.0            # an in-flight request costs as much as prefilling this many tokens
    queue_weight: float = 0.5            # the weight of prefill already queued on a backend against a miss
    weights: dict[str, float] = field(default_factory=default_weights)
    prediction_ttl_s: float = 30.0       # how long a routed prompt's blocks count as on its backend unconfirmed
    request_timeout_s: float = 600.0     # reading a backend's answer (a long generation streams; a body waits)
    hash_timeout_s: float = 30.0
    replay_timeout_s: float = 2.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0       # a slow client's bounds, as a backend's (service/read_limits.py)
    body_timeout_s: float = 30.0
    eject_cooldown_s: float = 5.0        # an ejected backend's first probe comes this long after (doubling per failed probe)
    eject_cooldown_max_s: float = 60.0
    log_probes: bool = False             # successful /health and /metrics answers at INFO in the request log (else DEBUG)
    # KV events over tcp take CURVE keys: the router's secret certificate (`tieredkv kv-events-keys`
    # writes it; the backends allow its public half), and optionally the backends' public keys.
    kv_events_key: str | None = None
    kv_events_server_keys: tuple[str, ...] = ()
    curve_keypair: CurveKeypair | None = field(init=False, repr=False, compare=False)
    pinned_server_keys: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backends: give at least one --backend URL")
        for url in self.backends:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--backend: expected an http(s)://host:port URL, got {url!r}")
        # A URL's trailing slash is dropped (the backend set keys by the bare URL).
        object.__setattr__(self, "backends", tuple(u.rstrip("/") for u in self.backends))
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"--backend: a URL is given twice: {', '.join(self.backends)}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "hash_timeout_s",
                     "replay_timeout_s", "eject_cooldown_s", "eject_cooldown_max_s", "header_timeout_s",
                     "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.prediction_ttl_s < 0:
            raise ValueError(f"prediction_ttl_s: expected >= 0, got {self.prediction_ttl_s}")
        object.__setattr__(self, "curve_keypair", None if self.kv_events_key is None
                           else read_keypair(self.kv_events_key, "--kv-events-key"))
        object.__setattr__(self, "pinned_server_keys", frozenset().union(
            *(read_public_keys(f, "--kv-events-server-key") for f in self.kv_events_server_keys)))
        if self.pinned_server_keys and self.curve_keypair is None:
            raise ValueError("--kv-events-server-key: pins the backends' keys for a router with its own: give "
                             "--kv-events-key too")
