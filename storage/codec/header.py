"""The block codec's container header: the bytes before a payload's data, written and parsed.

Knows: the header's byte layout (below) in every version this build reads, its constants (magic,
versions, flags, dtype codes, plane modes, the kinds of payload), and its crc32: `pack_header`
writes one, `parse_header` reads one back with every field sanity-checked (and, when asked, the
crc verified first), raising `CodecError`. Doesn't know: how planes are coded or decoded, what
the data after the header is, or what a binding means -- storage/codec/payload.py (the codec)
fills the header and checks the data against it. Imports no torch (`tieredkv inspect` and
`verify` read headers without it).

Payload format, version 4 (written; all integers little-endian):

    magic  b"TKVB"      4 bytes
    version             u8   (4)
    flags               u8   (bit 1: planes in dim-1-major order; bit 2: whole, the raw codec's
                              layout: the tensor's bytes in element order, no zstd; bit 3: nibble,
                              the nibble codec's planes, no zstd; at most one of them; other bits
                              must be 0)
    dtype code          u8   (_DTYPE_CODES; never renumber)
    level               i8   (zstd level of the coded planes, 0 with none; informational)
    ndim                u8
    dims                ndim x u32
    raw size            u64  (bytes of the tensor)
    binding length      u8
    binding             bytes (what the payload belongs to; the disk tier: block hash || namespace)
    plane table         itemsize x (mode u8: 0 stored, 1 coded; frame length u32), plane 0 first;
                        whole: ONE entry (mode 0 stored, length = raw size)
    coded crc32         u32  over the coded planes' frames, as stored, in plane order (0: none);
      whole, instead:   data xxh3   u64  xxh3_64 (seed 0) of the tensor's bytes
      nibble, instead:  data xxh3   u64  xxh3_64 (seed 0) of every byte after the header
    header crc32        u32  over everything above
    plane frames        one zstd frame per plane, plane 0 (least significant byte) first, back
                        to back, of exactly the lengths in the table and nothing after them;
                        each has its content size (numel) and zstd's content checksum;
      whole, instead:   data        the tensor's bytes in element order, exactly raw size of them
      nibble, instead:  planes      plane 0 first, in element order, back to back: a stored one is
                                    its numel bytes; a coded one (the top plane only) is a table,
                                    codes and escapes (storage/codec/_nibble.c) of a length within
                                    nibble.coded_bounds(numel)

The header crc32 vouches for the header, so a damaged shape, size, plane table or data checksum
never drives an allocation, a reshape or a frame boundary.

Version 3 (still read, no longer written): the same header up to the binding, no plane table,
flags bit 0 = byte-shuffled, then the crc32 and ONE zstd frame of the whole tensor (shuffled
into planes when the flag is set); no coded crc, so a flip in a don't-care bit of its frame
decodes, to the right bytes, without an error. Version 1 had a crc32 over the whole frame (~22% of a
restore's time, guarding nothing zstd's checksum does not); version 2 had no binding. This
build refuses both.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from storage.codec import byte_planes
from storage.codec.codec_error import CodecError
from storage.codec.nibble import coded_bounds
from storage.layout import DTYPE_ITEMSIZES

try:
    # ISA-L's crc32: the very CRC-32 zlib computes (same polynomial, init and xor), with the
    # carry-less-multiply fast path this machine's zlib 1.2.13 lacks: ~1.3 us for a bf16 block's
    # 70 KB coded frame where zlib.crc32 takes ~16 (a tenth of what a zstd block decode costs).
    from isal.isal_zlib import crc32
except ImportError:     # a dependency (pyproject.toml); without it the same checks run, slower
    from zlib import crc32

MAGIC = b"TKVB"
FORMAT_VERSION = 4                 # what encode() writes
READABLE_VERSIONS = (3, 4)         # what decode() reads
_FLAG_SHUFFLE = 0x01               # v3: the one frame holds byte planes
_FLAG_DIM1_MAJOR = 0x02            # v4: planes list elements with dims 0 and 1 swapped
_FLAG_WHOLE = 0x04                 # v4: the tensor's bytes as they are, under an xxh3_64 (raw codec)
_FLAG_NIBBLE = 0x08                # v4: nibble-coded planes, under an xxh3_64 (nibble codec)
_FLAGS_BY_VERSION = {3: _FLAG_SHUFFLE, 4: _FLAG_DIM1_MAJOR | _FLAG_WHOLE | _FLAG_NIBBLE}
# What Codec.kind may be (storage/config.py's CODECS says the same to users).
KINDS = ("zstd", "raw", "nibble")
# Stable codes for the dtype byte; they are on disk, so never renumber.
_DTYPE_CODES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_BY_CODE: dict[int, str] = {v: k for k, v in _DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sBBBbB")   # magic, version, flags, dtype code, level, ndim
_RAW_SIZE = struct.Struct("<Q")
_PLANE = struct.Struct("<BI")        # mode, frame length
_CRC = struct.Struct("<I")
_XXH = struct.Struct("<Q")           # whole: xxh3_64 of the tensor's bytes
_MAX_NDIM = 8
MAX_BINDING = 255

PLANE_STORED = 0
PLANE_CODED = 1


@dataclass(frozen=True, slots=True)
class PlaneFrame:
    """One plane's entry in a v4 plane table."""
    coded: bool        # compressed at the codec's level (True; the coded crc32 covers it) or stored
    length: int        # bytes of its zstd frame


