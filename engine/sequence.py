"""A Sequence: one request's tokens, blocks and progress through the engine; `Scheduled`: a
sequence and the tokens it computes this step (what the scheduler and its helpers hand on and
the model runner runs).

Knows: the prompt and output token ids, its blocks in the cache (`blocks`: an opaque handle the
cache alone changes, storage/kv_blocks.py; its page table is read as a tuple), how many tokens
have KV in them (num_computed), the block keys of its full blocks, the request's timing, and its
hit account (storage/hit_account.py: what it is billed).
Doesn't know: the pool, page ids' meaning, or the model.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any
from enum import Enum

import torch

from engine.retain_spans import RetainRecord
from engine.sampling_params import SamplingParams
from storage.exact_entry import ExactKeys
from storage.hashing import BlockKey, block_keys
from storage.hit_account import HitAccount
from storage.kv_blocks import RequestBlocks
from storage.load_records import ChainProbe, Load, Prefetch


class SeqStatus(Enum):
    WAITING = "waiting"
    LOADING = "loading"      # its prefix is being filled by the loader; it holds those pages
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    namespace: bytes
    block_size: int
    max_len: int                                  # the model's context: prompt + output cap
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # Its pages, held in the cache (storage/kv_blocks.py): planned at admission, grown, handed
    # back once at its end. A load in flight (while LOADING, or its back part while RUNNING its
    # front: compute-or-load) is the handle's too.
    blocks: RequestBlocks = field(default_factory=RequestBlocks)
    num_computed: int = 0                         # tokens whose KV is in its pages
    keys: list[BlockKey] = field(default_factory=list)   # keys of full blocks of tokens, in order
    # Billing (storage/hit_account.py): facts in, decided at the first admission; a preempted
    # request is not billed again. Its prefetch (below) tells it what it moved up; the cache bills
    # its blocks by it (TieredKVCache.start_load).
    hits: HitAccount = field(default_factory=HitAccount)
    restore_s: float = 0.0
    load_deadline: object | None = None           # the load's PlannedLoad: its deadline derives from it
    probe_deadline: float | None = None           # when waiting for its probe stops (likewise)
    late_probe: ChainProbe | None = None          # admitted without its probe's answer: still out
                                                  # (engine/probe_wait.py; engine thread)
    compute_until: int = 0                        # with a back part loading: where its front ends
    fair_guard: int = 0                           # not preempted for fairness again before num_computed
                                                  # reaches this (engine/fair_share.py)
    recomputed_hit_tokens: int = 0                # hit tokens it recomputed by choice (billed as hits)
    prefetch: Prefetch | None = None              # its disk -> host prefetch, started at submit
    probe: ChainProbe | None = None               # the tiers over a link asked at submit (None: none)
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    # Aborted (engine/abort.py): completion tokens that reached the caller; None: all generated.
    delivered_tokens: int | None = None
    # Output plumbing: the engine thread posts ("delta" | "final" | "error", payload) messages
    # here, the caller's thread reads them (not KV events: those are storage/kv_events/).
    outbox: "queue.Queue" = field(default_factory=queue.Queue)
    text: str = ""                                # detokenized output so far
    detok: Any = None                             # its IncrementalDetokenizer (engine thread)
    sent_chars: int = 0                           # text already streamed
    sent_tokens: int = 0                          # token ids already streamed
    stop_floor: int = 0                           # text a stop string must end past (min_tokens' text)
    stop_string: str | None = None                # the stop string that ended it (engine thread)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)   # the sampled token's, per output token
    pending_final: tuple[str, list[int]] = ("", [])  # the last chunk's text and ids
    # Exact hits (storage/exact_entry.py): the prompt's whole chain (None: off for this engine);
    # on an exact hit, the pages holding its stored logits until its first token is sampled.
    exact: ExactKeys | None = None
    retain: RetainRecord | None = None            # what its retention spans bought (engine/retain_spans.py)
    exact_hit: bool = False
    # n > 1 (engine/request_group.py): its choice's index and the request it is a choice of.
    index: int = 0
    group: Any = None

    @property
    def pages(self) -> tuple[int, ...]:
        """Its page table (read-only: the model runner's block table)."""
        return self.blocks.table

    @property
    def logits_pages(self) -> tuple[int, ...]:
        """An exact hit's stored logits' pages, until its first token is sampled."""
        return self.blocks.logits

    @property
    def registered(self) -> int:
        """Its leading blocks that are in the cache index."""
        return self.blocks.registered

    @property
    def load(self) -> Load | None:
        """Its load in flight (None: none)."""
        return self.blocks.load

    @property
    def hit_tokens_by_tier(self) -> dict[str, int] | None:
        """Its hit tokens per tier as billed (None: never admitted)."""
        return self.hits.by_tier

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def extend_keys(self) -> None:
        """Compute keys for every full block of the tokens so far (prompt and generated)."""
        have = len(self.keys)
        if self.num_tokens // self.block_size > have:
            parent = self.keys[-1].hash if self.keys else None
            self.keys.extend(block_keys(self.namespace, self.tokens, self.block_size, start=have, parent=parent))

    def prefix_keys(self) -> list[BlockKey]:
        """Keys a cache hit may cover: full blocks of all tokens but the last (at least one
        token is computed to produce logits)."""
        self.extend_keys()
        return self.keys[: (self.num_tokens - 1) // self.block_size]

    def reset_for_preemption(self) -> None:
        """Its blocks were handed back (TieredKVCache.finish): it waits to be admitted again."""
        self.num_computed = 0
        self.compute_until = 0
        self.late_probe = None     # a re-admission reads the answer itself (engine/probe_wait.py)
        self.status = SeqStatus.WAITING


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int          # new tokens computed this step, starting at seq.num_computed
