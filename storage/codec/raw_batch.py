"""The raw codec's read check for a batch of stored blocks, in one compiled call: every check
verify_and_decode makes of a raw block (metadata against the key, the header and its crc32, the
layout, the binding, the data's xxh3_64) and the one copy into its destination, the GIL released
for the headers, hashes and copies, spread over `threads` (storage/codec/_raw_batch.c).

Knows: which blocks the call can take -- a destination that is a contiguous CPU tensor of the
layout's dtype and size (without a layout: the first header's), or none (one is made) -- what
each verdict says in words, and that the blocks it cannot decide (not a v4 raw payload: zstd,
nibble, version 3; a destination of another dtype or size) are left to verify_and_decode, so every
block gets the verdict the Python path gives. Doesn't know: LMDB, seals (a sealed record keeps the Python path), or what
becomes of a damaged block (the disk tier counts and deletes it).

NOTE: a refused block's destination may hold part of its bytes (the copy and the hash are one
pass): a miss, whose destination no caller reads. Without the compiled module (no C compiler at
install) AVAILABLE is False and every block takes the Python path, as before.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from storage.codec.codec_error import CodecError
from storage.codec.header import _DTYPE_CODES, CodecHeader, parse_header   # the codes on disk
from storage.hashing import BlockKey
from storage.layout import DTYPE_ITEMSIZES, BlockLayout, dtype_from_name, dtype_name

try:
    from storage.codec import _raw_batch as _compiled
except ImportError:      # no C compiler at install: verify_and_decode decides every block
    _compiled = None

if TYPE_CHECKING:
    import torch

AVAILABLE = _compiled is not None

_NOT_RAW = 1
# Each verdict code of _raw_batch.c in words (index = code), as verify_and_decode words it.
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
)

Verdict = tuple["torch.Tensor | None", "str | None"]


def verify_batch(layout: BlockLayout | None, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor | None],
                 payloads: Sequence[bytes | memoryview | None], metas: Sequence[bytes | memoryview | None],
                 threads: int) -> list[Verdict | None] | None:
    """Each block's verdict: (its tensor, None) when verified and copied into its `out` (or a new
    tensor), (None, the reason) when damaged, or None where this call does not decide it (the
    caller runs verify_and_decode). None as a whole when nothing is decided here (no compiled
    module; no layout and a first payload that is not raw). The payloads and metas must stay
    valid until it returns (an LMDB read transaction's buffers: read inside it)."""
    if _compiled is None or not keys:
        return None
    if layout is not None:
        name, shape, strict = dtype_name(layout.dtype), layout.shape, True
    else:
        # No layout (a tier opened without one: `tieredkv inspect`, tests): the first payload's
        # header says what to expect (a guess: unchecked here); a block of another dtype or shape
        # is then left to verify_and_decode, which takes any.
        guess = _first_header(payloads)
        if guess is None:
            return None
        name, shape, strict = guess.dtype, guess.shape, False
    numel = math.prod(shape)
    nbytes = numel * DTYPE_ITEMSIZES[name]
    dtype = layout.dtype if layout is not None else dtype_from_name(name)   # torch: tensors are read into
    dsts: list[int] = []
    taken: list[torch.Tensor | None] = []
    for out in outs:
        if out is None:
            import torch         # a block asked for without a destination: one is made, as decode() does
            out = torch.empty(shape, dtype=dtype)
        elif not (out.is_cpu and out.dtype == dtype and out.numel() == numel and out.is_contiguous()):
            taken.append(None)   # verify_and_decode says why (or raises, for a destination no tier takes)
            dsts.append(0)
            continue
        taken.append(out)
        dsts.append(out.data_ptr())
    keep = [i for i, out in enumerate(taken) if out is not None]
    if len(keep) < len(taken):
        keys, payloads, metas = [keys[i] for i in keep], [payloads[i] for i in keep], [metas[i] for i in keep]
        dsts = [dsts[i] for i in keep]
    codes = _compiled.verify_copy(list(keys), list(payloads), list(metas), dsts, nbytes, _DTYPE_CODES[name],
                                  tuple(shape), strict, threads)
    verdicts: list[Verdict | None] = [None] * len(taken)
    for i, code in zip(keep, codes):
        if code == 0:
            out = taken[i]
            verdicts[i] = (out if out.shape == shape else out.view(shape)), None
        elif code != _NOT_RAW:
            verdicts[i] = None, REASONS[code]
    return verdicts


def _first_header(payloads: Sequence[bytes | memoryview | None]) -> CodecHeader | None:
    """The first payload's header, parsed but not checked, when it is a raw (whole) one."""
    for p in payloads:
        if p is not None:
            try:
                header = parse_header(memoryview(p))
            except CodecError:
                return None
            return header if header.whole else None
    return None


def xxh3_64(data: bytes | memoryview, baseline: bool = False) -> int:
    """The vendored xxh3_64 (seed 0) the compiled check uses: the `xxhash` package's digest.
    `baseline`: with the baseline kernel (SSE2 on x86-64) where the AVX2 one is in use."""
    if _compiled is None:
        raise RuntimeError("storage/codec/_raw_batch.c is not built")
    return _compiled.xxh3(data, baseline)


def kernel() -> str | None:
    """The xxh3 kernel the compiled check hashes with: "avx2", "sse2" or "baseline"; None unbuilt."""
    return None if _compiled is None else _compiled.kernel()
