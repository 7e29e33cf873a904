"""An exact entry: what lets a prompt whose every token is cached skip its forward entirely.

Knows: the keys of the blocks that complete a prompt's chain past its full blocks -- its TAIL
(the partial last block's KV: h = H(parent || tail tokens), 1..block_size-1 tokens, absent when
the prompt fills its last block) and its LOGITS (the raw last-position logits, before any
temperature, penalty or processor, so one entry serves every sampling setting: blocks with no
tokens, h = H(parent), chained after the prompt's last block, as many as the logits' bytes need)
-- and how a logits row is packed into pool pages and read back from them.
To every tier these are ordinary blocks of the chain: they move down and back up with the
blocks before them, a payload is bound to hash || namespace, tokens, namespace and parent are
compared on every hit, and `hash == hash_block(parent, token_ids)` holds (the disk's audit and
the store's verify check it). So an entry is bound to the model, its dtype and the tenant (the
namespace digests them) and to the full token chain; a damaged or missing block is a miss,
and a prompt whose chain is not whole up to its last logits block is not an exact hit.
KV events leave them out (storage/kv_events/publisher.py): a router matches full blocks only.
Doesn't know: the engine's scheduling, or which tier holds what.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from storage.hashing import BlockKey, hash_block


@dataclass(frozen=True, slots=True)
class LogitsFormat:
    """How a model's logits rows are laid out in pool pages: dtype and vocabulary width."""
    dtype: torch.dtype
    vocab: int
    page_bytes: int

    def __post_init__(self) -> None:
        if self.vocab < 1 or self.page_bytes < 1:
            raise ValueError(f"LogitsFormat: vocab {self.vocab} and page_bytes {self.page_bytes} must be >= 1")

    @property
    def nbytes(self) -> int:
        return self.vocab * torch.empty((), dtype=self.dtype).element_size()

    @property
    def pages(self) -> int:
        """Pool pages one logits row takes."""
        return -(-self.nbytes // self.page_bytes)


@dataclass(frozen=True, slots=True)
class ExactKeys:
    """A prompt's whole chain: every full block, its tail (None: it fills its last block) and
    the logits blocks after it. A hit on all of `chain` is an exact hit."""
    full: tuple[BlockKey, ...]
    tail: BlockKey | None
    logits: tuple[BlockKey, ...]

    @property
    def kv(self) -> tuple[BlockKey, ...]:
        """The blocks holding the prompt's KV (its page table on an exact hit)."""
        return self.full + ((self.tail,) if self.tail is not None else ())

    @property
    def chain(self) -> tuple[BlockKey, ...]:
        return self.kv + self.logits


def worth_keeping(fmt: LogitsFormat, prompt_tokens: int, block_size: int) -> bool:
    """Whether a prompt gets an exact entry: its logits take no more pages than its KV does (a
    logits row is padded to whole pages: one page for SmolLM2-135M's 96 KiB of bf16 logits in
    360 KiB blocks, but 96 for a tiny test model's 192 KiB in 2 KiB blocks). So an entry at most
    doubles what the prompt holds in the cache."""
    return fmt.pages <= -(-prompt_tokens // block_size)


def exact_keys(full: Sequence[BlockKey], prompt: Sequence[int], namespace: bytes, block_size: int,
               root: bytes, fmt: LogitsFormat) -> ExactKeys:
    """The exact entry's keys for `prompt`, whose full blocks' keys are `full` (in order);
    `root` is the namespace's root hash (the parent of a first block)."""
    if len(full) != len(prompt) // block_size:
        raise ValueError(f"exact_keys: {len(full)} full keys for a prompt of {len(prompt)} tokens")
    parent = full[-1].hash if full else root
    tail = None
    rest = tuple(int(t) for t in prompt[len(full) * block_size:])
    if rest:
        tail = BlockKey(hash_block(parent, rest), parent, rest, namespace)
        parent = tail.hash
    logits = []
    for _ in range(fmt.pages):
        key = BlockKey(hash_block(parent, ()), parent, (), namespace)
        logits.append(key)
        parent = key.hash
    return ExactKeys(tuple(full), tail, tuple(logits))


def store_logits(kv: torch.Tensor, pages: Sequence[int], row: torch.Tensor, fmt: LogitsFormat) -> None:
    """Copy one raw logits row's bytes into `pages` of the pool tensor `kv` (on its device; the
    rest of the last page zeroed, so the stored bytes are a function of the row alone)."""
    if row.dtype != fmt.dtype or row.numel() != fmt.vocab or len(pages) != fmt.pages:
        raise ValueError(f"store_logits: a {row.dtype} row of {row.numel()} into {len(pages)} pages, "
                         f"format wants {fmt.dtype} x {fmt.vocab} in {fmt.pages}")
    src = row.detach().contiguous().view(torch.uint8)
    for i, page in enumerate(pages):
        block = kv[page]
        part = src[i * fmt.page_bytes:(i + 1) * fmt.page_bytes]
        if block.is_contiguous():
            dst = block.view(-1).view(torch.uint8)
            dst[:part.numel()].copy_(part)
            if part.numel() < dst.numel():
                dst[part.numel():].zero_()
            continue
        # A layer-major pool's page is strided (storage/device_pool.py): the block's bytes in
        # serialized order are built whole, then copied in (the same bytes as page-major).
        whole = torch.zeros(block.numel() * block.element_size(), dtype=torch.uint8, device=block.device)
        whole[:part.numel()].copy_(part)
        block.copy_(whole.view(block.dtype).view(block.shape))


def read_logits(kv: torch.Tensor, pages: Sequence[int], fmt: LogitsFormat) -> torch.Tensor:
    """The stored row [vocab] from `pages` of the pool tensor: a view when it fits one page of a
    page-major pool, else a copy joined on the device. Either way no host <-> device copy."""
    if len(pages) != fmt.pages:
        raise ValueError(f"read_logits: {len(pages)} pages, format wants {fmt.pages}")
    # reshape: a view of a page-major page, a copy of a layer-major (strided) one.
    if len(pages) == 1:
        raw = kv[pages[0]].reshape(-1).view(torch.uint8)[:fmt.nbytes]
    else:
        raw = torch.cat([kv[p].reshape(-1).view(torch.uint8) for p in pages])[:fmt.nbytes]
    return raw.view(fmt.dtype)
