"""KV-event endpoints: what one may look like, and where the replay socket goes by default.

Knows: ZMQ endpoint syntax as far as we accept it -- `tcp://HOST:PORT` (PORT a number, 0 or `*`
for a free one; HOST a name, an address, `[v6]`, or `*` for every interface), `ipc://PATH`,
`inproc://NAME` -- and the default: `tcp://127.0.0.1:5557` (loopback: the stream is an
operator's component, like /metrics; `*` only when the operator writes it), its replay socket on
the same host at port + 1. Doesn't know: sockets (storage/kv_events/publisher.py binds them).
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
