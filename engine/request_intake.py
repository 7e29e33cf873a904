"""How a caller's requests enter the engine and how their outputs come back: `generate` and
`stream`, for one prompt or a batch of prompts.

Knows: a request validated and built into a Sequence on the caller's thread (nothing queued
when any prompt of a batch is refused), a batch queued all at once or not at all (the engine's
queue bound counts every prompt), an AbortHandle bound to the whole call, and how the engine
thread's messages reach the caller -- one prompt's from its sequence's outbox, a batch's streamed
chunks from one queue that every prompt's sequence writes to, each chunk indexed by OpenAI's
rule for batched prompts (index = prompt_index * n + choice).
An abort's `delivered_tokens` (engine/abort.py): None (every token generated counts), an int
(n = 1: the request's count; n > 1: each choice's), or one count per choice of the call, in
that same index order: each choice is billed for what reached its caller. A sampled request
without a seed takes the next of the engine's seed stream when it has one (`Engine(seed=N)`, vLLM's
`--seed`: requests differ, and the same requests in the same order sample the same).
Doesn't know: scheduling, sampling or billing (the engine thread: engine/step_loop.py).

Threads: every method here runs on the caller's thread (many at once); they share the engine's
inbox, in-flight count (under its lock) and abort queue, never the scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import random
import uuid
from typing import Iterator, Sequence as Seq

from engine.abort import CALLER_CLOSED, AbortHandle
from engine.billing import validate_tenant
from engine.errors import BillingUnavailable, EngineClosedError, QueueFullError
from engine.outputs import CompletionOutput, StreamChunk
from engine.request_group import RequestGroup
from engine.retain_spans import RetainSpan, check_spans, retain_request
from engine.sampler import is_greedy, make_generator
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger("tieredkv.engine")

Prompt = str | Seq[int]
Delivered = int | tuple[int, ...] | None


def is_batch(prompt: object) -> bool:
    """A list of prompts (strings or token-id lists); a list of ints is one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not all(isinstance(t, int) for t in prompt)


class _Tagged:
    """A batch's sequence's event queue: what the engine thread puts is tagged with the prompt's
    place in the batch and goes to the batch's one queue (its caller reads only that)."""

    def __init__(self, shared: "queue.Queue", tag: int) -> None:
        self._shared, self._tag = shared, tag

    def put(self, item: tuple[str, object]) -> None:
        self._shared.put((self._tag, *item))


def share_of(delivered: Delivered, prompt_index: int, n: int) -> Delivered:
    """Prompt `prompt_index`'s part of a call's delivered counts (its n choices')."""
    if not isinstance(delivered, tuple):
        return delivered
    part = delivered[prompt_index * n:(prompt_index + 1) * n]
    return (part[0] if part else 0) if n == 1 else part


