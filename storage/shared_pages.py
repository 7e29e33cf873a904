"""Held pages shared or made findable beyond one request: forks and exact entries.

Knows: a page held by several sequences (a request's n choices forked on its prompt's pages),
the copy a holder makes before writing into a page another user holds or the cache can find
(copy-on-write), and storing a computed prompt as an exact entry (its tail page and its raw
logits in pages of their own: storage/exact_entry.py). Doesn't know: sequences or sampling.

A part of TieredKVCache (a base class of it: `pool`, `_lock`, `allocate`, `register` and
`release` are the cache's); every method is safe beside the cache's other threads, and the
copies run with the lock free, on pages only the caller holds or reads. The engine reaches the
private ones through a request's handle (storage/kv_blocks.py: `fork`, `grow`), never by page id.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from storage.exact_entry import ExactKeys, LogitsFormat, store_logits

if TYPE_CHECKING:
    from storage.kv_blocks import RequestBlocks


class SharedPages:
    def _share(self, pages: Sequence[int]) -> None:
        """One more user of each held page (a sequence forked from the one holding them)."""
        with self._lock:
            for page in pages:
                if self.pool.refcount(page) < 1:
                    raise RuntimeError(f"share: page {page} is not held")
                self.pool.acquire(page)

    def _is_shared(self, page: int) -> bool:
        """Whether a held page must be copied before its holder writes into it: another user
        holds it too, or it is a cached block (others may find it)."""
        with self._lock:
            return self.pool.refcount(page) > 1 or self.pool.key_of(page) is not None

    def _copy_on_write(self, page: int) -> int:
        """A private copy of a held page, for a holder about to write into it: a fresh page with
        its bytes (a copy on the pool's device), the holder's reference to `page` given back.
        The caller checked can_allocate(1). NOTE: the copy runs with the lock free: `page` is
        held (never evicted or rewritten) and the new page is nobody else's yet."""
        new = self.allocate(1)[0]
        self.pool.kv[new].copy_(self.pool.kv[page])
        self.release([page])
        return new

    def store_exact(self, keys: ExactKeys, blocks: "RequestBlocks", row: torch.Tensor, fmt: LogitsFormat) -> bool:
        """Make a computed prompt an exact entry: its tail page (the one after its full blocks in
        `blocks`, the request's handle: held by the request, which copies it before writing into
        it again) is registered under the tail key, and its raw last-position
        logits `row` are copied into fresh pages registered under the logits keys, which are then
        given back (cached, evictable as any block). False when the pool has no pages for the
        logits now, or the row does not fit the format: no entry (a later repeat computes)."""
        if keys.tail is not None:
            self.register(blocks.table[len(keys.full)], keys.tail)
        if row.dtype != fmt.dtype or row.numel() != fmt.vocab:
            return False
        with self._lock:
            if not self.pool.can_allocate(len(keys.logits)):
                return False
            if all(self.pool.page_of(k) is not None for k in keys.logits):
                return True              # another request stored it first
        pages = self.allocate(len(keys.logits))
        try:
            store_logits(self.pool.kv, pages, row, fmt)
            for page, key in zip(pages, keys.logits):
                self.register(page, key)
        finally:
            self.release(pages)
        return True

