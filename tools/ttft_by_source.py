"""TTFT by prefix source, the measurement behind tools/bench_ttft.py: one shared prefix (real prose)
put into exactly one tier (device, host, disk, remote) or none (recompute) before each request,
each hit timed, and in the same run the limit each case is judged against (plain transformers
forward, torch copy, raw LMDB get + zstd decompress, raw pipelined MGETs of the stored values),
reduced to one row per (prefix length, source). Knows nothing of the command line, the table or
the remote-speedup target (tools/bench_ttft.py).
"""
from __future__ import annotations

import os
import statistics
import struct
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prompts import SUFFIX_TOKENS, prose_ids  # noqa: E402  (sibling scripts)
from bench_report import on_limit_thread  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.codec.payload import Codec  # noqa: E402
from storage.hashing import block_keys  # noqa: E402
from storage.remote.client import make_client  # noqa: E402
from storage.remote.value import HEAD_SIZE, remote_key  # noqa: E402

TARGET = 1.25
SOURCES = ("recompute", "device", "host", "disk", "remote")
_MGET_KEYS = 32            # keys per MGET in the raw limit: the remote tier's own batch

_tls = threading.local()


def _decompress(frame) -> bytes:
    # One decompressor per thread: zstandard's objects are not thread-safe.
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d.decompress(frame)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)



def _payload(value: bytes) -> memoryview:
    """The codec payload inside a stored value, unchecked: the limit reads no seal and no meta."""
    (n,) = struct.unpack_from("<I", value, HEAD_SIZE - 4)
    return memoryview(value)[HEAD_SIZE + n:]

