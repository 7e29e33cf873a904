"""The peer's side of tools/bench_peers.py: LMCache's storage layer timed on the bytes it is given.

Runs in LMCache's own virtual environment (bench_peers.py installs it there and starts this script
as a child), never in tieredkv's: it imports nothing of tieredkv. Knows: how to build LMCache
0.5.6's local-disk backend (`LocalDiskBackend`) and its Valkey backend (`RemoteBackend` over the
`valkey://` connector, naive serde) on the CPU, and how to time a put and a get of N KV blocks
through each. Doesn't know: tieredkv, limits, targets or tables (bench_peers.py has them).

The blocks come in a file of raw bytes, `[N, layers, 2, tokens, kv_heads, head_dim]` in the given
dtype (tieredkv's block layout). Each run of --chunk-blocks k consecutive blocks is stored as one
chunk of k * tokens tokens (one key, one file), laid out as LMCache stores a chunk, `KV_2LTD`
(`[2, layers, k * tokens, kv_heads * head_dim]`): the same bytes in its own order (`to_chunk`; its
inverse `from_chunk` is checked once at start). k = 16 of 16-token blocks is LMCache's default
chunk of 256 tokens; k = 1 stores each block as its own chunk. k must divide N: every chunk is a
full one (LMCache's valkey connector reads any key into a buffer of the configured chunk's shape,
so a shorter tail chunk would not read back as it was written).

Protocol: one JSON command per line on stdin, one `RESULT <json>` line per command on stdout
(anything else on stdout is LMCache's own logging, ignored by the parent):

    {"op": "disk", "round": r, "fsync": false}   put every block, wait until every file is written
                                                  (with "fsync": true each file is fsynced before
                                                  its put counts as done: LMCache never fsyncs, so
                                                  this is the durable variant, patched in here);
                                                  then one batched get. A fresh directory per call.
                                                  With "cold": true the directory's files are
                                                  dropped from the page cache before the get
                                                  (tools/page_cache.py; the result's "left": bytes
                                                  still resident after the drop).
    {"op": "remote", "round": r}                  the same through the Valkey backend (the parent
                                                  empties the store between calls)
    {"op": "quit"}

Each result: {"put_s", "get_s", "bytes", "chunks", "verified"}: seconds of the put (submit to the
last completion callback) and of the get (`batched_get_blocking` of every chunk), raw bytes moved,
the chunks (keys) they were in, and whether every chunk read back bit-identical (checked after the
timed get, every call).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_cache  # noqa: E402  (tools/page_cache.py: the standard library only)


def _fsync_write_file(self, buffer, path):
    """LocalDiskBackend.write_file as shipped (buffered open + write), plus an fsync of the file."""
    with open(path, "wb") as f:
        f.write(buffer)
        f.flush()
        os.fsync(f.fileno())


def to_chunk(blocks):
    """[k, layers, 2, tokens, kv_heads, head_dim] -> KV_2LTD [2, layers, k * tokens, kv_heads * head_dim]
    (a new contiguous tensor; token t of block j is chunk token j * tokens + t)."""
    k, layers, two, tokens, heads, head_dim = blocks.shape
    return blocks.permute(2, 1, 0, 3, 4, 5).reshape(two, layers, k * tokens, heads * head_dim).contiguous()


def from_chunk(chunk, tokens: int, heads: int):
    """The inverse of to_chunk: KV_2LTD [2, layers, k * tokens, kv_heads * head_dim] -> the k blocks."""
    two, layers, n_tokens, hidden = chunk.shape
    k = n_tokens // tokens
    return chunk.reshape(two, layers, k, tokens, heads, hidden // heads).permute(2, 1, 0, 3, 4, 5)


class Peer:
    def __init__(self, blocks_file: str, shape: tuple[int, ...], dtype_name: str, workdir: str,
                 url: str | None, chunk_blocks: int = 1) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.torch = torch
        self.dtype = getattr(torch, dtype_name)
        layers, two, tokens, heads, head_dim = shape
        raw = bytearray(open(blocks_file, "rb").read())
        src = torch.frombuffer(raw, dtype=self.dtype).view(-1, *shape)
        self.n = src.shape[0]
        self.block_bytes = src[0].numel() * src[0].element_size()
        self.chunk_tokens = chunk_blocks * tokens
        if chunk_blocks < 1 or self.n % chunk_blocks:
            raise ValueError(f"{self.n} blocks do not make whole chunks of {chunk_blocks} blocks")
        self.workdir = workdir
        self.meta = LMCacheMetadata(model_name="tieredkv-bench", world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=self.dtype,
                                    kv_shape=(layers, two, self.chunk_tokens, heads, head_dim), use_mla=False,
                                    chunk_size=self.chunk_tokens)
        # Room for the source chunks, one get's results and slack for the allocator.
        cpu_gib = (3 * self.n * self.block_bytes + (64 << 20) + 2 * chunk_blocks * self.block_bytes) / 2**30
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk_tokens, local_cpu=False, max_local_cpu_size=cpu_gib, remote_url=url,
            remote_serde="naive", local_disk=os.path.join(workdir, "unused"),
            max_local_disk_size=4 * self.n * self.block_bytes / 2**30 + 1)
        self.cpu = LocalCPUBackend(self.config, self.meta)
        self.objs = []
        for start in range(0, self.n, chunk_blocks):
            group = src[start:start + chunk_blocks]
            chunk = to_chunk(group)
            if not torch.equal(from_chunk(chunk, tokens, heads), group):     # untimed: the same bytes, reordered
                raise RuntimeError("a chunk does not hold its blocks' bytes")
            m = self.cpu.allocate(chunk.shape, self.dtype, MemoryFormat.KV_2LTD)
            if m is None:
                raise RuntimeError("LMCache's CPU allocator refused a chunk")
            m.tensor.copy_(chunk)
            self.objs.append(m)
        del src, raw
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="lmcache-loop").start()
        self.remote = None
        if url:
            from lmcache.v1.storage_backend.remote_backend import RemoteBackend
            self.remote = RemoteBackend(self.config, self.meta, self.loop, self.cpu, "cpu")
            if self.remote.connection is None:
                raise RuntimeError(f"LMCache's remote backend did not connect to {url}")

    def keys(self, base: int) -> list:
        from lmcache.utils import CacheEngineKey
        return [CacheEngineKey("tieredkv-bench", 1, 0, base + i, self.dtype) for i in range(len(self.objs))]

    def _put(self, backend, keys) -> float:
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        backend.batched_submit_put_task(keys, self.objs, on_complete_callback=lambda _k: done.release())
        for _ in keys:
            if not done.acquire(timeout=300):
                raise RuntimeError("a put never completed")
        return time.perf_counter() - t0

    def _get(self, backend, keys) -> tuple[float, bool]:
        t0 = time.perf_counter()
        got = backend.batched_get_blocking(keys)
        elapsed = time.perf_counter() - t0
        ok = all(g is not None and self.torch.equal(g.tensor, o.tensor) for g, o in zip(got, self.objs))
        for g in got:
            if g is not None:
                g.ref_count_down()
        return elapsed, ok

    def disk(self, rnd: int, fsync: bool, cold: bool = False) -> dict:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        path = os.path.join(self.workdir, f"disk-{rnd}-{int(fsync)}")
        os.makedirs(path)
        config = self.config
        config.local_disk = path
        backend = LocalDiskBackend(config, self.loop, self.cpu, "cpu", None, self.meta)
        if fsync:
            backend.write_file = _fsync_write_file.__get__(backend)
        try:
            keys = self.keys((rnd * 4 + 2 * int(fsync)) << 20)
            put_s = self._put(backend, keys)
            left = page_cache.drop([path])[2] if cold else 0
            get_s, ok = self._get(backend, keys)
        finally:
            backend.close()
            shutil.rmtree(path, ignore_errors=True)
        return {"put_s": put_s, "get_s": get_s, "bytes": self.n * self.block_bytes, "chunks": len(keys),
                "verified": ok, "left": left}

    def remote_round(self, rnd: int) -> dict:
        if self.remote is None:
            raise RuntimeError("no remote URL was given")
        keys = self.keys((rnd * 4 + 1) << 20)
        put_s = self._put(self.remote, keys)
        get_s, ok = self._get(self.remote, keys)
        return {"put_s": put_s, "get_s": get_s, "bytes": self.n * self.block_bytes, "chunks": len(keys),
                "verified": ok}


def _connector_name(remote) -> str | None:
    conn = getattr(remote, "connection", None)
    conn = getattr(conn, "_connector", conn)       # InstrumentedRemoteConnector wraps the real one
    return None if conn is None else type(conn).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks-file", required=True)
    ap.add_argument("--shape", required=True, help="layers,2,tokens,kv_heads,head_dim")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--url", default=None, help="valkey://host:port of the store (none: disk only)")
    ap.add_argument("--chunk-blocks", type=int, default=1, help="consecutive blocks stored as one chunk")
    args = ap.parse_args()
    out = sys.stdout

    def reply(obj: dict) -> None:
        out.write("RESULT " + json.dumps(obj) + "\n")
        out.flush()

    try:
        import lmcache
        peer = Peer(args.blocks_file, tuple(int(x) for x in args.shape.split(",")), args.dtype, args.workdir, args.url,
                    args.chunk_blocks)
    except Exception as e:   # noqa: BLE001 -- reported to the parent, which skips the peer
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    from importlib.metadata import version
    reply({"ready": True, "lmcache": version("lmcache"), "blocks": peer.n, "block_bytes": peer.block_bytes,
           "chunks": len(peer.objs), "chunk_tokens": peer.chunk_tokens,
           "connector": _connector_name(peer.remote), "module": lmcache.__file__})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "disk":
                reply(peer.disk(cmd["round"], cmd["fsync"], cmd.get("cold", False)))
            elif cmd["op"] == "remote":
                reply(peer.remote_round(cmd["round"]))
            else:
                reply({"error": f"unknown op {cmd['op']!r}"})
        except Exception as e:   # noqa: BLE001
            reply({"error": f"{type(e).__name__}: {e}"})
    os._exit(0)   # LMCache's threads (event loop, worker pools) need not be joined


if __name__ == "__main__":
    sys.exit(main())
