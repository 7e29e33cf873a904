"""One forward pass's batch, as the paged attention reads it: which sequences, in which groups.

Knows: a sequence's slice of a packed pass (SeqSlice: its new tokens' place in the row, its
context length, its page table), how sequences are grouped so that padding stays cheap
(decodes together; prefill chunks by context length: `prefill_groups`), and PagedBatch: every
integer a pass needs (write slots, each group's block table and query rows) uploaded once
(engine/staging.py), with what the backend derives from them prepared once for all layers.
Doesn't know: how a group attends (engine/attention_backends.py, handed in as `backend`), the
model, scheduling or the tiers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.staging import StepUpload


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's part of a packed forward pass."""
    q_start: int              # offset of its new tokens in the packed row
    q_len: int                # how many new tokens
    context_len: int          # tokens of context after this pass (cached + earlier + new)
    pages: tuple[int, ...]    # its page table, covering context_len tokens


@dataclass(frozen=True)
class Group:
    """Sequences attended together, padded to S x Q queries over C keys. Device tensors, derived
    once per pass from the step's one upload (engine/staging.py), shared by every layer."""
    size: int                  # S
    max_q: int                 # Q
    max_context: int           # C
    q_index: torch.Tensor      # [S, Q] packed positions of the queries (padded with 0)
    out_rows: torch.Tensor     # [n] packed positions of the real queries...
    res_rows: torch.Tensor     # [n] ...and their rows in the flattened [S * Q] result
    block_table: torch.Tensor  # [S, ceil(C / block)] pages (padded with 0)
    context_len: torch.Tensor  # [S]
    q_first: torch.Tensor      # [S] absolute position of each sequence's first new token
    q_len: torch.Tensor        # [S]


class PagedBatch:
    """Everything the attention needs for one forward pass, built once and shared by all layers.

    The integers (write slots, every group's block table and query rows, plus `extra` --
    the model's input ids and positions) go to the device in one upload; what the backend
    derives from them (masks, gather indices, block masks) is computed there, once per pass.
    NOTE invariant (issue 9): building a batch never waits for the device.
    """

    def __init__(self, kv: torch.Tensor, seqs: list[SeqSlice], block_size: int,
                 backend: Any, staging: StepUpload | None = None,
                 extra: dict[str, list[int]] | None = None) -> None:
        self.kv = kv                  # the pool: [page, layer, 2, slot, kv_head, head_dim]
        self.seqs = seqs
        self.block_size = block_size
        self.backend = backend        # an engine/attention_backends.py backend: prepares each group once
        parts: list[np.ndarray] = []
        layout: list[tuple[str, int, tuple[int, ...]]] = []

        def put(name: str, values, shape: tuple[int, ...] | None = None) -> None:
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
            parts.append(arr)
            layout.append((name, arr.size, shape or (arr.size,)))

        for name, values in (extra or {}).items():
            put(name, values)
        write_pages, write_slots = [], []
        for s in seqs:
            first = s.context_len - s.q_len
            pos = np.arange(first, s.context_len)
            write_pages.append(np.asarray(s.pages, dtype=np.int64)[pos // block_size])
            write_slots.append(pos % block_size)
        put("write_pages", np.concatenate(write_pages) if seqs else [])
        put("write_slots", np.concatenate(write_slots) if seqs else [])
        decodes = [s for s in seqs if s.q_len == 1]
        prefills = [s for s in seqs if s.q_len > 1]
        plans = ([decodes] if decodes else []) + prefill_groups(prefills)
        shapes = []
        for i, g in enumerate(plans):
            shapes.append(self._plan_group(i, g, block_size, put))
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        flat = (staging or StepUpload(kv.device)).upload(values)
        views: dict[str, torch.Tensor] = {}
        at = 0
        for name, n, shape in layout:
            views[name] = flat[at:at + n].view(shape)
            at += n
        self.extra = {name: views[name] for name in (extra or {})}
        self.write_pages = views["write_pages"]
        self.write_slots = views["write_slots"]
        self.groups = [Group(S, Q, C, *(views[f"g{i}.{f}"] for f in _GROUP_FIELDS))
                       for i, (S, Q, C) in enumerate(shapes)]
        self.num_tokens = int(sum(s.q_len for s in seqs))
        self.prepared = [self.backend.prepare(self, g) for g in self.groups]

    @staticmethod
    def _plan_group(i: int, seqs: list[SeqSlice], block_size: int, put) -> tuple[int, int, int]:
        S = len(seqs)
        Q = max(s.q_len for s in seqs)
        C = max(s.context_len for s in seqs)
        nb = -(-C // block_size)
        q_index = np.zeros((S, Q), dtype=np.int64)
        table = np.zeros((S, nb), dtype=np.int64)
        for j, s in enumerate(seqs):
            q_index[j, :s.q_len] = np.arange(s.q_start, s.q_start + s.q_len)
            n = -(-s.context_len // block_size)
            table[j, :n] = s.pages[:n]
        q_len = np.array([s.q_len for s in seqs], dtype=np.int64)
        # Integer rows, built here once per pass: a boolean index in the layer loop would be a
        # nonzero() -- a device -> host sync on CUDA -- per group per layer.
        res_rows = (np.arange(Q)[None, :] < q_len[:, None]).reshape(-1).nonzero()[0]
        put(f"g{i}.q_index", q_index, (S, Q))
        put(f"g{i}.out_rows", q_index.reshape(-1)[res_rows])
        put(f"g{i}.res_rows", res_rows)
        put(f"g{i}.block_table", table, (S, nb))
        put(f"g{i}.context_len", [s.context_len for s in seqs])
        put(f"g{i}.q_first", [s.context_len - s.q_len for s in seqs])
        put(f"g{i}.q_len", q_len)
        return S, Q, C


_GROUP_FIELDS = ("q_index", "out_rows", "res_rows", "block_table", "context_len", "q_first", "q_len")


# What one more attention group costs beyond its scores, in score elements (query x key): the
# gathers, the mask and the SDPA call per layer. Measured on SmolLM2 on CPU: 20 prefills of 8
# tokens as 20 groups made a step 3.7x a decode step; as one group, 1.2x.
GROUP_OVERHEAD = 4096


def prefill_groups(prefills: list[SeqSlice]) -> list[list[SeqSlice]]:
    """Prefill chunks batched into groups whose padding stays cheap: sorted by context, a chunk
    joins the current group while the padded scores (S x max Q x max C) cost at most twice the
    real ones plus the overhead a group of its own would cost. So many short prefills share one
    SDPA call, and a long prefill never pads short ones (nor the decodes) to its length."""
    groups: list[list[SeqSlice]] = []
    real = 0
    for s in sorted(prefills, key=lambda s: (s.context_len, s.q_len)):
        cost = s.q_len * s.context_len
        if groups:
            g = groups[-1]
            padded = (len(g) + 1) * max(s.q_len, max(x.q_len for x in g)) * s.context_len
            if padded <= 2 * (real + cost) + GROUP_OVERHEAD:
                g.append(s)
                real += cost
                continue
        groups.append([s])
        real = cost
    return groups
