"""Billing off the engine thread, with group commit.

Knows: a queue of finished requests' ledger entries, and the one thread that owns the ledger's
write transactions: it takes everything queued, commits it in one transaction (one fsync for
the whole group, however many requests finished meanwhile), then runs each entry's callback
with its outcome. The engine thread only enqueues, so a slow fsync (0.5-10 ms) never delays
another request's next token. Also what happens when the ledger cannot be written or opened.
Doesn't know: requests or responses -- a callback decides what the caller sees. The thread, its
loop and the stop are storage/background_writer.py's skeleton; the reserve and spill files are
engine/billing_spill.py's.

NOTE invariant (exactly once, committed before the caller sees the result): an entry's callback
runs only after the transaction holding it committed (or failed); the engine completes the
caller's response inside that callback. A crash before the commit loses a request whose caller
never got an answer; a crash after it keeps a request the caller may not have seen, and the
request id keeps a retry from counting it twice.

When the ledger cannot be written (a full filesystem) or opened at all (a full, read-only or
unwritable cache dir at start: the server runs with the ledger off, and tries to open it every
RETRY_S), `on_failure` decides:
  "serve" (the default): the request is answered once its bill is *held*: written into the
    reserve (billing/reserve.bin, made before the first request: its blocks are the bills' room
    on a full disk), fsynced, then kept in memory and retried every RETRY_S until the ledger
    takes it. The next open of the ledger commits what the reserve holds, so neither a full disk
    at shutdown nor a kill -9 loses a held bill. A bill the reserve cannot take -- there is none
    (status says why), it is full, or it cannot be written (issue 41: a read-only or aborted
    filesystem, EIO) -- is held in memory only, up to `memory_bound` bytes of them, and at close
    spilled where anything can be written (the reserve, a file beside the ledger, else the
    fallback directory: engine/billing_spill.py), logged whole when nothing can be. A bill that
    cannot be held at all fails its request with BillingUnavailable (a 503 with Retry-After), and
    while that is so new requests get it at admission (`refusing`): NOTE no request is answered
    with a bill that has nowhere to go. The operator sees it all (status(): degraded, with the
    count, where and why; /ready 503; /metrics).
  "refuse": the request fails (BillingUnavailable), as a ledger that must never lag demands.
A ledger whose directory is no longer the one it opened (the filesystem remounted after an
error, the directory removed or replaced: LMDB would go on "committing" into files nobody will
read) is dropped and opened again at its path, the reserve with it.
status() counts every bill answered and not yet committed -- those being retried included -- so
"ok" means every answered request is in the ledger.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from typing import Callable

from engine.errors import BillingUnavailable
from engine.billing import Entry, Ledger, Prices, entry_of, prepare
from engine.billing_spill import DEFAULT_RESERVE_BYTES, Reserve, ReserveFull, encode, spill
from storage.background_writer import BackgroundWriter
from storage.disk.environment import LOW_SPACE_BYTES, free_bytes

log = logging.getLogger("tieredkv.billing")

Done = Callable[[bool | None, Exception | None], None]   # (recorded, error)
ON_FAILURE = ("serve", "refuse")
RETRY_S = 2.0             # how often entries the ledger could not take (or its open) are tried again
_MIN_BILL_BYTES = 160     # about the smallest bill's line in the reserve or in memory


class BillingWriter(BackgroundWriter[list[tuple[Entry, Done | None]]]):
    """`ledger`: an open ledger; or None with `path` (and `prices`): the writer opens it, and runs
    without it while it cannot (it retries). `reserve_bytes`: the reserve wanted beside it."""

    def __init__(self, ledger: Ledger | None = None, max_group: int = 256, on_failure: str = "serve", *,
                 path: str | os.PathLike | None = None, prices: Prices | None = None,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure: expected one of {ON_FAILURE}, got {on_failure!r}")
        if ledger is None and path is None:
            raise ValueError("BillingWriter: give an open ledger or the path of one")
        super().__init__("tieredkv-billing")
        self.path = ledger.path if ledger is not None else os.path.abspath(os.fspath(path))
        self.prices = ledger.prices if ledger is not None else (prices or Prices())
        self.max_group = max_group
        self.on_failure = on_failure
        self._queue: deque[tuple[Entry, Done | None]] = deque()   # guarded by _cond
        # Entries answered ("serve") and not committed: held (in the reserve, or in memory when there
        # is none), retried. Under _cond; `_retrying` is the part the writer has in hand now.
        self._unwritten: list[Entry] = []
        self._retrying: list[Entry] = []
        self._memory_bytes = 0                # under _cond: the lines of the bills held in memory only
        self._in_memory: set[bytes] = set()   # under _cond: their request keys (not in the reserve)
        self.reserve_failed: str | None = None   # set by the writer thread, read anywhere: why the last write
        #                                          into the reserve failed (None once the filesystem takes writes)
        self._identity: tuple[int, int] | None = None   # writer thread: the ledger dir's (dev, inode) at its open
        self._full_logged = False             # writer thread: "held nowhere" said since the memory last emptied
        self._retry_at = 0.0                  # under _cond: when the next retry (or open) is due
        self._final_try = False               # under _cond: stopping, the unwritten were tried once more
        self.error: str | None = None         # under _cond: the last failure, while degraded
        self.degraded_since: float | None = None   # under _cond: wall time billing first failed
        self._last_logged_error: str | None = None   # writer thread: one log line per distinct failure
        self.spilled = 0                      # entries written to a spill file at close
        self.refused = 0                      # under _cond: requests failed because their bill had nowhere to go
        self.groups = 0                       # commits made (for tests and stats)
        self.entries = 0
        # NOTE: the reserve first, while the filesystem may still have room, and before the first
        # request; it reads the bills a killed process left in it (committed by the ledger's open).
        self.reserve = Reserve(self.path, reserve_bytes)
        # Bills the reserve cannot take are held in memory up to this many bytes of their lines.
        self.memory_bound = reserve_bytes if reserve_bytes > 0 else DEFAULT_RESERVE_BYTES
        if self.reserve.error:
            log.warning("billing: the reserve beside the ledger: %s", self.reserve.error)
        self.ledger: Ledger | None = ledger   # set on the writer thread (or here); read anywhere
        self.ledger_error: str | None = None
        self._identity = _identity(self.path) if ledger is not None else None
        if ledger is None:
            self._unwritten = [entry_of(rid, rec) for rid, rec in self.reserve.pending]
            self._open_ledger()
        self.reserve.pending = []
        self.start()

    def submit(self, entry: Entry, done: Done) -> None:
        """Queue one entry; `done(recorded, error)` runs on the billing thread after its commit."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("billing writer is stopped")
            self._queue.append((entry, done))
            self._cond.notify_all()

    def prepare(self, tenant: str, request_id: str, prompt_tokens: int, completion_tokens: int,
                hit_tokens_by_tier: dict[str, int], miss_tokens: int, cache_write_tokens: dict[str, int] | None = None,
                retained_token_seconds: int = 0) -> Entry:
        """One request's entry, priced (engine/billing.py's prepare): needs no open ledger."""
        return prepare(self.prices, tenant, request_id, prompt_tokens, completion_tokens, hit_tokens_by_tier,
                       miss_tokens, cache_write_tokens=cache_write_tokens,
                       retained_token_seconds=retained_token_seconds)

    def refusing(self, count: bool = False) -> str | None:
        """Why a new request would be refused now (BillingUnavailable at admission), or None:
        "serve" with the memory bound reached and no reserve to take more; "refuse" while the
        ledger is not open (its open is retried every RETRY_S). `count`: the request is refused
        (counted in `refused`). Any thread."""
        why = self._refusal()
        if why is not None and count:
            with self._cond:
                self.refused += 1
        return why

    def _refusal(self) -> str | None:
        with self._cond:
            if self.on_failure == "refuse":
                if self.ledger is not None and self.degraded_since is None:
                    return None
                return f"billing failed: {self.error or self.ledger_error}; --on-billing-failure refuse; retry later"
            full = self._memory_bytes + _MIN_BILL_BYTES > self.memory_bound
            if full and (self.reserve_failed or self.reserve.room() < _MIN_BILL_BYTES):
                held = len(self._unwritten) + len(self._retrying)
                return (f"billing failed: {held} bills wait for the ledger, the most this server holds "
                        f"({self.error or self.ledger_error}); retry later")
            return None

    def close(self) -> None:
        """Commit everything queued (or leave it held where the next open finds it), then stop."""
        self.stop()
        self.reserve.close()

    def status(self) -> dict:
        """What the operator sees: "ok" (the ledger is open and holds every answered request), or
        "degraded" with how many bills wait, where, and why. `reserve` is the reserve's real size
        on disk (0: there is none; `reserve_error` says why)."""
        with self._cond:
            held = len(self._unwritten) + len(self._retrying)
            ok = held == 0 and self.ledger is not None and self.degraded_since is None
            return {"state": "ok" if ok else "degraded", "on_failure": self.on_failure,
                    "ledger": "open" if self.ledger is not None else "unavailable",
                    "unwritten": held, "held_in": self._held_in(),
                    "held_in_memory": len(self._in_memory), "memory_bytes": self._memory_bytes,
                    "memory_bound": self.memory_bound, "refused": self.refused,
                    "error": None if ok else (self.error or self.ledger_error),
                    "degraded_since": None if ok else self.degraded_since,
                    "reserve": self.reserve.size, "reserve_wanted": self.reserve.wanted,
                    "reserve_used": self.reserve.used,
                    "reserve_error": "; ".join(filter(None, (self.reserve_failed, self.reserve.error))) or None}

    def _held_in(self) -> str:
        if not self._in_memory:
            return "reserve" if self.reserve.ready else "memory"
        return "memory" if len(self._in_memory) == len(self._unwritten) + len(self._retrying) else "reserve and memory"

    def _has_work(self) -> bool:
        if self._queue:
            return True
        if self._stopping:
            return bool(self._unwritten) and not self._final_try
        due = time.monotonic() >= self._retry_at
        return due and (bool(self._unwritten) or self.ledger is None or self.degraded_since is not None)

    def _idle_timeout(self) -> float | None:
        if self._unwritten or self.ledger is None or self.degraded_since is not None:
            return max(0.0, self._retry_at - time.monotonic())
        return None

    def _take(self) -> list[tuple[Entry, Done | None]]:
        group: list[tuple[Entry, Done | None]] = []
        if self._unwritten and (self._stopping or time.monotonic() >= self._retry_at):
            # NOTE: still counted by status() while in hand: "ok" only once they are committed.
            self._retrying, self._unwritten = self._unwritten, []
            group = [(e, None) for e in self._retrying]     # oldest first: their requests were answered
            self._final_try = self._stopping
        n = min(self.max_group, len(self._queue))
        return group + [self._queue.popleft() for _ in range(n)]

    def _open_ledger(self) -> None:
        """Try to open the ledger (at start, then every RETRY_S while it cannot be): its open
        commits what the reserve and spill files hold."""
        try:
            ledger = Ledger(self.path, self.prices)
            identity = _identity(self.path)
        except Exception as e:
            why = f"the ledger at {self.path} cannot be opened ({type(e).__name__}: {e})"
            if why != self.ledger_error:
                log.error("billing: %s; %s", why, "requests are answered and their bills held until it opens"
                          if self.on_failure == "serve" else "requests fail (--on-billing-failure refuse)")
            with self._cond:
                self.ledger_error = why
                if self.degraded_since is None:
                    self.degraded_since = time.time()
                self._retry_at = time.monotonic() + RETRY_S
            return
        if self._identity is not None and identity != self._identity:
            # A new directory (remounted, replaced): the reserve open on the old one goes too.
            old, self.reserve = self.reserve, Reserve(self.path, self.reserve.wanted)
            old.close()
            self.reserve.pending = []      # the ledger's open committed them
        self._forget_reserve()   # the open committed the journal (and marked it empty)
        self.reserve_failed = None
        self._identity = identity
        with self._cond:
            self.ledger, self.ledger_error = ledger, None
            self._retry_at = 0.0     # the held bills are in it now: their retry only finds them there
        if self.degraded_since is not None:
            log.warning("billing: the ledger at %s is open again", self.path)

    def _write(self, group: list[tuple[Entry, Done | None]]) -> bool:
        if self.ledger is not None and self._moved():
            with self._cond:
                self.ledger = None       # NOTE: not closed here: readers on other threads may hold it
        if self.ledger is None:
            self._open_ledger()
        entries = [e for e, _ in group]
        if not entries:
            return self.ledger is not None and self._probe()
        if self.ledger is None:
            outcomes, error = [None] * len(entries), OSError(self.ledger_error)
        else:
            outcomes, error = self._commit(entries)
        self.groups += 1
        self.entries += len(group)
        fresh = [(e, d) for e, d in group if d is not None]
        if error is None:
            with self._cond:
                retried, self._retrying = self._retrying, []
                empty = not self._unwritten
                if empty:
                    self._memory_bytes = 0
                    self._in_memory.clear()
                    self._full_logged = False
                else:
                    self._retry_at = 0.0      # the ledger takes bills again: the held ones now
            self.reserve_failed = None          # the filesystem takes writes again
            if retried and empty:
                self._forget_reserve()
            if empty and not self.reserve.ready:
                self.reserve.make()      # there was no room for one before
            self._answer(fresh, outcomes[len(group) - len(fresh):], None)
            return True
        held, refused = self._hold(fresh) if self.on_failure == "serve" else ([], fresh)
        if refused:
            error = BillingUnavailable(
                f"billing failed: the ledger cannot take this request's bill ({error})" + (
                    "; --on-billing-failure refuse" if self.on_failure == "refuse" else
                    f"; {len(self._unwritten) + len(self._retrying) + len(held)} bills are held already, the most "
                    "this server holds") + "; retry later")
        with self._cond:
            # NOTE: held before the callbacks run: a request answered is counted until committed.
            self._unwritten = self._retrying + [e for e, _ in held] + self._unwritten
            self._retrying = []
            self.refused += len(refused)
        self._answer(held, [None] * len(held), None)
        self._answer(refused, [None] * len(refused), error)
        return False

    def _hold(self, fresh: list[tuple[Entry, Done | None]]) -> tuple[list, list]:
        """Serve: the bills that can be held -- written into the reserve, else in memory within
        its bound -- and those that cannot (their requests fail)."""
        if not fresh:
            return [], []
        fits = 0
        if self.reserve.ready and not self.reserve_failed:
            room = self.reserve.room()
            for e, _ in fresh:
                room -= len(encode([(e.request_key, e.record)]))
                if room < 0:
                    break
                fits += 1
            try:
                if fits:
                    self.reserve.append([(e.request_key, e.record) for e, _ in fresh[:fits]])
            except (ReserveFull, OSError) as e:
                # NOTE (issue 41): a reserve that cannot be written (a read-only or aborted filesystem,
                # EIO) is no reason to fail a request: its bills are held in memory, bounded.
                self.reserve_failed = f"writing into {self.reserve.file} failed ({e})"
                log.error("billing: %s; bills are held in memory (at most %d bytes of them) until the ledger can "
                          "be written", self.reserve_failed, self.memory_bound)
                fits = 0
        rest, held = fresh[fits:], []
        with self._cond:
            for e, d in rest:
                size = len(encode([(e.request_key, e.record)]))
                if self._memory_bytes + size > self.memory_bound:
                    break
                self._memory_bytes += size
                self._in_memory.add(e.request_key)
                held.append((e, d))
        if len(held) < len(rest) and not self._full_logged:
            self._full_logged = True        # once, until the held bills are committed
            log.error("billing: bills can be held nowhere (the reserve %s, memory at its bound of %d bytes): requests "
                      "fail with 503 (BillingUnavailable) until the ledger takes the bills held",
                      "cannot be written" if self.reserve_failed else "is full or absent", self.memory_bound)
        return fresh[:fits] + held, rest[len(held):]

    def _answer(self, group: list[tuple[Entry, Done | None]], outcomes: list, error: Exception | None) -> None:
        for (_, done), recorded in zip(group, outcomes):
            if done is None:
                continue
            try:
                done(recorded, error)
            except Exception:
                log.exception("billing: a completion callback failed")

    def _probe(self) -> bool:
        """Degraded with nothing held ("refuse": no bill waits to be retried): whether the ledger
        takes a write now (Ledger.probe)."""
        if self.degraded_since is None:
            return True
        try:
            self.ledger.probe()
        except Exception as e:      # still degraded; tried again in RETRY_S
            log.debug("billing: the ledger still takes no writes: %s", e)
            return False
        return True

    def _forget_reserve(self) -> None:
        try:
            self.reserve.clear()
        except OSError as e:        # harmless: its bills are committed, and a read back is idempotent
            log.warning("billing: emptying the reserve's journal failed (%s)", e)

    def _commit(self, entries: list[Entry]) -> tuple[list[bool | None], Exception | None]:
        if self._final_try and not self.reserve.ready and free_bytes(self.path) < LOW_SPACE_BYTES:
            # Closing on a disk still full, bills in memory only: a commit would fail after taking
            # the last pages, which the spill file needs. Straight to the spill.
            return [None] * len(entries), OSError(errno.ENOSPC, "the filesystem is still full at close")
        try:
            return self.ledger.record_many(entries), None
        except Exception as e:     # the whole group failed to commit (it is one transaction)
            if self._last_logged_error != str(e):
                log.error("billing: committing %d entries failed (%s: %s); %s", len(entries), type(e).__name__, e,
                          "answering the requests whose bills the reserve holds, retried every %.0f s" % RETRY_S
                          if self.on_failure == "serve" else "their requests fail (--on-billing-failure refuse)")
                self._last_logged_error = str(e)
            return [None] * len(entries), e

    def _after(self, group: list[tuple[Entry, Done | None]], ok: bool) -> None:
        if ok:
            if self.degraded_since is not None and not self._unwritten and self.ledger is not None:
                log.warning("billing: the ledger is written again; every bill held is committed")
                self.degraded_since, self.error, self._last_logged_error = None, None, None
            return
        if self._retrying:          # _write raised midway: they are still held
            self._unwritten, self._retrying = self._retrying + self._unwritten, []
        if self.degraded_since is None:
            self.degraded_since = time.time()
        self.error = self._last_logged_error or self.ledger_error
        self._retry_at = time.monotonic() + RETRY_S

    def _on_exit(self) -> None:
        """Closing with bills the ledger never took: those in the reserve are there already (the
        next open commits them); those held in memory go wherever they can be written
        (engine/billing_spill.py's `spill`), else to the log."""
        with self._cond:
            left = self._unwritten + self._retrying
            memory = [e for e in left if e.request_key in self._in_memory or not self.reserve.ready]
        if not left:
            return
        if len(memory) < len(left):
            log.error("billing: %d bills could not be committed before closing; they are in %s (committed at the "
                      "next start)", len(left) - len(memory), self.reserve.file)
        if not memory:
            return
        try:
            where = spill(self.path, [(e.request_key, e.record) for e in memory],
                          self.reserve if self.reserve.ready else None)
            self.spilled += len(memory)
            log.error("billing: %d bills held in memory could not be committed before closing; written to %s "
                      "(committed at the next start)", len(memory), where)
        except OSError as e:
            log.error("billing: %d bills could not be committed nor spilled (%s); their records follow, to be "
                      "billed by hand", len(memory), e)
            for entry in memory:
                log.error("billing: unwritten %s %s", entry.request_key.decode(), entry.record.decode())

    def _moved(self) -> bool:
        """Whether the ledger's directory is no longer the one it opened (gone, replaced, remounted)."""
        try:
            return _identity(self.path) != self._identity
        except OSError:
            return True


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino
