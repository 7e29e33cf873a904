"""Where bench_ttft --restore-policy's hits come from: the sources, their engines' surroundings,
and how a stored prefix is put into exactly one tier before a timed request.

Knows:
- the sources: host and disk (one engine, no store), a remote store reached directly, the same
  store behind tools/throttle_proxy.py at a given link rate (one engine per link, so each learns
  its own link), and a stalled store -- a valkey-server of its own, SIGSTOPped after the prefix
  was stored and SIGCONTed once the timed request is answered (`Stall`);
- a `Site`: one engine's cache config (its own disk dir, kept across restarts, so a restarted
  engine finds what the last one left), its proxy and its stall;
- `store_prefixes`: a short-lived engine writing the prefixes straight into a store (write-
  through, no proxy). The engines that read a store are write-back and drop their misses, so
  nothing they compute crosses a slow link: a 2048-token miss is ~37 MB, a minute at 5 Mbit/s;
- `place` (before a steady request) and `place_first` (on a restarted engine, touching nothing
  that could teach it a figure: no fill, no lookup of the store).
Doesn't know: timing, policies or targets (tools/ttft_policies.py).

A stalled store is always resumed: by `Stall.stalled`'s exit (an error or Ctrl-C included), by
its guard timer (`guard_s` after the stop: the request then finishes, its sample marked), and by
`Stores.cleanup`, which SIGCONTs before killing. Only a SIGKILL of this process leaves it stopped.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prompts import SUFFIX_TOKENS, prose_ids  # noqa: E402  (sibling scripts)
from throttle_proxy import ThrottleProxy
from valkey_servers import ValkeyServer, own_store
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from storage.config import CacheConfig
from storage.remote.url import parse_remote_url

LOCAL, DIRECT, STALLED = "local", "remote", "stalled"


@dataclass(frozen=True)
class Source:
    label: str              # a row's source: host, disk, remote, remote@5Mbit, stalled
    tier: str               # the tier that holds the prefix before the request
    site: str               # the engine it is measured on (Site.label)


class Stall:
    """SIGSTOP / SIGCONT of one valkey-server (ours: started for this purpose). `fired` counts
    the guard's resumes. Owned by the bench's main thread; the guard's timer thread only
    SIGCONTs (idempotent)."""

    def __init__(self, server: ValkeyServer, guard_s: float) -> None:
        self.server, self.guard_s = server, guard_s
        self.fired = 0
        self._timer: threading.Timer | None = None

    def _signal(self, sig: int) -> None:
        if self.server.proc is not None and self.server.proc.poll() is None:
            os.kill(self.server.proc.pid, sig)

    def _guard(self) -> None:
        self.fired += 1
        self._signal(signal.SIGCONT)

    def resume(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._signal(signal.SIGCONT)

    @contextmanager
    def stalled(self) -> Iterator["Stall"]:
        """The store stopped for the block's duration (at most guard_s), resumed on any exit."""
        self._timer = threading.Timer(self.guard_s, self._guard)
        self._timer.daemon = True
        try:
            self._signal(signal.SIGSTOP)
            self._timer.start()
            yield self
        finally:
            self.resume()


class Stores:
    """The stores of a run: the shared one (--remote-url, else a valkey-server of our own) and,
    for the stalled source, one more of our own. `cleanup` resumes and kills what we started."""

    def __init__(self, remote_url: str | None, want_remote: bool, want_stall: bool) -> None:
        self._own: list[ValkeyServer] = []
        self.url = remote_url
        if want_remote and remote_url is None:
            self.url = self._start("bench_ttft")
        self.stall_server: ValkeyServer | None = None
        if want_stall:
            url = self._start("bench_ttft (stalled store)")
            self.stall_server = self._own[-1] if url is not None else None

    def _start(self, who: str) -> str | None:
        server = own_store(who)
        if server is None:
            return None
        self._own.append(server)
        return server.url

    def cleanup(self) -> None:
        for s in self._own:
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)     # resumed before it is killed: never left stopped
            s.cleanup()


@dataclass
class Site:
    """One engine's surroundings. `url` is what the engine talks to (the proxy's, for a link)."""
    label: str
    sources: tuple[Source, ...]
    cfg: CacheConfig
    mbit: float | None = None
    proxy: ThrottleProxy | None = None
    stall: Stall | None = None
    store_url: str | None = None                     # the store itself (the placer writes there)
    first_cost_models: dict = field(default_factory=dict)

    def open(self, loaded) -> Engine:
        return Engine(loaded, cache=self.cfg)

    def close(self) -> None:
        if self.stall is not None:
            self.stall.resume()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None


