"""Foreground activity: whether sequences are decoding in this process, and the width background
pools narrow to meanwhile.

Knows: who holds the signal (each engine, as an owner: set while it has running sequences) and
how many of a pool's tasks may work at once (`PoolWidth`: its full width with nothing running,
`yielding` -- 1 by default -- while anything does). Doesn't know: the engine (storage never
imports it: the engine thread writes the signal, pools read it) nor what a pool's work is.

Why: the write path encodes on a pool of one thread per core (storage/disk/writer.py,
storage/remote/writer.py). At nice +10 (storage/priority.py) those threads still take time slices
from the decoders' forward passes, and each holds the GIL for part of every block, which the
engine thread needs for every op it dispatches. While sequences run a pool works `yielding`
tasks at a time; with none it is as wide as before, so a flush with nothing decoding keeps its
throughput. NOTE (docs/BENCHMARKS.md, "Flush interference, run 1"): on the 2-core VM a flush
still slows the decoders (p50 1.4-1.6x), through the GIL its threads' per-block Python holds,
not through this pool's width -- but a width of 2 while decoding was worse than 1 (p99 2.41x
against 1.44-2.00x). A narrower pool while decoding means a flush or a write-back burst takes
longer then; a full writer queue drops (counted), it never stalls a step.

Threads: `hold` from the owners' threads (the engine thread); `PoolWidth` from the pool's tasks.
Both take the signal's one condition, never across I/O or an item's work.
"""
from __future__ import annotations

import threading


class Foreground:
    """The process's foreground signal: set while any owner holds it. Thread-safe."""

    def __init__(self) -> None:
        self.cond = threading.Condition()     # guards _holders and every PoolWidth's count
        self._holders: set[int] = set()       # id() of each owner holding it

    def hold(self, owner: object, active: bool) -> None:
        """`owner` has running sequences (active) or has none now. Idempotent; an owner that stops
        must call hold(owner, False) (the engine does when its thread ends)."""
        key = id(owner)
        with self.cond:
            if active == (key in self._holders):
                return
            if active:
                self._holders.add(key)
            else:
                self._holders.discard(key)
            self.cond.notify_all()            # narrowed or widened: waiting tasks look again

    def active(self) -> bool:
        with self.cond:
            return bool(self._holders)


FOREGROUND = Foreground()   # the process's: every engine writes it, every background pool reads it


class PoolWidth:
    """How many of a pool's tasks may work on an item at once: `full` while the foreground signal is
    clear, `yielding` while it is set. A task calls acquire() before taking an item and release()
    after it; an item already started finishes (the width drops at the next item)."""

    def __init__(self, full: int, yielding: int = 1, foreground: Foreground = FOREGROUND) -> None:
        if full < 1 or yielding < 1:
            raise ValueError("a pool's widths must be >= 1")
        self.full = full
        self.yielding = min(yielding, full)
        self._fg = foreground
        self._working = 0      # tasks inside an item now; under the signal's condition
        self._waiting = 0

    def limit(self) -> int:
        """The width now (the caller may hold the condition: it is reentrant)."""
        with self._fg.cond:
            return self.yielding if self._fg._holders else self.full

    def acquire(self) -> None:
        with self._fg.cond:
            self._waiting += 1
            try:
                while self._working >= self.limit():
                    self._fg.cond.wait()
            finally:
                self._waiting -= 1
            self._working += 1

    def release(self) -> None:
        with self._fg.cond:
            self._working -= 1
            if self._waiting:
                self._fg.cond.notify_all()

    def working(self) -> int:
        """Tasks inside an item now (for tests and stats)."""
        with self._fg.cond:
            return self._working

    def waiting(self) -> int:
        """Tasks waiting for their turn now."""
        with self._fg.cond:
            return self._waiting
