"""The block codec: a KV block tensor <-> self-describing, checksummed bytes, zstd-compressed or raw.

Knows: what follows the header in each kind of payload (below), which byte planes are worth
compressing, and how to prove a payload is intact and is the one asked for before handing bytes
back. Anything wrong with a payload raises `CodecError`; a damaged payload, or one stored under
another block's key, never decodes to wrong bytes. Doesn't know: the header's byte layout (its
versions, flags, plane table and crcs: storage/codec/header.py, which this fills and checks the
data against), where payloads are stored, what a binding means (the disk tier binds a payload to
its block hash and namespace), or eviction. The byte regrouping itself is
storage/codec/byte_planes.py.

Two codecs write it (Codec.kind, CacheConfig.codec); decode() reads either, whatever the
reader's own kind: "zstd" splits the tensor into byte planes and compresses the top one (below);
"raw" stores the tensor's bytes as they are, in element order, under an xxh3_64 checksum, with
no zstd at all (the header's "whole" flag).

A tensor is split into byte planes (plane b = byte b of every element). The top plane holds
the sign and the exponent's high bits, which take few values: it is "coded", i.e. compressed
with zstd at `level` with the match search turned almost off (7-byte matches, 64-entry tables):
exponent bytes hardly repeat as strings, and on real KV the matches zstd finds cost more bits
than the literals they replace (docs/BENCHMARKS.md, "Codec v4"), so what compresses is zstd's
Huffman coding of the literals. The other planes are mantissa bits, as good as random: they are
"stored": a zstd frame of raw blocks written by hand around views of the plane (with zstd's
content size and xxh64, so any zstd reads it; storage/codec/zstd_frames.py), or, for a plane that
looks like runs (an all-zero plane), zstd at a fast negative level, which collapses them. Plane-by-plane, measured
on SmolLM2 KV: the top plane codes to ~36% (bf16, fp32) or ~72% (fp16) of its size; no lower
plane, fp32's second byte included, shrinks at all (their entropy is 0.989-1.000 of 8 bits).
With 3 or more dims (the first two longer than 1) the planes list elements in dim-1-major order (a KV block's K of every
layer, then V) and the coded plane's zstd blocks end where each dim-1 slice ends: K and V exponents
are distributed differently, and each block carries its own Huffman table (+0.2-0.6% ratio, the
decoder sees ordinary frames).

The raw codec splits nothing, compresses nothing and has no zstd frame: its payload is the header
and the tensor's bytes as they are, and the header (under its crc32) holds an xxh3_64 of those
bytes. xxh3 runs at tens of GB/s (64 GB/s on a cached 360 KiB block here, above memcpy's ~43),
where zlib.crc32 (1.2.13 here, without the carry-less-multiply fast path) does ~2-4 GB/s and a
zstd raw-block frame costs a decompression into a fresh buffer (xxh64 plus a copy) before the copy
into the caller's tensor. Its decode hashes the data where it lies (an LMDB value read in place)
and copies it into the caller's tensor with one np.copyto: nothing is allocated, and the tensor
is untouched when the checksum fails. Planes only help a compressor, so the raw codec pays no
split or join. Its payloads are 1.15-1.45x larger on KV than the zstd codec's: it wins where the
drive or network moves bytes faster than zstd decodes them. (The raw codec's first layout, one
zstd frame at the fastest level, was never released; this build refuses it: its table entry is
not the raw size.)

Four checks, each over what it is cheapest to check: the header crc32 vouches for the header
(so a damaged shape, size, plane table or data checksum never drives an allocation, a reshape or
a frame boundary); the binding inside that header must equal the one the reader asks for, so an
intact payload found under the wrong key (a damaged LMDB page pointer, a misplaced record) is
refused, not served; each frame's content checksum (xxh64) vouches for its plane's bytes -- the
stored planes' too, since they are zstd frames -- so damage in a frame fails decompression or that
checksum; and the coded crc32 covers the compressed bytes of the coded frames, where some bits
are don't-cares to zstd (a Huffman table description's padding, say): a flip there decodes to the
right bytes, and without this crc would go unnoticed. It costs a crc over 11-42% of the payload
(fp32-fp16), not all of it. A frame without a content checksum, of the wrong content size, with
its header's unused bit set (zstd ignores that bit), or with bytes after it, is refused: zstd
would decode each without complaint. The raw codec has no frame: its third and fourth checks are
one, the xxh3_64 over all of its data, whose length must be exactly the raw size (a truncated or
extended payload is refused before hashing). So any damage raises, and no damage decodes to
other bytes.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from storage.codec import byte_planes, nibble
from storage.codec.codec_error import CodecError
from storage.codec.header import (
    KINDS, CodecHeader, PlaneFrame, check_encodable, crc32, pack_header, parse_header)
from storage.codec.zstd_frames import block_cuts, compress_coded, decompress_frame, raw_block_segments, stored_frame
from storage.layout import DTYPE_ITEMSIZES, dtype_from_name, dtype_name

if TYPE_CHECKING:      # torch is imported where a tensor is made (decode): `check` and the header need none
    import torch

# Which planes are coded, by itemsize: the top byte (sign and exponent). Measured, not assumed:
# tools/bench_codec.py prints what every plane would code to.
CODED_PLANES: dict[int, frozenset[int]] = {2: frozenset({1}), 4: frozenset({3})}


# This thread's scratch buffers (one per thread: encode and check run on pool threads).
_tls = threading.local()


def _planes_buffer(nbytes: int) -> np.ndarray:
    """This thread's buffer for encode's byte planes (a fresh array per block cost ~13 us of
    first-touch page faults on a 360 KiB bf16 block); grown when a larger block comes."""
    buf = getattr(_tls, "planes", None)
    if buf is None or buf.size < nbytes:
        buf = _tls.planes = np.empty(nbytes, dtype=np.uint8)
    return buf


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 numpy array (no copy). Works for bf16, which numpy lacks."""
    import torch        # a tensor was given: torch is loaded already
    return t.reshape(-1).view(torch.uint8).numpy()


