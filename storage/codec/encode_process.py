"""Blocks encoded in a child process (storage/codec/encode_worker.py), out of the engine's GIL.

Why: an encode holds the GIL of the process it runs in for ~a third of its time (~250 of ~760
us a bf16 block: the per-block Python between zstd's and the byte planes' GIL-free calls), and a
decoding engine thread waits for the GIL after every torch op it dispatches (docs/BENCHMARKS.md,
"Flush interference, run 1"). In a child the encode holds the child's GIL; the writer's side of a
batch is a memcpy per block into shared memory and an xxh3 of it (both GIL-free), one small
message each way, and a header check per payload.

Knows: the child's lifetime (started lazily at the first batch, restarted lazily after it dies,
given up on after `MAX_FAILURES` failures in a row: every batch then encodes in the caller's
process, as before), the arenas (one memfd per slot, grown as batches need: nothing is left in
/dev/shm or anywhere after a kill -9), and what it checks before a payload is handed out: it
lies inside the batch's output region, the child says it hashed the very bytes copied in
(xxh3_64), and its header's crc, version, dtype, shape, size, binding and frame lengths are those
of that job (a raw payload's data hash too). A payload that fails is refused (None, counted),
never returned. Doesn't know: blocks, keys or the store; what the caller does with a None (the
disk writer encodes it in its own process).

Slots: two, used in turn, so batch k+1 encodes while batch k's payloads (views of its slot) are
committed. NOTE: a payload is a view of shared memory, valid until the submit after next; a
caller that keeps one longer copies it (the disk writer does for what it forwards).
Memory: each slot holds a batch's blocks and their payloads' bound (~2x the batch's bytes: 24 MB
at 32 blocks of 360 KiB), resident once touched, kept for the next batch; the child ~19 MB more.

Threads: one owner thread calls submit/collect/close (the disk writer's); stats() from any.
Priority: the child runs at SCHED_IDLE by default (it gets a CPU only when nothing else wants one;
no GIL is shared any more, so no priority inversion): measured against nice +10, it kept a flush's
decoders' p99 at 1.18-1.37x (nice +10: 1.31-1.79x) for the same write rate with nothing decoding
(docs/BENCHMARKS.md, "Flush interference, run 2"). NOTE the price: on a host whose CPUs other work
keeps busy, the child gets almost nothing -- the write-behind falls behind, the cascade drops
blocks (counted), a flush takes longer; a batch unanswered for `reply_timeout_s` is encoded here.
TIEREDKV_ENCODE_PROCESS=nice runs it at nice +10 instead, =0 turns it off (`encode_process_policy`).
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import select
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from storage.codec.codec_error import CodecError
from storage.codec import byte_planes
from storage.codec.encode_worker import LEN, READY, SKEWED, codec_fingerprint, read_exact, write_message
from storage.codec.header import FORMAT_VERSION, KINDS
from storage.codec.payload import CODED_PLANES, Codec
from storage.layout import DTYPE_ITEMSIZES

log = logging.getLogger(__name__)

ENV = "TIEREDKV_ENCODE_PROCESS"
# What runs the child, read at each start (a test points them at a failing or lying child).
PYTHON = sys.executable
WORKER_MODULE = "storage.codec.encode_worker"
_MAX_REPLY = 1 << 24                 # an answer is a few ints a job: anything near this is garbage
MAX_FAILURES = 3                     # starts or batches failed in a row before the process is given up on
_ALIGN = 64
_HEADERS = Codec()                   # check_header reads either kind
_STORAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The codec as this process loaded it (at start-up, with the rest of storage/): a child must run
# the same files (encode_worker.codec_fingerprint), or it refuses to start.
FINGERPRINT = codec_fingerprint()


def encode_process_policy(value: str | None = None) -> str | None:
    """The encode process's setting: None (off: encode in this process), "idle" (on, the child at
    SCHED_IDLE; the default) or "nice" (on, nice +10). `value` defaults to $TIEREDKV_ENCODE_PROCESS."""
    v = (os.environ.get(ENV, "") if value is None else value).strip().lower()
    if v in ("0", "off", "false", "no"):
        return None
    return "nice" if v == "nice" else "idle"


def _bound(nbytes: int) -> int:
    """Room for one payload of an nbytes block: zstd's bound on its frames plus the header."""
    return nbytes + nbytes // 128 + 4096


@dataclass(frozen=True, slots=True)
class EncodeJob:
    """One block to encode: its bytes (flat contiguous uint8, element order), dtype name, shape, binding."""
    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    binding: bytes


@dataclass(slots=True)
class EncodeTicket:
    """A batch handed to the child: collect() it once, before the submit after next."""
    slot: int
    jobs: list[EncodeJob]
    digests: list[int]           # xxh3_64 of each job's bytes as copied in
    out_at: int
    out_end: int


