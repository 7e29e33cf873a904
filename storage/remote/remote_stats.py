"""What the remote tier reports: its counters and its breaker's state, one frozen record.

Knows the fields and what each counts, and how cache status shows them (report);
storage/remote/tier.py fills it (RemoteTier.stats).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class RemoteStats:
    enabled: bool
    url: str                   # password redacted
    cluster: bool
    breaker: str               # closed | open | half_open
    breaker_opened: int        # times the breaker opened
    store_hits: int            # blocks read and verified (the store's answers: TierStats.hits are blocks served)
    misses: int                # blocks asked for and not served (absent, damaged, or an error)
    errors: int                # calls that failed (connection, timeout): breaker failures
    corrupt: int               # values that failed verification: forged, damaged (deleted)
    foreign: int               # values sealed under another fleet secret (misses, left alone)
    skipped: int               # calls not made because the breaker was open
    cancelled: int             # reads their caller gave up on mid-flight (no request waited any more)
    cancelled_connections: int  # connections shut down mid-reply by such a cancel: dropped, never pooled
    writes: int                # blocks written
    write_errors: int          # blocks the store refused (e.g. out of memory) or a failed batch lost
    write_drops: int           # blocks never sent: queue full, or breaker open
    bytes_read: int
    bytes_written: int
    pending_writes: int
    last_error: str | None

    def report(self, into) -> None:
        """Into the cache's TierStats for the remote (storage/lower_tier.py's TierRecord).
        Capacity is the store's own (maxmemory and its eviction policy): not reported here.
        hits/promotions/bytes_read there are blocks served to requests (as for every tier); this
        client's own counters are in extra (store_hits, stored_bytes_read, ...), its
        writes as the tier's demotions and bytes_written."""
        r = asdict(self)
        into.demotions, into.bytes_written = r["writes"], r.pop("bytes_written")
        r["stored_bytes_read"] = r.pop("bytes_read")
        into.extra = r