_UINTS = {2: np.uint16, 4: np.uint32}


def _check_buffer(header: CodecHeader) -> np.ndarray:
    """This thread's scratch array for check(): the header's shape in unsigned ints of its
    dtype's size (the bits of the block, no torch needed); grown when a larger block comes."""
    itemsize = DTYPE_ITEMSIZES[header.dtype]
    buf = getattr(_tls, "check", None)
    if buf is None or buf.nbytes < header.raw_size:
        buf = _tls.check = np.empty(max(header.raw_size, 1 << 16), dtype=np.uint8)
    return buf[:header.raw_size].view(_UINTS[itemsize]).reshape(header.shape)


def decoded_digest(payload: bytes | memoryview, binding: bytes) -> int:
    """xxh3_64 of what `payload` decodes to (every check of decode() made; no torch): the encode
    process's child compares it with its input's before it answers (storage/codec/encode_worker.py)."""
    return xxhash.xxh3_64_intdigest(Codec().check(payload, binding).reshape(-1).view(np.uint8))


def encode_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...], binding: bytes, kind: str = "zstd",
                 level: int = 3) -> tuple[bytes | memoryview | np.ndarray, ...]:
    """Codec.encode_parts without torch: `data` is the block's bytes (a flat contiguous uint8
    array, element order), `dtype` its name ("float32", "float16", "bfloat16"), `shape` its
    shape. The parts are the very payload Codec(level, kind).encode_parts gives for that tensor
    (it calls this); the same NOTE on views holds. The encode process (storage/codec/
    encode_worker.py) calls it on blocks in shared memory."""
    check_encodable(dtype, shape, binding)
    itemsize = DTYPE_ITEMSIZES[dtype]
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous or data.size != math.prod(shape) * itemsize:
        raise ValueError(f"block: expected {math.prod(shape) * itemsize} contiguous bytes, got {data.dtype} {data.shape}")
    if kind == "raw":
        return (*pack_header(dtype, shape, data.size, binding, (PlaneFrame(coded=False, length=data.size),),
                             data_xxh3=xxhash.xxh3_64_intdigest(data)), data)
    if kind == "nibble":
        low, coded = nibble.encode(data, itemsize)
        top = coded if coded is not None else nibble.top_plane(data, itemsize)
        n = data.size // itemsize
        table = [PlaneFrame(coded=False, length=n)] * (itemsize - 1) + [PlaneFrame(coded=coded is not None,
                                                                                    length=top.size)]
        h = xxhash.xxh3_64()
        h.update(low)
        h.update(top)
        return (*pack_header(dtype, shape, data.size, binding, table, data_xxh3=h.intdigest(), nibble=True), low, top)
    dim1_major = byte_planes.can_swap(shape)
    # Into this thread's warm buffer: the planes live only until their frames are made.
    planes = byte_planes.split(data.view(_UINTS[itemsize]).reshape(shape), dim1_major, out=_planes_buffer(data.size))
    coded = CODED_PLANES[itemsize]
    cuts = block_cuts(shape, dim1_major)
    # Each frame as its parts: the coded plane's zstd frame, a stored plane's raw-block
    # frame around views of the planes buffer (so the caller's join is its one copy).
    frames = [[compress_coded(planes[b], level, cuts)] if b in coded else stored_frame(planes[b])
              for b in range(len(planes))]
    coded_crc = 0
    for b in sorted(coded):
        coded_crc = crc32(frames[b][0], coded_crc)
    table = [PlaneFrame(coded=b in coded, length=sum(len(x) for x in f)) for b, f in enumerate(frames)]
    return (*pack_header(dtype, shape, data.size, binding, table, level=level, dim1_major=dim1_major,
                         coded_crc=coded_crc), *(x for f in frames for x in f))


