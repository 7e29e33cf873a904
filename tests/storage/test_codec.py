"""Codec: bit-identical round trips, and every kind of damage raises CodecError -- for both kinds
of codec ("zstd" and "raw"), and a payload of either kind read by a codec of the other.

Payloads are real bytes from the real encoder; damage is done to them byte by byte. Where a
test needs a header that lies with a valid crc (a forger, not damage), it rebuilds the header
with the layout written down in storage/codec/header.py and recomputes the crc32.
"""
from __future__ import annotations

import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard

from storage.codec import byte_planes
from storage.codec.codec_error import CodecError
from storage.codec.header import FORMAT_VERSION, MAGIC
from storage.codec.payload import Codec
from storage.layout import dtype_from_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SHAPES = [(2, 2, 16, 3, 8), (1,), (7, 5), (3, 5, 7), (3, 2, 4, 1, 16), (1, 2, 3), (2, 1, 3), (), (0,), (2, 3, 0, 4)]
B = bytes(range(64))          # a binding, as the disk tier's (block hash || namespace)
SMALL = (2, 2, 4, 2, 8)       # a KV block's layout, 256 elements
KINDS = ["zstd", "raw", "nibble"]
OTHER = {"zstd": "raw", "raw": "nibble", "nibble": "zstd"}


def every_bit_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns, so NaNs with payloads, infinities, -0.0 and subnormals all occur."""
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(_INT[dtype])
    return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(_INT[dtype]).view(dtype)


def kv_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    n = max(1, shape[-1]) if shape else 1
    return (torch.randn(shape, generator=g) * torch.linspace(0.1, 4, n)[:shape[-1] if shape else 1]).to(dtype)


# Bit patterns: quiet NaN, NaN with a payload, negative NaN with a payload, signalling NaN,
# +inf, -inf, +0, -0, smallest subnormal, largest negative subnormal, largest finite.
SPECIAL_BITS = {
    torch.float32: [0x7FC00000, 0x7FC00123, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0, 0x80000000,
                    0x00000001, 0x807FFFFF, 0x7F7FFFFF],
    torch.float16: [0x7E00, 0x7E01, 0xFE03, 0x7C01, 0x7C00, 0xFC00, 0, 0x8000, 0x0001, 0x83FF, 0x7BFF],
    torch.bfloat16: [0x7FC0, 0x7FC1, 0xFFC3, 0x7F81, 0x7F80, 0xFF80, 0, 0x8000, 0x0001, 0x807F, 0x7F7F],
}


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """The special bit patterns above, then KV-like values, in a small block."""
    bits = 8 * torch.tensor([], dtype=dtype).element_size()
    head = torch.tensor([b - (1 << bits) if b >= 1 << (bits - 1) else b for b in SPECIAL_BITS[dtype]])
    x = kv_like(SMALL, dtype).clone()
    x.reshape(-1).view(_INT[dtype])[:len(head)] = head.to(_INT[dtype])
    return x


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_INT[a.dtype]), b.view(_INT[b.dtype]))


# ---- the v4 layout, written down here independently of the parser -----------------------------

def plane_table_at(payload: bytes) -> int:
    """Offset of the plane table: fixed fields, dims, raw size, binding (see storage/codec/header.py)."""
    at = 9 + 4 * payload[8] + 8
    return at + 1 + payload[at]


def itemsize_of(payload: bytes) -> int:
    return {1: 4, 2: 2, 3: 2}[payload[6]]


def is_whole(payload: bytes) -> bool:
    """Flags bit 2: the raw codec's layout, the tensor's bytes as they are under an xxh3_64."""
    return bool(payload[5] & 0x04)


def is_hashed(payload: bytes) -> bool:
    """Flags bit 2 or 3 (raw or nibble codec): the data under an xxh3_64 in place of a coded crc32."""
    return bool(payload[5] & 0x0C)


def table_entries_of(payload: bytes) -> int:
    """One per plane, or one when flags bit 2 says the payload holds the whole tensor (raw codec)."""
    return 1 if is_whole(payload) else itemsize_of(payload)


def header_size_of(payload: bytes) -> int:
    """Fields, plane table (5 bytes an entry), coded crc32 (whole: data xxh3_64, 8 bytes), header crc32."""
    return plane_table_at(payload) + 5 * table_entries_of(payload) + (8 if is_hashed(payload) else 4) + 4


def split_payload(payload: bytes) -> tuple[bytes, list[tuple[int, int]], list[bytes]]:
    """(header fields before the plane table, [(mode, length)], [frame]) of a v4 payload; whole:
    the one "frame" is the tensor's bytes."""
    table = plane_table_at(payload)
    entries = [struct.unpack_from("<BI", payload, table + 5 * b) for b in range(table_entries_of(payload))]
    at = header_size_of(payload)
    frames = []
    for _, length in entries:
        frames.append(payload[at:at + length])
        at += length
    return payload[:table], entries, frames


