"""A get_many's blocks checked and decoded by compiled threads while the rest are still being
fetched: every check verify_and_decode makes of such a block (metadata against the key, the header
and its crc32, the plane table, the layout, the binding, then the data's: a raw or nibble block's
xxh3_64, a zstd block's coded crc32 and each plane frame's checksum) and its decode into its
destination (a raw block's one copy; a nibble block's table lookup and interleave after its hash
held; a zstd block's frames decoded by libzstd and its planes joined), the GIL released for the
headers, hashes and decodes, spread over `threads` (storage/codec/_block_batch.c; each block's
checks storage/codec/block_checks.h, a zstd block's frames storage/codec/zstd_planes.h).

Knows: which blocks a batch can take -- a destination that is a contiguous CPU tensor of the
layout's dtype and size (without a layout: the first header's), or none (one is made) -- what
each verdict says in words, and that the blocks it cannot decide (version 3; zstd planes where
libzstd.so.1 could not be loaded, ZSTD False; a destination of another dtype or size) are left to
verify_and_decode, so every block gets the verdict the Python path gives. Doesn't know: LMDB, seals (a sealed record keeps the
Python path), or what becomes of a damaged block (the disk tier counts and deletes it).

Threads: a BlockBatch belongs to the thread that made it. NOTE invariant: its payloads are read
by other threads between add() and finish()/abandon(), so the caller keeps them valid until then
(an LMDB read transaction's buffers: one of the two is called inside it, `finally` included).

NOTE: a refused block's destination may hold part of its bytes (the copy and the hash are one
pass): a miss, whose destination no caller reads. Without the compiled module (no C compiler at
install) AVAILABLE is False and every block takes the Python path, as before.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from storage.codec.codec_error import CodecError
from storage.codec.header import _DTYPE_CODES, CodecHeader, parse_header   # the codes on disk
from storage.codec.payload import Codec
from storage.codec.stored_block import verify_and_decode
from storage.hashing import BlockKey
from storage.layout import DTYPE_ITEMSIZES, BlockLayout, dtype_from_name, dtype_name

try:
    from storage.codec import _block_batch as _compiled
except ImportError:      # no C compiler at install: verify_and_decode decides every block
    _compiled = None


def _load() -> tuple[bool, str | None]:
    """libzstd and the fastest crc32 (ISA-L's, from the isal module header.py uses) for zstd blocks."""
    if _compiled is None:
        return False, None
    try:
        from isal import isal_zlib
        isal_path = isal_zlib.__file__
    except ImportError:
        isal_path = None
    return _compiled.load(isal_path)


if TYPE_CHECKING:
    import torch

AVAILABLE = _compiled is not None
# Whether zstd blocks are decided here too (libzstd.so.1 found), and which crc32 their coded
# frames are checked with ("isal" or "zlib"; "none": zstd blocks stay verify_and_decode's).
ZSTD, CRC32 = _load()

_NOT_RAW = 1
# Each verdict code of block_checks.h in words (index = code), as verify_and_decode words it.
REASONS: tuple[str | None, ...] = (
    None, None, "payload missing", "metadata missing", "metadata record damaged: bad version or length",
    "stored token ids differ from the key's", "stored namespace differs from the key's",
    "stored parent differs from the key's", "record size differs from its metadata's",
    "codec: truncated payload", "codec: bad magic", "codec: unknown dtype code", "codec: ndim > 8",
    "codec: header crc32 mismatch: payload damaged", "codec: raw size does not match its shape",
    "codec: plane table: not a whole tensor's entry", "header raw size differs from its metadata's",
    "block's dtype or shape differs from the layout's",
    "codec: payload is bound to another block: stored under the wrong key",
    "codec: payload length differs from its plane table's", "codec: data xxh3 mismatch: payload damaged",
    "codec: plane table: a nibble plane of an unknown mode or another length", "codec: nibble: the coded plane is malformed",
    "codec: plane table: a plane of an unknown mode", "codec: dim-1-major planes flagged for a shape without dims 0 and 1",
    "codec: coded planes' crc32 mismatch: payload damaged",
    "codec: stored plane's content checksum mismatch: payload damaged",
    "codec: zstd frame damaged or not as the codec writes it",
)

Verdict = tuple["torch.Tensor | None", "str | None"]


class BlockBatch:
    """Up to `n` stored blocks of one get_many: add() each as it is read (its metadata checked at
    once, the rest started on the batch's threads), then finish() for every verdict, in add order."""

    def __init__(self, layout: BlockLayout | None, n: int, threads: int) -> None:
        self._n, self._threads = n, threads
        self._c = None               # the compiled batch, made at the first payload
        self._declined = False       # no layout, and the first payload is neither kind: nothing decided here
        self._served: list[torch.Tensor | None] = []   # per add: what a pass serves, None: not taken
        if layout is not None:
            self._expect(dtype_name(layout.dtype), layout.shape, True, layout.dtype)

    def _expect(self, name: str, shape: tuple[int, ...], strict: bool, dtype: torch.dtype) -> None:
        self._shape, self._dtype, self._numel = shape, dtype, math.prod(shape)
        self._c = _compiled.Batch(self._n, self._numel * DTYPE_ITEMSIZES[name], _DTYPE_CODES[name], tuple(shape),
                                  strict, self._threads)

    def add(self, key: BlockKey, out: torch.Tensor | None, payload: bytes | memoryview | None,
            meta: bytes | memoryview | None) -> None:
        """The block `key` names, read as `payload` and `meta` (either may be None), for `out`."""
        c = self._c
        if c is None and not self._declined and payload is not None:
            # No layout (a tier opened without one: `tieredkv inspect`, tests): the first payload's
            # header says what to expect (a guess: unchecked here); a block of another dtype or shape
            # is then left to verify_and_decode, which takes any.
            guess = _first_header(payload)
            if guess is None:
                self._declined = True
            else:
                self._expect(guess.dtype, guess.shape, False, dtype_from_name(guess.dtype))
                c = self._c
        if c is None:
            self._served.append(None)
            return
        if out is None:
            import torch         # a block asked for without a destination: one is made, as decode() does
            out = torch.empty(self._shape, dtype=self._dtype)
        elif not (out.is_cpu and out.dtype == self._dtype and out.numel() == self._numel and out.is_contiguous()):
            self._served.append(None)   # verify_and_decode says why (or raises, for a destination no tier takes)
            return
        c.add(key, payload, meta, out.data_ptr())
        self._served.append(out if out.shape == self._shape else out.view(self._shape))

    def finish(self) -> list[Verdict | None]:
        """Each added block's verdict, in add order: (its tensor, None) when verified and copied into
        its `out` (or a new tensor), (None, the reason) when damaged, or None where this batch does
        not decide it (the caller runs verify_and_decode). Waits for the batch's threads."""
        codes = iter(self._c.finish() if self._c is not None else ())
        verdicts: list[Verdict | None] = []
        for served in self._served:
            if served is None:
                verdicts.append(None)
                continue
            code = next(codes)
            verdicts.append((served, None) if code == 0 else None if code == _NOT_RAW else (None, REASONS[code]))
        return verdicts

    def abandon(self) -> None:
        """Stop the batch's threads (each after the block it holds) and wait for them; no verdicts."""
        if self._c is not None:
            self._c.abandon()


def verify_batch(layout: BlockLayout | None, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None],
                 payloads: Sequence[bytes | memoryview | None], metas: Sequence[bytes | memoryview | None],
                 threads: int) -> list[Verdict | None] | None:
    """BlockBatch for blocks already read: each block's verdict (finish()'s), or None as a whole
    when the compiled module is not built. The payloads and metas must stay valid until it returns."""
    if _compiled is None:
        return None
    batch = BlockBatch(layout, len(keys), threads)
    try:
        for key, out, payload, meta in zip(keys, outs, payloads, metas):
            batch.add(key, out, payload, meta)
    except BaseException:
        batch.abandon()
        raise
    return batch.finish()


