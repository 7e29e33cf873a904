"""`tieredkv demo`: a scripted scenario on a real model that shows where prompt tokens come from.

Knows: the story, in four phases --
  document  three questions over one shared manual (tieredkv/demo_document.txt, ~1.5k tokens):
            the first computes it, the next two hit it in the device pool;
  chat      a three-turn chat: each turn hits the earlier turns, the model's answers included;
  host      the device pool is reclaimed (as under memory pressure: its blocks move down to
            host memory) and a question is asked again: hits come from host memory;
  restart   the engine is closed (every cached block flushed to disk) and a new engine opens
            the same cache directory with an empty device pool: hits come from disk;
  remote    (with a remote store only) a second server -- a new engine with its own, empty
            disk -- asks a question again: its hits come from the store the first server wrote
            to (its blocks reached the store through its disk and the flush on close) --
and how each request is measured: hit tokens by tier and miss tokens (the engine's usage),
TTFT (its metrics), cost (the billing ledger's record of the request), and a recompute
baseline per distinct prompt: the same prompt on a second engine over the same weights with no
host or disk tier, under a fresh tenant each time so nothing can hit (max_tokens=1: only its
TTFT is wanted) -- or the request itself when it hit nothing, since it then was a recompute.
`phase_view` and `summary` draw what it measured (rich renderables); a hit that came out
slower than recomputing gets a line saying why (`slow_hit_note`).
Doesn't know: the command line (it gets a cache dir, a progress callback and a phase callback).

With a remote store the demo's tenant is `demo-<random>`, a namespace no earlier run wrote: a
store shared across runs (and servers) must not turn the first question into a hit, and the demo
never deletes anything from a store others may use.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, ContextManager

from storage.disk.preflight import ASIDE_INFIX, LOCK_SUFFIX
from engine.default_model import DEFAULT_MODEL_NAME
from storage.tier_kinds import TIERS
from tieredkv.cli_common import command_name, load_description

BLOCK_SIZE = 16
DEFAULT_MODEL = DEFAULT_MODEL_NAME
TENANT = "demo"
SYSTEM = "You are Halden's support assistant. Answer from the manual, in one or two sentences."
# Questions the default model (SmolLM2-135M) answers right from the document, greedy (checked
# 2026-11-29: "dry cloth", "self-consumption"); it got "E04" and the charging temperature wrong
# ("100 degrees Celsius"), and a showcase that answers wrong undersells what it shows.
QUESTIONS = (
    "How long is the warranty, and what does it cover?",
    "What should I wipe the vents with?",
    "Which mode saves most homes the most money?",
)
CHAT_SYSTEM = "You are a friendly, concise assistant."
CHAT_TURNS = (
    "I am thinking about adding a home battery to my solar panels. Is it worth it?",
    "What size of battery would suit a family of four?",
    "Thanks! What should I ask the installer before I sign anything?",
)
# The demo owns these entries of its cache dir and deletes them at start: kv (the disk tier),
# billing (the ledger), server2 (the second server of the remote phase: its disk tier, with that
# tier's lock and any store moved aside inside it).
_OWNED = {"kv", "billing", "server2"}
# Beside kv the disk tier makes its open lock (kept: deleting a lock file another process may be
# waiting on is a race; it is empty) and, when it finds a damaged store, moves that aside
# (storage/disk/preflight.py; deleted with the rest).
_KV_LOCK = "kv" + LOCK_SUFFIX
_KV_ASIDE = "kv" + ASIDE_INFIX


def document() -> str:
    return resources.files("tieredkv").joinpath("demo_document.txt").read_text(encoding="utf-8")


@dataclass(slots=True)
class Row:
    phase: str
    request: str                 # a short label: "Q1", "turn 2", "Q1 again"
    question: str                # the user message that ends the prompt
    answer: str
    prompt_tokens: int
    hit_tokens_by_tier: dict[str, int]
    hit_tokens: int
    miss_tokens: int
    completion_tokens: int
    ttft_ms: float
    restore_ms: float
    recompute_ttft_ms: float
    speedup: float
    cost_pico: int               # from the ledger's record of this request
    recompute_cost_pico: int     # the same request billed as if every prompt token missed


@dataclass(slots=True)
class Phase:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)


def reset_cache_dir(path: Path) -> None:
    """Delete the demo's own entries; refuse a directory that holds anything else."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"cache_dir: {path} is a file, not a directory")
        names = os.listdir(path)
        foreign = sorted(n for n in names if not _is_owned(n) and n != _KV_LOCK)
        if foreign:
            raise ValueError(f"cache_dir: {path} holds files the demo did not make ({', '.join(foreign[:3])}); "
                             "the demo deletes its cache dir at start, so give it an empty or a demo directory")
        for name in filter(_is_owned, names):
            entry = path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    path.mkdir(parents=True, exist_ok=True)