class TTFTBench:
    def __init__(self, engine: Engine, lengths: list[int], model_arg: str | None = None) -> None:
        self.engine = engine
        self.model_arg = model_arg
        self._plain = None
        self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="bench-raw-zstd")
        self.cache = engine.cache
        self._codec = Codec()        # only its header parsing (frames()) is used: no level involved
        self.sources = SOURCES if engine.cache.remote is not None else SOURCES[:-1]
        # The raw limit's own client: plain redis-py, not the tier's (no breaker, no verification).
        self._raw_client = None if engine.cache.remote is None else make_client(engine.config.remote, 30.0)
        self.remote_raw_s: dict[int, list[tuple[float, float]]] = {n: [] for n in lengths}
        self.remote_bytes: dict[int, int] = {}
        self.tok = engine.tokenizer
        self.lengths = lengths
        self.params = SamplingParams(max_tokens=1)
        self.block = engine.block_size
        self._suffix_no = 0
        self._tenant_no = 0
        # Tenant names unique to this run: a reused --cache-dir must not turn a recompute
        # into a hit on an earlier run's blocks.
        self.run_id = uuid.uuid4().hex[:8]
        self.samples: dict[tuple[int, str], list[float]] = {}
        self.restore: dict[tuple[int, str], list[float]] = {}
        self.hf_full: dict[int, list[float]] = {n: [] for n in lengths}
        self.copy_s: dict[int, list[float]] = {n: [] for n in lengths}
        self.hf_suffix_s: dict[int, list[float]] = {n: [] for n in lengths}
        self._hf_cache: dict = {}
        self.disk_raw_s: dict[int, list[tuple[float, float]]] = {n: [] for n in lengths}
        self.payload_bytes: dict[int, int] = {}
        self.prefix = {n: prose_ids(self.tok, n) for n in lengths}
        big = max(lengths) // self.block * engine.layout.nbytes
        dev = engine.loaded.device
        # The host -> device edge: pinned host memory on CUDA (as the host tier's slab is).
        self._copy_src = torch.ones(big, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self._copy_dst = torch.zeros(big, dtype=torch.uint8, device=dev)

    def close(self) -> None:
        self._pool.shutdown()
        self._plain = self._hf_cache = None
        if self._raw_client is not None:
            self._raw_client.close()

    # ---- requests ------------------------------------------------------------------------
    def suffix(self) -> list[int]:
        # A different 16-token window of the prose each request (offsets never repeat).
        self._suffix_no += 1
        return prose_ids(self.tok, SUFFIX_TOKENS, offset=37 * self._suffix_no + 5)

    def tenant(self, n: int) -> str:
        return f"ttft-{self.run_id}-{n}"

    def request(self, n: int, tenant: str, expect: str | None):
        out = self.engine.generate(self.prefix[n] + self.suffix(), self.params, tenant=tenant)
        if expect is not None:
            got = out.usage.hit_tokens_by_tier
            if got[expect] != n or sum(got.values()) != n:
                raise RuntimeError(f"prefix {n}, expected {n} hit tokens from {expect}, got {got}")
        return out

    def expect_in(self, n: int, tier: str) -> None:
        """The whole prefix must sit in `tier` (as the fastest tier holding it) before a request."""
        where = self.engine.lookup(self.prefix[n] + [0] * SUFFIX_TOKENS, tenant=self.tenant(n)).hit_tokens_by_tier
        if where[tier] != n:
            raise RuntimeError(f"prefix {n}: expected all of it in {tier}, lookup says {where}")

    def record(self, n: int, source: str, out) -> None:
        self.samples.setdefault((n, source), []).append(out.metrics.ttft_s)
        self.restore.setdefault((n, source), []).append(out.metrics.restore_s)

    # ---- one round -----------------------------------------------------------------------
    def round(self, n: int, hits: int) -> None:
        """One recompute, then `hits` cycles of device, host and disk hits (hits are cheap;
        more samples of them make their medians steadier on a shared machine)."""
        # recompute: a tenant nobody used, so no block of it is cached anywhere.
        self._tenant_no += 1
        out = self.request(n, f"ttft-{self.run_id}-fresh-{self._tenant_no}", expect=None)
        if out.usage.prompt_cache_miss_tokens != n + SUFFIX_TOKENS:
            raise RuntimeError(f"recompute of prefix {n} hit the cache: {out.usage}")
        self.record(n, "recompute", out)
        self.engine.drop_tier("device")    # the fresh tenant's pages: keep the pool clean
        self.hf_full[n].append(self.hf_forward(self.prefix[n] + self.suffix()))

        # An untimed request brings the prefix into device pages (from wherever it is).
        self.request(n, self.tenant(n), expect=None)
        for _ in range(hits):
            # device: the previous request left the prefix in device pages.
            self.expect_in(n, "device")
            self.record(n, "device", self.request(n, self.tenant(n), expect="device"))
            self.hf_suffix_s[n].append(self.hf_suffix(n))

            # host: every cached device page goes down one tier.
            self.cache.demote("device")
            self.expect_in(n, "host")
            self.record(n, "host", self.request(n, self.tenant(n), expect="host"))

            # disk: device -> host -> disk, writer drained, host empty.
            self.cache.demote("device")
            self.cache.demote("host")
            self.cache.disk.drain()
            if len(self.cache.host):
                raise RuntimeError(f"host tier still holds {len(self.cache.host)} blocks")
            self.expect_in(n, "disk")
            self.record(n, "disk", self.request(n, self.tenant(n), expect="disk"))

            self.copy_s[n].append(self.raw_copy(n))
            self.disk_raw_s[n].append(self.raw_disk(n))

            if "remote" in self.sources:
                # remote: the disk's commits were forwarded to the store; once they are all sent,
                # every local tier is emptied, so only the store holds the prefix.
                if not self.cache.remote.drain(60):
                    raise RuntimeError(f"prefix {n}: the remote writer lost writes: "
                                       f"{self.cache.stats()['remote'].to_dict()}")
                for tier in ("device", "host", "disk"):
                    self.engine.drop_tier(tier)
                self.expect_in(n, "remote")
                self.record(n, "remote", self.request(n, self.tenant(n), expect="remote"))
                # The hit also wrote the blocks into host and disk (a server keeps what it read):
                # let the disk writer finish before the next timed request.
                self.cache.disk.drain()
                self.remote_raw_s[n].append(self.raw_remote(n))

    # ---- limits --------------------------------------------------------------------------
    @property
    def plain(self):
        """A separate copy of the model with transformers' own SDPA attention and masks (the
        engine's copy has our attention registered: transformers builds no mask for it)."""
        if self._plain is None:
            self._plain = load_model(self.model_arg, device=self.engine.loaded.device,
                                     dtype=self.engine.loaded.dtype).model
        return self._plain

    @on_limit_thread
    @torch.inference_mode()
    def hf_forward(self, ids: list[int]) -> float:
        """A plain transformers forward of the whole prompt, no cache."""
        model = self.plain
        x = torch.tensor([ids], device=self.engine.loaded.device)
        t0 = time.perf_counter()
        model(input_ids=x, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0

    @on_limit_thread
    def raw_copy(self, n: int) -> float:
        """One plain torch copy of the prefix's bytes from a preallocated host buffer to one on
        the model's device (CPU here: a memcpy); the best of 3."""
        nbytes = n // self.block * self.engine.layout.nbytes
        src, dst = self._copy_src[:nbytes], self._copy_dst[:nbytes]
        sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
        dst.copy_(src)   # warm both buffers' pages
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    def raw_disk(self, n: int) -> tuple[float, float]:
        """(LMDB get, zstd decompress) seconds for the payloads the disk tier holds for the
        prefix, each the best of 3 (the raw capability, not a sample of the load). The
        decompress is the faster of zstd's own multi-threaded batch call and a pool of one
        decompressor per thread (the batch call faults in one fresh output buffer per call,
        which on this VM makes it the slower of the two).

        Reads the tier's own LMDB environment directly (private attributes: the point is to
        bypass DiskTier's verification and decoding)."""
        disk = self.cache.disk
        hashes = [k.hash for k in block_keys(self.engine.namespace(self.tenant(n)), self.prefix[n], self.block)]
        gets, decs = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            with disk._env.begin() as txn:
                payloads = [txn.get(h, db=disk._payload) for h in hashes]
            gets.append(time.perf_counter() - t0)
            if any(p is None for p in payloads):
                raise RuntimeError(f"prefix {n}: not every block is on disk")
            decs.append(self.raw_decompress(payloads))
        self.payload_bytes[n] = sum(len(p) for p in payloads)
        return min(gets), min(decs)

    @on_limit_thread
    def raw_decompress(self, payloads: list) -> float:
        """Seconds to decompress the zstd frames of these codec payloads, the faster of zstd's
        own multi-threaded batch call and a pool of per-thread decompressors (all threads)."""
        frames, sizes = [], []
        for p in payloads:
            for frame, size in self._codec.frames(p):      # the zstd frames after our header
                frames.append(frame)
                sizes.append(size)
        sizes_buf = struct.pack(f"={len(sizes)}Q", *sizes)
        t0 = time.perf_counter()
        zstandard.ZstdDecompressor().multi_decompress_to_buffer(frames, decompressed_sizes=sizes_buf,
                                                                threads=os.cpu_count() or 1)
        batch = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(self._pool.map(_decompress, frames))
        return min(batch, time.perf_counter() - t0)

    def raw_remote(self, n: int) -> tuple[float, float]:
        """(pipelined GET, zstd decompress) seconds for the values the store holds for the prefix,
        each the best of 3: one redis-py pipeline of 32-key MGETs (a cluster: keys grouped by hash
        slot, as an MGET must stay in one), then the frames of the payloads inside the values, no
        metadata or header checks, no verification, no copy into pages."""
        rkeys = [remote_key(k) for k in block_keys(self.engine.namespace(self.tenant(n)), self.prefix[n], self.block)]
        groups = [rkeys[i:i + _MGET_KEYS] for i in range(0, len(rkeys), _MGET_KEYS)]
        if self.engine.config.remote.cluster:
            from redis.crc import key_slot
            by_slot: dict[int, list[bytes]] = {}
            for k in rkeys:
                by_slot.setdefault(key_slot(k), []).append(k)
            groups = [ks[i:i + _MGET_KEYS] for ks in by_slot.values() for i in range(0, len(ks), _MGET_KEYS)]
        gets, decs = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            pipe = self._raw_client.pipeline(transaction=False)
            for g in groups:
                pipe.mget(g)
            values = [v for reply in pipe.execute() for v in reply]
            gets.append(time.perf_counter() - t0)
            if any(v is None for v in values):
                raise RuntimeError(f"prefix {n}: not every block is in the remote store")
            decs.append(self.raw_decompress([_payload(v) for v in values]))
        self.remote_bytes[n] = sum(len(v) for v in values)
        return min(gets), min(decs)

    @on_limit_thread
    @torch.inference_mode()
    def hf_suffix(self, n: int) -> float:
        """Reference only: transformers' own forward of a 16-token suffix over a DynamicCache
        holding the prefix (what the device hit's suffix prefill costs without pages)."""
        model = self.plain
        dev = self.engine.loaded.device
        if n not in self._hf_cache:
            out = model(input_ids=torch.tensor([self.prefix[n]], device=dev), use_cache=True, logits_to_keep=1)
            self._hf_cache = {n: out.past_key_values}     # one at a time: they are large
        cache = self._hf_cache[n]
        x = torch.tensor([self.suffix()], device=dev)
        t0 = time.perf_counter()
        model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        dt = time.perf_counter() - t0
        cache.crop(-SUFFIX_TOKENS)
        return dt

    # ---- report --------------------------------------------------------------------------
    def cases(self) -> list[dict]:
        rows = []
        nbytes_block = self.engine.layout.nbytes
        for n in self.lengths:
            raw_bytes = n // self.block * nbytes_block
            dev = _median(self.samples[(n, "device")])
            copy_s = _median(self.copy_s[n])
            get_s = _median([g for g, _ in self.disk_raw_s[n]])
            dec_s = _median([d for _, d in self.disk_raw_s[n]])
            limits = {
                "recompute": (_median(self.hf_full[n]), "transformers forward of the full prompt (SDPA, no cache)"),
                "device": (dev, "the device hit's own suffix prefill"),
                "host": (dev + copy_s, f"device TTFT + {raw_bytes / 1e6:.1f} MB at {raw_bytes / copy_s / 1e9:.2f} GB/s "
                                       f"(torch copy)"),
                "disk": (dev + get_s + dec_s,
                         f"device TTFT + LMDB get {get_s * 1e3:.1f} ms + zstd {dec_s * 1e3:.1f} ms "
                         f"({raw_bytes / (get_s + dec_s) / 1e9:.2f} GB/s raw, "
                         f"{self.payload_bytes[n] / 1e6:.1f} MB stored)"),
            }
            raw_restore = {"recompute": 0.0, "device": 0.0, "host": copy_s, "disk": get_s + dec_s}
            if "remote" in self.sources:
                rget = _median([g for g, _ in self.remote_raw_s[n]])
                rdec = _median([d for _, d in self.remote_raw_s[n]])
                limits["remote"] = (dev + rget + rdec,
                                    f"device TTFT + pipelined MGET {rget * 1e3:.1f} ms + zstd {rdec * 1e3:.1f} ms "
                                    f"({raw_bytes / (rget + rdec) / 1e9:.2f} GB/s raw, "
                                    f"{self.remote_bytes[n] / 1e6:.1f} MB of values)")
                raw_restore["remote"] = rget + rdec
            recompute_ttft = _median(self.samples[(n, "recompute")])
            for source in self.sources:
                samples = self.samples[(n, source)]
                ttft = _median(samples)
                limit, how = limits[source]
                row = {"prefix_tokens": n, "source": source, "ttft_s": round(ttft, 5),
                       "limit_s": round(limit, 5), "ratio": round(ttft / limit, 3),
                       "target_met": None if source == "recompute" else ttft <= TARGET * limit,
                       "best_ttft_s": round(min(samples), 5),
                       # The restore alone (the engine's acquire: lookups, page allocation,
                       # copies or reads + verification + decoding) beside the raw edge time.
                       "restore_s": round(_median(self.restore[(n, source)]), 5),
                       "raw_restore_s": round(raw_restore[source], 5),
                       "limit": how, "samples_s": [round(x, 5) for x in samples]}
                if source == "device":
                    row["hf_suffix_s"] = round(_median(self.hf_suffix_s[n]), 5)
                if source == "remote":
                    row["speedup_vs_recompute"] = round(recompute_ttft / ttft, 2)
                rows.append(row)
        return rows