@dataclass(frozen=True, slots=True)
class CodecHeader:
    version: int
    dtype: str
    shape: tuple[int, ...]
    raw_size: int
    shuffled: bool                     # the bytes are in planes (v4 unless whole; v3 when flagged)
    level: int
    binding: bytes
    header_size: int                   # bytes before the first zstd frame (whole: before the data)
    dim1_major: bool = False           # v4: planes in dim-1-major order
    planes: tuple[PlaneFrame, ...] = ()   # v4: one per plane, or one (whole: the data, stored); v3: empty
    coded_crc: int | None = None       # v4 planes: crc32 of the coded planes' frames
    data_xxh3: int | None = None       # v4 whole: xxh3_64 of the tensor's bytes; nibble: of the data
    nibble: bool = False               # v4: the nibble codec's planes (storage/codec/nibble.py)
    # True only when check_header parsed it: its crc32 matched, so every field above is the one
    # encode() wrote. decode(header=...) refuses a header without it (peek_header's).
    crc_checked: bool = False

    @property
    def whole(self) -> bool:
        """The raw codec's layout: the tensor's bytes as they are, no zstd frame."""
        return self.data_xxh3 is not None and not self.nibble

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def frame_size(self) -> int:
        """What each v4 frame decompresses to: a plane (numel bytes), or the whole tensor."""
        return self.numel if self.shuffled else self.raw_size


def check_encodable(dtype: str, shape: tuple[int, ...], binding: bytes) -> None:
    """Raise ValueError unless a header can hold this dtype, shape and binding."""
    if not isinstance(binding, bytes) or len(binding) > MAX_BINDING:
        raise ValueError(f"binding: expected at most {MAX_BINDING} bytes, got {binding!r:.40}")
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"block: unsupported dtype {dtype!r}")
    if len(shape) > _MAX_NDIM or any(d >= 2**32 for d in shape):
        raise ValueError(f"block: shape {shape} does not fit the header (ndim <= {_MAX_NDIM}, dims < 2**32)")


def pack_header(dtype: str, shape: tuple[int, ...], raw_size: int, binding: bytes, planes: Iterable[PlaneFrame], *,
                level: int = 0, dim1_major: bool = False, coded_crc: int = 0,
                data_xxh3: int | None = None, nibble: bool = False) -> tuple[bytes, bytes]:
    """A version-4 header (check_encodable's fields) as two payload parts: the header and its
    crc32. `data_xxh3` given: the whole layout (the raw codec; `planes` its one stored entry) or,
    with `nibble`, the nibble codec's planes; else zstd planes under `coded_crc`."""
    ndim = len(shape)
    flags = (_FLAG_NIBBLE if nibble else _FLAG_WHOLE) if data_xxh3 is not None else _FLAG_DIM1_MAJOR if dim1_major else 0
    header = b"".join((
        _FIXED.pack(MAGIC, FORMAT_VERSION, flags, _DTYPE_CODES[dtype], level, ndim),
        struct.pack(f"<{ndim}I", *shape), _RAW_SIZE.pack(raw_size),
        bytes((len(binding),)), binding,
        *(_PLANE.pack(PLANE_CODED if p.coded else PLANE_STORED, p.length) for p in planes),
        _XXH.pack(data_xxh3) if data_xxh3 is not None else _CRC.pack(coded_crc)))
    return header, _CRC.pack(crc32(header))