def verify_one(codec: Codec, layout: BlockLayout | None, key: BlockKey, out: torch.Tensor | None,
               payload: bytes | memoryview | None, meta: bytes | memoryview | None) -> Verdict:
    """One block's verdict: the compiled check's, on the calling thread with the GIL released (a
    remote tier's decode task, whose pool is the parallelism), or verify_and_decode's where the
    batch does not decide it (or is not built) -- the same verdict either way."""
    verdicts = verify_batch(layout, [key], [out], [payload], [meta], 1)
    if verdicts is not None and verdicts[0] is not None:
        return verdicts[0]
    return verify_and_decode(codec, layout, key, out, payload, meta)


def _first_header(payload: bytes | memoryview) -> CodecHeader | None:
    """The payload's header, parsed but not checked, when it is one the batch decodes: version 4,
    raw (whole), nibble, or zstd planes where libzstd was loaded."""
    try:
        header = parse_header(memoryview(payload))
    except CodecError:
        return None
    # NOTE: a header that says no elements (a forged dim of 0: its crc can be made to match) is not
    # a guess to size the batch by -- it would make an empty destination -- so verify_and_decode takes it.
    return header if (header.version == 4 and (header.whole or header.nibble or ZSTD)
                      and math.prod(header.shape) > 0) else None


def xxh3_64(data: bytes | memoryview, baseline: bool = False) -> int:
    """The vendored xxh3_64 (seed 0) the compiled check uses: the `xxhash` package's digest.
    `baseline`: with the baseline kernel (SSE2 on x86-64) where the AVX2 one is in use."""
    if _compiled is None:
        raise RuntimeError("storage/codec/_block_batch.c is not built")
    return _compiled.xxh3(data, baseline)


def kernel() -> str | None:
    """The xxh3 kernel the compiled check hashes with: "avx2", "sse2" or "baseline"; None unbuilt."""
    return None if _compiled is None else _compiled.kernel()
