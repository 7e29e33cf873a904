"""One registration line adds a tier (issue 43, item 2): a fifth tier -- a directory of files, one
block a file, written here -- is wired by one `add_tier` line and, touching no other file, is
filled by the cascade, said in KV events under its own medium, matched, planned, deadlined,
restored bit-identical, billed at its own price, metered in /metrics (the shared per-tier
families and its own series), in /ready and `tieredkv status` (the table and its own lines, said
by its kind's health), and ranked and weighed by the router."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.billing import Ledger
from engine.billing_prices import Prices
from engine.load_deadline import LoadDeadlines
from engine.restore_planner import RestorePlanner
from service.app import readiness
from service.metrics import CacheCollector, ttft_sources
from service.router.index import PrefixIndex
from service.router.policy import Candidate, Policy, choose
from service.router.settings import RouterSettings
from storage.codec.payload import Codec
from storage.codec.stored_block import payload_binding
from storage.config import CacheConfig
from storage.kv_events.sink import EventSink
from storage.kv_events.wire import BlockStored
from storage.lower_tier import LowerTier
from storage.tier_health import MetricRow, Span, TierHealth, line, number
from storage.tier_kinds import TIERS, TierKind, media
from storage.tier_wiring import add_tier, remove_tier
from storage.tiered_cache import TieredKVCache
from tests.storage.conftest import TINY, block_data, keys
from tests.storage.test_tiered_cache import fill, same_bits
from tieredkv.cli import app

class DirHealth(TierHealth):
    """How the directory's status reads: its path in /ready, its files in /metrics and `tieredkv status`."""
    ready_fields = ("path",)

    def ready(self, status: dict) -> str:
        return "ok" if status.get("path") else "off"

    def metrics(self, status: dict):
        if number(status.get("files")):
            yield MetricRow("files", "Files in the tier's directory", status["files"])

    def lines(self, status: dict):
        if status.get("path"):
            yield line(f"dir: {status['files']} files in ", Span(status["path"], "warn"))


DIR = TierKind("dir", "DIR", local=True, weight=0.6, calibrates="read", health=DirHealth())


class DirRecord:
    def __init__(self, blocks: int, nbytes: int, path: Path) -> None:
        self.blocks, self.nbytes, self.path = blocks, nbytes, path

    def report(self, into) -> None:
        into.blocks, into.used_bytes, into.capacity_bytes = self.blocks, self.nbytes, 1 << 30
        into.extra.update(files=len(list(self.path.iterdir())), path=str(self.path))


class DirTier(LowerTier):
    """A directory of files, one a block (its codec payload, bound to its hash and namespace)."""
    kind, name, local = DIR, DIR.name, DIR.local

    def __init__(self, path: Path) -> None:
        self.path, self.codec, self.held = path, Codec(kind="raw"), set()
        self.events = None
        path.mkdir(parents=True, exist_ok=True)

    def _file(self, h: bytes) -> Path:
        return self.path / h.hex()

    def contains(self, key) -> bool:
        return key.hash in self.held

    def get_many(self, keys, outs=None, payloads=None, cancel=None):
        got = []
        for i, key in enumerate(keys):
            out = outs[i] if outs is not None else torch.empty(TINY.shape, dtype=TINY.dtype)
            try:
                raw = self._file(key.hash).read_bytes()
                self.codec.decode(raw, payload_binding(key.hash, key.namespace), out)
                got.append(out)
            except (OSError, ValueError):
                got.append(None)
        return got

    def put(self, key, block=None, *, wait, timeout=None, payload=None, raw_size=0, owned=False) -> bool:
        binding = payload_binding(key.hash, key.namespace)
        data = payload if payload is not None else self.codec.encode(block.detach().contiguous().cpu(), binding)
        self._file(key.hash).write_bytes(data)
        if key.hash not in self.held:
            self.held.add(key.hash)
            self.events.stored([key], self.kind.medium)
        return True

    def delete(self, key) -> bool:
        if key.hash not in self.held:
            return False
        self._file(key.hash).unlink()
        self.held.discard(key.hash)
        self.events.removed([key.hash], self.kind.medium)
        return True

    def drain(self, timeout=None, since=None) -> bool:
        return True

    def write_failures(self) -> int:
        return 0

    def clear(self) -> int:
        gone = list(self.held)
        for h in gone:
            self._file(h).unlink()
        self.held.clear()
        self.events.removed(gone, self.kind.medium)
        return len(gone)

    def stats(self) -> DirRecord:
        return DirRecord(len(self.held), sum(self._file(h).stat().st_size for h in self.held), self.path)

    def close(self) -> None:
        pass


@pytest.fixture
def dir_tier(tmp_path):
    # THE line of wiring: a kind (between the host and the disk) and how it is built from the config.
    add_tier(DIR, lambda wiring: DirTier(tmp_path / "dir"), after="host")
    yield tmp_path / "dir"
    remove_tier(DIR)


class _SlowPrefill:
    def predict(self, new_tokens: int, context: int) -> float:
        return 10.0          # recomputing is slow: a hit is loaded


class _Status(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a) -> None:
        pass