def parse_header(mv: memoryview, check_crc: bool = False) -> CodecHeader:
    """The header's fields, sanity-checked (CodecError); with check_crc, its crc32 verified too
    (before any field is returned: a damaged one never drives an allocation or a slice)."""
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if len(mv) < _FIXED.size:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    magic, version, flags, code, level, ndim = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}")
    if version not in READABLE_VERSIONS:
        raise CodecError(f"unsupported codec version {version} (this build reads {READABLE_VERSIONS})")
    if flags & ~_FLAGS_BY_VERSION[version]:
        raise CodecError(f"unknown flags {flags:#x} for version {version}")
    whole = version == 4 and bool(flags & _FLAG_WHOLE)
    nibble = version == 4 and bool(flags & _FLAG_NIBBLE)
    if (whole or nibble) and flags & _FLAG_DIM1_MAJOR or whole and nibble:
        raise CodecError(f"flags {flags:#x}: at most one of whole, nibble and dim-1-major")
    if code not in _DTYPE_BY_CODE:
        raise CodecError(f"unknown dtype code {code}")
    if ndim > _MAX_NDIM:
        raise CodecError(f"ndim {ndim} > {_MAX_NDIM}")
    binding_at = _FIXED.size + 4 * ndim + _RAW_SIZE.size
    if len(mv) < binding_at + 1:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    binding_end = binding_at + 1 + mv[binding_at]
    dtype = _DTYPE_BY_CODE[code]
    itemsize = DTYPE_ITEMSIZES[dtype]
    n_planes = (1 if whole else itemsize) if version == 4 else 0
    table_end = binding_end + _PLANE.size * n_planes
    hashed = whole or nibble                 # a data xxh3 where zstd's planes have a coded crc32
    size = table_end + ((_XXH.size if hashed else _CRC.size) if version == 4 else 0) + _CRC.size
    if len(mv) < size:
        raise CodecError(f"truncated payload: {len(mv)} bytes")
    if check_crc and crc32(mv[:size - _CRC.size]) != _CRC.unpack_from(mv, size - _CRC.size)[0]:
        raise CodecError("header crc32 mismatch: payload damaged")
    binding = bytes(mv[binding_at + 1:binding_end])
    shape = tuple(struct.unpack_from(f"<{ndim}I", mv, _FIXED.size))
    (raw_size,) = _RAW_SIZE.unpack_from(mv, _FIXED.size + 4 * ndim)
    if math.prod(shape) * itemsize != raw_size:
        raise CodecError(f"raw size {raw_size} does not match shape {shape} of {dtype}")
    planes = []
    for b in range(n_planes):
        mode, length = _PLANE.unpack_from(mv, binding_end + b * _PLANE.size)
        if mode not in (PLANE_STORED, PLANE_CODED) or (whole and mode != PLANE_STORED):
            raise CodecError(f"unknown mode {mode} for plane {b}" + (" of a whole-tensor frame" if whole else ""))
        planes.append(PlaneFrame(coded=mode == PLANE_CODED, length=length))
    if whole and planes[0].length != raw_size:
        raise CodecError(f"plane table: a whole tensor's entry of {planes[0].length} bytes, raw size {raw_size}")
    if nibble:
        _check_nibble_planes(planes, raw_size // itemsize)
    coded_crc = _CRC.unpack_from(mv, table_end)[0] if version == 4 and not hashed else None
    data_xxh3 = _XXH.unpack_from(mv, table_end)[0] if hashed else None
    dim1_major = bool(flags & _FLAG_DIM1_MAJOR)
    if dim1_major and not byte_planes.can_swap(shape):
        raise CodecError(f"dim-1-major planes flagged for shape {shape}, which has no dims 0 and 1 to swap")
    return CodecHeader(version=version, dtype=dtype, shape=shape, raw_size=raw_size,
                       shuffled=(version == 4 and not whole) or (version == 3 and bool(flags & _FLAG_SHUFFLE)),
                       level=level, binding=binding,
                       header_size=size, dim1_major=dim1_major, planes=tuple(planes), coded_crc=coded_crc,
                       data_xxh3=data_xxh3, nibble=nibble, crc_checked=check_crc)


def _check_nibble_planes(planes: list[PlaneFrame], numel: int) -> None:
    """A nibble payload's plane table: every plane stored (numel bytes) but the top one, which
    may be coded (a length nibble.coded_bounds allows). Raises CodecError."""
    least, most = coded_bounds(numel)
    for b, p in enumerate(planes):
        ok = (least <= p.length <= most and b == len(planes) - 1) if p.coded else p.length == numel
        if not ok:
            raise CodecError(f"plane table: a nibble plane {b} ({'coded' if p.coded else 'stored'}) of "
                             f"{p.length} bytes for {numel} elements")