def _is_owned(name: str) -> bool:
    """An entry the demo deletes at start (its lock file is the demo's too, but kept)."""
    return name in _OWNED or (name.startswith(_KV_ASIDE) and len(name) > len(_KV_ASIDE))


BUILD_STEP = ("Building the engines: one with no cache (the baseline to recompute against) and one with "
              "device, host and disk tiers")


class Demo:
    def __init__(self, cache_dir: Path, model: str | None = None, max_tokens: int = 16, device: str = "auto",
                 step: Callable[[str], ContextManager] = lambda _: contextlib.nullcontext(),
                 on_phase: Callable[[Phase], None] = lambda _: None, remote_url: str | None = None) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
            raise ValueError(f"max_tokens: expected an int in [1, 256], got {max_tokens!r}")
        self.cache_dir = Path(cache_dir).expanduser().absolute()
        self.model = model
        self.max_tokens = max_tokens
        self.device = device
        self.step = step
        self.on_phase = on_phase
        self.remote_url = remote_url
        self.tenant = TENANT if remote_url is None else f"{TENANT}-{uuid.uuid4().hex[:8]}"
        self._baseline_ttft: dict[tuple[int, ...], float] = {}
        self._fresh = 0
        self.engine: Any = None
        self.baseline: Any = None

    def run(self) -> dict[str, Any]:
        """Play every phase; returns the report (one JSON-ready dict)."""
        from tieredkv import CacheConfig

        started = time.perf_counter()
        reset_cache_dir(self.cache_dir)
        cache = CacheConfig(block_size=BLOCK_SIZE, device_memory="512MiB", host_memory="512MiB",
                            disk_dir=str(self.cache_dir / "kv"), disk_capacity="4GiB", remote_url=self.remote_url)
        # NOTE: torch and the engine are imported inside the step, so its line shows at once
        # (importing them takes seconds).
        with self.step(load_description(self.model, None)):       # load_model converts under the default root
            from engine.model import load_model
            from tieredkv import Engine
            loaded = load_model(self.model, device=self.device)
        with contextlib.ExitStack() as stack:
            # Seconds of silence otherwise (issue 40): two engines' pools, the host slab, the disk store.
            with self.step(BUILD_STEP):
                # The baseline engine shares the weights (no second copy) but has no host or disk tier.
                self.baseline = Engine.from_loaded(loaded, CacheConfig(block_size=BLOCK_SIZE, device_memory="256MiB",
                                                                       host_memory=0, disk_dir=None))
                stack.callback(self.baseline.close)
                self.engine = Engine.from_loaded(loaded, cache)      # its ledger: <cache_dir>/billing
                stack.callback(lambda: self.engine.close())            # the engine of the moment (restart swaps it)
            # The second server of the remote phase: its own empty disk, the same store. Its bills go
            # to the demo's one ledger, so the report's costs stay the ledger's.
            second = CacheConfig(block_size=BLOCK_SIZE, device_memory="512MiB", host_memory="512MiB",
                                 disk_dir=str(self.cache_dir / "server2" / "kv"), disk_capacity="4GiB",
                                 remote_url=self.remote_url)
            phases = self._play(lambda: Engine.from_loaded(loaded, cache),
                                lambda: Engine.from_loaded(loaded, second, ledger_dir=str(self.cache_dir / "billing")))
            prices = self.engine.ledger.prices.to_dict()
        rows = [r for ph in phases for r in ph.rows]
        totals = {"requests": len(rows), "prompt_tokens": sum(r.prompt_tokens for r in rows),
                  "hit_tokens_by_tier": {t: sum(r.hit_tokens_by_tier[t] for r in rows) for t in TIERS},
                  "hit_tokens": sum(r.hit_tokens for r in rows), "miss_tokens": sum(r.miss_tokens for r in rows),
                  "completion_tokens": sum(r.completion_tokens for r in rows),
                  "cost_pico": sum(r.cost_pico for r in rows),
                  "recompute_cost_pico": sum(r.recompute_cost_pico for r in rows)}
        return {"model": loaded.identity.name, "device": str(loaded.device), "cache_dir": str(self.cache_dir),
                "block_size": BLOCK_SIZE, "max_tokens": self.max_tokens, "prices": prices, "tenant": self.tenant,
                "remote": None if cache.remote is None else cache.remote.redacted,
                "phases": [{"name": ph.name, "title": ph.title, "rows": [asdict(r) for r in ph.rows]} for ph in phases],
                "totals": totals, "elapsed_s": round(time.perf_counter() - started, 2)}

    def _play(self, new_engine: Callable[[], Any], second_server: Callable[[], Any]) -> list[Phase]:
        phases: list[Phase] = []
        with self.step("Warming up"):
            self._recompute_ttft(self._encode([{"role": "user", "content": "Hello!"}]))
        doc = document()
        doc_prompts = [self._encode([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]) for q in QUESTIONS]
        need = max(map(len, doc_prompts)) + self.max_tokens
        if need > self.engine.max_context:
            raise ValueError(f"--model: the demo's shared document takes {need - self.max_tokens:,} tokens "
                             f"(+{self.max_tokens} to generate), but {self.engine.model_name} holds "
                             f"{self.engine.max_context:,} tokens of context; use a model with a context of at "
                             f"least {need:,} tokens (the default, SmolLM2-135M-Instruct, has 8,192)")

        p = self._phase(phases, "document", f"Three questions over one shared manual ({len(doc_prompts[0]):,} tokens)")
        for i, ids in enumerate(doc_prompts):
            self._ask(p, f"Q{i + 1}", QUESTIONS[i], ids)
        self.on_phase(p)

        p = self._phase(phases, "chat", "A three-turn chat: each turn hits the earlier turns, answers included")
        messages = [{"role": "system", "content": CHAT_SYSTEM}]
        chat_prompts = []
        for i, turn in enumerate(CHAT_TURNS):
            messages.append({"role": "user", "content": turn})
            chat_prompts.append(self._encode(messages))
            messages.append({"role": "assistant", "content": self._ask(p, f"turn {i + 1}", turn, chat_prompts[-1])})
        self.on_phase(p)

        p = self._phase(phases, "host", "The device pool is reclaimed: its blocks move to host memory")
        with self.step("Demoting the device pool to host memory"):
            # As capacity pressure would: every unused device block goes one tier down.
            self.engine.demote("device")
        self._ask(p, "Q2 again", QUESTIONS[1], doc_prompts[1])
        self.on_phase(p)

        p = self._phase(phases, "restart", "Restart: close (flush to disk), new engine, empty device pool")
        with self.step("Restarting the engine (flushing every cached block to disk)"):
            self.engine.close()
            self.engine = new_engine()
        self._ask(p, "Q1 again", QUESTIONS[0], doc_prompts[0])
        self._ask(p, "Q3 again", QUESTIONS[2], doc_prompts[2])
        self._ask(p, "turn 3 again", CHAT_TURNS[2], chat_prompts[2])
        self.on_phase(p)

        if self.remote_url is not None:
            p = self._phase(phases, "remote", "A second server, its own empty disk: hits come from the shared store")
            with self.step("Starting a second server on the same remote store"):
                # The first server's close flushes its blocks to disk, and its disk writer forwards
                # them to the store (close waits for that): what a running server's write-behind
                # does over time. (One process holds the ledger at a time: the first one goes.)
                self.engine.close()
                self.engine = second_server()
            self._ask(p, "Q2 again", QUESTIONS[1], doc_prompts[1])
            self._ask(p, "turn 2 again", CHAT_TURNS[1], chat_prompts[1])
            self.on_phase(p)
        return phases

    # ---- one request ---------------------------------------------------------------------
    @staticmethod
    def _phase(phases: list[Phase], name: str, title: str) -> Phase:
        phases.append(Phase(name, title))
        return phases[-1]

    def _encode(self, messages: list[dict]) -> list[int]:
        try:
            return self.engine.apply_chat_template(messages)
        except ValueError:      # a model without a chat template: a plain transcript
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
            return self.engine.encode(text)

    def _ask(self, phase: Phase, label: str, question: str, ids: list[int]) -> str:
        from tieredkv import SamplingParams
        engine = self.engine
        with self.step(f"{phase.name}: {label}"):
            out = engine.generate(ids, SamplingParams(max_tokens=self.max_tokens), tenant=self.tenant)
            if out.usage.prompt_cache_hit_tokens == 0:
                # It hit nothing: it *is* a recompute of this prompt (saves one long prefill).
                self._baseline_ttft.setdefault(tuple(ids), out.metrics.ttft_s * 1e3)
            baseline_ms = self._recompute_ttft(ids)
        u, m = out.usage, out.metrics
        record = dict(engine.ledger.records())[out.request_id]
        prices = engine.ledger.prices
        ttft_ms = m.ttft_s * 1e3
        phase.rows.append(Row(
            phase=phase.name, request=label, question=question, answer=out.text.strip(), prompt_tokens=u.prompt_tokens,
            hit_tokens_by_tier=dict(u.hit_tokens_by_tier), hit_tokens=u.prompt_cache_hit_tokens,
            miss_tokens=u.prompt_cache_miss_tokens, completion_tokens=u.completion_tokens,
            ttft_ms=round(ttft_ms, 1), restore_ms=round(m.restore_s * 1e3, 1), recompute_ttft_ms=round(baseline_ms, 1),
            speedup=round(baseline_ms / ttft_ms, 2) if ttft_ms > 0 else 0.0, cost_pico=record["cost_pico"],
            recompute_cost_pico=u.prompt_tokens * prices.miss + u.completion_tokens * prices.completion))
        return out.text

    def _recompute_ttft(self, ids: list[int]) -> float:
        """TTFT (ms) of `ids` computed from scratch; measured once per distinct prompt."""
        from tieredkv import SamplingParams
        key = tuple(ids)
        if key not in self._baseline_ttft:
            self._fresh += 1
            out = self.baseline.generate(ids, SamplingParams(max_tokens=1), tenant=f"recompute-{self._fresh}")
            # NOTE: a fresh tenant is a fresh namespace, so this prompt cannot hit anything.
            assert out.usage.prompt_cache_hit_tokens == 0, "the recompute baseline hit the cache"
            self._baseline_ttft[key] = out.metrics.ttft_s * 1e3
        return self._baseline_ttft[key]


