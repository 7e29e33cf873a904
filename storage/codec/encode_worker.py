"""The encode process's own side: a child that encodes blocks out of shared memory, so the
per-block Python of an encode holds this process's GIL, not the engine's.

Knows: the wire between the two processes (a request and a reply per batch, each a u32 length
and a pickle, over the child's stdin and stdout) and the arenas (one memfd per slot, mapped by
both: the blocks' bytes at the request's input offsets, the payloads written after `out_at`).
It encodes with storage/codec/payload.py's `encode_bytes`, the very code `Codec.encode` runs, so
a payload is the one the engine's process would have made. It imports no torch (start-up time,
memory): only numpy, zstandard, xxhash and the codec.
Doesn't know: what a block or a binding is for, retries, or what becomes of a payload; the parent
(storage/codec/encode_process.py) checks every answer before anything is stored.

The child's first byte is READY, once it is up (imports done, priority set, its codec's files
the ones its parent loaded: else SKEWED, and it exits). Request: (slot, slot_size, width, kind, level, out_at, out_end, jobs), a job = (in_at, nbytes,
dtype, shape, binding). Reply: one (out_offset, length, input_xxh3) per job, offset -1 where it
failed (an exception, or no room left in the output region). A block's input xxh3_64 lets the
parent prove the payload was made from the bytes it copied in.

Lifetime: it exits on EOF on stdin (the parent closed it, or died), and where Linux has prctl,
when the thread that started it ends (PR_SET_PDEATHSIG). Priority: set on itself before its
threads start (they inherit it): SCHED_IDLE with `idle` as its argument, else nice +10.

Threads: the main thread reads requests, replies and owns the maps; `width` pool threads
encode a batch's jobs, each writing its own payloads (the output cursor under `_out_lock`).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import signal
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from storage.codec.payload import decoded_digest, encode_bytes

LEN = struct.Struct("<I")
READY = b"R"                          # the child's first byte, once it is up
SKEWED = b"S"                         # ... or this, and it exits: its codec is not its parent's


def codec_fingerprint() -> str:
    """xxh3 of the codec's files as they are on disk now (payload, header, zstd frames, byte planes,
    the nibble coding and their compiled kernels). The parent takes it when it imports storage/codec/encode_process.py
    (start-up) and hands it to each child: a child started after the tree changed under a running
    server (a pull, an editable install) would encode with code its parent does not decode with, so
    it refuses to start (a failed start: the parent encodes)."""
    from storage.codec import byte_planes, header, nibble, payload, zstd_frames
    h = xxhash.xxh3_64()
    for m in (payload, header, zstd_frames, byte_planes, byte_planes._compiled, nibble, nibble._compiled):
        path = getattr(m, "__file__", None) if m is not None else None
        if path:
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()
_PR_SET_PDEATHSIG = 1
BACKGROUND_NICE = 10                  # as storage/priority.py's threads


def read_exact(fd: int, n: int, ready=None) -> bytes | None:
    """n bytes from fd, or None at EOF (the other side is gone) or when `ready`, asked before each
    read whether fd has bytes, says False (the parent's deadline: encode_process._read_by)."""
    chunks, got = [], 0
    while got < n:
        if ready is not None and not ready():
            return None
        b = os.read(fd, n - got)
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_message(fd: int):
    head = read_exact(fd, LEN.size)
    if head is None:
        return None
    body = read_exact(fd, LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def write_message(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(LEN.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


def _lower_priority(policy: str) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)     # also where SCHED_IDLE is refused
        if policy == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass                          # EOF on stdin still ends it
    if os.getppid() != parent:        # the parent died before prctl took
        os._exit(0)


class _Batch:
    """One request's jobs, encoded into one output region (main thread builds it, pool fills it)."""

    def __init__(self, arena: np.ndarray, out_at: int, out_end: int, kind: str, level: int, jobs: list) -> None:
        self.arena, self.kind, self.level, self.jobs = arena, kind, level, jobs
        self.cursor, self.end = out_at, out_end
        self.results: list[tuple[int, int, int]] = [(-1, 0, 0)] * len(jobs)
        self._out_lock = threading.Lock()

    def encode(self, j: int) -> None:
        in_at, nbytes, dtype, shape, binding = self.jobs[j]
        try:
            data = self.arena[in_at:in_at + nbytes]
            digest = xxhash.xxh3_64_intdigest(data)
            parts = encode_bytes(data, dtype, tuple(shape), binding, self.kind, self.level)
            lengths = [len(p) if not isinstance(p, np.ndarray) else p.nbytes for p in parts]
            total = sum(lengths)
            with self._out_lock:
                at = self.cursor
                if at + total > self.end:
                    return            # no room: the parent encodes it itself
                self.cursor += total
            pos = at
            for p, n in zip(parts, lengths):
                self.arena[pos:pos + n] = np.frombuffer(p, dtype=np.uint8) if not isinstance(p, np.ndarray) else p.reshape(-1).view(np.uint8)
                pos += n
            # Decoded here, as the parent would, before it is answered: the parent checks the
            # header and that this child read its bytes, not the frames' contents.
            if decoded_digest(memoryview(self.arena[at:at + total]), binding) != digest:
                print(f"tieredkv encode worker: job {j}'s payload does not decode to its block", file=sys.stderr)
                return
            self.results[j] = (at, total, digest)
        except Exception as e:        # noqa: BLE001 -- reported as a failed job
            print(f"tieredkv encode worker: job {j} failed: {e!r}", file=sys.stderr)


def serve(inp: int, out: int, slot_fds: list[int], policy: str, fingerprint: str = "") -> None:
    _lower_priority(policy)
    if fingerprint != codec_fingerprint():
        os.write(out, SKEWED)
        return
    os.write(out, READY)              # started: a death from now on is a death, not a failed start
    maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    pool: ThreadPoolExecutor | None = None
    pool_width = 0
    while True:
        req = read_message(inp)
        if req is None:
            return                    # EOF: the parent closed the pipe or died
        slot, size, width, kind, level, out_at, out_end, jobs = req
        have = maps.get(slot)
        if have is None or len(have[0]) < size:
            m = mmap.mmap(slot_fds[slot], size)
            maps[slot] = have = (m, np.frombuffer(m, dtype=np.uint8))
        batch = _Batch(have[1], out_at, out_end, kind, level, jobs)
        width = max(1, min(width, len(jobs)))
        if width == 1:
            for j in range(len(jobs)):
                batch.encode(j)
        else:
            if pool is None or pool_width < width:
                if pool is not None:
                    pool.shutdown()
                pool, pool_width = ThreadPoolExecutor(width, thread_name_prefix="tieredkv-encode-worker"), width
            list(pool.map(batch.encode, range(len(jobs))))
        write_message(out, batch.results)


def main(argv: list[str]) -> None:
    parent, policy, fingerprint, fds = int(argv[0]), argv[1], argv[2], [int(x) for x in argv[3:]]
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C for the server is the parent's to handle
    reply = os.dup(sys.stdout.fileno())          # the replies' pipe, private: a stray print goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(sys.stdin.fileno(), reply, fds, policy, fingerprint)
    except BrokenPipeError:
        pass                          # the parent went away while we answered


if __name__ == "__main__":
    main(sys.argv[1:])
