"""Attention backends: how one group of sequences attends to its context in the page pool.

Knows: two ways to compute attention for a group (S sequences, Q queries padded, C keys):
- `gather_sdpa` (the default everywhere, and the CPU path): gather each sequence's context from
  its pages into [S, C] contiguous K/V per layer and run SDPA with a causal mask. Simple, exact,
  but it copies the whole context per layer per step. On CUDA it calls SDPA in a form a fused
  kernel accepts (`fused`): torch 2.13 runs a boolean mask with enable_gqa only in its math
  kernel (flash takes no mask, memory-efficient no GQA), which materializes fp32 scores.
- `flex_paged` (`torch.nn.attention.flex_attention`, engine/flex_paged.py): reads the pool in
  place through a block mask of each sequence's pages; compiled on CUDA for a bounded set of
  shapes at engine start. On CPU it runs too (eagerly, slower than gather_sdpa there, so it is
  never the CPU default).
Each backend's `prepare` runs once per forward pass (device ops only, no host sync) and its
`attend` once per layer per group. Doesn't know: scheduling, tiers, or how groups are formed
(engine/paged_batch.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.flex_paged import FlexPaged
from engine.paged_batch import Group, PagedBatch
from storage.device_pool import DevicePool
from storage.layout import BlockLayout

log = logging.getLogger(__name__)

BACKENDS = ("gather_sdpa", "flex_paged")


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: PagedBatch, g: Group) -> Any: ...

    def attend(self, q_all: torch.Tensor, kv: torch.Tensor, layer: int, g: Group, prepared: Any,
               scaling: float | None) -> torch.Tensor:
        """q_all [T, heads, D] -> the group's output [S * Q, heads, D] (padded rows included)."""
        ...


@dataclass(frozen=True)
class _Gather:
    pages: torch.Tensor        # [S * ceil(C / block)] each sequence's pages in order (padded with 0)
    mask: torch.Tensor         # [S, 1, Q, C] True = attend
    folded: dict = field(default_factory=dict)   # fused form: (G, dtype) -> additive mask, built by layer 0


def _query_rows(g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, Q] absolute position of each query, and whether it is a real (unpadded) query."""
    j = torch.arange(g.max_q, device=g.q_len.device)
    return g.q_first[:, None] + j[None, :], j[None, :] < g.q_len[:, None]


def _flash_accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's flash kernel takes this GQA call with no mask (CUDA, fp16/bf16, head dim
    <= 256, sm80+): torch's own predicate, no device work. is_causal False, as CausalBias asks
    before it calls the flash op with lower-right causality (nn/attention/bias.py)."""
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))


