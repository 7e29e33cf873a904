"""Runs one forward pass of the model over a scheduled batch, on the paged pool.

Knows: how to pack the new tokens of several sequences into one row with their absolute
positions, build the PagedBatch the attention reads, and keep logits only for each sequence's
last new token. Doesn't know: which sequences run or what happens to the logits.
"""
from __future__ import annotations

import torch

from engine.paged_attention import PagedBatch, SeqSlice
from engine.scheduler import Scheduled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.device

    @torch.inference_mode()
    def forward(self, scheduled: list[Scheduled]) -> torch.Tensor:
        """Logits [len(scheduled), vocab] of the last new token of each scheduled sequence."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            end = start + s.num_tokens
            slices.append(SeqSlice(q_start=len(ids), q_len=s.num_tokens, context_len=end, pages=tuple(seq.pages)))
            ids.extend(seq.tokens[start:end])
            positions.extend(range(start, end))
        batch = PagedBatch(self.kv, slices, self.block_size)
        last = torch.tensor([sl.q_start + sl.q_len - 1 for sl in slices], device=self.device)
        out = self.model(input_ids=torch.tensor([ids], device=self.device),
                         position_ids=torch.tensor([positions], device=self.device),
                         use_cache=False, logits_to_keep=last, tkv_batch=batch)
        return out.logits[0]
