"""remote_url parsing (storage/remote/url.py), CacheConfig's remote fields, and the circuit breaker
(storage/remote/breaker.py) on a fake clock."""
from __future__ import annotations

import pytest

from storage.remote.breaker import BreakerConfig, CircuitBreaker
from storage.config import CacheConfig
from storage.remote.url import parse_remote_url


@pytest.mark.parametrize("url, nodes, cluster, tls, db", [
    ("valkey://localhost", (("localhost", 6379),), False, False, 0),
    ("redis://10.0.0.5:6380/2", (("10.0.0.5", 6380),), False, False, 2),
    ("rediss://cache.example:6380", (("cache.example", 6380),), False, True, 0),
    ("valkeys://h:1", (("h", 1),), False, True, 0),
    ("valkey://h1:7000,h2:7001,h3:7002", (("h1", 7000), ("h2", 7001), ("h3", 7002)), True, False, 0),
    ("valkey://h1:7000?cluster=1", (("h1", 7000),), True, False, 0),
    ("redis://[::1]:7000", (("::1", 7000),), False, False, 0),
])
def test_url_forms(url, nodes, cluster, tls, db) -> None:
    u = parse_remote_url(url)
    assert (u.nodes, u.cluster, u.tls, u.db) == (nodes, cluster, tls, db)
    assert parse_remote_url(u.redacted) == u      # the redacted form of a URL without a password parses back


def test_password_and_tls_options_reach_the_client_but_never_the_screen() -> None:
    u = parse_remote_url("rediss://app:p%40ss@h:6380?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required")
    assert (u.username, u.password) == ("app", "p@ss")
    assert u.connection_kwargs() == {"username": "app", "password": "p@ss", "ssl": True,
                                     "ssl_ca_certs": "/etc/ca.pem", "ssl_cert_reqs": "required"}
    assert "p@ss" not in repr(u) and "p%40ss" not in u.redacted and "app:***@" in u.redacted
    assert parse_remote_url("redis://:secret@h").connection_kwargs() == {"password": "secret"}
    # (A password no field name holds: the repr names cache_secret_file and kv_events_secret_file.)
    config = CacheConfig(remote_url="redis://:hunter2pw@h:6379")
    assert "hunter2pw" not in repr(config) and "***" in repr(config)


@pytest.mark.parametrize("url, message", [
    ("http://h", "scheme"),
    ("valkey://", "empty host"),
    ("valkey://h:notaport", "bad host:port"),
    ("valkey://h/x", "database"),
    ("valkey://h1:1,h2:2/3", "only database 0"),
    ("valkey://h?cluster=maybe", "cluster"),
    ("valkey://h1:1,h2:2?cluster=0", "contradicts"),
    ("valkey://h?ssl_ca_certs=/x", "TLS scheme"),
    ("valkey://h?timeout=3", "unknown option"),
    ("rediss://h?ssl_cert_reqs=sometimes", "ssl_cert_reqs"),
])
def test_bad_urls_are_refused_by_name_without_the_password(url, message) -> None:
    with pytest.raises(ValueError, match=message) as e:
        parse_remote_url(url)
    assert str(e.value).startswith("remote_url:")
    with pytest.raises(ValueError, match="remote_url"):
        CacheConfig(remote_url=url.replace("://", "://:topsecret@") if "://h" in url else url)
    try:
        CacheConfig(remote_url=url.replace("://", "://:topsecret@"))
    except ValueError as err:
        assert "topsecret" not in str(err)


@pytest.mark.parametrize("field, value", [("remote_timeout_s", 0), ("remote_timeout_s", True), ("remote_retry_s", -1),
                                          ("remote_ttl_s", 0), ("remote_write", "sometimes"), ("remote_url", "")])
def test_remote_config_fields_are_validated(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_breaker_opens_after_failures_in_a_row_and_probes_after_its_cooldown() -> None:
    now = [0.0]
    closed_calls = []
    b = CircuitBreaker(BreakerConfig(failures_to_open=3, cooldown_s=5), clock=lambda: now[0],
                       on_close=lambda: closed_calls.append(now[0]))
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.allow()
    b.success()                                   # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert b.state == "open" and not b.allow() and b.opened == 1
    now[0] = 4.9
    assert not b.allow()
    now[0] = 5.0
    assert b.state == "half_open"
    assert b.allow() and not b.allow()            # one probe at a time
    b.failure()                                   # the probe failed: open for another cooldown
    assert b.state == "open" and b.opened == 2
    now[0] = 9.9
    assert not b.allow()
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow() and closed_calls == [10.0]
