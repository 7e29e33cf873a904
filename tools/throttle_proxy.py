"""A TCP proxy with a bandwidth limit: a slow network in front of a real server, for benchmarks.

Knows: how to relay bytes between clients and one upstream (host:port) at no more than a given
rate in each direction, shared by every connection as a link is (a token bucket per direction:
each chunk waits until the link has carried the ones before it at the rate), plus an optional
one-way latency added to every chunk. The link's queue (bytes accepted and not yet carried, all
connections together) holds at most `--queue-ms` of the link's time (default 250 ms, at least one
chunk), as a bottleneck's buffer does: a sender faster than the link is held back in its own
socket, where bytes cost the link nothing until they are sent and are dropped with the connection.
(Before, each connection could queue 4 MiB ahead of the link: 6.7 s at 5 Mbit/s, during which
every other command on the link waited, even after the client that asked for the bytes was gone.) It runs in its own process so its event loop never competes
with the measured engine for the GIL; `ThrottleProxy` starts that process and stops it.
Doesn't know: the protocol it carries (Valkey's here; any TCP byte stream).

    python tools/throttle_proxy.py --upstream 127.0.0.1:6379 --mbit 100 [--listen 127.0.0.1:0]
                                   [--latency-ms 0] [--queue-ms 250]

prints `listening HOST:PORT` on stdout once bound, then serves until SIGTERM (and, with
--exit-with-stdin, until stdin closes).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

CHUNK = 64 * 1024      # bytes read at a time: 5 ms of a 100 Mbit/s link, the pacing's grain


class Link:
    """One direction of the link: chunks leave no faster than `bytes_per_s`, in arrival order."""

    def __init__(self, bytes_per_s: float, queue_s: float = 0.25) -> None:
        self.bytes_per_s = bytes_per_s
        self.queue_s = queue_s          # the most link time queued ahead (one chunk always passes)
        self._free_at = 0.0            # when the link finishes carrying what it was given

    def room_in(self) -> float:
        """Seconds until the link's queue has room for another chunk (0: now)."""
        return max(0.0, self._free_at - time.monotonic() - self.queue_s)

    def reserve(self, nbytes: int) -> float:
        """Seconds to wait before `nbytes` may leave (the link's queue ahead of them)."""
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_s
        return self._free_at - now


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, latency_s: float) -> None:
    """Relay one direction: a chunk leaves once the link has carried the ones before it at the
    rate, and arrives latency_s after that; reading goes on meanwhile (the latency is in flight,
    not a pause between chunks). One event loop, so Link.reserve needs no lock."""
    # Bounded: a sender faster than the link is held back (as a TCP window would), 4 MiB ahead.
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)

    async def deliver() -> None:
        try:
            while (item := await queue.get()) is not None:
                at, chunk = item
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    delivery = asyncio.create_task(deliver())
    try:
        while True:
            while (wait := link.room_in()) > 0:      # the link's queue is full: the sender waits
                await asyncio.sleep(wait)
            chunk = await reader.read(CHUNK)
            if not chunk:
                break
            await queue.put((time.monotonic() + link.reserve(len(chunk)) + latency_s, chunk))
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        await queue.put(None)
        await delivery


async def serve(listen: tuple[str, int], upstream: tuple[str, int], mbit: float, latency_ms: float,
                exit_with_stdin: bool = False, queue_ms: float = 250.0) -> None:
    # client->server, server->client
    up_link, down_link = (Link(mbit * 1e6 / 8, queue_ms / 1e3), Link(mbit * 1e6 / 8, queue_ms / 1e3))
    latency_s = latency_ms / 1e3

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(_pump(c_reader, s_writer, up_link, latency_s),
                                 _pump(s_reader, c_writer, down_link, latency_s))
        except asyncio.CancelledError:      # the proxy is stopping with this connection open
            pass

    server = await asyncio.start_server(handle, *listen)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if exit_with_stdin:
        # The parent holding our stdin (ThrottleProxy) is how we learn it died: EOF ends us too.
        loop.add_reader(sys.stdin.fileno(), lambda: os.read(sys.stdin.fileno(), 1) or stop.set())
    async with server:
        await stop.wait()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


class ThrottleProxy:
    """The proxy in a child process: `with ThrottleProxy("127.0.0.1", 6379, mbit=100) as p: p.url`."""

    def __init__(self, host: str, port: int, mbit: float, latency_ms: float = 0.0, queue_ms: float = 250.0) -> None:
        self.upstream, self.mbit, self.latency_ms, self.queue_ms = (host, port), mbit, latency_ms, queue_ms
        self._proc: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> "ThrottleProxy":
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--upstream", f"{self.upstream[0]}:{self.upstream[1]}",
             "--mbit", str(self.mbit), "--latency-ms", str(self.latency_ms), "--queue-ms", str(self.queue_ms),
             "--exit-with-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline()
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"throttle_proxy did not start (said {line!r})")
        self.port = _addr(line.split()[1])[1]
        return self

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> "ThrottleProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the server behind the proxy")
    ap.add_argument("--mbit", type=float, required=True, help="link rate in Mbit/s, each direction")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: a free one)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency added to every chunk")
    ap.add_argument("--queue-ms", type=float, default=250.0,
                    help="the most link time the link's queue holds, all connections together (a chunk always passes)")
    ap.add_argument("--exit-with-stdin", action="store_true",
                    help="also stop at EOF on stdin (how ThrottleProxy's child learns its parent is gone)")
    args = ap.parse_args(argv)
    if args.mbit <= 0 or args.latency_ms < 0 or args.queue_ms < 0:
        ap.error("--mbit must be > 0, --latency-ms and --queue-ms >= 0")
    asyncio.run(serve(_addr(args.listen), _addr(args.upstream), args.mbit, args.latency_ms, args.exit_with_stdin,
                      args.queue_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
