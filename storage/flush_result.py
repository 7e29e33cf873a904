"""What an operator's flush answers (POST /v1/cache/flush, `Engine.flush`): one frozen record.

Knows: the fields, what each means and their JSON (to_dict). Doesn't know: how a flush runs
(storage/cascade.py fills it, walking the tiers without naming them; the record's `held` and
`remote` are the user's words for the first tier below the host and the tiers over a link).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What a flush did: blocks written down, and whether every cached block is in the lowest
    tier now. complete=False is the truth after a dropped write (no room even after evicting, an
    I/O error), a timeout, or -- with a disk tier -- a disk too small to hold them all: `held` of
    the `blocks` the flush pushed down (or found there) are on disk once the writer is done, and
    `evicted` blocks left the disk while it ran, to make room (issue 28: a small disk answered
    complete while it held none). The drops are in disk stats' write_errors. `remote` says
    whether every write to the tiers over a link (the store) was sent."""
    written: int
    complete: bool
    remote: bool | None = None   # every remote write sent (None: no tier over a link)
    evicted: int = 0             # blocks the disk evicted while the flush ran (its writes making room)
    held: int | None = None      # of `blocks`, those the disk holds after the flush (None: no disk tier)
    blocks: int = 0              # the cached blocks the flush pushed down to the disk or found there

    def to_dict(self) -> dict:
        d = {"written": self.written, "complete": self.complete}
        if self.held is not None:
            d.update(evicted=self.evicted, held=self.held, blocks=self.blocks)
        if self.remote is not None:
            d["remote"] = self.remote
        return d