@dataclass(frozen=True, slots=True)
class EncodeProcessStats:
    starts: int          # children started (the first and every restart)
    deaths: int          # children that died or hung with a batch in hand (killed and reaped)
    start_failures: int  # starts that failed (the exec, or a child dead before its first answer)
    fallbacks: int       # blocks handed back unencoded (None): the caller encoded them itself
    refused: int         # payloads that failed the check (never handed out)
    given_up: bool       # MAX_FAILURES in a row: every batch encodes in the caller's process


class EncodeProcess:
    def __init__(self, kind: str = "zstd", level: int = 3, policy: str = "idle", reply_timeout_s: float = 120.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        self._kind, self._level, self._policy = kind, level, policy
        self._timeout = reply_timeout_s
        self._proc: subprocess.Popen | None = None       # owner thread only
        self._fds: list[int] = []                        # one memfd per slot
        self._maps: list[tuple[mmap.mmap, np.ndarray] | None] = [None, None]
        self._next = 0
        self._answered = False        # the current child said READY (a death before: a failed start)
        self._failures = 0            # in a row
        self._starts = self._deaths = self._start_failures = self._fallbacks = self._refused = 0
        self._given_up = False
        self._logged_start = False

    # ---- the owner thread --------------------------------------------------------------------
    def submit(self, jobs: list[EncodeJob], width: int = 1) -> EncodeTicket | None:
        """Copy the jobs' bytes into the next slot and ask the child to encode them (`width`
        threads at once). None: not handed over (no child: the caller encodes them itself)."""
        if not jobs:
            return None
        if self._given_up or (self._proc is None and not self._start()):
            self._fallbacks += len(jobs)
            return None
        slot = self._next
        self._next ^= 1
        ins, at = [], 0
        for job in jobs:
            ins.append(at)
            at += -(-job.data.size // _ALIGN) * _ALIGN
        out_at = at
        out_end = out_at + sum(_bound(job.data.size) for job in jobs)
        arena = self._arena(slot, out_end)
        digests = []
        for job, i in zip(jobs, ins):
            dst = arena[i:i + job.data.size]
            dst[:] = job.data                             # one memcpy, GIL released
            digests.append(xxhash.xxh3_64_intdigest(dst))
        req = (slot, len(arena), width, self._kind, self._level, out_at, out_end,
               [(i, job.data.size, job.dtype, job.shape, job.binding) for job, i in zip(jobs, ins)])
        try:
            write_message(self._proc.stdin.fileno(), req)
        except OSError as e:
            self._died(f"its pipe refused a batch ({e})")
            self._fallbacks += len(jobs)
            return None
        return EncodeTicket(slot, jobs, digests, out_at, out_end)

    def collect(self, ticket: EncodeTicket) -> list[memoryview | None]:
        """The ticket's payloads, each checked (module docstring), in job order; None for a job the
        child did not encode or whose payload was refused (the caller encodes it)."""
        reply = self._reply()
        n = len(ticket.jobs)
        if reply is None or not isinstance(reply, list) or len(reply) != n:
            if reply is not None:
                self._died(f"a malformed answer ({type(reply).__name__})", kill=True)
            self._fallbacks += n
            return [None] * n
        self._failures = 0
        m, arena = self._maps[ticket.slot]
        out: list[memoryview | None] = []
        for job, digest, answer in zip(ticket.jobs, ticket.digests, reply):
            try:
                at, length, seen = answer
                if not all(type(x) is int for x in (at, length, seen)):
                    raise TypeError(answer)
            except (TypeError, ValueError):
                log.error("encode process: a malformed answer for a block (%.80r); encoding it here", answer)
                self._refused += 1
                at, length, seen = -1, 0, 0
            if at < 0:
                self._fallbacks += 1
                out.append(None)
                continue
            payload = memoryview(m)[at:at + length] if ticket.out_at <= at and at + length <= ticket.out_end else None
            why = "outside its batch's region" if payload is None else _check(payload, job, digest, seen, self._kind)
            if why:
                log.error("encode process: a payload refused (%s); encoding the block here", why)
                self._refused += 1
                self._fallbacks += 1
                out.append(None)
            else:
                out.append(payload)
        return out

    def close(self, timeout: float = 5.0) -> None:
        """The child told to exit (EOF), waited for, killed if it does not, and reaped."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc, timeout)
        for fd in self._fds:
            os.close(fd)
        self._fds, self._maps = [], [None, None]

    def stats(self) -> EncodeProcessStats:
        return EncodeProcessStats(self._starts, self._deaths, self._start_failures, self._fallbacks,
                                  self._refused, self._given_up)

    @property
    def pid(self) -> int | None:
        """The child's pid while one runs (tests kill it)."""
        return None if self._proc is None else self._proc.pid

    # ---- internals ---------------------------------------------------------------------------
    def _start(self) -> bool:
        if not self._fds:
            self._fds = [os.memfd_create(f"tieredkv-encode-{s}") for s in range(2)]
            self._maps = [None, None]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_STORAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [PYTHON, "-m", WORKER_MODULE, str(os.getpid()), self._policy, FINGERPRINT,
                 *map(str, self._fds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=self._fds,
                env=env, cwd=_STORAGE_ROOT)
        except OSError as e:
            self._failed_start(f"cannot start ({e})")
            return False
        self._starts += 1
        self._answered = False
        return True

    def _failed_start(self, why: str) -> None:
        self._start_failures += 1
        self._failure()
        if not self._logged_start:
            self._logged_start = True
            log.warning("encode process: %s; blocks are encoded in this process meanwhile", why)

    def _failure(self) -> None:
        self._failures += 1
        if self._failures >= MAX_FAILURES and not self._given_up:
            self._given_up = True
            log.warning("encode process: %d failures in a row; encoding every block in this process from now on",
                        self._failures)

    def _died(self, why: str, kill: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        _end(proc, 0.0 if kill else 5.0)
        if self._answered:
            self._deaths += 1
            self._failure()
            log.warning("encode process %d: %s (exit %s); its batch is encoded here, a new one starts with the next",
                        proc.pid, why, proc.returncode)
        else:
            self._failed_start(f"child {proc.pid} died before its first answer: {why} (exit {proc.returncode})")

    def _arena(self, slot: int, size: int) -> np.ndarray:
        """The slot's memory, at least `size` bytes (the memfd grown and mapped again when short)."""
        have = self._maps[slot]
        if have is None or len(have[0]) < size:
            size = max(size, 2 * len(have[0]) if have is not None else 0)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            os.ftruncate(self._fds[slot], size)
            m = mmap.mmap(self._fds[slot], size)      # the old map lives as long as views of it do
            self._maps[slot] = have = (m, np.frombuffer(m, dtype=np.uint8))
        return have[1]

    def _reply(self):
        """The child's answer to the batch in hand, or None (it died or hung: killed, counted)."""
        if self._proc is None:            # already found dead (and counted) since the submit
            return None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + self._timeout
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            if not self._answered:
                first = _read_by(fd, len(READY), poller, deadline)
                self._answered = first == READY
                if first == SKEWED:
                    raise EOFError("its codec's files are not the ones this process loaded (changed on disk since)")
                if not self._answered:
                    raise EOFError("no READY from it")
            head = _read_by(fd, LEN.size, poller, deadline)
            size = None if head is None else LEN.unpack(head)[0]
            if size is not None and size > _MAX_REPLY:
                raise EOFError(f"an answer of {size} bytes")
            body = None if size is None else _read_by(fd, size, poller, deadline)
            if body is not None:
                return pickle.loads(body)
            why = "no answer before its deadline" if time.monotonic() >= deadline else "its pipe closed"
        except Exception as e:          # noqa: BLE001 -- whatever it sent: killed, the batch encoded here
            why = f"its answer failed ({e})"
        self._died(why)
        return None


def _read_by(fd: int, n: int, poller: select.poll, deadline: float) -> bytes | None:
    """n bytes from the child before `deadline`, or None (EOF, or the deadline passed)."""
    def ready() -> bool:
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(max(1, int(left * 1000))):
                return True
        return False
    return read_exact(fd, n, ready)


def _check(payload: memoryview, job: EncodeJob, digest: int, seen: int, kind: str) -> str | None:
    """Why a payload from the child must not be stored, or None: it was made from the bytes copied
    in, and its checked header is this job's with frames that add up to its length."""
    if seen != digest:
        return "the child hashed other bytes than those copied in"
    try:
        h = _HEADERS.check_header(payload)
    except CodecError as e:
        return f"header: {e}"
    if (h.version, h.dtype, h.shape, h.raw_size, h.binding) != (FORMAT_VERSION, job.dtype, job.shape, job.data.size,
                                                                 job.binding):
        return "its header is another block's"
    if h.header_size + sum(p.length for p in h.planes) != len(payload):
        return f"{len(payload)} bytes, its header says {h.header_size + sum(p.length for p in h.planes)}"
    if h.whole and h.data_xxh3 != digest:
        return "its data hash is not the block's"
    if (h.nibble, h.whole) != (kind == "nibble", kind == "raw"):
        return f"its payload is not of this process's kind ({kind})"
    if not h.whole and not h.nibble:
        # How the frames decode, which the frames' own checksums (the child's) do not vouch for.
        coded = {b for b, plane in enumerate(h.planes) if plane.coded}
        if (h.dim1_major != byte_planes.can_swap(job.shape)
                or coded != set(CODED_PLANES[DTYPE_ITEMSIZES[job.dtype]])):
            return "its planes are not laid out as this process encodes them"
    return None


def _end(proc: subprocess.Popen, timeout: float) -> None:
    """EOF to the child, then a wait of up to `timeout`, then SIGKILL; reaped either way."""
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
