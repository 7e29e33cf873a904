"""zstd frames as the block codec writes and reads them (storage/codec/payload.py's planes).

Knows: the per-thread zstd compressors (the coded plane's "match search almost off" parameters,
the stored planes' fast negative level) and decompressor; where the coded plane's zstd blocks
end (`block_cuts`); a stored plane's frame written by hand around views of the plane
(`stored_frame`: a single-segment frame of raw blocks, RFC 8878 3.1.1, with its content size and
XXH64 checksum -- what zstd itself emits for noise, without its copy and match search); reading
one whole frame with every check zstd skips (`decompress_frame`: the unused header bit, content
size and checksum present, nothing after it); and a frame of raw blocks read where it lies
(`raw_block_segments`). Anything wrong raises `CodecError`.
Doesn't know: the payload container (header, plane table, crcs, bindings) around the frames:
storage/codec/header.py and storage/codec/payload.py.

Threads: any; each thread has its own zstd objects (`_tls`), nothing else is shared.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import xxhash
import zstandard

from storage.codec.codec_error import CodecError

# Stored planes: a negative level turns zstd's literal compression off and this one keeps the
# match search cheap (~4 GB/s on noise), so incompressible planes come out as raw blocks, while
# runs (an all-zero plane) still collapse to a few dozen bytes.
_STORE_LEVEL = -5
_ZSTD_FHD_UNUSED_BIT = 0x10          # RFC 8878 3.1.1.1.1: Frame_Header_Descriptor bit 4

# zstandard's compressor/decompressor objects are not thread-safe: one per thread.
_tls = threading.local()


def _coded_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    c = cache.get(level)
    if c is None:
        # Match search almost off: on exponent bytes the matches zstd finds at its defaults
        # cost more than the literals they replace (bf16 top plane: 45% of its size at level 3,
        # 38% like this, and it decodes 2-3x faster); levels 1-4 then code alike. The "fast"
        # strategy (one hash probe per position, no second table) finds the same few matches:
        # on real SmolLM2 KV the top plane codes to 38.1% either way (fp16: 74.29% against
        # 74.26%) and compresses 1.3x faster (bf16: ~203 against ~269 us a block; 240 against
        # 324 with the K/V cuts). Only the encoder changes: any zstd frame decodes alike.
        params = zstandard.ZstdCompressionParameters.from_level(
            level, strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=6, chain_log=6,
            write_checksum=True, write_content_size=True)
        c = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return c


def _store_compressor() -> zstandard.ZstdCompressor:
    c = getattr(_tls, "store", None)
    if c is None:
        c = _tls.store = zstandard.ZstdCompressor(level=_STORE_LEVEL, write_checksum=True, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "decompressor", None)
    if d is None:
        d = _tls.decompressor = zstandard.ZstdDecompressor()
    return d


def block_cuts(shape: tuple[int, ...], dim1_major: bool) -> list[int]:
    """Where the coded plane's zstd blocks end (element offsets, the plane's end excluded): at
    each dim-1 slice's end when the planes are dim-1-major (a KV block: every layer's K, then every
    layer's V), else nowhere (zstd's own 128 KiB blocks). Each cut costs a block flush (~13-16
    us a bf16 block of the default model): cuts at each half of the layers as well (3 in all, not
    1) gained another 0.5% (bf16 1.457 -> 1.465; fp16 1.155 -> 1.160) for 2.5x the cost, and
    the write path is CPU-bound (docs/BENCHMARKS.md)."""
    if not dim1_major:
        return []
    d0, d1 = shape[0], shape[1]
    rest = math.prod(shape[2:])
    return [i * d0 * rest for i in range(1, d1)]


def compress_coded(plane: np.ndarray, level: int, cuts: list[int]) -> bytes:
    c = _coded_compressor(level)
    if not cuts:
        return c.compress(plane)
    # One frame; FLUSH_BLOCK ends a zstd block, so the next one chooses its own Huffman table.
    co = c.compressobj(size=plane.size)
    parts, start = [], 0
    for end in cuts:
        parts += [co.compress(plane[start:end]), co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
        start = end
    parts += [co.compress(plane[start:]), co.flush()]
    return b"".join(parts)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_BLOCK_MAX = 128 * 1024          # RFC 8878 3.1.1.2.4: Block_Maximum_Size's cap
_FHD_RESERVED_BIT = 0x08
_FHD_CHECKSUM = 0x04
_FHD_SINGLE_SEGMENT = 0x20


def stored_frame(plane: np.ndarray) -> list[bytes | np.ndarray]:
    """A stored plane's zstd frame, as parts: a single-segment frame of raw blocks with its content
    size and checksum (RFC 8878 3.1.1), written here around views of the plane -- what zstd emits
    for noise, without its copy into a new buffer and its match search (bf16 block: ~13 us of
    XXH64 against ~30-85 us through zstd). A plane that looks like runs (its first and middle 4
    KiB all zero: the low planes of values that came from a narrower dtype) goes to zstd, which
    collapses them to a few bytes; a wrong guess costs size or time, never a wrong frame."""
    n = plane.size
    mid = n // 2
    if n < 256 or not (plane[:4096].any() or plane[mid:mid + 4096].any()):
        return [_store_compressor().compress(plane)]
    fcs_flag, fcs_len = (1, 2) if n < 65536 + 256 else ((2, 4) if n < 1 << 32 else (3, 8))
    size_field = (n - 256 if fcs_flag == 1 else n).to_bytes(fcs_len, "little")
    parts: list[bytes | np.ndarray] = []
    head = _ZSTD_MAGIC + bytes(((fcs_flag << 6) | _FHD_SINGLE_SEGMENT | _FHD_CHECKSUM,)) + size_field
    for start in range(0, n, _ZSTD_BLOCK_MAX):
        length = min(_ZSTD_BLOCK_MAX, n - start)
        last = start + length == n
        parts.append(head + ((length << 3) | last).to_bytes(3, "little"))   # type 0: raw
        parts.append(plane[start:start + length])
        head = b""
    parts.append((xxhash.xxh64_intdigest(plane) & 0xFFFFFFFF).to_bytes(4, "little"))
    return parts


def decompress_frame(frame: memoryview, size: int) -> bytes:
    """Exactly one whole zstd frame of `size` bytes with its content checksum verified, or CodecError."""
    # zstd ignores this bit of the frame header descriptor (its encoder writes 0): flipped, the
    # frame would still decode, and the damage would go unnoticed.
    if len(frame) > 4 and frame[4] & _ZSTD_FHD_UNUSED_BIT:
        raise CodecError("zstd frame header has its unused bit set")
    try:
        # Never let a frame's claimed size drive an allocation: it must equal the size our
        # (crc-checked) header promises.
        if zstandard.frame_content_size(frame) != size:
            raise CodecError("zstd frame content size does not match the header")
        # Without its content checksum a damaged frame can decode to wrong bytes silently.
        if not zstandard.get_frame_parameters(frame).has_checksum:
            raise CodecError("zstd frame has no content checksum")
        data = _decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd: {e}") from e
    if len(data) != size:
        raise CodecError(f"decompressed {len(data)} bytes, header says {size}")
    return data


def raw_block_segments(frame: memoryview, size: int) -> list[memoryview] | None:
    """The content of a zstd frame made only of raw blocks, as views of the frame (no copy),
    its content checksum verified: a stored plane as the codec writes it (zstd emits raw blocks
    for noise), read where it lies instead of copied out by zstd's decoder first. None for any
    frame that is not exactly that (RLE or compressed blocks, no checksum or content size, a
    dictionary, a reserved or unused bit, bytes after it): zstd's decoder then decides, as it
    always did (decompress_frame refuses the unused bit). Raises CodecError for a checksum that
    does not match, as zstd would.

    Frame layout (RFC 8878 3.1.1): magic, frame header descriptor, [window descriptor unless
    single segment], [dictionary id], frame content size, blocks (3-byte header: bit 0 last,
    bits 1-2 type, 0 = raw, bits 3-23 size), then the low 32 bits of the content's XXH64."""
    n = len(frame)
    if n < 6 or frame[:4] != _ZSTD_MAGIC:
        return None
    fhd = frame[4]
    if fhd & (_ZSTD_FHD_UNUSED_BIT | _FHD_RESERVED_BIT | 0x03) or not fhd & _FHD_CHECKSUM:
        return None                       # an unused or reserved bit, a dictionary id, no checksum
    single = bool(fhd & _FHD_SINGLE_SEGMENT)
    at = 5
    window = 0
    if not single:
        wd = frame[at]
        at += 1
        base = 1 << (10 + (wd >> 3))
        window = base + (base >> 3) * (wd & 7)
    fcs_len = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if fcs_len == 0 or at + fcs_len > n:
        return None
    content = int.from_bytes(frame[at:at + fcs_len], "little") + (256 if fcs_len == 2 else 0)
    at += fcs_len
    if content != size:
        return None
    block_max = min(_ZSTD_BLOCK_MAX, content if single else window)
    segments: list[memoryview] = []
    total = 0
    while True:
        if at + 3 > n:
            return None
        bh = int.from_bytes(frame[at:at + 3], "little")
        at += 3
        length = bh >> 3
        if (bh >> 1) & 3 != 0 or length > block_max or at + length > n:
            return None                   # not a raw block, or not one zstd would take
        if length:
            segments.append(frame[at:at + length])
        at += length
        total += length
        if bh & 1:
            break
    if total != size or at + 4 != n:
        return None
    h = xxhash.xxh64()
    for seg in segments:
        h.update(seg)
    if h.intdigest() & 0xFFFFFFFF != int.from_bytes(frame[at:n], "little"):
        raise CodecError("stored plane's content checksum mismatch: payload damaged")
    return segments
