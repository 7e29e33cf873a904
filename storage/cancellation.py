"""A read its caller gave up on: the flag the reader checks, and the sockets it drops at once.

Knows: whether a read was cancelled, and the sockets being read for it right now (a reader
registers one with `watch` while it reads a reply off it). `cancel()` sets the flag and shuts
those sockets down, so a reader blocked in recv() wakes at once (recv returns 0) and the bytes of
a reply nobody waits for stop flowing over the link -- a slow link would otherwise carry them
ahead of the next request's probe (issue 27: at 5 Mbit/s an abandoned MGET starved the next
EXISTS past its timeout). Doesn't know: who cancels (storage/loader.py, once no request waits
for any unfinished fill of a task: storage/load_outcome.py) or what is read (the remote tier's
MGETs: storage/remote/mget_reader.py, which drops the connection it read on -- its stream is out
of step -- and never gives it back to its pool half-read).

NOTE (threads): any thread may cancel; a reader thread watches. `_lock` guards the flag and the
watched sockets, and is held across `socket.shutdown` in cancel(): shutdown(2) never waits (it
queues a FIN and wakes readers), and holding the lock means a reader that stops watching (which
takes the lock) has its socket shut down either before it stops or not at all -- never after it
went back to a pool or was closed and its descriptor reused.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator


class Cancelled(Exception):
    """The read was cancelled by its caller: not the store's failure (no verdict on the store)."""


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._watched: set[socket.socket] = set()
        self.dropped = 0          # sockets shut down mid-read by cancel() (under _lock)

    @property
    def cancelled(self) -> bool:
        return self._cancelled     # a bool written once, under the lock; a stale False is harmless

    @property
    def reading(self) -> int:
        """Sockets being read for it right now."""
        with self._lock:
            return len(self._watched)

    def check(self) -> None:
        """Raise Cancelled when the read was cancelled (before starting a part of it)."""
        if self._cancelled:
            raise Cancelled()

    def cancel(self) -> int:
        """Cancel the read: every socket being read for it is shut down now. Returns how many.
        Idempotent. Never waits (see the module's NOTE)."""
        with self._lock:
            if self._cancelled:
                return 0
            self._cancelled = True
            n = 0
            for sock in self._watched:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    n += 1
                except OSError:        # already closed or reset: nothing flows on it anyway
                    pass
            self.dropped += n
            return n

    @contextlib.contextmanager
    def watch(self, sock: socket.socket) -> Iterator[None]:
        """While the body runs, a cancel() shuts `sock` down. Raises Cancelled at once when the
        read is already cancelled. NOTE: the caller must neither close `sock` nor give it back to
        a pool until the body has exited (the watch is over)."""
        with self._lock:
            if self._cancelled:
                raise Cancelled()
            self._watched.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._watched.discard(sock)