# ---- drawing -----------------------------------------------------------------------------

LEGEND = ("Prompt: prompt tokens; Device/Host/Disk/Remote: of those, hit in that tier; Miss: computed; TTFT: "
          "time to first token, ms; Recompute: TTFT of the same prompt on an uncached engine, ms; "
          "µ$: the ledger's cost in micro-dollars")


def phase_view(phase: Phase, legend: bool = False) -> Any:
    """The phase's table, then each request's question and the model's answer (and the legend)."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    t = Table(title=f"[bold]{phase.name}[/]: {phase.title}", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, padding=0)
    for col in ("Request", "Prompt", *(t.capitalize() for t in TIERS), "Miss", "TTFT", "Recompute", "Speedup", "µ$"):
        t.add_column(col, justify="left" if col == "Request" else "right", no_wrap=True)
    for r in phase.rows:
        t.add_row(r.request, f"{r.prompt_tokens:,}", *(_count(r.hit_tokens_by_tier[x]) for x in TIERS),
                  _count(r.miss_tokens), f"{r.ttft_ms:,.0f}", f"{r.recompute_ttft_ms:,.0f}", f"{r.speedup:.1f}x",
                  f"{r.cost_pico / 1e6:,.2f}")
    lines = [f"[dim]{LEGEND}[/]"] if legend else []
    lines += [f"{r.request}: {escape(r.question)} → [italic]{escape(_one_line(r.answer))}[/]" for r in phase.rows]
    lines += [f"[dim]{note}[/]" for r in phase.rows if (note := slow_hit_note(r))]
    return Group(t, *lines, "")


def slow_hit_note(r: Row) -> str | None:
    """One line on why a hit shows a speedup below 1x (as the table rounds it), else None."""
    if r.hit_tokens == 0 or round(r.speedup, 1) >= 1.0:
        return None
    tiers = " and ".join(t for t in TIERS if r.hit_tokens_by_tier[t])
    return (f"{r.request}, {r.speedup:.1f}x: recomputing all {r.prompt_tokens:,} tokens takes only "
            f"{r.recompute_ttft_ms:,.0f} ms here, about what reading {r.hit_tokens:,} back from {tiers} costs, "
            f"so this short a hit saves no time (it still bills as a hit)")


def summary(report: dict[str, Any]) -> str:
    from rich.markup import escape
    tot = report["totals"]
    hits = tot["hit_tokens_by_tier"]
    share = tot["hit_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0
    saved = 1 - tot["cost_pico"] / tot["recompute_cost_pico"] if tot["recompute_cost_pico"] else 0.0
    p = report["prices"]
    d = escape(report["cache_dir"])
    return (f"[bold]{tot['prompt_tokens']:,} prompt tokens in {tot['requests']} requests: "
            f"{share:.0%} from the cache[/]\n"
            f"  device {hits['device']:,}, host {hits['host']:,}, disk {hits['disk']:,}"
            + (f", remote {hits['remote']:,}" if report.get("remote") else "") + "; "
            f"computed {tot['miss_tokens']:,}\n"
            f"[bold]Cost ${tot['cost_pico'] / 1e12:.6f}[/] instead of ${tot['recompute_cost_pico'] / 1e12:.6f} "
            f"without the cache ({saved:.0%} less)\n"
            f"  per 1M tokens: miss ${p['miss'] / 1e6:.2f}, hit ${p['device_hit'] / 1e6:.3f}, "
            f"output ${p['completion'] / 1e6:.2f}\n"
            f"{escape(report['model'])} on {report['device']}, {report['elapsed_s']:.1f} s. The cache stays in {d}:\n"
            f"  {command_name()} inspect --cache-dir {d} --tree\n"
            f"  {command_name()} billing --cache-dir {d}")


def _count(n: int) -> str:
    return f"{n:,}" if n else "·"


def _one_line(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
