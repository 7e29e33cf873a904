"""Copies from the device pool into host slots, and who waits for them.

Knows: on CUDA, a copy runs non-blocking on a dedicated copy stream (the slab is pinned, so it
is truly asynchronous) and records an event for the host slot it writes. Two different waits
follow from that, and they must never be confused:
- `fence()`: device-side. Compute-stream work issued after it sees every copy issued before it
  (a page is rewritten only after its block was copied out). The CPU does not wait.
- `wait_host(slot)` / `sync_host()`: CPU-side. Host code (the disk writer's put, a prefetch
  writing the slot) reads or rewrites a slot only after the copy into it is complete. A reader
  that pins the slot (the loader's host fill) takes its `pending` completion under the lock and
  `wait`s for it after letting the lock go (on CUDA: its copy stream waits, not the CPU).
NOTE invariant (issue 9, item 1): a fence never clears what a CPU-side wait checks. The old
protocol kept one "pending" flag for both, so after a fence the disk writer could checksum a
slot whose copy was still queued, and the stale bytes passed verification forever.

On CPU a copy is a plain memcpy and both waits are free. Tests use `deferred=True` on CPU: each
copy snapshots its source (what a stream-ordered device copy would read) and writes the slot
later on a worker thread, so a missing CPU-side wait shows up as wrong bytes, as on CUDA.
Doesn't know: which blocks move or why.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Transfer:
    def __init__(self, device: torch.device, deferred: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._device_pending = False                         # copies the compute stream has not waited for
        self._host_pending: dict[int, object] = {}           # slot -> completion of its last copy (Event / Future)
        self._late = ThreadPoolExecutor(1, thread_name_prefix="tieredkv-late-copy") if deferred and not self.cuda else None

    def copy_to_host(self, slab: torch.Tensor, copies: list[tuple[int, torch.Tensor]]) -> None:
        """slab[slot] <- src for each (slot, src: a device page), as one batch. On CUDA:
        asynchronous on the copy stream, ordered after the compute stream's work so far (a page
        may have just been written), with one stream wait and one event for the whole batch
        (issue 9: per block, those made ~4 CUDA calls per evicted block)."""
        if not copies:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for slot, src in copies:
                    slab[slot].copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._device_pending = True
        elif self._late is not None:
            done = self._late.submit(_late_copy, [(slab[slot], src.clone()) for slot, src in copies])
        else:
            for slot, src in copies:
                slab[slot].copy_(src)
            return
        for slot, _ in copies:
            self._host_pending[slot] = done     # one completion shared by the batch's slots

    def ready(self, slot: int) -> bool:
        """Whether a CPU read of `slot` would not wait now (never blocks, never syncs)."""
        done = self._host_pending.get(slot)
        if done is None:
            return True
        return done.done() if isinstance(done, Future) else done.query()

    def wait_host(self, slot: int) -> None:
        """The CPU may read or rewrite host slot `slot`: every copy into it is complete.
        NOTE: called before every CPU access to a slot that a copy may have targeted."""
        done = self._host_pending.pop(slot, None)
        if done is None:
            return
        if isinstance(done, Future):
            done.result()
        else:
            done.synchronize()

    def pending(self, slot: int) -> object | None:
        """The completion of the last copy into `slot` not yet waited for (None: none), for a
        reader that pins the slot (HostTier.pin: no copy into it can be issued meanwhile) and
        waits with `wait` once it let the tiers' lock go. Under the tiers' lock."""
        return self._host_pending.get(slot)

    def writing(self, slot: int) -> tuple[object | None, Future]:
        """A CPU-side writer (a prefetch copying a decoded block into `slot`, the slot pinned)
        announces its copy: returns the slot's previous pending copy (to `wait` for before
        writing: a dropped block's late copy must not land on ours) and the Future it resolves
        once its own bytes are in. Until then every reader of the slot finds that Future as the
        slot's pending copy and waits for it. Under the tiers' lock; the copy is made without it."""
        before = self._host_pending.get(slot)
        mine: Future = Future()
        self._host_pending[slot] = mine
        return before, mine

    @staticmethod
    def wait(done: object | None, stream: "torch.cuda.Stream | None" = None) -> None:
        """Wait for a completion from `pending` with no lock held: the CPU waits (a Future; an
        Event with no `stream`), or, for a reader that is itself a copy on `stream`, that stream
        waits (device-side: the CPU goes on). The entry stays in the pending map; the next
        `wait_host` of the slot finds it complete."""
        if done is None:
            return
        if isinstance(done, Future):
            done.result()
        elif stream is not None:
            stream.wait_event(done)
        else:
            done.synchronize()

    def sync_host(self) -> None:
        """Every copy into every host slot is complete (a flush reading many slots)."""
        for slot in list(self._host_pending):
            self.wait_host(slot)

    def issued(self) -> "torch.cuda.Event | None":
        """A mark after every copy issued so far AND every compute-stream kernel issued so far,
        for another stream to wait on (CUDA; None elsewhere, where a copy's source is read before
        this returns or is a snapshot, and a forward is done when it returns). The loader's stream
        waits on it before it writes pages handed to a fill.

        NOTE invariant (issue 18): a page handed to a fill may have had no copy out at all -- a
        partial page freed by a preemption after a step of non-final prefill chunks, which never
        synchronises -- while the previous forward's K/V writes into it are still queued on the
        compute stream. A mark on the copy stream alone would let the fill land first and that
        forward overwrite it: wrong KV registered and moved down the tiers. So the copy stream
        first waits for the compute stream (called on the engine thread, whose current stream is
        the compute stream), then the mark is recorded."""
        if not self.cuda:
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        mark = torch.cuda.Event()
        mark.record(self.stream)
        return mark

    def fence(self) -> None:
        """Compute-stream work issued after this sees every copy issued before it; the CPU does
        not wait, and host slots are not known complete after it (use wait_host for that).
        NOTE invariant: called before a page whose block was copied out is reused."""
        if self.cuda and self._device_pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._device_pending = False

    def close(self) -> None:
        self.sync_host()
        if self._late is not None:
            self._late.shutdown(wait=True)


def _late_copy(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    time.sleep(random.uniform(0.0005, 0.003))     # long enough for a missing wait to read early
    for dst, snapshot in copies:
        dst.copy_(snapshot)
