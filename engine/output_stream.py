"""How a sequence's tokens become what its caller sees.

Knows: when a sequence stops (an end-of-sequence or stop token, a stop string, its length; not
before min_tokens), its text grown incrementally (engine/detokenizer.py), what is streamed when
(a possibly partial UTF-8 character or stop string is held back until it is known), and the
final output with its usage billed by token origin and its timings.
Doesn't know: the model, the scheduler or billing (engine/engine.py runs these on the engine
thread and hands the final chunk to the caller once the ledger committed it).
"""
from __future__ import annotations

import time

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestMetrics, StreamChunk, Usage
from engine.retain_spans import retention_usage
from engine.sequence import Sequence
from storage.tiered_cache import TIERS


def take_token_text(seq: Sequence, token: int, eos_ids, tokenizer) -> str | None:
    """Grow the sequence's text by its newest token; the reason it stops now ("stop", "length"),
    or None. A stop string found cuts the text before it (after it with
    include_stop_str_in_output); an end or stop token's own text is left out likewise, as vLLM
    does. Nothing stops the sequence before it has min_tokens (the sampler keeps end and stop ids
    from being drawn until then; a stop string must end past the text of those tokens)."""
    p = seq.params
    counting = len(seq.output_ids) > p.min_tokens      # this token is past the first min_tokens
    stop_token = counting and ((token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids)
    reason = "stop" if stop_token else None
    if tokenizer is not None:
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(tokenizer)
        if not stop_token or p.include_stop_str_in_output:
            seq.text = seq.detok.add(token)      # == decode(output_ids), in O(new tokens)
        if not counting:
            seq.stop_floor = len(seq.text)
        elif p.stop:
            found = None
            for stop in p.stop:
                i = seq.text.find(stop, max(0, seq.sent_chars - len(stop), seq.stop_floor - len(stop) + 1))
                if i >= 0 and (found is None or i < found[0]):
                    found = (i, stop)
            if found is not None:
                i, stop = found
                seq.text, reason = seq.text[:i + (len(stop) if p.include_stop_str_in_output else 0)], "stop"
                seq.stop_string = stop
    if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_len):
        reason = "length"
    return reason


def emit(seq: Sequence, final: bool) -> None:
    """Stream what is new since the last chunk; on the final token keep it for the final chunk
    (sent only once the request is billed)."""
    end = len(seq.text)
    if not final:
        # Hold back a possibly partial UTF-8 character and a possibly partial stop string.
        if seq.text.endswith("\ufffd"):
            end -= 1
        if seq.params.stop and not seq.params.include_stop_str_in_output:
            end = max(seq.sent_chars, end - (max(len(s) for s in seq.params.stop) - 1))
    text = seq.text[seq.sent_chars:end]
    ids = seq.output_ids[seq.sent_tokens:]
    if not final and not text and not ids:
        return
    first = seq.sent_tokens == 0
    seq.sent_chars, seq.sent_tokens = max(seq.sent_chars, end), len(seq.output_ids)
    if not final:
        hits = dict(seq.hit_tokens_by_tier) if first and seq.hit_tokens_by_tier is not None else None
        seq.outbox.put(("delta", StreamChunk(seq.request_id, text, ids, index=seq.index, hit_tokens_by_tier=hits,
                                             **logprobs_of_last(seq, len(ids)))))
    else:
        seq.pending_final = (text, ids)


def usage_of(seq: Sequence, reason: str) -> Usage:
    """What a finished sequence is billed. NOTE billing of an aborted one (reason "abort": its
    caller left, engine/abort.py): the prompt as served -- every prompt token, by the origin
    decided at its first admission, once it was admitted (its hits held or loading, its prefill
    begun), none before --, and the completion tokens that reached the caller (never more than
    were generated). hit + miss == prompt holds either way (checked in Usage.__post_init__)."""
    hits = seq.hit_tokens_by_tier or dict.fromkeys(TIERS, 0)
    prompt, completion = len(seq.prompt_ids), len(seq.output_ids)
    if reason == "abort":
        if seq.hit_tokens_by_tier is None:
            prompt = 0              # never admitted: nothing was served
        if seq.delivered_tokens is not None:
            completion = min(completion, seq.delivered_tokens)
    written, token_seconds, refused = retention_usage(seq.retain, prompt, sum(hits.values()) if prompt else 0,
                                                      seq.block_size)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, hit_tokens_by_tier=dict(hits),
                 prompt_cache_miss_tokens=prompt - sum(hits.values()), cache_write_tokens=written,
                 retained_token_seconds=token_seconds, retention_refused_tokens=refused)


def completion_of(seq: Sequence, reason: str, with_text: bool) -> tuple[CompletionOutput, StreamChunk]:
    """A finished sequence's output (usage as billed, timings) and its final stream chunk."""
    usage = usage_of(seq, reason)
    now = time.perf_counter()
    metrics = RequestMetrics(ttft_s=(seq.first_token_at or now) - seq.arrival, restore_s=seq.restore_s,
                             total_s=now - seq.arrival, queue_s=(seq.admitted_at or now) - seq.arrival,
                             recomputed_hit_tokens=seq.recomputed_hit_tokens)
    text, ids = seq.pending_final
    out = CompletionOutput(seq.request_id, seq.text if with_text else "", list(seq.output_ids),
                           reason, usage, metrics, list(seq.prompt_ids),
                           seq.logprobs if seq.params.logprobs else None,
                           seq.token_logprobs if seq.params.logprobs else None, index=seq.index,
                           stop_string=seq.stop_string)
    last = StreamChunk(seq.request_id, text, ids, reason, usage, metrics, index=seq.index,
                       stop_string=seq.stop_string, **logprobs_of_last(seq, len(ids)))
    return out, last


def logprobs_of_last(seq: Sequence, n: int) -> dict:
    """StreamChunk's logprobs fields for the sequence's last n output tokens (none when not asked)."""
    if not seq.params.logprobs:
        return {}
    start = len(seq.output_ids) - n
    return {"logprobs": seq.logprobs[start:], "token_logprobs": seq.token_logprobs[start:]}
