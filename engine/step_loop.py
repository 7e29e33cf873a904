"""The engine thread's loop: take new requests, apply aborts, schedule, run the forward, sample,
hand each sequence its token, finish and bill it.

Knows: one step's order and its isolation -- an admission, a forward, a sample or a token's
handling that fails fails its own sequence(s), never the step; the foreground signal background
pools narrow for (storage/foreground.py); how a finished request reaches its caller only after its
bill is committed. Doesn't know: request intake or validation, status, or the cache's lifecycle
(engine/engine.py, whose Engine this is a part of: it owns every attribute used here).

Engine thread only: every method here runs on `tieredkv-engine` (Engine._loop's thread).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import time

import torch

from engine.errors import BillingUnavailable
from engine.output_stream import completion_of, emit, take_token_text
from engine.sampler import (RowResult, SampledStep, SamplingError, draw_knobs, is_greedy, make_generator,
                            packed_step, sample_batch, upload)
from engine.sequence import Sequence, SeqStatus
from storage.exact_entry import read_logits
from storage.foreground import FOREGROUND

log = logging.getLogger("tieredkv.engine")


class StepLoop:
    """The step loop of an Engine (a base class of it: the state is the Engine's)."""

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is not None and item.status is not SeqStatus.FINISHED:   # aborted before it got here
                    self.scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # Background pools narrow while sequences run (storage/foreground.py).
                FOREGROUND.hold(self, bool(self.scheduler.running))
                self._take_inbox(block=not self.scheduler.has_work())
                self._apply_aborts()
                if not self.scheduler.has_work():
                    continue
                try:
                    self._step()
                except Exception as e:
                    # Last resort only: _step isolates each sequence's admission, forward and token
                    # handling, so reaching here is a bug outside any one request. Keep serving.
                    log.exception("engine step failed")
                    for seq in list(self.scheduler.running):
                        self._fail(seq, RuntimeError(f"engine step failed: {e}"))
        finally:
            FOREGROUND.hold(self, False)

    def _apply_aborts(self) -> None:
        """End the sequences whose callers left (between steps): pages back, billed as usage_of says."""
        for seq, reason, delivered in self._aborts.take():
            # n > 1: the abort ends every choice still open, each billed for the tokens that
            # reached its caller (`delivered`: one count per choice, or one count for each).
            members = seq.group.open_members() if seq.group is not None and seq.group.forked else [seq]
            members = [m for m in members if m.status is not SeqStatus.FINISHED]
            if not members:
                continue         # it finished (or failed) first: that outcome and its bill stand
            self._aborts.counted(reason)
            for m in members:
                m.delivered_tokens = (delivered[m.index] if m.index < len(delivered) else 0) \
                    if isinstance(delivered, tuple) else delivered
                log.info("request %s aborted (%s) after %d generated tokens", m.request_id, reason, len(m.output_ids))
                try:
                    self._finish(m, "abort")
                except Exception as e:
                    self._fail(m, e)

    def _done(self, seq: Sequence) -> None:
        if seq.group is not None and seq.group.forked:
            return        # a choice: the request leaves the count when its last choice ends (_settle)
        with self._inflight_lock:
            self._inflight -= 1

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """Fail one request: its pages go back, its caller gets the error, nothing else changes.
        A failed request is not billed (it produced nothing the caller can use)."""
        log.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error)
        if seq.group is not None and seq.group.forked:
            if seq.status is not SeqStatus.FINISHED:      # one choice fails alone
                self.scheduler.finish(seq)
                self._settle(seq, error)
            return
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq)
            self._done(seq)
        seq.outbox.put(("error", error))

    def _step(self) -> None:
        # NOTE invariant: one request's failure fails that request alone. Admission failures
        # come back from the scheduler per sequence; a failed forward is retried one sequence at
        # a time to find the one that fails (re-running a chunk rewrites the same KV slots with
        # the same values); sampling and token handling are guarded per sequence.
        scheduled = self.scheduler.schedule()
        for seq, error in self.scheduler.take_failed():
            self._fail(seq, error)
        if not scheduled:
            time.sleep(0.001)
            return
        # An exact hit (num_tokens 0) computes nothing: its row is its stored logits.
        computing = [s for s in scheduled if s.num_tokens > 0]
        # A decode step may choose the tokens itself (engine/decode_graph.py): asked before the
        # forward, since it draws each sampled row's noise from the request's generator.
        draws = self._draws(computing) if computing and len(computing) == len(scheduled) else None
        rows = self._forward(computing, draws) if computing else []
        decoded = self.runner.tokens if draws is not None else None
        scheduled = computing + [s for s in scheduled if s.num_tokens == 0]
        rows += [read_logits(self.cache.pool.kv, s.seq.logits_pages, self.logits_format)
                 for s in scheduled[len(computing):]]
        self.scheduler.after_step(scheduled)
        for seq, error in self.scheduler.take_failed():
            self._fail(seq, error)
        now = time.perf_counter()
        producing = [(s.seq, row) for s, row in zip(scheduled, rows)
                     # failed above, or a prefill chunk that is not the last: no token yet
                     if s.seq.status is not SeqStatus.FINISHED and s.seq.num_computed >= s.seq.num_tokens]
        if not producing:
            return
        firsts = [(seq, row) for seq, row in producing if not seq.output_ids]
        for seq, row in firsts:
            if seq.group is not None and not seq.group.forked:
                producing += [(child, row) for child in self._fork(seq)]
        try:
            with self._sync_check():
                if decoded is not None:
                    step = self._decoded(decoded, computing, producing)
                else:
                    step = sample_batch(torch.stack([row for _, row in producing]),
                                        [q.params for q, _ in producing], [q.generator for q, _ in producing],
                                        [(q.prompt_ids, q.output_ids) for q, _ in producing], self.eos_ids)
            results = step.read()        # the step's one wait for the device
            self.step_timer.collect()    # this step's GPU time, readable now (CUDA events)
        except Exception as e:
            log.exception("sampling a step of %d sequences failed", len(producing))
            for seq, _ in producing:
                self._fail(seq, RuntimeError(f"sampling failed: {e}"))
            return
        for seq, row in firsts:
            self._keep_exact(seq, row)
        for (seq, _), result in zip(producing, results):
            try:
                self._take_token(seq, result, now)
            except Exception as e:
                self._fail(seq, e if isinstance(e, SamplingError) else RuntimeError(f"handling a token failed: {e}"))

    def _draws(self, scheduled: list) -> list | None:
        """How a decode step may draw each sequence's token (DecodeRow.draw; None: greedy, or no
        token this step), or None when some row's token must come from the sampler over the logits:
        penalties or min_tokens change its logits, or it is a first token with choices to fork."""
        decode = self.runner.decode
        if decode is None:
            return None
        out = []
        for s in scheduled:
            seq, p = s.seq, s.seq.params
            if seq.num_computed + s.num_tokens < seq.num_tokens:
                out.append(None)             # a prompt chunk that is not the last: no token, no draw
                continue
            if p.penalized or p.min_tokens > len(seq.output_ids) or (seq.group is not None and not seq.group.forked):
                return None
            out.append(None if is_greedy(p) or seq.generator is None
                       else (draw_knobs(p, decode.vocab), seq.generator))
        return out

    def _decoded(self, decoded: tuple, computing: list, producing: list) -> SampledStep:
        """The tokens the decode step chose, for the rows producing one (in `producing`'s order),
        with the logprobs asked for, as one SampledStep (the step's one copy back)."""
        tokens, nan = decoded
        at = {id(s.seq): j for j, s in enumerate(computing)}
        pos = [at[id(seq)] for seq, _ in producing]
        if pos != list(range(len(computing))):      # a sequence failed after the forward
            index = upload([pos], torch.long, tokens.device)[0]
            tokens, nan = tokens.index_select(0, index), nan.index_select(0, index)
        return packed_step(tokens, nan, lambda: torch.stack([row for _, row in producing]),
                           [q.params.logprobs or 0 for q, _ in producing])

    def _forward(self, scheduled: list, draws: list | None = None) -> list:
        """Logits rows of the scheduled sequences (failed ones taken out of `scheduled`)."""
        work = [(s.num_tokens, s.seq.num_computed + s.num_tokens) for s in scheduled]
        self.step_timer.collect()        # earlier CUDA steps whose end event completed (no wait)
        try:
            started = self.step_timer.start()
            with self._sync_check():
                rows = list(self.runner.forward(scheduled, draws))
            self.step_timer.stop(started, work)
        except Exception as batch_error:
            log.exception("a forward pass of %d sequences failed", len(scheduled))
            rows = []
            for s in list(scheduled):
                try:
                    if len(scheduled) == 1:
                        raise batch_error
                    rows.append(self.runner.forward([s])[0])
                except Exception as e:
                    self._fail(s.seq, RuntimeError(f"forward pass failed: {e}"))
                    scheduled.remove(s)
        return rows

    def _fork(self, first: Sequence) -> list[Sequence]:
        """n > 1: the request's other choices, forked on its first's pages (engine/request_group.py)."""
        return first.group.fork(first, self.cache.fork, self.scheduler.adopt,
                                lambda i: make_generator(first.params, self.loaded.device, choice=i))

    def _keep_exact(self, seq: Sequence, row: torch.Tensor) -> None:
        """After a prompt's first token: an exact hit gives its stored logits' pages back; a
        computed prompt is kept as an exact entry (its tail page and raw logits: the cache's
        store_exact), so its repeat computes nothing. Storing is best effort: a failure is
        logged, never the request's."""
        if seq.logits_pages:
            self.cache.release_logits(seq.blocks)
            return
        if seq.exact is None or seq.exact_hit or seq.status is SeqStatus.FINISHED:
            return
        try:
            self.cache.store_exact(seq.exact, seq.blocks, row, self.logits_format)
        except Exception:
            log.exception("keeping request %s as an exact entry failed", seq.request_id)

    @contextlib.contextmanager
    def _sync_check(self):
        if self.sync_debug is None:
            yield
            return
        torch.cuda.set_sync_debug_mode(self.sync_debug)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def _take_token(self, seq: Sequence, result: RowResult, now: float) -> None:
        if result.nan:
            raise SamplingError("the model produced NaN logits for this request")
        token = result.token
        if seq.params.logprobs:
            seq.logprobs.append(result.top)
            seq.token_logprobs.append(result.token_logprob)
        seq.output_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
        self._after_token(seq, token)

    def _after_token(self, seq: Sequence, token: int) -> None:
        reason = take_token_text(seq, token, self.eos_ids, self.tokenizer)
        emit(seq, final=reason is not None)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        # Right after finish: a FINISHED sequence has always left the in-flight count, so _fail
        # (if anything below raises) neither counts it twice nor leaves it counted.
        self._done(seq)
        seq.finish_reason = reason
        out, last = completion_of(seq, reason, with_text=self.tokenizer is not None)
        if seq.group is not None and seq.group.forked:
            self._settle(seq, (out, last))
            return
        self._bill(seq, out.usage, [(out, last)], out)

    def _settle(self, seq: Sequence, outcome) -> None:
        """One choice of an n > 1 request ended; the request is answered and billed once all have
        (engine/request_group.py): the prompt once, the completions summed."""
        group = seq.group
        if not group.settle(seq, outcome):
            return
        with self._inflight_lock:
            self._inflight -= 1
        usage = group.usage()
        if usage is None:           # every choice failed: the request did
            seq.outbox.put(("error", group.first_error()))
            return
        results = group.results(usage)
        self._bill(seq, usage, results, [out for out, _ in results])

    def _bill(self, seq: Sequence, usage, results: list, final) -> None:
        """Bill `usage`, then hand the caller each choice's last chunk and the final output."""

        def complete(recorded: bool | None = True, error: Exception | None = None) -> None:
            # NOTE: runs after the ledger committed this request (billing thread), so a caller
            # never sees a result that is not billed; a bill that cannot be written fails the
            # request instead of serving it unbilled.
            if error is not None:      # a 503 with Retry-After to an HTTP client (engine/errors.py)
                seq.outbox.put(("error", error if isinstance(error, BillingUnavailable)
                                else BillingUnavailable(f"billing failed: {error}")))
                return
            for _, last in results:
                seq.outbox.put(("delta", last))
            seq.outbox.put(("final", final))
        if self.billing is None:
            complete()
            return
        try:
            entry = self.billing.prepare(seq.tenant, seq.request_id, usage.prompt_tokens, usage.completion_tokens,
                                         usage.hit_tokens_by_tier, usage.prompt_cache_miss_tokens,
                                         cache_write_tokens=usage.cache_write_tokens,
                                         retained_token_seconds=usage.retained_token_seconds)
            self.billing.submit(entry, complete)
        except Exception as e:
            log.exception("billing failed for %s", seq.request_id)
            complete(None, e)

