"""Byte planes: a tensor's element bytes regrouped by significance, and back.

Plane b holds byte b (little-endian significance) of every element, so a 2-byte dtype has two
planes and a 4-byte dtype four. For the floats a KV cache holds, the top plane carries the sign
and (most of) the exponent, which take few distinct values, while the lower planes are mantissa
bits and look like noise: grouping the bytes this way lets a compressor spend its effort where it
pays (the filter of Blosc/HDF5's shuffle, and of ZipNN for model weights).

Optionally the planes list elements in "dim-1-major" order: the tensor's first two dimensions
swapped (for a KV block `[layers, 2, ...]`, every layer's K before every layer's V), so that
regions with different statistics (K and V) are contiguous in each plane and an entropy coder
can give each its own table. Only the order of elements inside each plane changes; the bytes
are the same.

Knows: how to split a contiguous CPU tensor of a 2- or 4-byte dtype into planes, and how to join
planes back into a tensor in place -- or into a numpy array of uint16/uint32 elements of the
tensor's shape (the codec's check of a payload, which needs no torch: `tieredkv verify`).
Doesn't know: compression, checksums, payload formats, or what a dimension means (the codec
decides when the swapped order is used and records it).

Two implementations of the same transform, chosen at import:
- compiled (storage/codec/_byte_planes.c, built by `pip install`): plain byte loops over each
  contiguous run, vectorized by the C compiler, with the GIL released. Measured on one block of
  the default model's shape (one core, warm caches, beside one np.copyto of its bytes): bf16
  (360 KiB) join ~8 us and split ~10 us against a memcpy's ~8; fp32 (720 KiB) ~19 and ~27
  against ~16. This is the one used whenever it was built.
- numpy (the fallback where no C compiler was at hand at install time, and the reference the
  tests hold the compiled one to): integer shifts and casts inside numpy's ufuncs, which are
  vectorized; a copy with an inner stride of 1-4 bytes is not. bf16 join ~46 us and split ~39;
  fp32 ~148 and ~121. Per-plane strided views (`out.view(uint8).reshape(-1, itemsize)[:, b] =
  plane`) take ~205 us either way, one transposed np.copyto or torch copy 0.4-1.9 ms, and
  torch's cast/shift/add ops would run on torch's intra-op threads from every decode thread.
`KERNEL` says which one this process runs ("c" or "numpy").
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from storage.codec import _byte_planes as _compiled
except ImportError:     # built without a C compiler (pyproject.toml: the extension is optional)
    _compiled = None
KERNEL = "c" if _compiled is not None else "numpy"

# Plane b is defined as byte b in little-endian order, and the shifts below work on the
# machine's integer views, so the machine must be little-endian (x86-64 and arm64 are).
assert sys.byteorder == "little", "storage.codec.byte_planes assumes a little-endian machine"

_UINTS: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32}

Buffer = bytes | bytearray | memoryview | np.ndarray


def can_swap(shape: Sequence[int]) -> bool:
    """Whether the dim-1-major order applies: at least 3 dims (so each swapped run is the
    contiguous tail of the shape, not single elements) and both leading dims longer than 1."""
    return len(shape) >= 3 and shape[0] > 1 and shape[1] > 1


def _rows(shape: Sequence[int]) -> tuple[int, int, int]:
    """(dim 0, dim 1, everything after them) of a shape that can_swap."""
    d0, d1 = int(shape[0]), int(shape[1])
    rest = 1
    for d in shape[2:]:
        rest *= int(d)
    return d0, d1, rest


def _elements(t: Any) -> np.ndarray:
    """The elements of a contiguous CPU tensor, or of a C-contiguous uint16/uint32 numpy array, as
    a flat unsigned-integer numpy view (no copy; bf16 included, which numpy lacks)."""
    if isinstance(t, np.ndarray):
        if t.dtype not in (np.uint16, np.uint32) or not t.flags.c_contiguous:
            raise ValueError(f"byte planes: expected a contiguous uint16/uint32 array, got {t.dtype}")
        return t.reshape(-1)
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte planes: expected a contiguous CPU tensor")
    size = t.element_size()
    if size not in _UINTS:
        raise ValueError(f"byte planes: expected a 2- or 4-byte dtype, got {t.dtype}")
    import torch        # a tensor was given: torch is loaded already
    return t.reshape(-1).view(torch.int16 if size == 2 else torch.int32).numpy().view(_UINTS[size])


def split(t: Any, swapped: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """The byte planes of a contiguous CPU tensor: a `[itemsize, numel]` uint8 array, row b
    = byte b of every element, in dim-1-major order when `swapped` (requires can_swap(shape)).
    `out`: a contiguous uint8 array of at least itemsize * numel bytes to write them into (its
    front, returned as that shape: a warm buffer reused block after block), else a new one."""
    x = _elements(t)
    size = x.itemsize
    if out is None:
        out = np.empty((size, x.size), dtype=np.uint8)
    else:
        if out.dtype != np.uint8 or not out.flags.c_contiguous or out.size < size * x.size:
            raise ValueError(f"byte planes: out must be a contiguous uint8 array of >= {size * x.size} bytes")
        out = out.reshape(-1)[:size * x.size].reshape(size, x.size)
    if swapped and not can_swap(t.shape):
        raise ValueError(f"byte planes: shape {tuple(t.shape)} has no dims 0 and 1 to swap")
    if _compiled is not None:
        d0, d1, rest = _rows(t.shape) if swapped else (1, 1, x.size)
        _compiled.split(x.view(np.uint8), out, size, d0, d1, rest, swapped)
        return out
    if swapped:
        d0, d1, rest = _rows(t.shape)
        x = x.reshape(d0, d1, rest).transpose(1, 0, 2)     # a view; the ufuncs below reorder
    planes = [out[b].reshape(x.shape) for b in range(size)]
    if size == 2:
        _unpair(x, planes[0], planes[1])
    else:
        # The two 16-bit halves first, then the bytes of each: ~8% fewer passes over a float32
        # block than a shift per plane from the 32-bit elements (~93 us against ~101).
        half = _scratch(x.size, np.uint16).reshape(x.shape)
        np.copyto(half, x, casting="unsafe")                    # the unsafe cast keeps the low half
        _unpair(half, planes[0], planes[1])
        np.right_shift(x, 16, out=half, casting="unsafe")
        _unpair(half, planes[2], planes[3])
    return out


def _unpair(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """lo, hi (uint8) = the low and high byte of x (uint16 or wider: the bytes above are dropped),
    the narrowing done inside the ufuncs (no temporary)."""
    np.copyto(lo, x, casting="unsafe")
    np.right_shift(x, 8, out=hi, casting="unsafe")


def join(planes: Sequence[Buffer | Sequence[Buffer]], out: Any, swapped: bool = False) -> None:
    """Inverse of split: write the planes (plane 0 first, each numel bytes) into `out`, a
    contiguous CPU tensor (or uint16/uint32 array) whose dtype and shape say how they were split. A plane may also be
    given as its segments, a list of buffers in order whose lengths add up to numel (a stored
    plane read in place from its zstd frame's raw blocks, storage/codec/payload.py)."""
    x = _elements(out)
    size = x.itemsize
    if len(planes) != size:
        raise ValueError(f"byte planes: {out.dtype} has {size} planes, got {len(planes)}")
    src = [_flat(p) if not isinstance(p, (list, tuple)) else [_flat(s) for s in p] for p in planes]
    sizes = [p.size if isinstance(p, np.ndarray) else sum(s.size for s in p) for p in src]
    if any(n != x.size for n in sizes):
        raise ValueError(f"byte planes: expected {x.size} bytes per plane, got {sizes}")
    if swapped and not can_swap(out.shape):
        raise ValueError(f"byte planes: shape {tuple(out.shape)} has no dims 0 and 1 to swap")
    if _compiled is not None:
        d0, d1, rest = _rows(out.shape) if swapped else (1, 1, x.size)
        _compiled.join(src, x.view(np.uint8), size, d0, d1, rest, swapped)
        return
    # numpy reads a plane whole: segments are joined into one array first.
    src = [p if isinstance(p, np.ndarray) else np.concatenate(p) if p else np.empty(0, np.uint8) for p in src]
    if swapped:
        d0, d1, rest = _rows(out.shape)
        x = x.reshape(d0, d1, rest)
        src = [p.reshape(d1, d0, rest).transpose(1, 0, 2) for p in src]   # views, read in place
    if size == 2:
        _pair(src[0], src[1], x)
    else:
        # Two 16-bit halves, then one 32-bit OR: fewer passes over 4-byte elements than a
        # shift-and-OR per plane (~5.3 GB/s against ~4.1 measured for a float32 block).
        half = _scratch(x.size, np.uint16).reshape(x.shape)
        _pair(src[2], src[3], half)
        np.left_shift(half, 16, out=x, dtype=np.uint32)
        _pair(src[0], src[1], half)
        np.bitwise_or(x, half, out=x, dtype=np.uint32)


def _flat(p: Buffer) -> np.ndarray:
    return p.reshape(-1) if isinstance(p, np.ndarray) else np.frombuffer(p, dtype=np.uint8)


def _pair(lo: np.ndarray, hi: np.ndarray, out: np.ndarray) -> None:
    """out (uint16) = hi << 8 | lo, the bytes widened inside the ufuncs (no temporary)."""
    np.left_shift(hi, 8, out=out, dtype=np.uint16)
    np.bitwise_or(out, lo, out=out, dtype=np.uint16)


# One scratch array per thread (the disk tier decodes on several), kept, rather than a fresh
# allocation of a few hundred KiB per block.
_tls = threading.local()


def _scratch(n: int, dtype: type[np.unsignedinteger] | np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.nbytes < n * dtype.itemsize:
        buf = _tls.buf = np.empty(max(n * dtype.itemsize, 1 << 16), dtype=np.uint8)
    return buf[:n * dtype.itemsize].view(dtype)
