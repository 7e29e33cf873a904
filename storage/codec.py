"""The block codec: a KV block tensor <-> self-describing, checksummed, zstd-compressed bytes.

Knows: the payload format (below), the byte-shuffle filter, and how to prove a payload is
intact and is the one asked for before handing bytes back. Anything wrong with a payload
raises `CodecError`; a damaged payload, or one stored under another block's key, never
decodes to wrong bytes. Doesn't know: where payloads are stored, what a binding means (the
disk tier binds a payload to its block hash and namespace), or eviction.

Payload format (all integers little-endian):

    magic  b"TKVB"      4 bytes
    version             u8   (FORMAT_VERSION)
    flags               u8   (bit 0: byte-shuffled)
    dtype code          u8   (_DTYPE_CODES; never renumber)
    level               i8   (zstd level used; informational)
    ndim                u8
    dims                ndim x u32
    raw size            u64  (bytes of the tensor before compression)
    binding length      u8
    binding             bytes (what the payload belongs to; the disk tier: block hash || namespace)
    header crc32        u32  over the header fields above
    zstd frame          exactly one frame, with its content size and zstd's content checksum

Three checks, each over what it is cheapest to check: the crc32 vouches for the header (so a
damaged shape or size never drives an allocation or a wrong reshape); the binding inside that
header must equal the one the reader asks for, so an intact payload found under the wrong key
(a damaged LMDB page pointer, a misplaced record) is refused, not served; and zstd's content
checksum (xxh64) vouches for the decompressed bytes -- damage in the frame either fails
decompression or fails that checksum. A frame without a content checksum, or with bytes after
it, is refused: zstd would decode either without complaint. Version 1 also had a crc32 over
the whole frame; it cost ~22% of a block's restore time and guarded nothing zstd's checksum
does not (docs/BENCHMARKS.md, "Tier edges"). Version 2 had no binding: this build refuses it.

Byte-shuffle: element bytes are split into planes (all low bytes, then all high bytes, ...).
The exponent/sign bytes of KV values repeat a lot while the mantissa bytes are noise, so
grouping them gives zstd long runs to work with (the trick of Blosc/HDF5's shuffle filter).
"""
from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from storage.layout import dtype_from_name, dtype_name

# Byte planes and header integers are defined little-endian; the shuffle works on the
# machine's integer views, so it must be one (x86-64 and arm64 are).
assert sys.byteorder == "little", "storage.codec assumes a little-endian machine"

