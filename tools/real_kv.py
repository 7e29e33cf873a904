"""Real KV blocks for the tier benchmarks: the default model (SmolLM2-135M-Instruct, or `model`)
run on the CPU over real prose (written for this benchmark, tiled) in 512-token forwards, its
past_key_values restacked into the block layout `[num_layers, 2, block_size, num_kv_heads,
head_dim]`, fp32. Knows nothing of tiers or timing; tools/bench_tiers.py (which re-exports
real_kv_blocks for its siblings), tools/bench_peers.py and tools/bench_write_pool.py use it.

A larger model's shape (tools/bench_peers.py --shape llama8b: 32 layers, 8 KV heads, 128 dims) is
filled with the default model's real values by `widen_kv`: each source block is cut into its
per-(layer, head) slices `[2, tokens, head_dim]` (K and V of one head over the block's tokens), and
each wider block takes the next slices in order (source block, layer, head), a wider head being
consecutive source heads side by side along its dims. So every value is a real K or V value, the
slices of one wider block are all different (no repeat inside a block for a compressor to find),
and a wider block needs about need/give source blocks (llama8b: 512 slices / 90 = 5.7). What it
does not have: a real 8B model's statistics across heads and layers (its outliers, its rotary
over 128 dims); compression ratios on it are the default model's, not an 8B model's.
"""
from __future__ import annotations

import math

import torch

from storage.layout import BlockLayout

CHUNK_TOKENS = 512          # tokens per forward: KV of longer forwards is no different, only slower here

# Real prose, written for this benchmark. Consecutive 512-token windows of the tiled text start
# at different places in it, so every block's KV differs.
PROSE = """\
The ferry across the estuary ran every forty minutes in summer and twice a day in winter, and
the timetable was painted by hand on a board beside the slipway. When the tide was very low
the boat could not reach the concrete ramp, so passengers walked the last stretch on planks
laid over the mud, carrying their shoes, while the ferryman apologised as if he had personally
arranged the moon. Nobody complained much. The alternative was a drive of two hours around the
head of the water, past the paper mill and through three towns that all claimed to have the
oldest bridge in the county.

In the middle of the crossing there is a point where neither shore seems closer than the
other. Gulls follow the boat to that point and then turn back, as though an agreement had been
made long ago about whose birds belong where. Children are told to watch for seals there, and
sometimes one appears, a round grey head that looks at the boat with the patience of an old
man waiting for a bus, then sinks without a ripple.

The ferryman kept a notebook in which he recorded the weather, the number of passengers, and
anything he found on the deck after the last run of the day: gloves, a library book, a bag of
apples, once a violin in a case with no name on it. Most things were collected within a week.
The violin stayed on the shelf in the ticket hut for eleven years, until a woman came to ask
for it, explaining that her father had left it there on purpose, hoping that whoever found it
would learn to play. Nobody had. She took it home and, the ferryman said, looked relieved.

Plans for a bridge were drawn up more than once. Engineers arrived with instruments on
tripods, measured the channel, drilled into the bed of the river and went away again. Each
time the cost came out higher than the year before, and each time the council decided that
the ferry would do for now. The drawings are kept in the town archive, where anyone can look
at them: elegant arches that were never built, spanning water that still has to be crossed
slowly, at the speed of a small diesel engine and the patience of the tide.

When the old boat was finally replaced, the new one was faster, warmer and painted a bright
blue that people disliked at first and then defended fiercely against visitors who called it
ugly. The notebook continued in the same hand. Its last entries are mostly about the weather,
the way the light falls on the mud flats in October, and the names of regular passengers who
no longer travel, written in a short list at the back with the dates of their final crossings.
"""



@torch.inference_mode()
def real_kv_blocks(n_blocks: int, block_size: int = 16,
                   model: str | None = None) -> tuple[BlockLayout, torch.Tensor, list[int]]:
    """(fp32 layout, [n_blocks, *layout.shape] fp32 KV, the token ids it covers), computed on
    the CPU by `model` (None: the default model; a random-weight copy of its shape times the
    same, but its KV compresses like noise, so ratios from it do not hold)."""
    from engine.model import kv_layout, load_model

    loaded = load_model(model, device="cpu", dtype="float32")
    layout = kv_layout(loaded, block_size)
    base = loaded.tokenizer(PROSE)["input_ids"]
    need = n_blocks * block_size
    stream = (base * (need // len(base) + 1))[:need]
    blocks = torch.empty((n_blocks, *layout.shape), dtype=torch.float32)
    b = 0
    for start in range(0, need, CHUNK_TOKENS):
        ids = stream[start:start + CHUNK_TOKENS]
        out = loaded.model(input_ids=torch.tensor([ids]), use_cache=True)
        # Per layer: keys/values [1, kv_heads, seq, head_dim] -> [layers, 2, seq, kv_heads, head_dim]
        kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in out.past_key_values.layers])
        kv = kv.permute(0, 1, 3, 2, 4)
        for s in range(0, len(ids), block_size):
            blocks[b].copy_(kv[:, :, s:s + block_size])
            b += 1
    return layout, blocks, stream


def source_blocks_for(n_blocks: int, src: BlockLayout, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """How many blocks of layout `src` `widen_kv` needs to fill n_blocks of the wider shape."""
    if head_dim % src.head_dim:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the source's {src.head_dim}")
    need = num_layers * num_kv_heads * (head_dim // src.head_dim)
    return math.ceil(n_blocks * need / (src.num_layers * src.num_kv_heads))


def widen_kv(src_blocks: torch.Tensor, n_blocks: int, num_layers: int, num_kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """[n_blocks, num_layers, 2, tokens, num_kv_heads, head_dim] filled with the real values of
    `src_blocks` ([m, layers, 2, tokens, kv_heads, d], m >= source_blocks_for(...)), slice by
    slice as the module docstring says; the values are copied, never computed."""
    m, layers, two, tokens, heads, d = src_blocks.shape
    per_head = head_dim // d
    need = num_layers * num_kv_heads * per_head
    total = n_blocks * need
    # [m, layers, 2, tokens, heads, d] -> slices [m * layers * heads, 2, tokens, d], in (block, layer, head) order
    slices = src_blocks.permute(0, 1, 4, 2, 3, 5).reshape(m * layers * heads, two, tokens, d)
    if slices.shape[0] < total:
        raise ValueError(f"{m} source blocks give {slices.shape[0]} slices; {n_blocks} blocks need {total}")
    # [n, layers', heads', per_head, 2, tokens, d] -> [n, layers', 2, tokens, heads', per_head * d]
    out = slices[:total].reshape(n_blocks, num_layers, num_kv_heads, per_head, two, tokens, d)
    out = out.permute(0, 1, 4, 5, 2, 3, 6)
    return out.reshape(n_blocks, num_layers, two, tokens, num_kv_heads, head_dim).contiguous()
