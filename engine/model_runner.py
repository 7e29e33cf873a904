"""Runs one forward pass of the model over a scheduled batch, on the paged pool.

Knows: how to pack the new tokens of several sequences into one row with their absolute
positions, build the PagedBatch the attention reads, and keep logits only for each sequence's
last new token. Doesn't know: which sequences run or what happens to the logits.
"""
from __future__ import annotations

import torch

from engine.attention_backends import AttentionBackend, make_backend
from engine.decode_graph import DecodeGraphs, DecodeRow
from engine.flex_paged import attention_span
from engine.paged_batch import PagedBatch, SeqSlice
from engine.sequence import Scheduled
from engine.staging import StepUpload


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: torch.Tensor, block_size: int,
                 attention: AttentionBackend | str | None = None, max_query: int = 512, decode: str = "off",
                 max_seqs: int = 64, max_context: int = 0, sink: int | None = None) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.device
        # The engine hands in the backend it built (one per engine); a name or None builds one here.
        self.backend: AttentionBackend = (make_backend(attention, kv.device, block_size, attention_span(kv))
                                          if attention is None or isinstance(attention, str) else attention)
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is not None:
            # Compiled now, every shape class a pass up to `max_query` new tokens takes: never on a
            # first request (engine/flex_paged.py).
            config = model.config
            warm_up(kv, block_size, config.num_attention_heads, next(model.parameters()).dtype, max_query,
                    attention_scaling(model))
        # Decode-only steps through the graph-safe step (engine/decode_graph.py), unless "off".
        self.decode: DecodeGraphs | None = None
        if decode != "off":
            self.decode = DecodeGraphs(model, kv, block_size, self.backend, max_seqs=max_seqs,
                                       max_context=max_context, sink=sink, mode=decode)
            self.decode.capture()
        self.staging = StepUpload(kv.device)    # owned by the engine thread, like the runner
        # A 4-D attention_mask makes transformers take it as prepared and skip building one:
        # our attention reads its masks from the PagedBatch, and the mask builder's check for
        # packed sequences in position_ids is a host sync (`.all()` in a Python `if`) per forward.
        self._prepared_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=kv.device)
        # Tokens run through the model and forward passes, since start (an exact hit adds none).
        self.tokens_computed = 0
        self.forward_passes = 0
        self.tokens: tuple[torch.Tensor, torch.Tensor] | None = None    # see forward

    @torch.inference_mode()
    def forward(self, scheduled: list[Scheduled], draws: list | None = None) -> torch.Tensor:
        """Logits [len(scheduled), vocab] of the last new token of each scheduled sequence.
        `draws` (one DecodeRow.draw per sequence, None greedy): the step's token ids may be chosen
        in the graph-safe decode step; when they were, `tokens` holds (token ids, NaN flags) on the
        device, one per scheduled sequence, until the next forward (else None)."""
        self.forward_passes += 1
        self.tokens_computed += sum(s.num_tokens for s in scheduled)
        self.tokens = None
        if self.decode is not None and all(s.num_tokens == 1 for s in scheduled) and self.decode.accepts(
                len(scheduled), max(s.seq.num_computed + 1 for s in scheduled)):
            logits = self.decode.run([DecodeRow(s.seq.tokens[s.seq.num_computed], s.seq.num_computed + 1,
                                                tuple(s.seq.pages), draws[j] if draws else None)
                                      for j, s in enumerate(scheduled)])
            if draws is not None:
                self.tokens = (self.decode.tokens, self.decode.nan)
            return logits
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            end = start + s.num_tokens
            slices.append(SeqSlice(q_start=len(ids), q_len=s.num_tokens, context_len=end, pages=tuple(seq.pages)))
            ids.extend(seq.tokens[start:end])
            positions.extend(range(start, end))
        # The model's inputs travel in the same upload as the attention's metadata: one copy.
        batch = PagedBatch(self.kv, slices, self.block_size, self.backend, self.staging,
                           extra={"ids": ids, "positions": positions,
                                  "last": [sl.q_start + sl.q_len - 1 for sl in slices]})
        out = self.model(input_ids=batch.extra["ids"].unsqueeze(0), position_ids=batch.extra["positions"].unsqueeze(0),
                         attention_mask=self._prepared_mask, use_cache=False, logits_to_keep=batch.extra["last"],
                         tkv_batch=batch)
        return out.logits[0]


def attention_scaling(model: torch.nn.Module) -> float | None:
    """The scale the model's attention modules pass to the attention function (a constant of the
    compiled kernels: the warm-up must compile with the same one)."""
    for m in model.modules():
        if hasattr(m, "layer_idx") and isinstance(getattr(m, "scaling", None), float):
            return m.scaling
    return None
