"""Ours in tools/bench_peers.py: our disk tier (and remote tier, given a URL) with one codec kind,
its puts and gets timed, and the bare steps that bound each edge (memcpy, the codec's zstd, LMDB
puts/gets of the payloads our tier stored, SET pipelines and MGETs on a client built as the
tier's), each timed alone. Knows nothing of the peer, the rounds or the targets.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tiers import _decompress_into, same_bits, timed  # noqa: E402  (sibling scripts)
import page_cache  # noqa: E402
from storage.codec import byte_planes, nibble  # noqa: E402
from storage.codec.payload import CODED_PLANES, Codec, tensor_bytes  # noqa: E402
from storage.codec.zstd_frames import _coded_compressor  # noqa: E402
from storage.disk.tier import DiskTier, default_map_size  # noqa: E402
from storage.codec.stored_block import payload_binding  # noqa: E402
from storage.hashing import BlockKey, block_keys  # noqa: E402
from storage.layout import BlockLayout  # noqa: E402
from storage.remote.client import MGET_CHUNK, make_client, mget_one, pipeline, run_parallel, split  # noqa: E402
from storage.remote.recv_buffers import RecvBuffers  # noqa: E402
from storage.disk.seal import DiskSeal  # noqa: E402
from storage.fleet_secret import FleetSecret  # noqa: E402
from storage.remote.tier import RemoteTier  # noqa: E402
from storage.remote.url import parse_remote_url  # noqa: E402
from storage.remote.value import pack_value  # noqa: E402

GETS_PER_ROUND = 2         # disk gets a round, as the LMCache peer's round has (one per put kind)
WRITER_BATCH = 32           # our writers' blocks per LMDB txn / SET pipeline (DiskTier, RemoteTier defaults)

class Ours:
    """Our disk tier (and remote tier, given a URL) with one codec kind, and the limits' pieces."""

    def __init__(self, kind: str, level: int, layout: BlockLayout, blocks: torch.Tensor, tokens: list[int],
                 tmp: str, url: str | None, connections: int | None = None, seal_disk: bool = False,
                 decode_threads: int | None = None) -> None:
        self.kind, self.layout, self.blocks, self.tokens = kind, layout, blocks, tokens
        self.n = blocks.shape[0]
        self.nbytes = self.n * layout.nbytes
        self.codec = Codec(level=level, kind=kind)
        self.level = level
        cap = 4 * self.nbytes
        self.secret = FleetSecret.random()        # the remote tier's seal (and the disk's with seal_disk)
        self.disk_dir = os.path.join(tmp, f"disk-{kind}")
        self.cold_left = 0        # the most bytes a cold get found still resident after the drop
        self.disk = DiskTier(self.disk_dir, cap, self.codec, layout=layout,
                             seal=DiskSeal(self.secret) if seal_disk else None, decode_threads=decode_threads)
        self.threads = self.disk._decode_threads     # get_many's decode threads (every core)
        self.pool = ThreadPoolExecutor(self.threads)
        self.raw_env = lmdb.open(os.path.join(tmp, f"raw-{kind}"), map_size=default_map_size(cap), readahead=True)
        self.outs = torch.zeros((self.n, *layout.shape), dtype=layout.dtype)    # pre-touched
        self.limit_outs = torch.zeros_like(self.outs)
        self._tls = threading.local()     # a warm decompression buffer per decode thread
        self.url = parse_remote_url(url) if url else None
        extra = {} if connections is None else {"connections": connections}
        self.remote = RemoteTier(self.url, layout, self.codec, secret=self.secret, timeout_s=5.0,
                                 **extra) if url else None
        self.client = make_client(self.url, 5.0) if url else None
        # The limit's sends run as the tier's do: as many at once, each on a thread of its own.
        self.connections = self.remote.connections if url else 1
        self.io_pool = ThreadPoolExecutor(self.connections) if self.connections > 1 else None
        # The limit's MGETs receive into warm buffers kept from round to round, as the tier's do.
        self.recv_buffers = RecvBuffers()
        # The coded byte planes, split once (untimed): the put limit times only their zstd.
        itemsize = layout.dtype.itemsize
        swapped = byte_planes.can_swap(layout.shape)
        coded = CODED_PLANES.get(itemsize, frozenset()) if kind == "zstd" else frozenset()
        self.coded_planes = [byte_planes.split(b, swapped)[p] for b in blocks for p in sorted(coded)]
        # The payloads and values our tiers store (same sizes whatever the key), and where each
        # payload's coded frames are.
        probe = self.keys("probe")
        self.payloads = [self.codec.encode(b, payload_binding(k.hash, k.namespace)) for b, k in zip(blocks, probe)]
        self.values = [pack_value(k, p, layout.nbytes, self.secret) for k, p in zip(probe, self.payloads)]
        self.coded_spans = []
        for p in self.payloads:
            header, spans = self.codec.check_header(p), []
            at = header.header_size
            for plane in header.planes:
                if plane.coded:
                    spans.append((at, plane.length, header.numel))
                at += plane.length
            self.coded_spans.append(spans)
        self.stored_bytes = sum(len(p) for p in self.payloads)
        self.headers = [self.codec.check_header(p) for p in self.payloads]
        self.flat_outs = [o.reshape(-1).view(torch.uint8).numpy() for o in self.limit_outs]

    def keys(self, tag: str) -> list[BlockKey]:
        ns = f"bench-peers-{self.kind}-{tag}".encode()[:32].ljust(32, b"\0")
        return block_keys(ns, self.tokens, self.layout.block_size)

    def close(self) -> None:
        self.pool.shutdown()
        if self.io_pool is not None:
            self.io_pool.shutdown()
        self.disk.close()
        self.raw_env.close()
        if self.remote is not None:
            self.remote.close()
            self.client.close()

    # ---- the real paths ------------------------------------------------------------------
    def disk_round(self, r: int, cold: bool = False) -> dict[str, float]:
        """One durable put of every block, then the gets (cold: the store's files dropped from the
        page cache before each, tools/page_cache.py)."""
        keys = self.keys(f"d{r}")

        def put() -> None:   # handed over, as LMCache's prepared memory objects (bench_peers.py)
            for k, b in zip(keys, self.blocks):
                self.disk.put(k, b, owned=True)
            assert self.disk.drain(timeout=600), "disk drain failed"
        put_s = timed(put)
        st = self.disk.stats()
        assert st.blocks == self.n and st.write_errors == 0, st
        # Two gets a round, the faster counted: the peer's round reads twice too (after its plain
        # and its fsync'd put, lmcache_peer.py) and counts the faster. Before 2026-11-29 ours read
        # once a round, so the peer had twice our samples on this noisy machine.
        get_s = float("inf")
        for _ in range(GETS_PER_ROUND):
            self.outs.zero_()
            outs = list(self.outs)
            if cold:
                self.cold_left = max(self.cold_left, page_cache.drop([self.disk_dir])[2])
            t0 = time.perf_counter()
            got = self.disk.get_many(keys, outs)
            get_s = min(get_s, time.perf_counter() - t0)
            assert all(g is not None for g in got) and same_bits(self.outs, self.blocks), "disk get: wrong bytes"
            self.disk.drain()     # the writer records the reads' accesses; not part of the read
        self.disk.clear()
        return {"disk_put": put_s, "disk_get": get_s}

    def remote_round(self, r: int) -> dict[str, float]:
        keys = self.keys(f"r{r}")

        def put() -> None:
            for k, b in zip(keys, self.blocks):
                self.remote.put(k, b, wait=True, owned=True)
            assert self.remote.drain(timeout=600), "remote drain failed"
        put_s = timed(put)
        assert self.remote.stats().write_errors == 0 and self.remote.stats().write_drops == 0
        self.outs.zero_()
        outs = list(self.outs)
        t0 = time.perf_counter()
        got = self.remote.get_many(keys, outs)
        get_s = time.perf_counter() - t0
        assert all(g is not None for g in got) and same_bits(self.outs, self.blocks), "remote get: wrong bytes"
        self.client.flushall()
        return {"remote_put": put_s, "remote_get": get_s}

    # ---- the limits' bare steps ------------------------------------------------------------
    def memcpy_s(self) -> float:
        """One memcpy of every block into a warm tensor, on the decode threads."""
        def copy(i: int) -> None:
            self.limit_outs[i].copy_(self.blocks[i])
        return timed(lambda: list(self.pool.map(copy, range(self.n))))

    def compress_s(self) -> float:
        """zstd of every coded plane with the codec's compressor, in one thread (the writer's); for
        the nibble codec, its coding of every block (storage/codec/nibble.py's kernel)."""
        if self.kind == "nibble":
            itemsize = self.layout.dtype.itemsize
            return timed(lambda: [nibble.encode(tensor_bytes(b), itemsize) for b in self.blocks])
        if not self.coded_planes:
            return 0.0      # the raw codec codes no plane
        c = _coded_compressor(self.level)
        return timed(lambda: [c.compress(p) for p in self.coded_planes])

    def decompress_s(self) -> float:
        """zstd decompression of every coded frame into a warm per-thread buffer, on the decode
        threads; for the nibble codec, its kernel's decode of every payload's planes into a warm
        tensor (the decode's write is the copy: no memcpy beside it)."""
        if self.kind == "nibble":
            return self._nibble_s()
        if not any(self.coded_spans):
            return 0.0      # the raw codec codes no plane

        def work(i: int) -> None:
            buf = getattr(self._tls, "buf", None)
            if buf is None:
                buf = self._tls.buf = memoryview(bytearray(self.layout.nbytes))
            payload = self.payloads[i]
            for at, length, size in self.coded_spans[i]:
                _decompress_into(payload[at:at + length], buf[:size])
        return timed(lambda: list(self.pool.map(work, range(self.n))))

    def _nibble_s(self) -> float:
        itemsize = self.layout.dtype.itemsize

        def work(i: int) -> None:
            p, h = memoryview(self.payloads[i]), self.headers[i]
            n, at, coded = h.numel, h.header_size, h.planes[-1].coded
            low = [p[at + b * n:at + (b + 1) * n] for b in range(itemsize - 1)]
            top = p[at + (itemsize - 1) * n:]
            nibble.decode(top if coded else None, low, None if coded else top, self.flat_outs[i], itemsize)
        return timed(lambda: list(self.pool.map(work, range(self.n))))

    def lmdb_put_s(self) -> float:
        with self.raw_env.begin(write=True) as txn:     # untimed: empty the raw store
            txn.drop(self.raw_env.open_db(None, txn=txn), delete=False)
        keys = [k.hash for k in self.keys("raw")]

        def put() -> None:
            for start in range(0, self.n, WRITER_BATCH):
                with self.raw_env.begin(write=True) as txn:
                    for k, p in zip(keys[start:start + WRITER_BATCH], self.payloads[start:start + WRITER_BATCH]):
                        txn.put(k, p)
        return timed(put)

    def lmdb_get_s(self) -> float:
        keys = [k.hash for k in self.keys("raw")]

        def get() -> None:
            with self.raw_env.begin(buffers=True) as txn:
                got = [txn.get(k) for k in keys]
                assert all(g is not None for g in got)
        return timed(get)

    def set_s(self) -> float:
        keys = [b"bench-peers:limit:%d" % i for i in range(self.n)]

        def put() -> None:
            for start in range(0, self.n, WRITER_BATCH):
                cmds = [("SET", k, v) for k, v in zip(keys[start:start + WRITER_BATCH],
                                                      self.values[start:start + WRITER_BATCH])]
                run_parallel(self.io_pool, [lambda part=part: pipeline(self.client, part)
                                            for part in split(cmds, self.connections)])
        return timed(put)

    def mget_s(self) -> float:
        keys = [b"bench-peers:limit:%d" % i for i in range(self.n)]

        def mget(start: int) -> None:
            got = mget_one(self.client, keys[start:start + MGET_CHUNK], self.recv_buffers.take)
            assert all(v is not None for v in got)
            for v in got:
                self.recv_buffers.give(v)

        def get() -> None:
            run_parallel(self.io_pool, [lambda start=start: mget(start) for start in range(0, self.n, MGET_CHUNK)])
        s = timed(get)
        self.client.flushall()
        return s

    def drive_read_s(self) -> float:
        """The drive's read of the store's data file from a cold page cache (dropped first): one
        sequential readinto of 8 MiB at a time, as a copy out of the drive costs at the least.
        Scaled to the raw KV bytes the blocks hold (the file holds LMDB's pages around them)."""
        path = os.path.join(self.disk_dir, "data.mdb")
        page_cache.drop([path])
        buf, size = bytearray(8 << 20), 0
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                size += n
        return (time.perf_counter() - t0) * self.stored_bytes / max(size, 1)

    def limits_round(self, edges: tuple[str, ...] = ("disk", "remote"),
                     cold: bool = False) -> dict[str, dict[str, float]]:
        """Every limit's parts, each timed alone (seconds), for the edges asked. Cold: the disk
        get's read is the drive's (drive_read_s), not LMDB's get from the page cache."""
        memcpy, comp, decomp = self.memcpy_s(), self.compress_s(), self.decompress_s()
        # nibble: its kernel decodes into the tensor (the copy is in it); zstd: frames, then a join
        step, copy = ("nibble", {}) if self.kind == "nibble" else ("zstd", {"memcpy": memcpy})
        out = {}
        if "disk" in edges:
            out["disk_put"] = {"memcpy": memcpy, step: comp, "lmdb_put": self.lmdb_put_s()}
            read = {"drive": self.drive_read_s()} if cold else {"lmdb_get": self.lmdb_get_s()}
            out["disk_get"] = {**read, step: decomp, **copy}
        if self.remote is not None and "remote" in edges:
            out["remote_put"] = {"memcpy": memcpy, step: comp, "set": self.set_s()}
            out["remote_get"] = {"mget": self.mget_s(), step: decomp, **copy}
        return out

