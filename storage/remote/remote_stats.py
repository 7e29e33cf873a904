"""What the remote tier reports: its counters and its breaker's state, one frozen record.

Knows the fields and what each counts; storage/remote/tier.py fills it (RemoteTier.stats).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RemoteStats:
    enabled: bool
    url: str                   # password redacted
    cluster: bool
    breaker: str               # closed | open | half_open
    breaker_opened: int        # times the breaker opened
    hits: int                  # blocks read and verified
    misses: int                # blocks asked for and not served (absent, damaged, or an error)
    errors: int                # calls that failed (connection, timeout): breaker failures
    corrupt: int               # values that failed verification (deleted)
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
