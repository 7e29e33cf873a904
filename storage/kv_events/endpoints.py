"""KV-event endpoints: what one may look like, and where the replay socket goes by default.

Knows: ZMQ endpoint syntax as far as we accept it -- `tcp://HOST:PORT` (PORT a number, 0 or `*`
for a free one; HOST a name, an address, `[v6]`, or `*` for every interface), `ipc://PATH`,
`inproc://NAME` -- and the default: `tcp://127.0.0.1:5557` (loopback: the stream is an
operator's component, like /metrics; `*` only when the operator writes it), its replay socket on
the same host at port + 1. And who an endpoint lets in by itself (`needs_curve`): a tcp port, or an
abstract `ipc://@NAME`, anyone on the host can reach, so they take subscribers' keys (CURVE); an
ipc PATH's directory and an inproc NAME keep strangers out without. Doesn't know: sockets or keys
(storage/kv_events/access.py and publisher.py bind them).
"""
from __future__ import annotations

import re

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+|\*):(\d{1,5}|\*)$")


def check_endpoint(value: object, field_name: str) -> str:
    """`value` if it is an endpoint we can bind, else a ValueError naming the field."""
    if isinstance(value, str):
        m = _TCP.match(value)
        if m and (m.group(2) == "*" or int(m.group(2)) <= 65535):
            return value
        for scheme in ("ipc://", "inproc://"):
            if value.startswith(scheme) and len(value) > len(scheme) and not any(c.isspace() for c in value):
                return value
    raise ValueError(f"{field_name}: expected an endpoint like tcp://127.0.0.1:5557 (port 0 or * for a free "
                     f"one, host * for every interface), ipc:///path or inproc://name, got {value!r}")


def default_replay(endpoint: str) -> str:
    """The replay endpoint beside `endpoint`: tcp on the same host at port + 1 (a free port when
    the events take a free one), ipc PATH.replay, inproc NAME-replay."""
    m = _TCP.match(endpoint)
    if m:
        host, port = m.groups()
        if port == "*" or int(port) == 0:
            return f"tcp://{host}:{port}"
        if int(port) >= 65535:
            raise ValueError(f"kv_events_replay: {endpoint} has no port + 1 for the replay socket; set one")
        return f"tcp://{host}:{int(port) + 1}"
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    return endpoint + "-replay"


def needs_curve(endpoint: str) -> bool:
    """Whether any local user could connect to `endpoint` without a key: tcp (every port on the
    host, loopback too) and Linux's abstract ipc names (no file, so no permissions)."""
    return endpoint.startswith(("tcp://", "ipc://@"))


def curve_advice(endpoint: str, field_name: str) -> str:
    """The error for `endpoint` without keys: why, and the two ways out."""
    return (f"{field_name}: {endpoint} lets any local user subscribe, and the events name every tenant's "
            f"prompt prefixes: give the subscribers' public keys (kv_events_allow_keys; serve "
            f"--kv-events-allow-keys FILE|DIR, made by `tieredkv kv-events-keys DIR`), or publish on a private "
            f"socket, ipc:///DIR/events.sock with DIR yours alone")