def test_a_fifth_tier_added_by_one_line(dir_tier: Path, tmp_path: Path) -> None:
    assert list(TIERS) == ["device", "host", "dir", "disk", "remote"] and "DIR" in media()
    config = CacheConfig(block_size=TINY.block_size, device_memory=8 * TINY.nbytes, host_memory=2 * TINY.nbytes,
                         disk_dir=None)
    cache = TieredKVCache(TINY, config, num_pages=8)
    try:
        sink = EventSink()
        cache.tiers.publish_to(sink)
        assert [t.name for t in cache.tiers.lower] == ["dir"]
        ks = keys(6, ns=os.urandom(32))
        cache.release(fill(cache, ks))
        cache.demote("device")
        cache.demote("host")                         # device -> host -> the directory
        assert sorted(p.name for p in dir_tier.iterdir()) == sorted(k.hash.hex() for k in ks)
        said = []
        while not sink.queue.empty():
            said.append(sink.queue.get_nowait())
        assert {k.hash for kind, medium, *rest in said if kind == "stored" and medium == "DIR" for k in rest[0]} \
            == {k.hash for k in ks}
        # Matched and planned from its own figures (its read calibrated at start, a local tier's fill).
        match = cache.match(ks)
        assert [t for _, t in match.blocks] == ["dir"] * 6
        assert cache.tiers.rates.get("dir") is not None
        planner = RestorePlanner("auto", cache.tiers.rates, _SlowPrefill(), TINY.nbytes, TINY.block_size, 64)
        assert planner.load_seconds(["dir"] * 6) is not None
        assert planner.split([t for _, t in match.blocks]).start == 0        # loaded, not recomputed
        # Deadlined as a local tier: bounded by the recompute alone, never by a link's margin.
        deadlines = LoadDeadlines(compute_seconds=lambda a, b: 1.0, load_seconds=lambda tiers: 0.1,
                                  margin=1.5, slack_s=0.0)
        assert deadlines.seconds(0, 6, ["dir"] * 6) == 1.5
        # Restored bit-identical from the files.
        got = cache.load_now(match)
        assert got.tiers == ("dir",) * 6
        for page, k in zip(got.pages, ks):
            assert same_bits(cache.pool.kv[page], block_data(k))
        cache.release(got.pages)
        stats = {name: st.to_dict() for name, st in cache.stats().items()}
        assert stats["dir"]["promotions"] == 6 and stats["dir"]["blocks"] == 6
    finally:
        cache.close()

    # Billed at its own price, under its own name, in the ledger.
    with Ledger(tmp_path / "ledger", Prices(miss=1000, dir_hit=7, completion=0)) as led:
        led.record("t", "r1", prompt_tokens=30, completion_tokens=0, hit_tokens_by_tier={"dir": 24}, miss_tokens=6)
        bill = led.tenant("t")
        assert bill.hit_tokens_by_tier["dir"] == 24 and bill.cost_pico == 24 * 7 + 6 * 1000
    assert "dir" in ttft_sources()

    # Metered: /metrics' per-tier families carry a tier="dir" row, and its own series is there.
    status = {"tiers": stats}
    rows = {(s.name, s.labels.get("tier")): s.value for m in CacheCollector(lambda: status, ("m", "1")).collect()
            for s in m.samples}
    assert ("tieredkv_cache_blocks", "dir") in rows and rows[("tieredkv_dir_files", None)] == 6
    # In /ready: its state and the fields its health names, as its kind reads them.
    ready = readiness(status, draining=False, alive=True)
    assert ready["tiers"]["dir"] == "ok" and ready["dir"] == {"path": str(dir_tier)} and ready["ready"]

    # `tieredkv status` shows it (a real HTTP server on loopback answering /v1/cache/status).
    _Status.body = json.dumps({"model": "m", "block_size": TINY.block_size, "tiers": stats}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = CliRunner().invoke(app, ["status", "--url", f"http://127.0.0.1:{server.server_address[1]}"],
                               env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert any(row.split()[:1] == ["dir"] for row in r.output.splitlines()
                   if row.strip().startswith("dir")), r.output
        assert f"dir: 6 files in {dir_tier}" in r.output.splitlines(), r.output     # its own line
    finally:
        server.shutdown()


def test_a_fifth_tier_is_known_to_the_router(dir_tier: Path) -> None:
    """The router (imported before the tier was added) ranks and weighs the tier's medium from its kind."""
    hashes = [bytes([i]) * 32 for i in range(4)]
    index = PrefixIndex()
    index.apply("a", BlockStored(hashes[:2], None, list(range(32)), 16, None, "DIR"))
    index.apply("b", BlockStored(hashes[:2], None, list(range(32)), 16, None, "DISK"))
    assert index.media(hashes[0]) == {"a": ["DIR"], "b": ["DISK"]}
    prefixes = index.prefix(hashes, ["a", "b"])
    assert prefixes == {"a": [2, 2], "b": [3, 3]}          # between the host's CPU and the disk's DISK
    policy = Policy()
    assert policy.weights["DIR"] == DIR.weight and RouterSettings(backends=("http://127.0.0.1:1",)).weights["DIR"] == DIR.weight
    choice = choose(policy, [Candidate("b", 0), Candidate("a", 0)], prefixes, prompt_tokens=64, block_size=16)
    assert (choice.backend, choice.miss_tokens) == ("a", round(64 - 2 * 16 * DIR.weight))