@dataclass(frozen=True)
class Codec:
    """Encoding settings only -- the kind ("zstd": byte planes, the top one compressed at `level`;
    "raw": the bytes as they are) and the zstd level: decode reads the header, so any Codec
    decodes a payload of either kind."""
    level: int = 3
    kind: str = "zstd"

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"level: expected an int in [-7, 22], got {self.level!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")

    def encode(self, block: torch.Tensor, binding: bytes) -> bytes:
        """Encode a contiguous CPU float32/float16/bfloat16 tensor into a version-4 payload of this
        codec's kind bound to `binding` (at most 255 bytes; decode() refuses the payload for any
        other binding)."""
        return b"".join(self.encode_parts(block, binding))

    def encode_parts(self, block: torch.Tensor, binding: bytes) -> tuple[bytes | memoryview, ...]:
        """encode()'s payload as the parts it is the concatenation of, not yet joined: a caller
        that frames the payload (the remote tier's value) joins once instead of twice. NOTE: some
        parts are views -- with the raw codec of `block`'s own bytes, with zstd of this thread's
        planes buffer (the stored planes) -- valid only until the block changes or this thread
        encodes again: join the parts on this thread, before either."""
        if block.device.type != "cpu" or not block.is_contiguous():
            raise ValueError(f"block: expected a contiguous CPU tensor, got device={block.device}, "
                             f"contiguous={block.is_contiguous()}")
        return encode_bytes(tensor_bytes(block), dtype_name(block.dtype), tuple(block.shape), binding,
                            self.kind, self.level)

    def peek_header(self, payload: bytes | memoryview) -> CodecHeader:
        """Parse and sanity-check the header without checking the crc or decompressing."""
        return parse_header(memoryview(payload))

    def check_header(self, payload: bytes | memoryview) -> CodecHeader:
        """Parse the header and check its crc32 (no decompression): the fields, binding and plane
        table included, are then the ones encode() wrote. Raises CodecError. The answer, given
        back to decode(header=...) with the same payload, spares decode a second parse."""
        return parse_header(memoryview(payload), check_crc=True)

    def frames(self, payload: bytes | memoryview) -> list[tuple[memoryview, int]]:
        """The payload's zstd frames, each with the size it decompresses to (the header checked,
        the frames not): what a benchmark's bare-zstd limit decompresses. None for a whole (raw
        codec) or nibble payload, which has no zstd frame."""
        mv = memoryview(payload).cast("B")
        header = self.check_header(mv)
        if header.whole or header.nibble:
            return []
        if header.version == 3:
            return [(mv[header.header_size:], header.raw_size)]
        spans, at = [], header.header_size
        for p in header.planes:
            spans.append((mv[at:at + p.length], header.frame_size))
            at += p.length
        return spans

    def decode(self, payload: bytes | memoryview, binding: bytes, out: torch.Tensor | None = None, *,
               header: CodecHeader | None = None) -> torch.Tensor:
        """Verify and decode a payload (version 3 or 4, either kind, whatever this codec's kind);
        the result has the header's dtype and shape.

        `binding` must equal the one the payload was encoded with. `out`, when given, is a
        contiguous CPU tensor of the header's dtype and numel that receives the bytes (no
        allocation); the returned tensor is a view of it. Raises CodecError for any damage or
        a binding mismatch, ValueError when `out` does not fit the payload. `header`: what
        check_header answered for this very payload (verify_and_decode has checked it already).
        """
        mv, header = self._checked(payload, binding, header)
        import torch        # the one place a tensor is made
        dtype = dtype_from_name(header.dtype)
        if out is None:
            out = torch.empty(header.shape, dtype=dtype)
        elif not out.is_cpu or out.dtype != dtype or out.numel() != header.numel or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous CPU {header.dtype} tensor of {header.numel} elements, "
                             f"got {out.dtype} numel={out.numel()} device={out.device} contiguous={out.is_contiguous()}")
        # Per-block costs count here (a restore decodes thousands): a view only where the shape differs.
        if out.shape != header.shape:
            out = out.view(header.shape)
        ints = torch.int16 if dtype.itemsize == 2 else torch.int32
        _decode_into(mv, header, out.view(ints).numpy().view(_UINTS[dtype.itemsize]))
        return out

    def check(self, payload: bytes | memoryview, binding: bytes, *, header: CodecHeader | None = None) -> np.ndarray:
        """decode()'s every check and its full decode, into a scratch array of this thread
        rather than a tensor (no torch: `tieredkv verify` checks a store without importing it).
        Raises CodecError for any damage or a binding mismatch, as decode() does. Returns the
        scratch array (the block's bits), valid until this thread checks again."""
        mv, header = self._checked(payload, binding, header)
        out = _check_buffer(header)
        _decode_into(mv, header, out)
        return out

    def _checked(self, payload: bytes | memoryview, binding: bytes,
                 header: CodecHeader | None) -> tuple[memoryview, CodecHeader]:
        mv = memoryview(payload).cast("B")
        if header is None:
            header = self.check_header(mv)
        elif not header.crc_checked or header.header_size > len(mv):
            # NOTE invariant: nothing is decoded under a header whose crc32 was not verified.
            raise ValueError("decode: header must be check_header's, for this payload")
        # NOTE invariant: a payload is served only for the binding it was written with -- an
        # intact payload under another key is refused here, before any byte is decoded.
        if header.binding != binding:
            raise CodecError("payload is bound to another block: stored under the wrong key")
        return mv, header


