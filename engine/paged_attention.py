"""Paged attention for transformers models: reads and writes KV in our device page pool.

Knows: how one forward pass over a packed batch (the new tokens of several sequences, laid out
in one row) maps onto pages -- where each new token's K/V is written (page, slot), and which
pages hold each sequence's context. Registered with `transformers.AttentionInterface` under
ATTN_NAME; the model's forward passes a `PagedBatch` through as the `tkv_batch` keyword
argument, which transformers hands to every attention call. Doesn't know: scheduling, the
tiers, or sampling.

Per layer: write the new K/V into their slots, then each group of sequences (engine/paged_batch.py:
decodes together, prefill chunks grouped by context length) attends through the batch's
backend (engine/attention_backends.py).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.paged_batch import PagedBatch

ATTN_NAME = "tieredkv_paged"


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            tkv_batch: PagedBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, D], key/value [1, kv_heads, T, D] (RoPE applied) -> [1, T, heads, D]."""
    if tkv_batch is None:
        # Not driven by our engine (e.g. plain model.generate): behave like SDPA.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch = tkv_batch
    layer = module.layer_idx
    kv = batch.kv
    # Write the new tokens' K/V into their (page, slot); the pool layout is
    # [page, layer, k/v, slot, kv_head, head_dim].
    k_new = key[0].transpose(0, 1).to(kv.dtype)     # [T, kv_heads, D]
    v_new = value[0].transpose(0, 1).to(kv.dtype)
    kv[batch.write_pages, layer, 0, batch.write_slots] = k_new
    kv[batch.write_pages, layer, 1, batch.write_slots] = v_new

    q_all = query[0].transpose(0, 1)                  # [T, heads, D]
    out = torch.empty_like(q_all)
    for g, prepared in zip(batch.groups, batch.prepared):
        o = batch.backend.attend(q_all, kv, layer, g, prepared, scaling)    # [S * Q, heads, D]
        out.index_copy_(0, g.out_rows, o.index_select(0, g.res_rows))
    return out.unsqueeze(0), None


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name.

    The SDPA mask is registered under our name too: without it transformers builds no mask
    for a custom attention, and the SDPA fallback (the model run outside the engine, e.g. with
    a DynamicCache and several new tokens) would attend wrongly. Our paged path ignores it.
    """
    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
