"""The nibble coding: a block's top byte plane as 4-bit codes into a table of its 15 commonest
values, the rest as escapes; its lower planes stored as they are. A lossless codec whose decode is
a table lookup and an interleave: one pass in C on the CPU, a handful of tensor ops on a device.

Why: the top byte of a bf16 or fp32 KV element is its sign and exponent, and on real KV a block
uses few of them: the 15 commonest cover 99.8% of SmolLM2's elements (bf16 and fp32), so the
plane codes to ~4.02 bits an element. A bf16 block is 1.33x smaller (zstd's byte planes: 1.46x)
and decodes at memory speed, where zstd's Huffman decode runs at a few GB/s a core. fp16's top
byte holds mantissa bits too (its 15 commonest cover ~45%): coding it would grow the block, so
its top plane is stored and the payload is raw bytes in planes (`encode` decides per block).
The layout of a coded plane (table, codes, escapes) is storage/codec/_nibble.c's docstring.

Knows: how to code a block (`encode`: the planes a payload holds), how to decode them into a
buffer in element order (`decode`: compiled, or numpy where no C compiler was at install), and
the same decode in torch ops on whatever device the bytes are (`decode_torch`: a GPU decodes the
coded bytes after they crossed the bus, so a host's few cores are not the limit).
Doesn't know: headers, checksums or bindings -- storage/codec/payload.py hashes the planes
(xxh3_64 in the header) before any is decoded, so these functions see only intact bytes; their
own checks (escape count, padding) refuse a malformed plane, never a damaged one.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from storage.codec import byte_planes

try:
    from storage.codec import _nibble as _compiled
except ImportError:     # built without a C compiler (pyproject.toml: the extension is optional)
    _compiled = None
KERNEL = "c" if _compiled is not None else "numpy"

if TYPE_CHECKING:
    import torch

assert sys.byteorder == "little", "storage.codec.nibble assumes a little-endian machine"

ESCAPE = 15
TABLE = 16            # bytes of a coded plane's table
_UINTS = {2: np.uint16, 4: np.uint32}


def coded_bounds(numel: int) -> tuple[int, int]:
    """(least, most) bytes a coded plane of `numel` elements can take: no escape, every one."""
    base = TABLE + (numel + 1) // 2
    return base, base + numel


def encode(src: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(lower planes, coded top plane) of a block: `src` its bytes (flat uint8, element order).
    The lower planes are one array of (itemsize - 1) * numel bytes, plane 0 first; the coded plane
    is None when coding would not make the top plane smaller (store it as is: `top_plane`)."""
    n = src.size // itemsize
    low = np.empty((itemsize - 1) * n, dtype=np.uint8)
    coded = np.empty(coded_bounds(n)[1] + 1, dtype=np.uint8)     # + 1: the C loop's slack
    if _compiled is not None:
        length = _compiled.encode(src, itemsize, low, coded)
    else:
        length = _encode_numpy(src.reshape(n, itemsize), low.reshape(itemsize - 1, n), coded)
    return low, (coded[:length] if length < n else None)


def top_plane(src: np.ndarray, itemsize: int) -> np.ndarray:
    """The top byte of every element, as stored when coding does not pay."""
    return np.ascontiguousarray(src.reshape(-1, itemsize)[:, itemsize - 1])


def decode(coded: memoryview | np.ndarray | None, low: Sequence[memoryview | np.ndarray], top: memoryview | None,
           out: np.ndarray, itemsize: int) -> None:
    """Write the block into `out` (flat uint8, itemsize * numel bytes) in element order from its
    lower planes `low` and either its coded top plane `coded` or its stored top plane `top`.
    ValueError for a malformed coded plane (escapes not exactly the codes' 15s, padding not 0)."""
    if coded is None:
        byte_planes.join([*low, top], out.view(_UINTS[itemsize]))
        return
    if _compiled is not None:
        _compiled.decode(coded, list(low), out, itemsize)
        return
    n = out.size // itemsize
    t = _top_numpy(np.frombuffer(coded, dtype=np.uint8), n)
    view = out.reshape(n, itemsize)
    for b, p in enumerate(low):
        view[:, b] = np.frombuffer(p, dtype=np.uint8)
    view[:, itemsize - 1] = t


def decode_torch(coded: torch.Tensor | None, low: torch.Tensor, top: torch.Tensor | None, itemsize: int
                 ) -> torch.Tensor:
    """decode() in torch ops, on the device the bytes are on: `coded` the coded top plane (uint8),
    `low` the lower planes ([itemsize - 1, numel] uint8), `top` the stored top plane when not
    coded. Returns the block's bytes ([numel * itemsize] uint8, element order): view them as the
    block's dtype. ValueError for a malformed coded plane (checked on the device: one sync)."""
    import torch
    n = low.shape[1]
    t = top if coded is None else _top_torch(coded, n)
    return torch.cat([low, t.view(1, n)]).t().contiguous().view(-1)


def _top_torch(coded: torch.Tensor, n: int) -> torch.Tensor:
    """_top_numpy in torch ops, on the bytes' device."""
    import torch
    ncodes = (n + 1) // 2
    table, codes, esc = coded[:TABLE], coded[TABLE:TABLE + ncodes], coded[TABLE + ncodes:]
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)
    c = nibbles[:n].long()
    is_esc = c == ESCAPE
    if int(is_esc.sum()) != esc.numel() or int(table[ESCAPE]) != 0 or (n % 2 and int(nibbles[n]) != 0):
        raise ValueError("nibble: the coded plane is malformed")
    return table[c].masked_scatter(is_esc, esc)


def _top_numpy(coded: np.ndarray, n: int) -> np.ndarray:
    ncodes = (n + 1) // 2
    table, codes, esc = coded[:TABLE], coded[TABLE:TABLE + ncodes], coded[TABLE + ncodes:]
    nibbles = np.empty(2 * ncodes, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = codes & 0x0F, codes >> 4
    c = nibbles[:n]
    is_esc = c == ESCAPE
    if int(is_esc.sum()) != esc.size or table[ESCAPE] != 0 or (n % 2 and nibbles[n] != 0):
        raise ValueError("nibble: the coded plane is malformed")
    t = table[c]
    t[is_esc] = esc
    return t


def _encode_numpy(elements: np.ndarray, low: np.ndarray, coded: np.ndarray) -> int:
    """_nibble.c's encode in numpy (the same bytes): returns the coded plane's length."""
    n, itemsize = elements.shape
    top = elements[:, itemsize - 1]
    for b in range(itemsize - 1):
        low[b] = elements[:, b]
    count = np.bincount(top, minlength=256)
    order = np.lexsort((np.arange(256), -count))     # by count, then the smaller value
    common = [int(v) for v in order[:ESCAPE] if count[v] > 0]
    code_of = np.full(256, ESCAPE, dtype=np.uint8)
    code_of[common] = np.arange(len(common), dtype=np.uint8)
    ncodes = (n + 1) // 2
    coded[:TABLE] = 0
    coded[:len(common)] = common
    c = np.zeros(2 * ncodes, dtype=np.uint8)
    c[:n] = code_of[top]
    coded[TABLE:TABLE + ncodes] = c[0::2] | (c[1::2] << 4)
    esc = top[c[:n] == ESCAPE]
    coded[TABLE + ncodes:TABLE + ncodes + esc.size] = esc
    return TABLE + ncodes + esc.size
