"""Throughput of each tier edge, beside the limit measured in the same run on the same bytes.

Knows: how to get real KV blocks (the default model, SmolLM2-135M-Instruct, run over real
prose in 512-token forwards; its past_key_values restacked into the block layout
`[num_layers, 2, block_size, num_kv_heads, head_dim]`), and how to time each edge through the
real code path and through the bare operation that bounds it:

    edge            real path                                   limit (same bytes, same threads)
    device_to_host  TieredKVCache.demote("device"): every       torch copy_ page -> host slab slot,
                    page evicted into the host slab             one block at a time
    host_to_disk    TieredKVCache.demote("host") + disk.drain(): the format's own work in one thread
                    DiskTier.put copies, the writer's pool      like the writer did: Codec.encode of each
                    encodes a batch ahead, its thread commits   block (byte planes, zstd per plane,
                    32-block transactions                       crcs), then LMDB puts of the
                                                                payloads, 32 per write transaction
                                                                (tools/bench_write_pool.py splits it)
    disk_to_host    DiskTier.get_many(keys, outs): one read     LMDB get of the payloads in one read
                    txn (payloads read in place), verify (meta, txn + zstd decompression of each
                    header and coded crc32s) and decode (zstd   payload's frames (one per byte plane)
                    of each plane + join) on decode_threads     straight into a warm buffer on as
                    threads                                     many threads: no crc, no meta, no
                                                                join (also shown: the same plus the
                                                                format's join of the planes)
    host_to_device  TieredKVCache.acquire(match) of blocks      torch copy_ host slot -> page, one
                    that are only in the host tier              block at a time

GB/s counts raw (uncompressed) block bytes. Each round measures every edge and its limit back
to back, so load from other processes hits both alike; the best of --repeat rounds is kept.
The OS page cache is warm (the LMDB files were just written), so "disk" here is LMDB + zstd,
not the drive. The device is the CPU when there is no GPU (tensors stay on the CPU).
Also: compression ratio and single-thread codec MB/s per dtype (tools/bench_codec.py compares
the codec's formats), and a single-thread profile (microseconds per block) of the codec's steps on the same blocks,
which says where the disk edges' time goes.

    python tools/bench_tiers.py [--blocks 256] [--level 3] [--repeat 5] [--dtype float32]
                                [--torch-threads N] [--json]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note  # noqa: E402  (sibling scripts)
from real_kv import real_kv_blocks  # noqa: E402  (siblings import it from here too)
from storage.codec import byte_planes  # noqa: E402
from storage.codec.payload import Codec
from storage.disk.tier import DiskTier, default_map_size
from storage.layout import BlockLayout, dtype_from_name, dtype_name
from storage.tiered_cache import TieredKVCache
from storage.config import CacheConfig
from storage.hashing import BlockKey, block_keys

EDGES = ("device_to_host", "host_to_disk", "disk_to_host", "host_to_device")
TARGET = 0.8
COPY_REPS = 3              # memory-edge samples per round
WRITER_BATCH = 32           # DiskTier's default batch_blocks: blocks per write transaction
NAMESPACE = b"bench-tiers".ljust(32, b"\0")


# ---- helpers -------------------------------------------------------------------------------

def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def load_device(cache: TieredKVCache, keys: list[BlockKey], blocks: torch.Tensor) -> list[int]:
    """Untimed setup: every block cached in a device page, unused (evictable)."""
    pages = cache.allocate(len(keys))
    for page, key, block in zip(pages, keys, blocks):
        cache.pool.kv[page].copy_(block)
        cache.register(page, key)
    cache.release(pages)
    return pages


def load_host(cache: TieredKVCache, keys: list[BlockKey], blocks: torch.Tensor) -> None:
    """Untimed setup: every block in the host tier only."""
    for key, block in zip(keys, blocks):
        cache.host.slab[cache.host.reserve(key)].copy_(block)


class EdgeBench:
    """One TieredKVCache (device pages and host slots for every block, a disk tier in a temp dir)
    plus a raw LMDB environment for the disk limits."""

    def __init__(self, layout: BlockLayout, blocks: torch.Tensor, keys: list[BlockKey], level: int,
                 tmp: str) -> None:
        self.layout, self.blocks, self.keys = layout, blocks, keys
        self.n = len(keys)
        self.nbytes = self.n * layout.nbytes
        self.level = level
        self.codec = Codec(level)
        cap = 2 * self.nbytes
        config = CacheConfig(block_size=layout.block_size, device_memory=self.nbytes, host_memory=self.nbytes,
                             disk_dir=os.path.join(tmp, "tier"), disk_capacity=cap, zstd_level=level)
        self.cache = TieredKVCache(layout, config, num_pages=self.n)
        self.cache.host.slab.zero_()   # steady state: the slab's pages are mapped once, up front
        self.disk: DiskTier = self.cache.disk
        self.threads = self.disk._decode_threads   # get_many's decode threads (all cores by default)
        self.pool = ThreadPoolExecutor(self.threads)
        self.limit_outs = [memoryview(bytearray(layout.nbytes)) for _ in range(self.n)]   # pre-touched
        self.limit_payloads: list[memoryview] = []
        self.limit_spans: list[list[tuple[int, int]]] = []   # per block: (offset, length) of each frame
        self.format_limit_gbps = 0.0   # disk_to_host's limit plus the format's join of the planes
        self.raw_env = lmdb.open(os.path.join(tmp, "raw"), map_size=default_map_size(cap), readahead=False)
        self.outs = torch.zeros((self.n, *layout.shape), dtype=layout.dtype)   # pre-touched
        self.best: dict[str, list[float]] = {e: [0.0, 0.0] for e in EDGES}   # [gbps, limit_gbps]

    def close(self) -> None:
        self.pool.shutdown()
        self.cache.close()
        self.raw_env.close()

    def record(self, edge: str, real_s: float, limit_s: float) -> None:
        b = self.best[edge]
        b[0] = max(b[0], gbps(self.nbytes, real_s))
        b[1] = max(b[1], gbps(self.nbytes, limit_s))

    # ---- one round: every edge and its limit ---------------------------------------------
    def round(self) -> None:
        """Both memory edges COPY_REPS times (they take milliseconds, so one sample is at the
        mercy of the scheduler), then both disk edges; each right beside its limit."""
        c = self.cache
        c.drop("disk")
        for _ in range(COPY_REPS):
            c.drop("device")
            c.drop("host")
            self.memory_edges()
        self.disk_edges()   # moves the blocks the host tier now holds

    def memory_edges(self) -> None:
        c = self.cache
        # device -> host: eviction of every cached page into the slab.
        pages = load_device(c, self.keys, self.blocks)
        real = timed(lambda: c.demote("device"))
        assert len(c.host) == self.n and c.pool.stats().cached_blocks == 0
        slots = [c.host.slot_of(k) for k in self.keys]
        # The limit copies the same pages into the same (now warm) slots.

        def copy_pages_to_slab() -> None:
            for p, s in zip(pages, slots):
                c.host.slab[s].copy_(c.pool.kv[p])
        self.record("device_to_host", real, timed(copy_pages_to_slab))

        # host -> device: promotion of blocks that only the host holds.
        m = c.match(self.keys)
        assert [t for _, t in m.blocks] == ["host"] * self.n
        t0 = time.perf_counter()
        got = c.load_now(m)
        real = time.perf_counter() - t0
        assert got.tiers == ("host",) * self.n
        check = got.pages[self.n // 2], self.blocks[self.n // 2]
        assert same_bits(c.pool.kv[check[0]], check[1])
        got_pages = got.pages

        def copy_slab_to_pages() -> None:
            for p, s in zip(got_pages, slots):
                c.pool.kv[p].copy_(c.host.slab[s])
        limit = timed(copy_slab_to_pages)
        self.record("host_to_device", real, limit)
        c.release(got.pages)
        c.drop("device")

    def disk_edges(self) -> None:
        c = self.cache
        # host -> disk: the host tier's blocks through the disk writer, committed.
        def host_to_disk() -> None:
            c.demote("host")
            assert self.disk.drain(timeout=600)
        real = timed(host_to_disk)
        assert self.disk.stats().blocks == self.n and self.disk.stats().write_errors == 0
        self.record("host_to_disk", real, self.raw_compress_and_put())

        # disk -> host: parallel verified decode into preallocated buffers.
        outs = list(self.outs)
        t0 = time.perf_counter()
        res = self.disk.get_many(self.keys, outs)
        real = time.perf_counter() - t0
        assert all(r is not None for r in res) and same_bits(self.outs, self.blocks)
        self.disk.drain()   # the writer records the accesses; not part of the read
        self.outs.zero_()
        self.record("disk_to_host", real, self.raw_get_and_decompress())
        self.format_limit_gbps = max(self.format_limit_gbps, gbps(self.nbytes, self.raw_get_and_decompress(join=True)))

    # ---- limits for the disk edges -------------------------------------------------------
    def raw_compress_and_put(self) -> float:
        """Codec.encode of each block (the format's own work) in one thread like the writer, and
        LMDB puts of the payloads in WRITER_BATCH-block write transactions; payloads live one
        batch at a time, as in the writer."""
        with self.raw_env.begin(write=True) as txn:
            txn.drop(self.raw_env.open_db(None, txn=txn), delete=False)
        t0 = time.perf_counter()
        for start in range(0, self.n, WRITER_BATCH):
            payloads = [self.codec.encode(block, BINDING) for block in self.blocks[start:start + WRITER_BATCH]]
            with self.raw_env.begin(write=True) as txn:
                for key, payload in zip(self.keys[start:start + WRITER_BATCH], payloads):
                    txn.put(key.hash, payload)
        elapsed = time.perf_counter() - t0
        with self.raw_env.begin() as txn:   # untimed: where each payload's frames are
            self.limit_spans = []
            for k in self.keys:
                header = self.codec.check_header(txn.get(k.hash))
                spans, at = [], header.header_size
                for plane in header.planes:
                    spans.append((at, plane.length))
                    at += plane.length
                self.limit_spans.append(spans)
        return elapsed

    def raw_get_and_decompress(self, join: bool = False) -> float:
        """LMDB get of every payload in one read transaction, then zstd decompression of each
        payload's frames (one per byte plane) straight into its own preallocated buffer on the
        tier's decode_threads threads (zstd releases the GIL): no crc, no metadata, no
        intermediate copy. join=True adds the format's join of the planes (decompress into a
        per-thread buffer, then join into the block's buffer)."""
        with self.raw_env.begin() as txn:   # untimed warm-up of the map's pages
            for k in self.keys:
                txn.get(k.hash)
        plane = self.layout.nbytes // self.layout.dtype.itemsize

        def decompress(i: int) -> None:
            payload, spans = self.limit_payloads[i], self.limit_spans[i]
            if not join:
                for b, (at, length) in enumerate(spans):
                    _decompress_into(payload[at:at + length], self.limit_outs[i][b * plane:(b + 1) * plane])
                return
            scratch = getattr(_tls, "scratch", None)
            if scratch is None or len(scratch) != self.layout.nbytes:
                scratch = _tls.scratch = memoryview(bytearray(self.layout.nbytes))
            for b, (at, length) in enumerate(spans):
                _decompress_into(payload[at:at + length], scratch[b * plane:(b + 1) * plane])
            out = torch.frombuffer(self.limit_outs[i], dtype=self.layout.dtype).view(self.layout.shape)
            byte_planes.join([scratch[b * plane:(b + 1) * plane] for b in range(len(spans))], out,
                             byte_planes.can_swap(self.layout.shape))
        t0 = time.perf_counter()
        with self.raw_env.begin(buffers=True) as txn:   # payloads read in place, as get_many does
            self.limit_payloads = [txn.get(k.hash) for k in self.keys]
            list(self.pool.map(decompress, range(self.n)))
            self.limit_payloads = []
        return time.perf_counter() - t0

    def result(self) -> dict:
        res = {e: {"gbps": round(g, 3), "limit_gbps": round(lg, 3), "ratio": round(g / lg, 3)}
               for e, (g, lg) in self.best.items()}
        if self.format_limit_gbps:
            d = res["disk_to_host"]
            d["limit_with_join_gbps"] = round(self.format_limit_gbps, 3)
            d["ratio_with_join"] = round(self.best["disk_to_host"][0] / self.format_limit_gbps, 3)
        return res


_tls = threading.local()


def _decompress_into(frame: bytes, out: memoryview) -> None:
    """One whole zstd frame into `out`, its content checksum verified (read to the frame's end)."""
    dctx = getattr(_tls, "dctx", None)
    if dctx is None:
        dctx = _tls.dctx = zstandard.ZstdDecompressor()
    with dctx.stream_reader(frame) as reader:
        got = 0
        while got < len(out):
            k = reader.readinto(out[got:])
            if k == 0:
                raise RuntimeError("zstd frame shorter than its block")
            got += k
        if reader.read(1):
            raise RuntimeError("zstd frame longer than its block")


# ---- compression ---------------------------------------------------------------------------

def compression(blocks32: torch.Tensor, level: int, repeat: int) -> dict:
    """Per dtype: ratio (raw / stored payload bytes) and single-thread Codec.encode /
    Codec.decode MB/s (raw bytes), best of `repeat`."""
    out = {}
    codec = Codec(level=level)
    for name in ("float32", "float16", "bfloat16"):
        blocks = blocks32.to(dtype_from_name(name))
        raw = blocks.numel() * blocks.element_size()
        dst = torch.zeros_like(blocks)
        enc_s = dec_s = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            payloads = [codec.encode(b, BINDING) for b in blocks]
            enc_s = min(enc_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for p, d in zip(payloads, dst):
                codec.decode(p, BINDING, out=d)
            dec_s = min(dec_s, time.perf_counter() - t0)
        assert same_bits(dst, blocks)
        out[name] = {"ratio": round(raw / sum(len(p) for p in payloads), 3),
                     "compress_mbps": round(raw / enc_s / 1e6, 1), "decompress_mbps": round(raw / dec_s / 1e6, 1)}
    return out


BINDING = bytes(64)   # the disk tier binds each payload to block hash || namespace (64 bytes)


def codec_profile(blocks: torch.Tensor, level: int, repeat: int) -> dict:
    """Single-thread microseconds per block of each step of Codec.encode / Codec.decode (the work
    the disk writer and get_many's decode threads do per block), best of `repeat`, warm buffers."""
    from storage.codec.header import crc32
    from storage.codec.payload import CODED_PLANES
    from storage.codec.zstd_frames import _store_compressor, block_cuts as _block_cuts, compress_coded as _compress_coded

    codec = Codec(level=level)
    shape = tuple(blocks.shape[1:])
    swapped = byte_planes.can_swap(shape)
    cuts = _block_cuts(shape, swapped)
    coded = CODED_PLANES[blocks.element_size()]
    payloads = [codec.encode(b, BINDING) for b in blocks]
    headers = [codec.check_header(p) for p in payloads]
    planes = [byte_planes.split(b, swapped) for b in blocks]
    frames = [[f for f, _ in codec.frames(p)] for p in payloads]
    coded_frames = [f for fs, h in zip(frames, headers) for f, pl in zip(fs, h.planes) if pl.coded]
    plane_size = blocks[0].numel()
    out = torch.zeros_like(blocks[0])
    scratch = memoryview(bytearray(blocks[0].numel() * blocks.element_size()))
    warm = [scratch[b * plane_size:(b + 1) * plane_size] for b in range(blocks.element_size())]
    split_buf = np.empty(blocks[0].numel() * blocks.element_size(), dtype=np.uint8)
    steps = {
        # Into one warm buffer, as Codec.encode splits (its per-thread buffer): the step, not
        # the page faults of a new array per block.
        "encode.split": lambda: [byte_planes.split(b, swapped, out=split_buf) for b in blocks],
        "encode.coded": lambda: [_compress_coded(ps[b], level, cuts) for ps in planes for b in coded],
        "encode.stored": lambda: [_store_compressor().compress(ps[b]) for ps in planes
                                  for b in range(len(ps)) if b not in coded],
        "encode.total": lambda: [codec.encode(b, BINDING) for b in blocks],
        "decode.crc32": lambda: [crc32(f) for f in coded_frames] + [codec.check_header(p) for p in payloads],
        "decode.zstd": lambda: [_decompress_into(f, warm[b]) for fs in frames for b, f in enumerate(fs)],
        "decode.join": lambda: [byte_planes.join(warm, out, swapped) for _ in blocks],
        "decode.total": lambda: [codec.decode(p, BINDING, out=out) for p in payloads],
    }
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeat):
        for name, fn in steps.items():
            best[name] = min(best[name], timed(fn))
    return {name: round(t / len(blocks) * 1e6, 1) for name, t in best.items()}


# ---- report --------------------------------------------------------------------------------

def print_table(res: dict) -> None:
    cfg = res["config"]
    print(f"Tier edges: {cfg['blocks']} real KV blocks of {cfg['model']} ({cfg['dtype']}, "
          f"{cfg['block_bytes'] / 2**10:.0f} KiB each, {cfg['blocks'] * cfg['block_bytes'] / 1e6:.0f} MB), "
          f"zstd level {cfg['level']}, best of {cfg['repeat']}")
    print(f"{'edge':<15} {'GB/s':>7} {'limit GB/s':>11} {'ratio':>6}  target >= {TARGET}")
    for e, r in res["edges"].items():
        print(f"{e:<15} {r['gbps']:>7.3f} {r['limit_gbps']:>11.3f} {r['ratio']:>6.2f}  "
              f"{'met' if r['ratio'] >= TARGET else 'MISSED'}")
    d = res["edges"]["disk_to_host"]
    if "limit_with_join_gbps" in d:
        print(f"  disk_to_host against zstd + the format's join of the byte planes: limit {d['limit_with_join_gbps']:.3f} "
              f"GB/s, ratio {d['ratio_with_join']:.2f}")
    print()
    print(f"Compression (level {cfg['level']}, one thread, Codec.encode / Codec.decode, format v4, header and crcs included)")
    print(f"{'dtype':<18} {'ratio':>6} {'compress MB/s':>14} {'decompress MB/s':>16}")
    for k, r in res["compression"].items():
        print(f"{k:<18} {r['ratio']:>6.3f} {r['compress_mbps']:>14.1f} {r['decompress_mbps']:>16.1f}")
    print()
    prof = res["profile_us_per_block"]
    print(f"Codec steps, one thread, microseconds per {cfg['dtype']} block:")
    for side in ("encode", "decode"):
        print(f"  {side}: " + ", ".join(f"{k.split('.')[1]} {v:.0f}" for k, v in prof.items() if k.startswith(side)))
    print(f"\nmachine: {res['machine']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks to move per edge (16 tokens each)")
    ap.add_argument("--level", type=int, default=3, help="zstd level (the tier's and the limits')")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best of them is reported")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="KV dtype for the edges (the model runs in float32; its KV is cast)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch intra-op threads for the copies (default: torch's own choice)")
    ap.add_argument("--model", default=None, help="model whose KV is moved (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.repeat < 1:
        ap.error("--blocks and --repeat: expected >= 1")
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            ap.error("--torch-threads: expected >= 1")
        torch.set_num_threads(args.torch_threads)
    Codec(level=args.level)   # validates the level
    logging.basicConfig(level=logging.WARNING)

    layout32, blocks32, stream = real_kv_blocks(args.blocks, model=args.model)
    dtype = dtype_from_name(args.dtype)
    layout = BlockLayout(layout32.num_layers, layout32.block_size, layout32.num_kv_heads, layout32.head_dim, dtype)
    blocks = blocks32.to(dtype)
    keys = block_keys(NAMESPACE, stream, layout.block_size)
    tmp = tempfile.mkdtemp(prefix="tieredkv-bench-tiers-")
    try:
        bench = EdgeBench(layout, blocks, keys, args.level, tmp)
        try:
            for r in range(args.repeat):
                bench.round()
                if not args.json:
                    print(f"round {r + 1}/{args.repeat} done", file=sys.stderr)
            edges = bench.result()
            threads = bench.threads
        finally:
            bench.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    few = max(1, min(args.blocks, 64))
    res = {"edges": edges, "compression": compression(blocks32, args.level, min(args.repeat, 3)),
           "profile_us_per_block": codec_profile(blocks[:few], args.level, args.repeat),
           "config": {"model": "SmolLM2-135M-Instruct", "blocks": args.blocks, "dtype": dtype_name(dtype),
                      "block_bytes": layout.nbytes, "level": args.level,
                      "repeat": args.repeat, "decode_threads": threads, "encode_threads": threads,
                      "target_ratio": TARGET},
           "machine": machine_note()}
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