MAGIC = b"TKVB"
FORMAT_VERSION = 3
_FLAG_SHUFFLE = 0x01
# Stable codes for the dtype byte; they are on disk, so never renumber.
_DTYPE_CODES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_BY_CODE: dict[int, str] = {v: k for k, v in _DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sBBBbB")   # magic, version, flags, dtype code, level, ndim
_RAW_SIZE = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MAX_NDIM = 8
MAX_BINDING = 255


class CodecError(Exception):
    """A payload is damaged or not ours: bad magic/version/crc, truncated, zstd failure, size mismatch."""


@dataclass(frozen=True, slots=True)
class CodecHeader:
    version: int
    dtype: str
    shape: tuple[int, ...]
    raw_size: int
    shuffled: bool
    level: int
    binding: bytes
    header_size: int    # bytes before the zstd frame

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# zstandard's compressor/decompressor objects are not thread-safe: one per thread.
_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "decompressor", None)
    if d is None:
        d = _tls.decompressor = zstandard.ZstdDecompressor()
    return d


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 numpy array (no copy). Works for bf16, which numpy lacks."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class Codec:
    """zstd at `level`, optionally byte-shuffled. Encoding settings only: decode reads the header."""
    level: int = 3
    shuffle: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"level: expected an int in [-7, 22], got {self.level!r}")
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"shuffle: expected True or False, got {self.shuffle!r}")

    def encode(self, block: torch.Tensor, binding: bytes) -> bytes:
        """Compress a contiguous CPU float32/float16/bfloat16 tensor into a payload bound to
        `binding` (at most 255 bytes; decode() refuses the payload for any other binding)."""
        if not isinstance(binding, bytes) or len(binding) > MAX_BINDING:
            raise ValueError(f"binding: expected at most {MAX_BINDING} bytes, got {binding!r:.40}")
        if block.device.type != "cpu" or not block.is_contiguous():
            raise ValueError(f"block: expected a contiguous CPU tensor, got device={block.device}, "
                             f"contiguous={block.is_contiguous()}")
        name = dtype_name(block.dtype)
        if block.dim() > _MAX_NDIM or any(d >= 2**32 for d in block.shape):
            raise ValueError(f"block: shape {tuple(block.shape)} does not fit the header (ndim <= {_MAX_NDIM}, dims < 2**32)")
        raw = _bytes_view(block)
        itemsize = block.element_size()
        shuffled = self.shuffle and itemsize > 1 and raw.size > 0
        if shuffled:
            raw = _shuffle(raw, itemsize)
        frame = _compressor(self.level).compress(raw)
        header = (_FIXED.pack(MAGIC, FORMAT_VERSION, _FLAG_SHUFFLE if shuffled else 0, _DTYPE_CODES[name],
                              self.level, block.dim())
                  + struct.pack(f"<{block.dim()}I", *block.shape) + _RAW_SIZE.pack(raw.size)
                  + bytes((len(binding),)) + binding)
        return b"".join((header, _CRC.pack(zlib.crc32(header)), frame))

    def peek_header(self, payload: bytes | memoryview) -> CodecHeader:
        """Parse and sanity-check the header without checking the crc or decompressing."""
        return _parse_header(memoryview(payload))

    def check_header(self, payload: bytes | memoryview) -> CodecHeader:
        """Parse the header and check its crc32 (no decompression): the fields, binding included,
        are then the ones encode() wrote. Raises CodecError."""
        mv = memoryview(payload).cast("B")
        header = _parse_header(mv)
        fields_end = header.header_size - _CRC.size
        (crc,) = _CRC.unpack_from(mv, fields_end)
        if zlib.crc32(mv[:fields_end]) != crc:
            raise CodecError("header crc32 mismatch: payload damaged")
        return header

    def decode(self, payload: bytes | memoryview, binding: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
        """Verify and decompress a payload; the result has the header's dtype and shape.

        `binding` must equal the one the payload was encoded with. `out`, when given, is a
        contiguous CPU tensor of the header's dtype and numel that receives the bytes (no
        allocation); the returned tensor is a view of it. Raises CodecError for any damage or
        a binding mismatch, ValueError when `out` does not fit the payload.
        """
        mv = memoryview(payload).cast("B")
        header = self.check_header(mv)
        # NOTE invariant: a payload is served only for the binding it was written with -- an
        # intact payload under another key is refused here, before any byte is decoded.
        if header.binding != binding:
            raise CodecError("payload is bound to another block: stored under the wrong key")
        frame = mv[header.header_size:]
        dtype = dtype_from_name(header.dtype)
        if out is None:
            out = torch.empty(header.shape, dtype=dtype)
        elif (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != dtype
              or out.numel() != header.numel):
            raise ValueError(f"out: expected a contiguous CPU {header.dtype} tensor of {header.numel} elements, "
                             f"got {out.dtype} numel={out.numel()} device={out.device} contiguous={out.is_contiguous()}")
        try:
            # Never let a frame's claimed size drive an allocation: it must equal the size our
            # (crc-checked) header promises.
            if zstandard.frame_content_size(frame) != header.raw_size:
                raise CodecError("zstd frame content size does not match the header's raw size")
            # Without its content checksum a damaged frame can decode to wrong bytes silently.
            if not zstandard.get_frame_parameters(frame).has_checksum:
                raise CodecError("zstd frame has no content checksum")
            data = _decompressor().decompress(frame, max_output_size=header.raw_size, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd: {e}") from e
        if len(data) != header.raw_size:
            raise CodecError(f"decompressed {len(data)} bytes, header says {header.raw_size}")
        src = np.frombuffer(data, dtype=np.uint8)
        dst = _bytes_view(out)
        if header.shuffled:
            _unshuffle(src, dst, dtype.itemsize)
        else:
            np.copyto(dst, src)
        return out.view(header.shape)


_UINTS = {2: np.uint16, 4: np.uint32}


def _shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes: plane b holds byte b (little-endian significance) of every element.

    Done with integer shifts on whole planes rather than a strided transpose: numpy copies
    with an inner stride of 2 or 4 bytes run at ~0.5 GB/s, contiguous shifts at several GB/s.
    """
    x = raw.view(_UINTS[itemsize])
    n = x.size
    planes = np.empty(raw.size, dtype=np.uint8)
    for b in range(itemsize):
        np.copyto(planes[b * n:(b + 1) * n], x >> (8 * b) if b else x, casting="unsafe")   # keeps the low byte
    return planes


def _unshuffle(planes: np.ndarray, dst: np.ndarray, itemsize: int) -> None:
    """Inverse of _shuffle, written into `dst` (uint8, same size)."""
    ut = _UINTS[itemsize]
    x = dst.view(ut)
    n = x.size
    np.copyto(x, planes[:n], casting="unsafe")
    if itemsize > 1:
        tmp = np.empty(n, dtype=ut)
        for b in range(1, itemsize):
            np.left_shift(planes[b * n:(b + 1) * n], 8 * b, out=tmp, dtype=ut)
            np.bitwise_or(x, tmp, out=x)


def _parse_header(mv: memoryview) -> CodecHeader:
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if len(mv) < _FIXED.size:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    magic, version, flags, code, level, ndim = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported codec version {version} (this build reads {FORMAT_VERSION})")
    if flags & ~_FLAG_SHUFFLE:
        raise CodecError(f"unknown flags {flags:#x}")
    if code not in _DTYPE_BY_CODE:
        raise CodecError(f"unknown dtype code {code}")
    if ndim > _MAX_NDIM:
        raise CodecError(f"ndim {ndim} > {_MAX_NDIM}")
    binding_at = _FIXED.size + 4 * ndim + _RAW_SIZE.size
    if len(mv) < binding_at + 1:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    binding = bytes(mv[binding_at + 1:binding_at + 1 + mv[binding_at]])
    size = binding_at + 1 + mv[binding_at] + _CRC.size
    if len(mv) < size:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    shape = struct.unpack_from(f"<{ndim}I", mv, _FIXED.size)
    (raw_size,) = _RAW_SIZE.unpack_from(mv, _FIXED.size + 4 * ndim)
    dtype = _DTYPE_BY_CODE[code]
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype_from_name(dtype).itemsize != raw_size:
        raise CodecError(f"raw size {raw_size} does not match shape {shape} of {dtype}")
    return CodecHeader(version=version, dtype=dtype, shape=tuple(shape), raw_size=raw_size,
                       shuffled=bool(flags & _FLAG_SHUFFLE), level=level, binding=binding, header_size=size)
