"""One MGET's reply read straight off a borrowed redis-py connection: each value received once,
into a buffer of exactly its size.

Why not redis-py's own read: it hands the socket's bytes to hiredis a recv() at a time; hiredis
appends each to its buffer, copies every finished value into a new bytes object and moves the
unread rest of its buffer to the front. On the default model's bf16 blocks (~360 KiB values, 32
per MGET, a valkey-server on loopback) that reads 1.1 GB/s, where receiving each value straight
into its own bytearray reads 2.6-3.4 GB/s (tools/bench_peers.py's remote get).

Knows: RESP framing of an MGET's reply (an array of bulk strings and nulls, RESP2's `$-1` or
RESP3's `_`, or a single error line) and how to borrow a connection from a redis-py pool: send with
it, read its socket, give it back. Doesn't know: keys, values, clusters' slot maps, the breaker
(storage/remote/client.py's mget_one decides when this path is taken and falls back to redis-py's
for anything else).

Errors come out as redis-py's own (TimeoutError, ConnectionError), so the tier's breaker reads
them as it reads redis-py's. An error reply (MOVED in a cluster, LOADING, OOM...) raises
`ErrorReply`: the caller sends the command again through redis-py, which knows what each means.

NOTE invariant: a connection goes back to its pool only when its reply was read to its last byte
with nothing left over; any failure part-way disconnects it, because its stream is out of step
and the next command would read the rest of this reply as its own. (Every value is also bound to
its key by the codec, so even that would be a miss, never a wrong block.)

Cancellation (storage/cancellation.py): a read whose caller gave up (its load's deadline passed
and no request waits for it) has its socket shut down by the canceller while this thread reads
it; the reader then raises `Cancelled`, and the connection is disconnected like any cut reply --
the rest of the reply stops coming over the link instead of being read to its end for nobody.
"""
from __future__ import annotations

import contextlib
import socket
from typing import Callable

from storage.cancellation import Cancellation, Cancelled

_LINE_MAX = 1 << 16           # the scratch buffer: a header line never comes near it


class ErrorReply(Exception):
    """The store answered the MGET with an error line (read whole; the connection is clean)."""


class CannotBorrow(Exception):
    """This redis-py's connections keep their socket elsewhere: nothing was sent, use redis-py."""


def read_mget(pool, rkeys: list[bytes], take: Callable[[int], memoryview] | None = None,
              cancel: Cancellation | None = None) -> list[bytearray | memoryview | None]:
    """MGET `rkeys` on a connection of redis-py `pool`: each value (None: absent), in key order.
    `take(size)`: where a value of `size` bytes is received (storage/remote/recv_buffers.py's
    warm buffers); a new bytearray each without it. `cancel`: raises Cancelled (nothing sent, or
    the connection dropped mid-reply) once it is cancelled."""
    from redis import exceptions as rx
    # get_connection() hands out a connected connection with nothing unread on it: it checks
    # (can_read) and reconnects one the server closed or that holds stray data.
    conn = pool.get_connection()
    if "_sock" not in vars(conn):       # a redis-py whose Connection we do not know: before sending
        pool.release(conn)
        raise CannotBorrow(type(conn).__name__)
    clean = False
    try:
        if cancel is not None and cancel.cancelled:
            clean = True                 # nothing sent: the connection is as it was, given back
            raise Cancelled()
        conn.send_command("MGET", *rkeys)
        sock = conn._sock
        if sock is None:                 # send_command connects; None here: it was closed under us
            raise rx.ConnectionError("the connection closed before its reply")
        reply = _Reply(sock, take)
        # The socket is watched from after the send (a few KiB of keys, never blocking) until the
        # read ends: the disconnect and the release below come after the watch is over.
        with cancel.watch(sock) if cancel is not None else _NOT_WATCHED:
            try:
                values = reply.values(len(rkeys))
            except ErrorReply:
                clean = reply.drained()      # an error line is the whole reply
                raise
            except (OSError, ValueError) as e:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled() from e     # shut down under us: the caller gave up
                if isinstance(e, socket.timeout):  # the builtin TimeoutError; redis-py's is its own
                    raise rx.TimeoutError("Timeout reading from socket") from e
                if isinstance(e, OSError):       # the builtin ConnectionError (closed mid-reply) too
                    raise rx.ConnectionError(f"Error while reading from socket: {e}") from e
                raise rx.InvalidResponse(f"MGET reply: {e}") from e
        if not reply.drained():
            raise rx.InvalidResponse("MGET reply: bytes after its end")
        # Read whole; a cancel that came after its last byte may have shut the socket down, so
        # then the connection is dropped, not given back (the values themselves are whole).
        clean = cancel is None or not cancel.cancelled
        return values
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


_NOT_WATCHED = contextlib.nullcontext()


class _Reply:
    """One reply as it comes off `sock`: header lines parsed out of a small scratch buffer, each
    bulk value received straight into its own bytearray (what the scratch already holds of it is
    copied first). Owned by the one thread reading the reply."""

    def __init__(self, sock: socket.socket, take: Callable[[int], memoryview] | None) -> None:
        self._sock = sock
        self._take_buffer = take
        self._buf = bytearray(_LINE_MAX)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0       # the unread bytes: _buf[_start:_end]

    def values(self, n: int) -> list[bytearray | memoryview | None]:
        head = self._line()
        if head[:1] == b"-":
            raise ErrorReply(head[1:].decode("utf-8", "replace"))
        if head[:1] != b"*" or int(head[1:]) != n:
            raise ValueError(f"expected an array of {n}, got {head[:40]!r}")
        out: list[bytearray | memoryview | None] = []
        for _ in range(n):
            line = self._line()
            kind = line[:1]
            if kind == b"_" or line == b"$-1":        # RESP3's null, RESP2's null bulk string
                out.append(None)
                continue
            if kind != b"$":
                # An error inside the array is not an MGET reply (MGET's items are bulk or null).
                raise ValueError(f"expected a bulk string, got {line[:40]!r}")
            size = int(line[1:])
            if size < 0:
                raise ValueError(f"bulk string of size {size}")
            value = self._take_buffer(size) if self._take_buffer is not None else bytearray(size)
            self._read_into(memoryview(value))
            if self._take(2) != b"\r\n":
                raise ValueError("bulk string not followed by CRLF")
            out.append(value)
        return out

    def drained(self) -> bool:
        """Nothing read beyond the reply's end (nothing but this reply was asked for)."""
        return self._start == self._end

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._mv[self._start:at])
                self._start = at + 2
                return line
            if self._start == 0 and self._end == len(self._buf):
                raise ValueError("a header line longer than 64 KiB")
            self._recv()

    def _take(self, n: int) -> bytes:
        while self._end - self._start < n:
            self._recv()
        out = bytes(self._mv[self._start:self._start + n])
        self._start += n
        return out

    def _read_into(self, dest: memoryview) -> None:
        have = min(len(dest), self._end - self._start)
        dest[:have] = self._mv[self._start:self._start + have]
        self._start += have
        while have < len(dest):
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise ConnectionError("the server closed the connection mid-reply")
            have += got

    def _recv(self) -> None:
        """More bytes into the scratch buffer, the unread ones moved to its front first."""
        if self._start:
            left = self._end - self._start
            self._buf[:left] = self._mv[self._start:self._end]
            self._start, self._end = 0, left
        got = self._sock.recv_into(self._mv[self._end:])
        if not got:
            raise ConnectionError("the server closed the connection mid-reply")
        self._end += got
