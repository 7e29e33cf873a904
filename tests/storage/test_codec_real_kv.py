"""Codec v4's compression ratio on real KV, the default model's own keys and values (and the raw
codec storing them as they are).

The one storage test that reaches up to the engine: random bytes do not compress and synthetic
values carry whatever exponent distribution the test writer guessed, so the ratio is measured
on what the disk tier will hold -- SmolLM2-135M-Instruct run through the Engine over the demo
document, its blocks read back from the device pool. A ratio, not a timing: deterministic for
a given model and text (tools/bench_codec.py measures speed).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard

from storage.codec.payload import Codec
from tieredkv import CacheConfig, Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
B = bytes(range(64))
# Issue 10's targets; measured here ~1.46, ~1.16, ~1.19 (docs/BENCHMARKS.md, "Codec v4").
TARGET = {torch.bfloat16: 1.40, torch.float16: 1.15, torch.float32: 1.15}


@pytest.fixture(scope="module")
def real_blocks(default_model) -> torch.Tensor:
    """float32 KV of 512 tokens of the demo document: 32 blocks of [30, 2, 16, 3, 64], computed
    in float32 (the session's model runs in bfloat16 on a CPU with native bf16, whose KV has only
    bf16's 8 mantissa bits: every other dtype's ratio would be measured on rounded values)."""
    import copy
    import dataclasses

    from engine.model import model_identity
    model = copy.deepcopy(default_model.model).to(torch.float32)
    fp32 = dataclasses.replace(default_model, model=model, dtype=torch.float32,
                               identity=model_identity(default_model.identity.name, model.config, torch.float32))
    # exact_hits=False: the pool then holds the prompt's 32 KV blocks only, not its logits block
    # (a ratio of KV, not of logits; the exact entry's blocks are stored as any, tested elsewhere).
    # calibrate=False: the start's timing passes (7 forwards of the real model in float32, several
    # seconds on 2 cores) only plan hits, and this engine serves one miss (tests/engine/
    # test_calibration.py tests the calibration).
    engine = Engine.from_loaded(fp32, CacheConfig(device_memory="64MiB", host_memory=0, disk_dir=None,
                                                  calibrate=False), exact_hits=False)
    try:
        ids = engine.tokenizer((ROOT / "tieredkv" / "demo_document.txt").read_text())["input_ids"][:512]
        assert len(ids) == 512
        engine.generate(ids, SamplingParams(max_tokens=1))
        pages = sorted(engine.cache.pool.cached_pages())
        assert len(pages) == 32
        return engine.cache.pool.kv[pages].float().cpu()
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", list(TARGET))
def test_v4_ratio_on_real_kv_meets_the_target_and_beats_v3(real_blocks: torch.Tensor, dtype: torch.dtype) -> None:
    blocks = real_blocks.to(dtype)
    codec = Codec()
    payloads = [codec.encode(b, B) for b in blocks]
    for p, b in zip(payloads, blocks):
        assert torch.equal(codec.decode(p, B).view(torch.uint8), b.view(torch.uint8))
    raw = blocks.numel() * blocks.element_size()
    ratio = raw / sum(len(p) for p in payloads)
    # What format 3 stored by default: zstd level 3 over the whole block.
    v3 = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    v3_ratio = raw / sum(len(v3.compress(b.reshape(-1).view(torch.uint8).numpy())) for b in blocks)
    assert ratio >= TARGET[dtype], (dtype, ratio)
    assert ratio >= 1.05 * v3_ratio, (dtype, ratio, v3_ratio)
    # Only the sign/exponent plane is coded; the stored planes stay within a frame's overhead.
    header = codec.check_header(payloads[0])
    plane = blocks[0].numel()
    assert [p.coded for p in header.planes] == [False] * (blocks.element_size() - 1) + [True]
    assert all(p.length <= plane + 64 for p in header.planes if not p.coded)


@pytest.mark.parametrize("dtype", list(TARGET))
def test_the_raw_codec_stores_real_kv_as_it_is(real_blocks: torch.Tensor, dtype: torch.dtype) -> None:
    # The raw codec's payload is the header and the bytes as they are -- nothing compressed,
    # nothing framed, nothing to decode.
    blocks = real_blocks.to(dtype)
    for b in blocks:
        payload = Codec(kind="raw").encode(b, B)
        header = Codec().check_header(payload)
        assert not header.shuffled and len(header.planes) == 1
        assert len(payload) - header.header_size == header.raw_size
        assert torch.equal(Codec().decode(payload, B).view(torch.uint8), b.view(torch.uint8))


# The nibble codec's targets on real KV (issue 38: >= 1.25x fewer bytes on bf16); measured here
# ~1.33 (bf16), ~1.14 (fp32). fp16's top byte holds mantissa bits: its 15 commonest values cover
# under half the elements, so the plane is stored, never grown.
NIBBLE_TARGET = {torch.bfloat16: 1.25, torch.float32: 1.10, torch.float16: 1.0}


@pytest.mark.parametrize("dtype", list(NIBBLE_TARGET))
def test_the_nibble_codec_codes_real_kv_to_its_target(real_blocks: torch.Tensor, dtype: torch.dtype) -> None:
    blocks = real_blocks.to(dtype)
    payloads = [Codec(kind="nibble").encode(b, B) for b in blocks]
    for p, b in zip(payloads, blocks):
        assert torch.equal(Codec().decode(p, B).view(torch.uint8), b.view(torch.uint8))
    raw = blocks.numel() * blocks.element_size()
    stored = sum(len(p) - Codec().check_header(p).header_size for p in payloads)
    assert raw / stored >= NIBBLE_TARGET[dtype], (dtype, raw / stored)
    coded = [Codec().check_header(p).planes[-1].coded for p in payloads]
    assert coded == [dtype != torch.float16] * len(blocks), coded