def request_seeds(seed: int | None) -> random.Random | None:
    """The engine's seed stream (Engine(seed=...), vLLM's --seed): each unseeded sampled request
    takes its next value; None: no stream, each such request draws its own from the OS."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected an int >= 0 or None, got {seed!r}")
    return random.Random(seed)


class RequestIntake:
    """The caller-facing half of an Engine (a base class of it: the state is the Engine's)."""

    def _sequence(self, prompt: Prompt, params: SamplingParams | None, tenant: str, id_prefix: str = "cmpl"
                  ) -> Sequence:
        """A validated request as a Sequence, not queued yet (ValueError naming the field)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: expected a SamplingParams")
        validate_tenant(tenant)   # refused now, not when the finished request is billed
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.n > self.max_n:
            raise ValueError(f"n: at most {self.max_n} choices per request (max_n), got {params.n}")
        ids = self.encode(prompt)
        if params.seed is None and self.seeds is not None and not is_greedy(params):
            params = dataclasses.replace(params, seed=self.seeds.getrandbits(63))     # the engine's seed stream
        rid = f"{id_prefix}{'' if id_prefix.endswith('_') else '-'}{uuid.uuid4().hex[:24]}"   # "msg_": msg_<hex>
        seq = Sequence(request_id=rid, prompt_ids=ids, params=params, tenant=tenant,
                       namespace=self.namespace(tenant), block_size=self.block_size,
                       max_len=min(self.max_context, len(ids) + params.max_tokens),
                       generator=make_generator(params, self.loaded.device),
                       group=RequestGroup(params.n) if params.n > 1 else None)
        seq.exact = self.exact_keys(ids, seq.namespace)
        return seq

    def _submit(self, prompts: list[Prompt], params: SamplingParams | None, tenant: str,
                abort: AbortHandle | None, shared: "queue.Queue | None" = None, id_prefix: str = "cmpl",
                retain: Seq[RetainSpan] = ()) -> list[Sequence]:
        """Build every prompt's sequence, then queue them all (QueueFullError: none queued).
        `shared`: a batch's one queue (each sequence's messages tagged with its place). `retain`:
        spans of each prompt to keep past LRU (engine/retain_spans.py), retained once queued."""
        retain = check_spans(retain)
        if self._closed:
            raise EngineClosedError("engine is closed")
        refusing = self.billing.refusing(count=True) if self.billing is not None else None
        if refusing is not None:     # its bill would have nowhere to go: refused before any work
            raise BillingUnavailable(refusing)
        bare = id_prefix.removesuffix("_")
        if not (bare.isascii() and bare.isalnum()):
            raise ValueError(f"id_prefix: expected letters and digits, and an optional trailing '_'; got {id_prefix!r}")
        if len(prompts) > max(1, self.max_queue):     # a batch that could never be queued whole
            raise ValueError(f"prompt: {len(prompts)} prompts in one call, more than the engine's queue holds "
                             f"(max_queue {self.max_queue})")
        seqs = [self._sequence(p, params, tenant, id_prefix) for p in prompts]
        if shared is not None:
            for i, seq in enumerate(seqs):
                seq.outbox = _Tagged(shared, i)
        with self._inflight_lock:
            if self._inflight - len(self.scheduler.running) + len(seqs) > self.max_queue:
                raise QueueFullError(f"engine queue is full ({self.max_queue} prompts may wait, {len(seqs)} more "
                                     "would pass it); retry later")
            self._inflight += len(seqs)
        if abort is not None:
            n = seqs[0].params.n
            try:      # an abort asked already is applied now (the engine thread skips it in the inbox)
                abort.bind(lambda reason, delivered: [self._request_abort(seq, reason, share_of(delivered, i, n))
                                                      for i, seq in enumerate(seqs)])
            except ValueError:
                for seq in seqs:
                    self._done(seq)
                raise
        for seq in seqs:
            if retain:      # kept from now: the blocks are retained as they are computed
                # The prompt's full blocks: hashed already when it has an exact entry (an exact
                # hit never hashes them again), else its prefix keys (admission needs them anyway).
                keys = seq.exact.full if seq.exact is not None else seq.prefix_keys()
                try:
                    seq.retain = retain_request(self.cache, tenant, keys, len(seq.prompt_ids), self.block_size,
                                                retain)
                except Exception:      # a cache closing under it: served and cached as ever, nothing retained
                    log.exception("retention of %s failed: the request runs without it", seq.request_id)
            # Its disk blocks start moving to the host tier now, so its wait in the queue overlaps
            # the drive, and the tiers over a link are asked what they hold (storage/loader.py;
            # reads only memory here).
            chain = list(seq.exact.chain) if seq.exact is not None else seq.prefix_keys()
            seq.prefetch = self.cache.prefetch(chain, seq.hits)
            seq.probe = self.cache.probe(chain)
            self._inbox.put(seq)
        return seqs

    def _request_abort(self, seq: Sequence, reason: str, delivered: Delivered) -> None:
        self._aborts.request(seq, reason, delivered)
        self._inbox.put(None)        # wakes an idle engine thread

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt], params: SamplingParams | None = None,
                 tenant: str = "default", abort: AbortHandle | None = None, id_prefix: str = "cmpl",
                 retain: Seq[RetainSpan] = ()) -> CompletionOutput | list:
        """One prompt -> one output; a list of prompts -> a list of outputs, run concurrently (each
        its own request, billed on its own). (A list of ints is one prompt of token ids.) `abort`
        stops the call -- every prompt of a batch -- from any thread (engine/abort.py).
        With params.n > 1 a prompt's output is the list of its n choices (index order), each
        carrying the request's usage (the prompt once, the choices' completions summed).
        `id_prefix`: each request's id is `<id_prefix>-<hex>` (the HTTP service's chat route asks
        for "chatcmpl": the id its body carries is then the one its bill is recorded under), or
        `<id_prefix><hex>` for a prefix ending in "_" (the Messages route's "msg_"). `retain`: spans
        of the prompt kept past LRU until their deadlines (engine/retain_spans.py: Anthropic's
        cache_control, OpenAI's prompt_cache_retention), billed as cache writes in the usage."""
        batch = is_batch(prompt)
        seqs = self._submit(prompt if batch else [prompt], params, tenant, abort, id_prefix=id_prefix, retain=retain)
        outs = [self._wait(seq) for seq in seqs]
        return outs if batch else outs[0]

    def stream(self, prompt: Prompt | list[Prompt], params: SamplingParams | None = None,
               tenant: str = "default", abort: AbortHandle | None = None, id_prefix: str = "cmpl",
               retain: Seq[RetainSpan] = ()) -> Iterator[StreamChunk]:
        """Chunks with only the new text/token ids; the last has finish_reason, usage, metrics.
        Closing the iterator early aborts the request (billed for the chunks it yielded).
        With params.n > 1 the choices' chunks come interleaved, each with its `index`; each
        choice's last chunk has its finish_reason and the request's usage. A list of prompts
        streams them all interleaved, a chunk's `index` = prompt_index * n + choice (OpenAI's
        order), each prompt's last chunks with that prompt's usage (its own request_id); an
        error of one prompt is raised once the others have ended (each was billed)."""
        abort = abort if abort is not None else AbortHandle()
        batch = is_batch(prompt)
        n = (params or SamplingParams()).n
        shared: queue.Queue | None = queue.Queue() if batch else None
        seqs = self._submit(prompt if batch else [prompt], params, tenant, abort, shared, id_prefix, retain)
        yielded = [0] * (len(seqs) * n)
        try:
            chunks = self._batch_messages(shared, len(seqs), n) if batch else self._chunks(seqs[0])
            for chunk in chunks:
                yielded[chunk.index] += len(chunk.token_ids)
                yield chunk
        except GeneratorExit:
            abort.abort(CALLER_CLOSED, tuple(yielded) if batch or n > 1 else yielded[0])
            raise

    # ---- the engine thread's messages, read on the caller's thread ---------------------------
    @staticmethod
    def _messages(seq: Sequence) -> Iterator[tuple[str, object]]:
        """A sequence's messages from the engine thread, up to and including "final"; an
        "error" message is raised in the caller's thread."""
        while True:
            kind, payload = seq.outbox.get()
            if kind == "error":
                raise payload
            yield kind, payload
            if kind == "final":
                return

    def _chunks(self, seq: Sequence) -> Iterator[StreamChunk]:
        for kind, payload in self._messages(seq):
            if kind == "delta":
                yield payload

    @staticmethod
    def _batch_messages(shared: "queue.Queue", prompts: int, n: int) -> Iterator[StreamChunk]:
        """A batch's chunks as they come, re-indexed prompt-major; ends once every prompt ended."""
        open_, error = prompts, None
        while open_:
            tag, kind, payload = shared.get()
            if kind == "delta":
                yield dataclasses.replace(payload, index=tag * n + payload.index)
            elif kind in ("final", "error"):
                open_ -= 1
                if kind == "error" and error is None:
                    error = payload
        if error is not None:
            raise error

    def _wait(self, seq: Sequence) -> CompletionOutput | list[CompletionOutput]:
        for kind, payload in self._messages(seq):
            if kind == "final":
                if seq.group is not None and not isinstance(payload, list):
                    return [payload]      # ended before its choices were forked (aborted while queued)
                return payload
        raise AssertionError("unreachable: the event stream ends with 'final'")
