"""How the remote tier's status reads outside the cache (storage/tier_health.py's rows): its
circuit breaker in /ready, its client's own series (tieredkv_remote_*: how the store answered,
the writer's queue, the breaker's state) and its lines under `tieredkv status`.

Knows: the fields RemoteTier's status carries (storage/remote/remote_stats.py, the URL with its
password masked, the wiring's `write_policy`) and what each means to an operator. Blocks served to
requests are the shared per-tier rows (tier="remote"); these say how the store itself answered.
Its capacity, contents and evictions are the store's (maxmemory, its LRU): `tieredkv inspect
--remote-url` reads them there.
Doesn't know: the store (nothing here opens a connection), HTTP, Prometheus or rich.
"""
from __future__ import annotations

from typing import Iterable

from storage.tier_health import MetricRow, Span, StatusLine, TierHealth, line, number

# (key in its status, series suffix, help)
_COUNTERS = (
    ("store_hits", "hits", "Blocks read from the remote store and verified"),
    ("misses", "misses", "Blocks asked of the remote store and not served (absent, damaged, or an error)"),
    ("errors", "errors", "Calls to the remote store that failed (connection, timeout): the breaker's failures"),
    ("corrupt", "corrupt", "Remote values that failed verification: forged or damaged (a miss; deleted)"),
    ("foreign", "foreign", "Remote values sealed under another fleet secret (a miss; left alone)"),
    ("skipped", "skipped", "Calls not made because the breaker was open"),
    ("cancelled", "cancelled", "Reads of the remote store cut off because no request waited for them any more"),
    ("cancelled_connections", "cancelled_connections", "Connections to the remote store shut down mid-reply by "
     "such a cut (dropped, never pooled)"),
    ("writes", "writes", "Blocks written to the remote store"),
    ("write_errors", "write_errors", "Blocks the remote store refused, or lost with a failed batch"),
    ("write_drops", "write_drops", "Blocks never sent to the remote store: its queue full, or the breaker open"),
    ("stored_bytes_read", "read_bytes", "Bytes of values read from the remote store"),
    ("bytes_written", "written_bytes", "Bytes of values written to the remote store"),
    ("breaker_opened", "breaker_openings", "Times the remote tier's circuit breaker opened"),
)
BREAKER_STATES = ("closed", "open", "half_open")


class RemoteHealth(TierHealth):
    def ready(self, store: dict) -> str:
        if not store.get("enabled", True):
            return "off"
        return "ok" if store.get("breaker", "closed") == "closed" else f"breaker {store.get('breaker')}"

    def metrics(self, remote: dict) -> Iterable[MetricRow]:
        if not remote.get("enabled"):
            return
        for key, suffix, help_text in _COUNTERS:
            if number(remote.get(key)):
                yield MetricRow(suffix, help_text, remote[key], counter=True)
        if number(remote.get("pending_writes")):
            yield MetricRow("pending_writes", "Blocks waiting in the remote writer's queue", remote["pending_writes"])
        # One series per state, 1 for the current one (Prometheus' idiom for an enum): an alert on
        # tieredkv_remote_breaker_state{state="open"} == 1 fires while the store is being skipped.
        for state in BREAKER_STATES:
            yield MetricRow("breaker_state", "The remote tier's circuit breaker: 1 for its current state",
                            1.0 if remote.get("breaker") == state else 0.0, label=("state", state))

    def lines(self, remote: dict) -> Iterable[StatusLine]:
        if not remote.get("enabled"):
            return
        breaker = remote.get("breaker", "?")
        yield line(f"remote: {remote.get('url', '?')}{' (cluster)' if remote.get('cluster') else ''}, breaker ",
                   Span(str(breaker), "alert" if breaker == "open" else ""),
                   f" (opened {remote.get('breaker_opened', 0)}x), errors {remote.get('errors', 0)}, "
                   f"corrupt blocks found {remote.get('corrupt', 0)}, writes {remote.get('writes', 0)} "
                   f"(pending {remote.get('pending_writes', 0)}, dropped {remote.get('write_drops', 0)}, "
                   f"refused {remote.get('write_errors', 0)})")
        if remote.get("foreign"):
            yield line(f"remote: {remote['foreign']:,} blocks sealed under another fleet secret (misses): do all "
                       "servers read the same --cache-secret-file?")
        if remote.get("last_error"):
            yield line(f"remote: last error {remote['last_error']}")