def _decode_into(mv: memoryview, header: CodecHeader, out: np.ndarray) -> None:
    """The payload's frames (header checked, binding matched) verified and decoded into `out`: a
    C-contiguous uint16/uint32 array of the header's shape (a tensor's memory, or check()'s
    scratch). Raises CodecError with `out` untouched when a frame is damaged."""
    out_bytes = out.reshape(-1).view(np.uint8)
    if header.version == 3:
        data = decompress_frame(mv[header.header_size:], header.raw_size)
        if header.shuffled:
            n, view = header.numel, memoryview(data)
            byte_planes.join([view[b * n:(b + 1) * n] for b in range(out.itemsize)], out)
        else:
            np.copyto(out_bytes, np.frombuffer(data, dtype=np.uint8))
        return
    at = header.header_size
    if header.whole:                        # the raw codec: the tensor's bytes, in element order
        if len(mv) - at != header.raw_size:
            raise CodecError(f"payload is {len(mv)} bytes, its plane table says {at + header.raw_size}")
        data = mv[at:]
        # Hashed where they lie (an LMDB value is read in place) and then copied once: the
        # checksum is ~10x faster than the copy, and `out` is untouched when it fails.
        if xxhash.xxh3_64_intdigest(data) != header.data_xxh3:
            raise CodecError("data xxh3 mismatch: payload damaged")
        np.copyto(out_bytes, np.frombuffer(data, dtype=np.uint8))
        return
    if len(mv) - at != sum(p.length for p in header.planes):
        raise CodecError(f"payload is {len(mv)} bytes, its plane table says "
                         f"{at + sum(p.length for p in header.planes)}")
    if header.nibble:                       # the nibble codec: planes in element order, one hash
        _decode_nibble(mv, header, out_bytes)
        return
    frames, crc = [], 0
    for p in header.planes:
        frames.append(mv[at:at + p.length])
        if p.coded:
            crc = crc32(frames[-1], crc)
        at += p.length
    if crc != header.coded_crc:
        raise CodecError("coded planes' crc32 mismatch: payload damaged")
    # Every plane ready (and checked) before the join writes into `out`: a damaged one
    # raises with `out` untouched. A stored plane whose frame is raw blocks is read where it
    # lies (its checksum checked here); anything else goes through zstd.
    planes = []
    for p, f in zip(header.planes, frames):
        segments = None if p.coded else raw_block_segments(f, header.numel)
        planes.append(segments if segments is not None else decompress_frame(f, header.numel))
    byte_planes.join(planes, out, header.dim1_major)


def _decode_nibble(mv: memoryview, header: CodecHeader, out_bytes: np.ndarray) -> None:
    """A nibble payload's planes (header checked, the payload's length the plane table's: the
    caller's check) hashed where they lie, then decoded into `out_bytes` (storage/codec/nibble.py).
    Raises CodecError with `out` untouched when the hash fails."""
    at, n, size = header.header_size, header.numel, DTYPE_ITEMSIZES[header.dtype]
    if xxhash.xxh3_64_intdigest(mv[at:]) != header.data_xxh3:
        raise CodecError("data xxh3 mismatch: payload damaged")
    low = [mv[at + b * n:at + (b + 1) * n] for b in range(size - 1)]
    top = mv[at + (size - 1) * n:]
    try:
        nibble.decode(top if header.planes[-1].coded else None, low, None if header.planes[-1].coded else top,
                      out_bytes, size)
    except ValueError as e:       # intact bytes (the hash held) that no encoder of ours writes
        raise CodecError(str(e)) from None