def make_sites(args, stores: Stores, tmp: str) -> list[Site]:
    """Every engine of the run with its sources, in the order they are measured. Proxies are
    started here (Site.close stops them)."""
    def cfg(label: str, url: str | None) -> CacheConfig:
        return CacheConfig(device_memory=args.device_memory, host_memory=args.host_memory,
                           disk_dir=os.path.join(tmp, f"kv-{label}"), isolate_tenants=True, codec=args.codec,
                           remote_url=url, remote_write="write_back", remote_timeout_s=args.remote_timeout,
                           **({} if args.load_deadline_slack is None else {"load_deadline_slack_s": args.load_deadline_slack,
                                                                            "probe_wait_slack_s": args.load_deadline_slack}))

    sites = [Site(LOCAL, (Source("host", "host", LOCAL), Source("disk", "disk", LOCAL)), cfg(LOCAL, None))]
    if stores.url is not None:
        if args.direct:
            sites.append(Site(DIRECT, (Source(DIRECT, "remote", DIRECT),), cfg(DIRECT, stores.url),
                              store_url=stores.url))
        for m in args.remote_mbit:
            label = f"remote@{m:g}Mbit"
            host, port = parse_remote_url(stores.url).nodes[0]
            proxy = ThrottleProxy(host, port, m).start()
            sites.append(Site(label, (Source(label, "remote", label),), cfg(label, proxy.url), mbit=m, proxy=proxy,
                              store_url=stores.url))
    if stores.stall_server is not None:
        server = stores.stall_server
        sites.append(Site(STALLED, (Source(STALLED, "remote", STALLED),), cfg(STALLED, server.url),
                          stall=Stall(server, args.stall_guard), store_url=server.url))
    return sites


def store_prefixes(loaded, url: str, prefixes: dict[str, list[int]], disk_dir: str, timeout_s: float,
                   device_memory: str) -> None:
    """Each tenant's prefix written into the store at `url` by an engine of its own (write-
    through, straight to the store), every write waited for."""
    cfg = CacheConfig(device_memory=device_memory, host_memory=device_memory, disk_dir=disk_dir, isolate_tenants=True,
                      remote_url=url, remote_write="write_through", remote_timeout_s=timeout_s)
    with Engine(loaded, cache=cfg) as engine:
        params = SamplingParams(max_tokens=1)
        for tenant, prefix in prefixes.items():
            engine.generate(prefix + prose_ids(engine.tokenizer, SUFFIX_TOKENS, offset=3), params, tenant=tenant)
        # The whole cascade's flush: write-through blocks go down behind the engine (host write-
        # behind -> disk -> forwarded to the store), so the remote writer alone being idle says
        # nothing of the last request's blocks -- dropping the host below would lose them (this
        # was test_ttft_policies' "store lost the prefix's last blocks" flake).
        flushed = engine.cache.flush(300)
        if not flushed.remote:
            raise RuntimeError(f"storing the prefixes in {parse_remote_url(url).redacted}: the remote writer lost writes")
        engine.drop_tier("device")      # nothing left for close's flush
        engine.drop_tier("host")


def _lookup(engine: Engine, prefix: list[int], tenant: str) -> dict[str, int]:
    return engine.lookup(prefix + [0] * SUFFIX_TOKENS, tenant=tenant).hit_tokens_by_tier


REMOTE_SETTLE_S = 10.0


def place(engine: Engine, source: Source, prefix: list[int], tenant: str, settle_s: float = 0.0) -> None:
    """The prefix held by source.tier as the fastest tier holding it (host: nothing on the
    device; disk: nothing on device or host; remote: the store alone -- the local copies a
    remote hit kept are dropped, never written back). `settle_s`: how long the lookup may keep
    missing the store (after a stall, until the breaker's cooldown lets a probe through)."""
    try:
        _place(engine, source, prefix, tenant, settle_s)
    except ShortPlacement as short:
        raise RuntimeError(str(short)) from None


class ShortPlacement(Exception):
    """The tier looked up holds less of the prefix than placed."""


def _place(engine: Engine, source: Source, prefix: list[int], tenant: str, settle_s: float) -> None:
    cache = engine.cache
    # Write-through blocks go down behind the engine (storage/host_writeback.py): a disk drain
    # waits only for what reached the disk's writer, so the write-behind is waited for first,
    # else a kept copy lands on the disk after it was dropped.
    cache.cascade.writeback.wait_idle(60)
    if source.tier == "remote":
        engine.drop_tier("device")
        engine.drop_tier("host")
        cache.disk.drain()              # the kept copies of the last hit land before they are dropped
        engine.drop_tier("disk")
    else:
        cache.demote("device")
        if source.tier == "disk":
            cache.demote("host")
            cache.disk.drain()
            engine.drop_tier("host")
    # A store's lookup can come back short while its link is busy (the probe has a deadline: the
    # rest of the chain reads as absent), so a remote placement is looked up again for a while.
    deadline = time.monotonic() + max(settle_s, REMOTE_SETTLE_S if source.tier == "remote" else 0.0)
    while (where := _lookup(engine, prefix, tenant))[source.tier] != len(prefix):
        if time.monotonic() >= deadline:
            raise ShortPlacement(f"{source.label}: expected the prefix in {source.tier}, lookup says {where}")
        time.sleep(0.25)


def place_first(engine: Engine, source: Source, prefix: list[int], tenant: str) -> None:
    """On a restarted engine (its device and host empty, its disk as the last engine left it):
    the prefix held by source.tier, with nothing that teaches the engine a restore figure --
    host: a disk -> host prefetch (it teaches the disk's rate, not the host's); disk: as found;
    remote: the kept disk copies dropped, and no lookup (the request's own probe is its first
    word with the store)."""
    if source.tier == "remote":
        engine.drop_tier("disk")
        return
    if source.tier == "host":
        _, keys = engine.prompt_keys(prefix + [0] * SUFFIX_TOKENS, tenant)
        if not engine.cache.prefetch(keys).wait(120):
            raise RuntimeError(f"{source.label}: the disk -> host prefetch did not finish")
    where = _lookup(engine, prefix, tenant)
    if where[source.tier] != len(prefix):
        raise RuntimeError(f"{source.label} (after a restart): expected the prefix in {source.tier}, "
                           f"lookup says {where}")
