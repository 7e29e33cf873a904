"""`codec="auto"`: which codec a tier writes, chosen at start from rates measured here -- the fewest
seconds per restored byte, not the fewest bytes.

Knows: each codec kind's figures on a sample block of the cache's layout (its stored ratio, and
its single-thread decode rate: best of a few decodes of the sample, warm), the drive's read rate
under the disk tier's directory (a scratch file written, fsync'd, dropped from the page cache
with posix_fadvise and read back once), and the choice: for each kind, the time to restore a
byte = stored bytes / the medium's rate + raw bytes / (decode rate x decode threads), smallest
wins. On tmpfs, or where the page cache cannot be dropped, the read runs at memory speed and the
fastest decode wins (raw); on a slow drive the smallest payload does (zstd); in between, nibble.
Doesn't know: tiers, or what a codec does inside (storage/codec/payload.py). The sample block is
synthetic, with KV's shape of values (normal, magnitudes log-normal: a few exponents carry most
elements), so its ratio is close to, not equal to, real KV's (docs/BENCHMARKS.md, issue 38).

Runs on the thread that builds the cache, in ~30-200 ms the first time (the scratch file is 16
MiB); a layout's and a directory's figures are kept for the process's life.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from storage.codec import block_batch
from storage.codec.header import KINDS
from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta, payload_binding
from storage.hashing import block_keys
from storage.layout import BlockLayout

log = logging.getLogger(__name__)

SCRATCH_BYTES = 16 << 20
DECODES = 3


@dataclass(frozen=True, slots=True)
class CodecFigures:
    kind: str
    ratio: float                  # raw bytes / stored bytes on the sample
    decode_bytes_per_s: float     # raw bytes a second, one thread


@dataclass(frozen=True, slots=True)
class CodecChoice:
    kind: str
    medium_bytes_per_s: float | None      # None: not measured (the choice is then the smallest payload)
    threads: int
    figures: tuple[CodecFigures, ...]

    def seconds_per_byte(self, f: CodecFigures) -> float:
        read = 0.0 if self.medium_bytes_per_s is None else 1.0 / (f.ratio * self.medium_bytes_per_s)
        return read + 1.0 / (f.decode_bytes_per_s * self.threads)

    def describe(self) -> str:
        medium = "unmeasured" if self.medium_bytes_per_s is None else f"{self.medium_bytes_per_s / 1e9:.2f} GB/s"
        each = ", ".join(f"{f.kind} {f.ratio:.2f}x / {f.decode_bytes_per_s / 1e9:.1f} GB/s"
                         for f in self.figures)
        return f"{self.kind} (medium {medium}, {self.threads} decode threads; {each})"


def sample_block(layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.shape, generator=g) * torch.exp(0.5 * torch.randn(layout.shape, generator=g))
    return x.to(layout.dtype)


def measure_codecs(layout: BlockLayout, kinds: tuple[str, ...] = KINDS) -> tuple[CodecFigures, ...]:
    """Each kind's ratio and one-thread read rate, through the check a disk read runs: the compiled
    one (storage/codec/block_batch.py) where it decides the kind, else verify_and_decode -- every
    check included, so each rate is what a restore of that kind costs here."""
    block = sample_block(layout)
    out = torch.empty_like(block)
    key = block_keys(b"\0" * 32, range(layout.block_size), layout.block_size)[0]
    binding = payload_binding(key.hash, key.namespace)
    figures = []
    for kind in kinds:
        codec = Codec(kind=kind)
        payload = codec.encode(block, binding)
        meta = BlockMeta(key.parent, key.namespace, key.token_ids, layout.nbytes, len(payload), 0.0, 0, 0).pack()

        def read() -> None:
            verdict = block_batch.verify_one(codec, layout, key, out, payload, meta)
            if verdict[0] is None:
                raise RuntimeError(f"codec {kind}: the sample block does not read back ({verdict[1]})")
        read()                                         # warm
        best = float("inf")
        for _ in range(DECODES):
            t0 = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t0)
        figures.append(CodecFigures(kind, layout.nbytes / len(payload), layout.nbytes / max(best, 1e-9)))
    return tuple(figures)


def drive_read_rate(directory: str, nbytes: int = SCRATCH_BYTES) -> float | None:
    """Bytes a second read from a fresh file in `directory` after it left the page cache (as far
    as posix_fadvise drops it), or None where it cannot be measured (no room, no permission)."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".tieredkv-read-rate-", dir=directory)
    except OSError:
        return None
    try:
        chunk = os.urandom(1 << 20)
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
        os.fsync(fd)
        buf = bytearray(4 << 20)
        os.preadv(fd, [buf], 0)             # the buffer's pages touched before the clock starts
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        got = 0
        while n := os.preadv(fd, [buf], got):
            got += n
        return got / max(time.perf_counter() - t0, 1e-9)
    except (OSError, AttributeError):     # AttributeError: no preadv/posix_fadvise (not Linux)
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def choose(figures: tuple[CodecFigures, ...], medium_bytes_per_s: float | None, threads: int) -> CodecChoice:
    """The kind whose restore of a byte takes least (ties: the first in `figures`)."""
    probe = CodecChoice(figures[0].kind, medium_bytes_per_s, max(1, threads), figures)
    best = min(figures, key=probe.seconds_per_byte) if medium_bytes_per_s is not None else \
        max(figures, key=lambda f: f.ratio)
    return CodecChoice(best.kind, medium_bytes_per_s, max(1, threads), figures)


# Per process: a layout's codec figures and a directory's read rate, measured once (a process that
# builds many caches -- a test suite, a benchmark -- writes one scratch file per directory).
_measured: dict[object, object] = {}
_measured_lock = threading.Lock()


def _once(key: object, measure):
    with _measured_lock:
        if key in _measured:
            return _measured[key]
    value = measure()          # NOTE: measured outside the lock (I/O); a race measures twice, harmlessly
    with _measured_lock:
        return _measured.setdefault(key, value)


def choose_for_disk(layout: BlockLayout, directory: str, threads: int) -> CodecChoice:
    figures = _once(("codecs", layout), lambda: measure_codecs(layout))
    rate = _once(("drive", os.path.realpath(directory)), lambda: drive_read_rate(directory))
    choice = choose(figures, rate, threads)
    log.info("disk tier codec auto: %s", choice.describe())
    return choice