def build_payload(fields: bytes, entries: list[tuple[int, int]], frames: list[bytes]) -> bytes:
    """A v4 payload whose checks (coded crc or whole data xxh3, header crc) are valid, whatever it says."""
    if is_hashed(fields):
        check = struct.pack("<Q", xxhash.xxh3_64_intdigest(b"".join(frames)))
    else:
        coded_crc = 0
        for (mode, _), frame in zip(entries, frames):
            if mode == 1:
                coded_crc = zlib.crc32(frame, coded_crc)
        check = struct.pack("<I", coded_crc)
    header = fields + b"".join(struct.pack("<BI", m, n) for m, n in entries) + check
    return header + struct.pack("<I", zlib.crc32(header)) + b"".join(frames)


def with_crc(payload: bytes) -> bytes:
    """The payload with its header crc32 made to match a tampered header of the same length."""
    end = header_size_of(payload) - 4
    return payload[:end] + struct.pack("<I", zlib.crc32(payload[:end])) + payload[end + 4:]


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_bit_identical(kind: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    codec = Codec(level=3, kind=kind)
    for x in (every_bit_pattern(shape, dtype), kv_like(shape, dtype)):
        payload = codec.encode(x, B)
        assert_same_bits(codec.decode(payload, B), x)
        assert_same_bits(codec.decode(memoryview(payload), B), x)
        assert_same_bits(codec.decode(bytearray(payload), B), x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [-7, 1, 3, 19])
def test_special_values_round_trip_at_any_level(kind: str, dtype: torch.dtype, level: int) -> None:
    x = special_values(dtype)
    flat = x.reshape(-1).float()
    assert flat[:4].isnan().all() and flat[4:6].isinf().all() and 0 < flat[8] < torch.finfo(dtype).tiny
    codec = Codec(level=level, kind=kind)
    assert_same_bits(codec.decode(codec.encode(x, B), B), x)


@pytest.mark.parametrize("writer", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 16, 3, 8), (7, 5), (), (0,)])
def test_either_kind_reads_what_the_other_wrote(writer: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # A store written with one codec and reopened with the other serves every block bit for bit:
    # decode reads the header, never its own kind.
    x = every_bit_pattern(shape, dtype, seed=5)
    payload = Codec(kind=writer).encode(x, B)
    assert_same_bits(Codec(kind=OTHER[writer]).decode(payload, B), x)
    out = torch.empty(x.numel(), dtype=dtype)
    assert Codec(kind=OTHER[writer]).decode(payload, B, out=out).data_ptr() == out.data_ptr()
    assert_same_bits(out.view(shape), x)
    with pytest.raises(CodecError, match="bound to another block"):
        Codec(kind=OTHER[writer]).decode(payload, B[:-1])


def test_a_raw_payload_holds_the_tensor_bytes_as_they_are() -> None:
    x = kv_like((4, 2, 16, 2, 32), torch.bfloat16)
    payload = Codec(level=5, kind="raw").encode(x, B)
    h = Codec().check_header(payload)
    assert (h.version, h.dtype, h.shape, h.raw_size, h.shuffled, h.level, h.binding, h.dim1_major) == (
        4, "bfloat16", (4, 2, 16, 2, 32), x.numel() * 2, False, 0, B, False)
    raw = x.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert payload[5] == 0x04 and [(p.coded, p.length) for p in h.planes] == [(False, len(raw))]
    assert payload[h.header_size:] == raw            # element order, verbatim, nothing after them
    assert h.header_size == header_size_of(payload)
    assert payload[h.header_size - 12:h.header_size - 4] == struct.pack("<Q", xxhash.xxh3_64_intdigest(raw))
    assert h.data_xxh3 == xxhash.xxh3_64_intdigest(raw) and h.coded_crc is None
    assert Codec().frames(payload) == []             # no zstd frame to decompress


def test_header_describes_the_block() -> None:
    x = kv_like((2, 2, 16, 3, 8), torch.bfloat16)
    h = Codec(level=5).check_header(Codec(level=5).encode(x, B))
    assert (h.version, h.dtype, h.shape, h.raw_size, h.shuffled, h.level, h.binding) == (
        4, "bfloat16", (2, 2, 16, 3, 8), 1536 * 2, True, 5, B)
    assert h.dim1_major and [p.coded for p in h.planes] == [False, True]
    h = Codec().check_header(Codec().encode(kv_like((7, 5), torch.float32), B))
    assert (h.dtype, h.raw_size, h.level, h.dim1_major) == ("float32", 35 * 4, 3, False)
    assert [p.coded for p in h.planes] == [False, False, False, True]


def test_the_stored_planes_are_raw_and_the_top_plane_is_coded() -> None:
    x = kv_like((4, 2, 16, 2, 32), torch.bfloat16)
    payload = Codec().encode(x, B)
    low, top = byte_planes.split(x, swapped=True)
    _, entries, frames = split_payload(payload)
    assert low.tobytes() in frames[0]              # verbatim: zstd raw blocks
    assert len(frames[1]) < 0.8 * top.size         # the exponents compress
    assert [e[0] for e in entries] == [0, 1]
    assert FORMAT_VERSION == 4 and payload[4] == 4


def test_frames_lists_each_plane_frame_with_its_size() -> None:
    x = kv_like(SMALL, torch.float32)
    payload = Codec().encode(x, B)
    planes = byte_planes.split(x, swapped=True)
    frames = Codec().frames(payload)
    assert [n for _, n in frames] == [x.numel()] * 4
    assert [zstandard.ZstdDecompressor().decompress(f) for f, _ in frames] == [p.tobytes() for p in planes]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_into_out(kind: str, dtype: torch.dtype) -> None:
    x = every_bit_pattern((2, 2, 16, 3, 8), dtype, seed=3)
    out = torch.empty(x.numel(), dtype=dtype)   # flat buffer: the result takes the header's shape
    got = Codec().decode(Codec(kind=kind).encode(x, B), B, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == x.shape
    assert_same_bits(got, x)


def test_out_that_does_not_fit_is_a_value_error() -> None:
    payload = Codec().encode(kv_like((4, 8), torch.float16), B)
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(31, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(64, dtype=torch.float16)[::2])


def test_encode_rejects_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        Codec().encode(torch.zeros(4, dtype=torch.int32), B)
    with pytest.raises(ValueError, match="contiguous"):
        Codec().encode(torch.zeros(4, 4).t(), B)
    with pytest.raises(ValueError, match="level"):
        Codec(level=23)
    with pytest.raises(ValueError, match="kind"):
        Codec(kind="lz4")
    with pytest.raises(ValueError, match="binding"):
        Codec().encode(kv_like((4, 8), torch.float16), b"x" * 256)


def test_kv_like_data_compresses() -> None:
    x = kv_like((2, 2, 16, 3, 8), torch.bfloat16)
    assert len(Codec().encode(x, B)) < x.numel() * 2


def test_parallel_decodes_in_threads_are_correct() -> None:
    blocks = [every_bit_pattern((4, 2, 16, 2, 16), DTYPES[i % 3], seed=i) for i in range(24)]
    payloads = [Codec(level=1 + i % 3, kind=KINDS[i % 2]).encode(b, B) for i, b in enumerate(blocks)]
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        for i in range(k, len(blocks), 4):
            results[i] = Codec().decode(payloads[i], B)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(blocks):
        assert_same_bits(results[i], b)


# ---- damage: every byte, every length ---------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_byte_corruption_raises(kind: str, dtype: torch.dtype) -> None:
    # A small real payload: header, each stored plane's frame, the coded plane's frame (raw: the
    # tensor's bytes). Every byte of it, changed three ways, must fail -- in the header (crc), in a
    # frame's header, blocks or checksum (zstd), in the data (raw: its xxh3) -- and never decode
    # to other bytes.
    x = special_values(dtype)
    payload = Codec(kind=kind).encode(x, B)
    fields, entries, frames = split_payload(payload)
    header_size = header_size_of(payload)
    if kind == "raw":
        assert entries == [(0, len(payload) - header_size)]
    elif kind == "nibble":      # the top plane coded where that pays (special values: either)
        assert all(m == 0 for m, _ in entries[:-1])
    else:
        assert [m for m, _ in entries][-1] == 1 and all(m == 0 for m, _ in entries[:-1])
    assert len(payload) == header_size + sum(len(f) for f in frames)
    survived = []
    for offset in range(len(payload)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(payload)
            damaged[offset] ^= mask
            try:
                got = Codec().decode(bytes(damaged), B)
            except CodecError:
                continue
            survived.append((offset, mask, torch.equal(got.view(_INT[dtype]), x.view(_INT[dtype]))))
    assert survived == []


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_corruption_of_real_kv_sized_payloads_raises(kind: str) -> None:
    # Full-size blocks (zstd raw blocks over 128 KiB split in two or more): a sample of positions
    # in each region -- header, every frame's start, middle, each raw block's header, and end
    # (raw: the data's start, middle, end and every 128 KiB).
    for dtype in DTYPES:
        x = kv_like((30, 2, 16, 3, 64), dtype)
        payload = Codec(kind=kind).encode(x, B)
        fields, entries, frames = split_payload(payload)
        at = header_size_of(payload)
        offsets = list(range(0, at))
        for f in frames:
            offsets += [at, at + 3, at + 6, at + 9, at + len(f) // 2, at + len(f) - 5, at + len(f) - 1]
            if kind == "raw":
                offsets += [at + k * (128 << 10) + j for k in range(1, len(f) >> 17) for j in (-1, 0)]
            else:
                first_block = zstandard.frame_header_size(f)
                offsets += [at + first_block + k * (3 + (128 << 10)) + j for k in range(len(f) >> 17) for j in (0, 1, 2)]
            at += len(f)
        for offset in offsets:
            damaged = bytearray(payload)
            damaged[offset] ^= 0x04
            with pytest.raises(CodecError):
                Codec().decode(bytes(damaged), B)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_or_extended_payload_raises(kind: str) -> None:
    payload = Codec(kind=kind).encode(special_values(torch.bfloat16), B)
    for n in range(len(payload)):
        with pytest.raises(CodecError):
            Codec().decode(payload[:n], B)
    for junk in (b"\0", b"junk", payload[-40:]):
        with pytest.raises(CodecError, match="plane table"):
            Codec().decode(payload + junk, B)


@pytest.fixture(scope="module", params=KINDS)
def payload(request: pytest.FixtureRequest) -> bytes:
    return Codec(kind=request.param).encode(kv_like(SMALL, torch.float16), B)


def test_an_intact_payload_under_another_binding_is_refused(payload: bytes) -> None:
    for other in (bytes(reversed(B)), B[:32], b"", B + b"\0"):
        with pytest.raises(CodecError, match="bound to another block"):
            Codec().decode(payload, other)
    assert Codec().check_header(payload).binding == B


def test_wrong_magic_or_version_raises(payload: bytes) -> None:
    with pytest.raises(CodecError, match="magic"):
        Codec().decode(with_crc(b"XKVB" + payload[4:]), B)
    with pytest.raises(CodecError, match="magic"):
        Codec().peek_header(b"XKVB" + payload[4:])
    for version in (1, 2, 5, 9):
        body = payload[:4] + bytes([version]) + payload[5:]
        assert body[:4] == MAGIC
        with pytest.raises(CodecError, match="version"):
            Codec().decode(with_crc(body), B)


def test_header_lies_with_a_valid_crc_raise(payload: bytes) -> None:
    fields, entries, frames = split_payload(payload)
    raw_size_at = len(fields) - 1 - len(B) - 8
    lies = {
        "raw size": fields[:raw_size_at] + struct.pack("<Q", 999) + fields[raw_size_at + 8:],
        "unknown flags": fields[:5] + bytes([0x01]) + fields[6:],          # v3's shuffle bit on v4
        "unknown dtype": fields[:6] + bytes([9]) + fields[7:],
    }
    for match, bad in lies.items():
        with pytest.raises(CodecError, match=match):
            Codec().decode(build_payload(bad, entries, frames), B)
    with pytest.raises(CodecError, match="unknown mode"):
        Codec().decode(build_payload(fields, [(2, entries[0][1]), *entries[1:]], frames), B)
    with pytest.raises(CodecError, match="plane table"):     # lengths that do not add up
        Codec().decode(build_payload(fields, [(entries[0][0], entries[0][1] + 1), *entries[1:]], frames), B)
    if len(entries) > 1:
        with pytest.raises(CodecError):                      # a boundary moved: both frames broken
            Codec().decode(build_payload(fields, [(entries[0][0], entries[0][1] + 1),
                                                  (entries[1][0], entries[1][1] - 1)], frames), B)
    stale = bytearray(payload)                               # the coded crc (raw: xxh3) of other bytes
    stale[header_size_of(payload) - 8] ^= 1
    with pytest.raises(CodecError, match="xxh3" if is_hashed(payload) else "coded planes' crc32"):
        Codec().decode(with_crc(bytes(stale)), B)


def test_the_whole_flag_with_planes_or_a_coded_frame_raises() -> None:
    # Forged with valid crcs: bit 2 (whole) together with bit 1 (dim-1-major), or a whole-tensor
    # frame marked coded; and a flag flipped either way, which changes how the table is read.
    raw = Codec(kind="raw").encode(kv_like(SMALL, torch.bfloat16), B)
    fields, entries, frames = split_payload(raw)
    with pytest.raises(CodecError, match="at most one of whole, nibble and dim-1-major"):
        Codec().decode(build_payload(fields[:5] + bytes([0x06]) + fields[6:], entries, frames), B)
    with pytest.raises(CodecError, match="unknown mode 1 for plane 0 of a whole-tensor frame"):
        Codec().decode(build_payload(fields, [(1, entries[0][1])], frames), B)
    with pytest.raises(CodecError):                          # raw read as planes
        Codec().decode(with_crc(raw[:5] + bytes([0x00]) + raw[6:]), B)
    planes = Codec().encode(kv_like(SMALL, torch.bfloat16), B)
    for flags in (0x04, 0x06):                               # planes read as one whole frame
        with pytest.raises(CodecError):
            Codec().decode(with_crc(planes[:5] + bytes([flags]) + planes[6:]), B)


def test_dim1_major_flag_on_a_shape_without_those_dims_raises() -> None:
    p = Codec().encode(kv_like((7, 5), torch.bfloat16), B)
    assert p[5] == 0
    with pytest.raises(CodecError, match="dim-1-major"):
        Codec().decode(with_crc(p[:5] + bytes([0x02]) + p[6:]), B)


@pytest.fixture(scope="module")
def zstd_payload() -> bytes:
    return Codec(kind="zstd").encode(kv_like(SMALL, torch.float16), B)


def test_a_frame_without_its_content_checksum_is_refused(zstd_payload: bytes) -> None:
    # zstd decodes a frame without a checksum without complaint, and a changed byte in a raw
    # block would then be served as KV: the frame must carry its checksum, header crc or not.
    fields, entries, frames = split_payload(zstd_payload)
    plane = zstandard.ZstdDecompressor().decompress(frames[0])
    bare = zstandard.ZstdCompressor(level=-5, write_checksum=False, write_content_size=True).compress(plane)
    assert not zstandard.get_frame_parameters(bare).has_checksum
    with pytest.raises(CodecError, match="checksum"):
        Codec().decode(build_payload(fields, [(0, len(bare)), *entries[1:]], [bare, *frames[1:]]), B)


def test_a_frame_of_another_size_or_with_bytes_after_it_is_refused(zstd_payload: bytes) -> None:
    fields, entries, frames = split_payload(zstd_payload)
    plane = zstandard.ZstdDecompressor().decompress(frames[0])
    c = zstandard.ZstdCompressor(level=-5, write_checksum=True, write_content_size=True)
    for other, match in ((c.compress(plane[:-1]), "content size"), (c.compress(plane + b"\0"), "content size"),
                         (frames[0] + b"\0", "unused data|extra"), (frames[0] + frames[0], "unused data|extra")):
        with pytest.raises(CodecError, match=match):
            Codec().decode(build_payload(fields, [(0, len(other)), *entries[1:]], [other, *frames[1:]]), B)


@pytest.mark.parametrize("dtype", DTYPES)
def test_damaged_raw_payloads_raise_and_leave_out_untouched(dtype: torch.dtype) -> None:
    # The raw layout has no zstd frame: its xxh3_64 (inside the crc-checked header) and the
    # table's length (= raw size) are all that stand between damage and the caller's tensor.
    x = every_bit_pattern(SMALL, dtype, seed=11)
    payload = Codec(kind="raw").encode(x, B)
    fields, entries, (data,) = split_payload(payload)
    at = header_size_of(payload)
    out = torch.zeros(x.numel(), dtype=dtype)

    def refused(bad: bytes, match: str) -> None:
        with pytest.raises(CodecError, match=match):
            Codec().decode(bad, B, out=out)
        assert not out.view(_INT[dtype]).any()             # nothing copied before the check

    for offset in (at, at + len(data) // 2, len(payload) - 1):     # a flipped data byte
        for mask in (0x01, 0x80):
            damaged = bytearray(payload)
            damaged[offset] ^= mask
            refused(bytes(damaged), "xxh3")
    for k in range(8):                                          # a flipped checksum byte, crc fixed
        damaged = bytearray(payload)
        damaged[at - 12 + k] ^= 0x10
        refused(with_crc(bytes(damaged)), "xxh3")
        refused(bytes(damaged), "header crc32")                 # and as damage: the header crc
    for n in (at, at + 1, len(payload) - 1):                    # truncated
        refused(payload[:n], "plane table")
    for junk in (b"\0", data[:16], data):                       # trailing bytes
        refused(payload + junk, "plane table")
    # Wrong size, forged with every check valid: a table entry or data that is not the raw size,
    # a raw size (with the shape) that is not the data's.
    refused(build_payload(fields, [(0, len(data) - 2)], [data[:-2]]), "plane table")
    refused(build_payload(fields, [(0, len(data) + 2)], [data + b"xx"]), "plane table")
    refused(build_payload(fields, [(0, len(data))], [data[:-2]]), "plane table")
    refused(build_payload(fields, [(0, len(data))], [data + b"xx"]), "plane table")
    raw_size_at = len(fields) - 1 - len(B) - 8
    refused(build_payload(fields[:raw_size_at] + struct.pack("<Q", len(data) - 2) + fields[raw_size_at + 8:],
                          [(0, len(data) - 2)], [data[:-2]]), "raw size")
    # The intact payload still decodes into the same tensor.
    assert_same_bits(Codec().decode(payload, B, out=out), x)


def test_the_raw_codecs_first_layout_is_refused() -> None:
    # The raw kind's first layout (never released): one zstd frame of the bytes under a coded crc
    # of 0. Its table entry is the frame's length, not the raw size, so it cannot be read as data.
    x = kv_like(SMALL, torch.bfloat16)
    raw = x.reshape(-1).view(torch.uint8).numpy().tobytes()
    frame = zstandard.ZstdCompressor(level=-(1 << 17), write_checksum=True, write_content_size=True).compress(raw)
    fields, _, _ = split_payload(Codec(kind="raw").encode(x, B))
    header = fields + struct.pack("<BI", 0, len(frame)) + struct.pack("<I", 0)
    old = header + struct.pack("<I", zlib.crc32(header)) + frame
    with pytest.raises(CodecError):
        Codec().decode(old, B)


# ---- payloads already on disk stay readable ---------------------------------------------------

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
V3_STEMS = ["codec_v3_bfloat16_shuffled", "codec_v3_float16", "codec_v3_float32_shuffled"]


@pytest.mark.parametrize("stem", V3_STEMS)
def test_golden_v3_payloads_decode_to_their_exact_bytes(stem: str) -> None:
    # Written by the format-3 codec (tests/fixtures/README.md): a later build must serve what an
    # earlier one stored, bit for bit.
    payload = (FIXTURES / f"{stem}.tkvb").read_bytes()
    expected = (FIXTURES / f"{stem}.raw").read_bytes()
    header = Codec().check_header(payload)
    assert header.version == 3 and header.shape == (2, 2, 4, 2, 8)
    assert header.shuffled == stem.endswith("shuffled")
    got = Codec().decode(payload, B)
    assert got.shape == (2, 2, 4, 2, 8) and got.dtype == dtype_from_name(header.dtype)
    assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == expected
    out = torch.empty(256, dtype=got.dtype)
    assert Codec().decode(memoryview(payload), B, out=out).data_ptr() == out.data_ptr()
    assert out.view(torch.uint8).numpy().tobytes() == expected
    with pytest.raises(CodecError, match="bound to another block"):
        Codec().decode(payload, bytes(64))
    assert [n for _, n in Codec().frames(payload)] == [len(expected)]


@pytest.mark.parametrize("stem", V3_STEMS)
def test_damaged_v3_payloads_never_decode_to_other_bytes(stem: str) -> None:
    # Version 3 has no crc over its frame's compressed bytes: a flip in a bit zstd does not read
    # (in a Huffman table description, say) still decodes to the stored bytes. Never to others.
    payload = (FIXTURES / f"{stem}.tkvb").read_bytes()
    expected = (FIXTURES / f"{stem}.raw").read_bytes()
    undetected = []
    for offset in range(len(payload)):
        for mask in (0x01, 0x10, 0x80, 0xFF):
            damaged = bytearray(payload)
            damaged[offset] ^= mask
            try:
                got = Codec().decode(bytes(damaged), B)
            except CodecError:
                continue
            assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == expected
            undetected.append(offset)
    assert all(offset > Codec().peek_header(payload).header_size + 4 for offset in undetected)
    with pytest.raises(CodecError, match="unused data|extra"):
        Codec().decode(payload + b"\0", B)
    with pytest.raises(CodecError):
        Codec().decode(payload[:-1], B)


def test_decode_takes_check_headers_answer_and_refuses_an_unchecked_header() -> None:
    x = kv_like((4, 2, 16, 3, 8), torch.bfloat16)
    payload = Codec().encode(x, B)
    header = Codec().check_header(payload)
    assert header.crc_checked
    assert_same_bits(Codec().decode(payload, B, header=header), x)
    with pytest.raises(ValueError, match="check_header"):
        Codec().decode(payload, B, header=Codec().peek_header(payload))   # its crc never checked
    with pytest.raises(ValueError, match="check_header"):
        Codec().decode(payload[:header.header_size - 1], B, header=header)   # not this payload's


def test_the_header_crc_is_checked_before_any_field_is_trusted() -> None:
    payload = bytearray(Codec().encode(kv_like((4, 2, 16, 3, 8), torch.bfloat16), B))
    payload[9] ^= 0x01                   # a dim of the shape: the raw size no longer matches it
    with pytest.raises(CodecError, match="header crc32"):
        Codec().check_header(bytes(payload))
    with pytest.raises(CodecError, match="does not match shape"):
        Codec().peek_header(bytes(payload))   # parsed without the crc: the fields' own checks


def test_the_crc32_is_zlibs() -> None:
    """header.crc32 (ISA-L's when installed) is zlib's CRC-32, chained from any start value:
    payloads written by either read with the other."""
    from storage.codec.header import crc32
    data = memoryview(bytes(range(256)) * 300 + b"tail")
    for start, seed in ((0, 0), (3, 0), (0, 0x12345678), (1000, 77)):
        assert crc32(data[start:], seed) == zlib.crc32(data[start:], seed)
    assert crc32(data) == zlib.crc32(data)


@pytest.mark.parametrize("kind", KINDS)
def test_encode_parts_are_the_payload_and_frame_into_the_same_stored_value(kind):
    """The remote tier frames a value from encode_parts in one join: its payload is byte for byte
    encode()'s, its metadata counts the same payload size, and it decodes bit-identically."""
    from storage.hashing import BlockKey
    from storage.fleet_secret import FleetSecret
    from storage.remote.value import open_value, pack_value, remote_key
    from storage.codec.stored_block import BlockMeta
    codec = Codec(kind=kind)
    block = kv_like(SMALL, torch.bfloat16)
    whole = codec.encode(block, B)
    parts = codec.encode_parts(block, B)
    assert len(parts) >= 3 and b"".join(parts) == whole
    key = BlockKey(hash=bytes(32), parent=bytes(32), token_ids=tuple(range(4)), namespace=bytes(range(32)))
    secret = FleetSecret.random()
    a = open_value(remote_key(key), pack_value(key, parts, block.numel() * 2, secret), secret)
    b = open_value(remote_key(key), pack_value(key, whole, block.numel() * 2, secret), secret)
    (meta_a, payload_a), (meta_b, payload_b) = (a.meta, a.payload), (b.meta, b.payload)
    assert bytes(payload_a) == bytes(payload_b) == whole
    assert BlockMeta.unpack(bytes(meta_a)).stored_size == BlockMeta.unpack(bytes(meta_b)).stored_size == len(whole)
    out = torch.empty_like(block)
    codec.decode(bytes(payload_a), B, out)
    assert torch.equal(out.view(torch.int16), block.view(torch.int16))


# ---- stored planes read in place --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_planes_are_read_in_place_and_their_damage_raises_with_out_untouched(dtype: torch.dtype) -> None:
    # Noise planes come out of zstd as raw blocks; decode reads them where they lie (no zstd
    # decoder), and checks their XXH64 itself: one flipped bit in a stored plane's content, in
    # a raw block's header or in the frame's checksum is an error, and `out` stays as it was.
    from storage.codec.zstd_frames import raw_block_segments as _raw_block_segments
    x = every_bit_pattern((30, 2, 16, 3, 64), dtype, seed=21)          # 180 KiB planes: 2 raw blocks each
    codec = Codec()
    payload = codec.encode(x, B)
    header = codec.check_header(payload)
    frames = codec.frames(payload)
    stored = [(f, size) for (f, size), p in zip(frames, header.planes) if not p.coded]
    assert stored and all(_raw_block_segments(f, size) is not None for f, size in stored)
    assert all(len(_raw_block_segments(f, size)) == 2 for f, size in stored)
    out = torch.zeros(x.numel(), dtype=dtype)
    assert torch.equal(codec.decode(payload, B, out=out).view(_INT[dtype]), x.view(_INT[dtype]))
    frame, size = stored[0]
    start = bytes(payload).index(bytes(frame))
    first_block = start + 4 + 1 + 4      # magic, descriptor, 4-byte content size (single segment)
    second_block = first_block + 3 + 128 * 1024
    for offset in (first_block + 3, first_block + 3 + 1000, second_block, second_block + 3 + 7,
                   start + len(frame) - 1, first_block):
        damaged = bytearray(payload)
        damaged[offset] ^= 0x04
        out.zero_()
        with pytest.raises(CodecError):
            codec.decode(bytes(damaged), B, out=out)
        assert not out.view(_INT[dtype]).any()


def test_a_frame_the_in_place_reader_does_not_know_goes_to_zstd() -> None:
    # An all-zero plane is an RLE block, a compressible one a compressed block: zstd decodes those.
    from storage.codec.zstd_frames import raw_block_segments as _raw_block_segments
    data = bytes(1000) + bytes(range(256)) * 8
    for level in (-5, 3):
        frame = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(data)
        assert _raw_block_segments(memoryview(frame), len(data)) is None
    noise = bytes(xxhash.xxh64(bytes([i])).digest()[j] for i in range(200) for j in range(8))
    raw = zstandard.ZstdCompressor(level=-5, write_checksum=True).compress(noise)
    assert b"".join(_raw_block_segments(memoryview(raw), len(noise))) == noise
    assert _raw_block_segments(memoryview(raw), len(noise) + 1) is None          # not the size asked
    assert _raw_block_segments(memoryview(raw + b"\0"), len(noise)) is None      # bytes after it
    unchecked = zstandard.ZstdCompressor(level=-5, write_checksum=False).compress(noise)
    assert _raw_block_segments(memoryview(unchecked), len(noise)) is None        # zstd's path refuses it


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_planes_are_written_as_raw_block_frames_that_zstd_reads_too(dtype: torch.dtype) -> None:
    # The encoder frames a noise plane itself (raw blocks around views of the plane, its XXH64);
    # the result is an ordinary zstd frame: zstd's own decoder reads it to the same bytes. A
    # plane of zeros (the low bytes of values that came from a narrower dtype) still goes to
    # zstd, which collapses it.
    from storage.codec.zstd_frames import raw_block_segments as _raw_block_segments
    x = every_bit_pattern((30, 2, 16, 3, 64), dtype, seed=31)
    codec = Codec()
    parts = codec.encode_parts(x, B)
    payload = b"".join(parts)
    assert payload == codec.encode(x, B)                      # the parts join to encode()'s bytes
    header = codec.check_header(payload)
    planes = byte_planes.split(x, header.dim1_major)
    for (frame, size), p, plane in zip(codec.frames(payload), header.planes, planes):
        if p.coded:
            continue
        assert _raw_block_segments(frame, size) is not None
        assert zstandard.ZstdDecompressor().decompress(bytes(frame)) == plane.tobytes()
    if dtype == torch.float32:
        widened = x.to(torch.bfloat16).to(torch.float32)     # its two low planes are all zero
        small = codec.encode(widened, B)
        assert len(small) < widened.numel() * 2 + 1024      # 2 of its 4 planes' bytes: the zeros took ~nothing
        assert torch.equal(codec.decode(small, B).view(torch.int32), widened.view(torch.int32))
