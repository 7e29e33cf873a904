"""Codec v4 (byte planes) against v3 (one zstd frame), on real KV, beside the limits of the same bytes.

Knows: how to get real KV blocks (the default model, SmolLM2-135M-Instruct, run through the
project's Engine over tieredkv/demo_document.txt tiled to --tokens tokens; the blocks are read
back from the engine's device pool, `[30 layers, 2, 16 tokens, 3 kv heads, 64]` each), how to
write format-3 payloads as the previous build did (a reference writer, checked against the
golden fixtures in tests/fixtures/), and how to time, one thread, the same blocks through:

    row          encode                                    decode (into a warm tensor per block)
    v3           the v3 writer: zstd --level of the whole   Codec.decode of the v3 payload: header
                 block (v3's default, no shuffle)           crc, zstd, copy into the tensor
    v3-shuffle   the same over byte-shuffled bytes (the     Codec.decode: header crc, zstd,
                 opt-in CacheConfig(shuffle=True) of v3)    unshuffle into the tensor
    v4           Codec.encode: byte planes, top plane        Codec.decode: header + coded crc,
                 coded, the others stored                   zstd of each plane, join into the tensor

and the limits, on the same bytes and buffers: memcpy (torch copy_ of each block into its warm
tensor) and the bare zstd decompress of each format's frames (zstd's one-shot decompress, the
call the codec makes, output dropped: no header, crc, join or copy). MB/s count raw block bytes.
Ratio = raw bytes / payload bytes, headers (64-byte binding) included. Every round runs every row
and limit back to back, in alternating order, so load from other processes hits them alike; the
best of --repeat rounds is kept. Each dtype is the model run in that dtype (--cast: one float32
run, its KV cast; same exponents, faster on a CPU).

Also per plane: what each byte plane codes to alone (the v4 coded compressor), in token-major
and dim-1-major order -- the measurement behind which planes v4 codes.

Also the raw codec (the bytes as they are) and the nibble codec (the top plane as 4-bit codes
into a table: storage/codec/nibble.py), beside the nibble kernel alone on the same planes.

Targets (issue 10): ratio >= 1.40 (bf16) and >= 1.15 (fp16, fp32); v4 decode no slower than v3.
Issue 38: nibble's ratio >= 1.25 (bf16).

    python tools/bench_codec.py [--tokens 3072] [--repeat 5] [--level 3] [--dtypes bfloat16,float16,float32]
                                [--cast] [--json]
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import zlib
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note  # noqa: E402  (a sibling script)
from storage.codec import byte_planes, nibble  # noqa: E402
from storage.codec.payload import CODED_PLANES, Codec
from storage.config import CacheConfig
from storage.layout import dtype_from_name

ROOT = Path(__file__).resolve().parent.parent
BINDING = bytes(range(64))        # the disk tier binds each payload to block hash || namespace (64 bytes)
TARGET_RATIO = {"bfloat16": 1.40, "float16": 1.15, "float32": 1.15}
ROWS = ("v3", "v3-shuffle", "v4", "raw", "nibble")
# The nibble codec's ratio target on real KV (issue 38: >= 1.25x fewer bytes, bf16); fp16's top
# byte is stored as is (its 15 commonest values cover under half the elements).
NIBBLE_RATIO = {"bfloat16": 1.25, "float16": 1.0, "float32": 1.10}


# ---- the format-3 writer, as the previous build wrote it ----------------------------------------

_V3_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}   # storage/codec/header.py's codes


def encode_v3(block: torch.Tensor, binding: bytes, level: int, shuffle: bool, cctx: zstandard.ZstdCompressor) -> bytes:
    """A format-3 payload (storage/codec/header.py's docstring): header, crc32 of it, one zstd frame."""
    raw = byte_planes.split(block).reshape(-1) if shuffle else block.reshape(-1).view(torch.uint8).numpy()
    frame = cctx.compress(raw)
    name = str(block.dtype).removeprefix("torch.")
    header = (struct.pack("<4sBBBbB", b"TKVB", 3, 1 if shuffle else 0, _V3_DTYPE_CODES[name], level, block.dim())
              + struct.pack(f"<{block.dim()}I", *block.shape) + struct.pack("<Q", raw.size)
              + bytes((len(binding),)) + binding)
    return header + struct.pack("<I", zlib.crc32(header)) + frame


def v3_writer_matches_fixtures() -> bool:
    """Whether encode_v3 reproduces the golden v3 payloads byte for byte (same zstd library)."""
    fixtures = ROOT / "tests" / "fixtures"
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    for stem, dtype, shuffle in (("codec_v3_bfloat16_shuffled", torch.bfloat16, True),
                                 ("codec_v3_float16", torch.float16, False),
                                 ("codec_v3_float32_shuffled", torch.float32, True)):
        raw = bytearray((fixtures / f"{stem}.raw").read_bytes())
        block = torch.frombuffer(raw, dtype=dtype).reshape(2, 2, 4, 2, 8)
        if encode_v3(block, BINDING, 3, shuffle, cctx) != (fixtures / f"{stem}.tkvb").read_bytes():
            return False
    return True


# ---- real KV -------------------------------------------------------------------------------------

def real_kv(dtype: str, tokens: int) -> torch.Tensor:
    """[n_blocks, *block shape] KV of the default model run in `dtype` over the demo document,
    read back from the engine's device pool (every full block of the prompt)."""
    from tieredkv import Engine, SamplingParams

    engine = Engine.from_pretrained(cache=CacheConfig(device_memory="2GiB", host_memory=0, disk_dir=None),
                                    device="cpu", dtype=dtype)
    try:
        text = (ROOT / "tieredkv" / "demo_document.txt").read_text()
        ids = engine.tokenizer(text)["input_ids"]
        prompt = (ids * (tokens // len(ids) + 1))[:tokens]
        engine.generate(prompt, SamplingParams(max_tokens=1))
        pages = sorted(engine.cache.pool.cached_pages())
        return engine.cache.pool.kv[pages].clone()
    finally:
        engine.close()


# ---- one dtype -----------------------------------------------------------------------------------

def best_of(times: dict[str, list[float]], key: str, t: float) -> None:
    times.setdefault(key, []).append(t)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_dtype(blocks: torch.Tensor, level: int, repeat: int) -> dict:
    n_blocks = blocks.shape[0]
    raw_bytes = blocks.numel() * blocks.element_size()
    codec = Codec(level=level)
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    dctx = zstandard.ZstdDecompressor()
    outs = torch.zeros_like(blocks)          # a warm tensor per block, as pages are
    encoders = {
        "v3": lambda b: encode_v3(b, BINDING, level, False, cctx),
        "v3-shuffle": lambda b: encode_v3(b, BINDING, level, True, cctx),
        "v4": lambda b: codec.encode(b, BINDING),
        "raw": lambda b: Codec(kind="raw").encode(b, BINDING),
        "nibble": lambda b: Codec(kind="nibble").encode(b, BINDING),
    }
    payloads = {row: [enc(b) for b in blocks] for row, enc in encoders.items()}
    frames = {row: [f for p in ps for f, _ in codec.frames(p)] for row, ps in payloads.items()}
    for row, ps in payloads.items():     # every payload decodes, bit for bit, through the real reader
        for p, out in zip(ps, outs):
            codec.decode(p, BINDING, out=out)
        assert torch.equal(outs.view(torch.uint8), blocks.view(torch.uint8)), row
        outs.zero_()

    def encode(row: str) -> None:
        enc = encoders[row]
        for b in blocks:
            enc(b)

    def decode(row: str) -> None:
        for p, out in zip(payloads[row], outs):
            codec.decode(p, BINDING, out=out)

    def memcpy() -> None:
        for b, out in zip(blocks, outs):
            out.copy_(b)

    def zstd_only(row: str) -> None:
        for f in frames[row]:
            dctx.decompress(f)

    # The nibble kernel alone on each block's planes (no header, hash, binding or tensor): the
    # format's own work, the nibble row's limit as bare zstd is v4's.
    itemsize = blocks.element_size()
    planes = []
    for b, p in zip(blocks, payloads["nibble"]):
        h = codec.check_header(p)
        n, at = h.numel, h.header_size
        low = [memoryview(p)[at + i * n:at + (i + 1) * n] for i in range(itemsize - 1)]
        top = memoryview(p)[at + (itemsize - 1) * n:]
        planes.append((top if h.planes[-1].coded else None, low, None if h.planes[-1].coded else top))
    flat_outs = [o.reshape(-1).view(torch.uint8).numpy() for o in outs]

    def nibble_only() -> None:
        for (coded, low, top), out in zip(planes, flat_outs):
            nibble.decode(coded, low, top, out, itemsize)

    steps = [(f"encode {r}", lambda r=r: encode(r)) for r in ROWS] + \
            [(f"decode {r}", lambda r=r: decode(r)) for r in ROWS] + \
            [("memcpy", memcpy), ("nibble kernel", nibble_only)] + \
            [(f"zstd {r}", lambda r=r: zstd_only(r)) for r in ("v3", "v4")]
    times: dict[str, list[float]] = {}
    for i in range(repeat):
        for name, fn in (steps if i % 2 == 0 else steps[::-1]):
            best_of(times, name, timed(fn))
    mbps = {k: raw_bytes / min(v) / 1e6 for k, v in times.items()}
    rows = {r: {"ratio": raw_bytes / sum(len(p) for p in payloads[r]),
                "encode_mbps": mbps[f"encode {r}"], "decode_mbps": mbps[f"decode {r}"]} for r in ROWS}
    limits = {"memcpy_mbps": mbps["memcpy"], "zstd_v3_frames_mbps": mbps["zstd v3"], "zstd_v4_frames_mbps": mbps["zstd v4"],
              "nibble_kernel_mbps": mbps["nibble kernel"]}
    return {"blocks": n_blocks, "block_bytes": blocks[0].numel() * blocks.element_size(), "rows": rows,
            "limits": limits, "planes": plane_report(blocks, level)}


def plane_report(blocks: torch.Tensor, level: int) -> list[dict]:
    """Per byte plane: coded size / plane size with v4's coded compressor, token-major and
    dim-1-major (the latter with v4's block cuts), and whether v4 codes it."""
    from storage.codec.zstd_frames import block_cuts as _block_cuts, compress_coded as _compress_coded

    size = blocks.element_size()
    shape = tuple(blocks.shape[1:])
    coded = [[0, 0] for _ in range(size)]
    for b in blocks:
        for order, swapped in enumerate((False, True)):
            planes = byte_planes.split(b, swapped)
            cuts = _block_cuts(shape, swapped)
            for p in range(size):
                coded[p][order] += len(_compress_coded(planes[p], level, cuts))
    n = blocks.numel()   # bytes in each plane, over all blocks
    return [{"plane": p, "coded_by_v4": p in CODED_PLANES[size], "token_major": coded[p][0] / n,
             "dim1_major": coded[p][1] / n} for p in range(size)]


# ---- report --------------------------------------------------------------------------------------

def print_table(res: dict) -> None:
    cfg = res["config"]
    print(f"Codec v3 vs v4 on real KV of {cfg['model']} ({cfg['tokens']} tokens of demo_document.txt, "
          f"{'float32 KV cast' if cfg['cast'] else 'model run in each dtype'}), zstd level {cfg['level']}, "
          f"one thread, best of {cfg['repeat']}; MB/s of raw block bytes")
    print(f"{'dtype':<9} {'row':<11} {'ratio':>6} {'encode MB/s':>12} {'decode MB/s':>12}   target")
    for dtype, d in res["dtypes"].items():
        for row, r in d["rows"].items():
            target = ""
            if row == "v4":
                ok_ratio = r["ratio"] >= TARGET_RATIO[dtype]
                ok_dec = r["decode_mbps"] >= d["rows"]["v3"]["decode_mbps"]
                target = (f"ratio >= {TARGET_RATIO[dtype]:.2f} {'met' if ok_ratio else 'MISSED'}; "
                          f"decode >= v3 {'met' if ok_dec else 'MISSED'} "
                          f"({r['decode_mbps'] / d['rows']['v3']['decode_mbps']:.2f}x)")
            elif row == "nibble":
                ok_ratio = r["ratio"] >= NIBBLE_RATIO[dtype]
                target = (f"ratio >= {NIBBLE_RATIO[dtype]:.2f} {'met' if ok_ratio else 'MISSED'}; decode "
                          f"{r['decode_mbps'] / d['rows']['v4']['decode_mbps']:.2f}x v4's, "
                          f"{r['decode_mbps'] / d['limits']['memcpy_mbps']:.2f}x memcpy, "
                          f"{r['decode_mbps'] / d['limits']['nibble_kernel_mbps']:.2f}x its kernel")
            print(f"{dtype:<9} {row:<11} {r['ratio']:>6.3f} {r['encode_mbps']:>12.0f} {r['decode_mbps']:>12.0f}   {target}")
        lim = d["limits"]
        print(f"{dtype:<9} {'limits':<11} {'':>6} {'':>12} {'':>12}   memcpy {lim['memcpy_mbps']:.0f}, "
              f"bare zstd of v3's frames {lim['zstd_v3_frames_mbps']:.0f}, of v4's frames {lim['zstd_v4_frames_mbps']:.0f}, "
              f"nibble kernel {lim['nibble_kernel_mbps']:.0f}")
    print()
    print("Per byte plane, coded alone with v4's coded compressor (size / plane size): token-major, dim-1-major")
    for dtype, d in res["dtypes"].items():
        cells = [f"plane {p['plane']}{'*' if p['coded_by_v4'] else ''} {p['token_major']:.3f}, {p['dim1_major']:.3f}"
                 for p in d["planes"]]
        print(f"  {dtype:<9} " + "; ".join(cells) + "   (* = coded by v4)")
    print(f"\nv3 writer reproduces the golden v3 fixtures: {res['v3_writer_matches_fixtures']}")
    print(f"machine: {res['machine']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3072, help="prompt tokens (the demo document, tiled); 16 per block")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best of them is reported")
    ap.add_argument("--level", type=int, default=3, help="zstd level (v3's frame, v4's coded plane)")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--cast", action="store_true", help="one float32 run, its KV cast to each dtype (faster on a CPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in TARGET_RATIO:
            ap.error(f"--dtypes: unknown dtype {d!r}")
    if args.tokens < 16 or args.repeat < 1:
        ap.error("--tokens: expected >= 16; --repeat: expected >= 1")
    Codec(level=args.level)   # validates the level
    torch.set_num_threads(1)  # one thread: the codec's own speed (the disk tier decodes on several)

    base = real_kv("float32", args.tokens) if args.cast else None
    results = {}
    for d in dtypes:
        blocks = base.to(dtype_from_name(d)) if base is not None else real_kv(d, args.tokens)
        results[d] = bench_dtype(blocks, args.level, args.repeat)
        if not args.json:
            print(f"{d} done", file=sys.stderr)
    res = {"dtypes": results, "v3_writer_matches_fixtures": v3_writer_matches_fixtures(),
           "config": {"model": "SmolLM2-135M-Instruct", "tokens": args.tokens, "level": args.level,
                      "repeat": args.repeat, "cast": args.cast, "threads": 1,
                      "target_ratio": TARGET_RATIO},
           "machine": machine_note()}
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
