"""tools/real_kv.widen_kv fills a wider KV shape (tools/bench_peers.py --shape llama8b) with the
source blocks' values, slice by slice: every (layer, head, half) of a wider block is one source
head's K and V over the block's tokens, taken in (source block, layer, head) order, none repeated
inside a block. Random source values stand in for the model's (nothing is computed here)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from real_kv import source_blocks_for, widen_kv  # noqa: E402  (tools/ is not a package)
from storage.layout import BlockLayout  # noqa: E402

SRC = BlockLayout(30, 16, 3, 64, torch.float32)       # the default model's block


def test_source_blocks_for_llama8b():
    # A [32, 2, 16, 8, 128] block takes 32 * 8 * 2 = 512 head slices; a source block gives 30 * 3 = 90.
    assert source_blocks_for(1, SRC, 32, 8, 128) == 6
    assert source_blocks_for(64, SRC, 32, 8, 128) == 365
    with pytest.raises(ValueError):
        source_blocks_for(1, SRC, 32, 8, 96)          # not a multiple of 64 dims


def test_every_slice_is_the_next_source_head():
    n = 2
    m = source_blocks_for(n, SRC, 32, 8, 128)
    src = torch.randn((m, *SRC.shape), generator=torch.Generator().manual_seed(0))
    out = widen_kv(src, n, 32, 8, 128)
    assert out.shape == (n, 32, 2, 16, 8, 128) and out.is_contiguous()
    seen = set()
    for b in range(n):
        for layer in range(32):
            for h in range(8):
                for half in range(2):
                    i = ((b * 32 + layer) * 8 + h) * 2 + half
                    sb, rest = divmod(i, 30 * 3)
                    sl, sh = divmod(rest, 3)
                    got = out[b, layer, :, :, h, half * 64:(half + 1) * 64]           # [2, tokens, 64]
                    assert torch.equal(got, src[sb, sl, :, :, sh]), (b, layer, h, half)
                    seen.add((b, sb, sl, sh))
    assert len(seen) == n * 32 * 8 * 2           # no source slice twice inside a block (nor across these)


def test_too_few_source_blocks_is_an_error():
    src = torch.zeros((5, *SRC.shape))
    with pytest.raises(ValueError):
        widen_kv(src, 1, 32, 8, 128)
