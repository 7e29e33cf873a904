"""A request's n choices (SamplingParams.n > 1): one prefill, n sequences forked on its pages.

Knows: how the first sequence (choice 0, the one admitted and prefilled) forks n - 1 others
once its prompt is computed -- each holds the same pages (one more reference each: the pool
frees a page only when every choice let it go; the partial last page is copied by whichever
choice writes into it while another holds it: engine/scheduler.py's copy-on-write), continues
from the same last-position logits with its own generator (a per-choice seed derived from the
request's: engine/sampler.choice_seed) -- and how the choices end: each on its own (stop,
length, abort, or a failure of its own, which never ends the others), the request when the
last one does. Its bill then: the prompt once, as decided at the first admission, and the
completion tokens of every choice that did not fail, summed (as OpenAI bills n).
Doesn't know: scheduling, sampling or billing's mechanics (engine/step_loop.py runs them).

Engine thread only, like the sequences it holds (created on the caller's thread before the
request is queued).
"""
from __future__ import annotations

import dataclasses

from engine.outputs import CompletionOutput, RequestMetrics, StreamChunk, Usage
from engine.sequence import Sequence, SeqStatus

Outcome = tuple[CompletionOutput, StreamChunk] | Exception


class RequestGroup:
    def __init__(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"RequestGroup: n = {n}; one choice needs no group")
        self.n = n
        self.members: list[Sequence] = []        # choice order, once forked
        self.forked = False
        self.outcomes: dict[int, Outcome] = {}

    def fork(self, first: Sequence, fork_blocks, adopt, make_generator) -> list[Sequence]:
        """The n - 1 choices after `first`, whose prompt has just been computed (its first token
        not sampled yet): each shares its pages (`fork_blocks(blocks)`: the cache's fork, one
        reference more each) and is running (`adopt`). `make_generator(choice)`: that choice's
        generator."""
        if self.forked or first.output_ids or first.num_computed != len(first.prompt_ids):
            raise RuntimeError("fork: only a request's first sequence forks, once, right after its prefill")
        children = []
        for i in range(1, self.n):
            child = Sequence(request_id=first.request_id, prompt_ids=first.prompt_ids, params=first.params,
                             tenant=first.tenant, namespace=first.namespace, block_size=first.block_size,
                             max_len=first.max_len, generator=make_generator(i), blocks=fork_blocks(first.blocks),
                             num_computed=first.num_computed, keys=list(first.keys),
                             # billed already: a preempted choice is re-admitted as admitted
                             hits=first.hits.forked(),
                             restore_s=first.restore_s, arrival=first.arrival, admitted_at=first.admitted_at,
                             outbox=first.outbox, index=i, group=self)
            adopt(child)
            children.append(child)
        self.members = [first, *children]
        self.forked = True
        return children

    def settle(self, seq: Sequence, outcome: Outcome) -> bool:
        """A choice ended (its output, or the error that failed it alone). True once every
        choice has."""
        self.outcomes[seq.index] = outcome
        return len(self.outcomes) == self.n

    def open_members(self) -> list[Sequence]:
        return [s for s in self.members if s.status is not SeqStatus.FINISHED]

    def usage(self) -> Usage | None:
        """The request's usage: the prompt once (the first choice's billing), the completion
        tokens of the choices that did not fail summed. None when every choice failed."""
        done = [o[0].usage for o in self.outcomes.values() if not isinstance(o, Exception)]
        if not done:
            return None
        first = done[0]
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in done),
                     hit_tokens_by_tier=dict(first.hit_tokens_by_tier),
                     prompt_cache_miss_tokens=first.prompt_cache_miss_tokens,
                     cache_write_tokens=dict(first.cache_write_tokens),
                     retained_token_seconds=first.retained_token_seconds,
                     retention_refused_tokens=first.retention_refused_tokens)

    def results(self, usage: Usage) -> list[tuple[CompletionOutput, StreamChunk]]:
        """Every choice's output and last chunk, in index order, carrying the request's usage; a
        failed choice reads as finish_reason "error" with what it had generated."""
        out = []
        for i in range(self.n):
            o = self.outcomes[i]
            if isinstance(o, Exception):
                seq = self.members[i]
                o = (CompletionOutput(seq.request_id, seq.text, list(seq.output_ids), "error", usage,
                                      _ERROR_METRICS, list(seq.prompt_ids), index=i),
                     StreamChunk(seq.request_id, "", [], "error", usage, _ERROR_METRICS, index=i))
            out.append((dataclasses.replace(o[0], usage=usage), dataclasses.replace(o[1], usage=usage)))
        return out

    def first_error(self) -> Exception:
        return next(o for o in self.outcomes.values() if isinstance(o, Exception))


_ERROR_METRICS = RequestMetrics(ttft_s=0.0, restore_s=0.0, total_s=0.0)     # a failed choice has none