class GatherSDPA:
    """`fused`: call SDPA in a form CUDA's fused kernels take (None: on CUDA only). torch 2.13's
    dispatch (aten/.../cuda/sdp_utils.cpp) gives flash no mask and memory-efficient no GQA, so a
    boolean mask with enable_gqa runs the math kernel: fp32 scores [S, heads, Q, C] per layer.
    The fused form: a one-sequence group is a lower-right causal square or band with no padding,
    so it goes to flash with GQA and no mask at all; any other group folds each KV head's G query
    heads onto the query axis ([S, kv_heads, G * Q, D]), so K/V stay at kv_heads (no expansion, no
    enable_gqa) and the mask becomes an additive one in q's dtype with 16-aligned rows, built once
    per pass (G-fold, by the first layer) -- what memory-efficient takes with no copy per layer.
    The CPU path keeps the plain call (measured; the fused form is only checked there in tests)."""
    name = "gather_sdpa"

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def prepare(self, batch: PagedBatch, g: Group) -> _Gather:
        C = g.max_context
        pos = torch.arange(C, device=g.block_table.device)
        q_pos, q_real = _query_rows(g)
        # Query j sits at absolute position q_first + j and sees keys 0..q_first + j (causal).
        mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < g.context_len[:, None, None])
        mask &= q_real[:, :, None]
        mask |= (~q_real)[:, :, None] & (pos == 0)[None, None, :]   # padded rows attend to one key: no NaN
        return _Gather(g.block_table.reshape(-1), mask.unsqueeze(1))

    @staticmethod
    def gather(kv: torch.Tensor, layer: int, which: int, g: Group, pages: torch.Tensor) -> torch.Tensor:
        """[S, C, kv_heads, D]: the group's context of one layer's K (0) or V (1), copied a whole
        page at a time (index_select of [block, kv_heads, D] slabs; ~5x faster on the CPU than
        indexing every position by page and slot). Positions past a sequence's context come
        from its padding pages: the mask never attends to them."""
        slabs = kv[:, layer, which].index_select(0, pages)        # [S * pages, B, kv_heads, D]
        S, C = g.size, g.max_context
        return slabs.view(S, -1, *slabs.shape[2:])[:, :C]

    def attend(self, q_all, kv, layer, g, prepared: _Gather, scaling):
        k = self.gather(kv, layer, 0, g, prepared.pages)        # [S, C, kv_heads, D]
        v = self.gather(kv, layer, 1, g, prepared.pages)
        q = q_all[g.q_index]                                       # [S, Q, heads, D]
        fused = self.fused if self.fused is not None else q.device.type == "cuda"
        if fused:
            return self._attend_fused(q, k.to(q.dtype), v.to(q.dtype), g, prepared, scaling)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=prepared.mask, scale=scaling, enable_gqa=True)   # [S, heads, Q, D]
        S, H, Q, D = o.shape
        return o.transpose(1, 2).reshape(S * Q, H, D)

    def _attend_fused(self, q, k, v, g: Group, prepared: _Gather, scaling) -> torch.Tensor:
        S, Q, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if S == 1 and self._flash_ok(q, k, v):
            # One sequence: Q = its new tokens, C = its context, q_first = C - Q; the mask is
            # exactly causal aligned to the lower right (no padded rows or keys).
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Q, g.max_context),
                                               scale=scaling, enable_gqa=True)   # [1, heads, Q, D]
            return o.transpose(1, 2).reshape(Q, H, D)
        # Query head h reads KV head h // G (torch's and transformers' GQA order).
        qf = q.reshape(S, H_kv, G, Q, D).reshape(S, H_kv, G * Q, D)
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=self._folded_mask(prepared, G, q.dtype),
                                           scale=scaling)          # [S, kv_heads, G * Q, D]
        return o.view(S, H_kv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(S * Q, H, D)

    @staticmethod
    def _flash_ok(q, k, v) -> bool:
        return _flash_accepts(q, k, v)

    @staticmethod
    def _folded_mask(prepared: _Gather, G: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, G * Q, C] additive (0 / -inf) in q's dtype: row g * Q + j is query j's mask.
        Rows padded to 16 elements so SDPA's memory-efficient path neither converts nor pads it
        per layer (attention.cpp preprocess_mask: strides must be multiples of 8)."""
        m = prepared.folded.get((G, dtype))
        if m is None:
            S, _, Q, C = prepared.mask.shape
            Cp = -(-C // 16) * 16
            buf = torch.full((S, G, Q, Cp), float("-inf"), dtype=dtype, device=prepared.mask.device)
            buf[..., :C].masked_fill_(prepared.mask, 0.0)          # broadcast over the G query heads
            m = buf.view(S, 1, G * Q, Cp)[..., :C]
            prepared.folded[(G, dtype)] = m
        return m


GATHER_SDPA = _GATHER = GatherSDPA()


# The most KV elements flex_paged's kernels address from one layer's view of the pool: its Triton
# kernels index K/V with 32-bit offsets. The H200 run of 2026-11-26 (torch 2.11) hit "an illegal
# memory access" with a 16 GiB and a 24 GiB bf16 page-major pool of the Llama-3.1-8B shape (8.7G
# and 12.9G elements: page-major, a layer's view spans the whole pool) where 2 GiB pools (1.1G) ran
# right. So a pool past it is laid out layer-major (storage/device_pool.py): a layer's view spans
# its own region, 1/L of the pool (403M elements at 24 GiB), and flex_paged serves it.
FLEX_MAX_POOL_ELEMENTS = 2**31 - 1
POOL_LAYOUTS = ("page", "layer")


def _resolve(name: str | None, device: torch.device, block_size: int) -> tuple[str, bool]:
    """(the backend's name, whether it was 'auto'): TIEREDKV_ATTENTION overrides 'auto'; on CUDA
    'auto' is flex_paged where the block size suits its kernel (a power of two >= 16)."""
    auto = name in (None, "auto")
    if auto:
        env = os.environ.get("TIEREDKV_ATTENTION")
        name = env if env not in (None, "", "auto") else ("flex_paged" if device.type == "cuda" else "gather_sdpa")
    if name not in BACKENDS:
        raise ValueError(f"attention: expected one of {BACKENDS} or 'auto', got {name!r}")
    if name == "flex_paged" and device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        if not auto:
            raise ValueError(f"attention: flex_paged on CUDA needs a block size that is a power of two >= 16, "
                             f"got {block_size}")
        log.warning("attention: block size %d does not suit flex_paged; using gather_sdpa", block_size)
        return "gather_sdpa", auto
    return name, auto


def pool_by_layer(name: str | None, device: torch.device, block_size: int, layout: BlockLayout,
                  num_pages: int) -> bool:
    """Whether the device pool is laid out layer-major: TIEREDKV_POOL_LAYOUT 'page' or 'layer'
    says; 'auto' (or unset) takes layer-major exactly where flex_paged runs and a page-major pool
    would put a layer's view past its 32-bit offsets -- every other pool stays page-major (one
    contiguous copy per block). Shapes only: nothing is allocated."""
    env = os.environ.get("TIEREDKV_POOL_LAYOUT", "auto") or "auto"
    if env not in POOL_LAYOUTS + ("auto",):
        raise ValueError(f"TIEREDKV_POOL_LAYOUT: expected one of {POOL_LAYOUTS} or 'auto', got {env!r}")
    if env != "auto":
        return env == "layer"
    span = DevicePool.attention_span(layout, num_pages, False)
    if span <= FLEX_MAX_POOL_ELEMENTS or _resolve(name, device, block_size)[0] != "flex_paged":
        return False
    log.info("attention: the device pool (%s KV elements) is laid out by layer for flex_paged's 32-bit offsets",
             f"{span:,}")
    return True


def make_backend(name: str | None, device: torch.device, block_size: int = 16,
                 span: int = 0) -> AttentionBackend:
    """'gather_sdpa', 'flex_paged', or None/'auto' (TIEREDKV_ATTENTION overrides 'auto'): on CUDA,
    flex_paged when the block size suits its kernel (a power of two >= 16) and one layer's view of
    the pool (`span`: DevicePool.attention_span) is within its 32-bit offsets; gather_sdpa
    otherwise, and always on CPU (flex's unfused CPU path is for tests only). flex_paged asked for
    by name where it cannot run is an error."""
    name, auto = _resolve(name, device, block_size)
    if name == "gather_sdpa":
        return _GATHER
    if span > FLEX_MAX_POOL_ELEMENTS:
        why = (f"one layer's view of the device pool spans {span:,} KV elements, past flex_paged's 32-bit "
               f"offsets ({FLEX_MAX_POOL_ELEMENTS:,}); a smaller --device-memory keeps it")
        if not auto:
            raise ValueError(f"attention: flex_paged: {why}")
        log.warning("attention: %s; using gather_sdpa", why)
        return _GATHER
    # One per runner: its compiled shapes, counted and sealed after its warm-up, are its own.
    return FlexPaged(device)
