"""A request's blocks: the one boundary between the engine's scheduler and the cache (vLLM v1's
`KVCacheBlocks` between its scheduler and kv_cache_manager).

Knows: the typed answers that cross it and the calls that make them. The engine asks once per
admission (`plan`: what the cache holds of a chain, where, and -- once the scheduler chose
from that answer -- the pages held and the loads started) and gets a `BlockPlan` carrying the
request's `RequestBlocks`: an opaque handle whose page ids only the cache writes (the model
runner reads the block table as a tuple). While it runs, the engine hands back what it computed
(`computed`: full blocks made findable), asks for room (`growth`, `grow`), joins a load that ended
(`join`), forks a choice (`fork`), and once, when it ends (finished, failed, preempted,
cancelled), hands the handle back (`finish`). Also here: the promotion verbs these are built on
(`start_load`, `finish_load`, `cancel_load`, `load_now`: storage tests and tools drive them
directly).
Doesn't know: sequences, budgets, tenants or deadlines -- the scheduler decides which matched
blocks a request takes (`choose`, handed to `plan` and called with no lock held, so it may
preempt others) --, nor how blocks are read (storage/loader.py).

A part of TieredKVCache (a base class of it: `pool`, `loader`, `transfer`, `tiers`, `_lock`,
`match`, `allocate`, `register`, `release`, `_share`, `_is_shared` and `_copy_on_write` are the
cache's). Every method takes the tiers' lock for its page changes, never across I/O or `choose`.
Handles are the engine thread's: one request's handle is used by one thread at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from storage.hashing import BlockKey
from storage.hit_account import HitAccount
from storage.load_outcome import Acquired, finish
from storage.load_records import Fill, Load, ProbeAnswer
from storage.tiers import TIERS


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """Per matched block (in prompt order): its key and the tier that holds it. Stops at the
    first block no tier holds, so `blocks` is always a prefix of the keys asked about."""
    blocks: tuple[tuple[BlockKey, str], ...]

    def __len__(self) -> int:
        return len(self.blocks)

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for _, tier in self.blocks:
            out[tier] = out.get(tier, 0) + block_size
        return out


@dataclass(eq=False, slots=True)
class RequestBlocks:
    """One request's pages, held in the cache. The engine reads `table` (its block table, a
    tuple: one page per block, in order), `logits` (an exact hit's stored-logits pages, until its
    first token is sampled), `registered` (leading blocks findable in the cache) and whether a
    load is in flight; only the cache changes them."""
    _pages: list[int] = field(default_factory=list)
    _logits: list[int] = field(default_factory=list)
    _load: Load | None = None          # blocks after `_pages` being filled (joined by `join`)
    _registered: int = 0
    _prefix: int | None = None         # not held whole: at most this many blocks kept (an exact chain)
    _whole: int = 0                    # the chain's length when `_prefix` is set
    _kv: int = 0                       # held whole: its first `_kv` blocks are KV, the rest logits,
    _full: int = 0                     # and its first `_full` blocks are full ones (a tail is not)

    @property
    def table(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def logits(self) -> tuple[int, ...]:
        return tuple(self._logits)

    @property
    def registered(self) -> int:
        return self._registered

    @property
    def load(self) -> Load | None:
        """The load in flight (read it, never change it: for deadlines' spans and tests)."""
        return self._load

    def ready(self) -> bool:
        """No load in flight, or its every fill ended."""
        return self._load is None or self._load.ready()

    def __len__(self) -> int:
        return len(self._pages)


@dataclass(frozen=True, slots=True)
class Take:
    """The scheduler's choice over a match: its first `blocks` matched blocks. With a split
    (compute-or-load): blocks [0, device) are acquired, [device, start) recomputed by the
    request itself, and [start, blocks) loaded from the back when `loaded`."""
    blocks: int
    device: int | None = None
    start: int = 0
    loaded: bool = True


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """What `plan` answers: the match (which tier holds each block), what `choose` answered
    (a Take; None or False: not admitted, nothing held), and, admitted, the request's handle.
    `held`: the tier each block it holds now is billed from; `recomputed`: a split's blocks the
    request computes (billed tiers); `back`: a split's back load (billed tiers); `waiting`: its
    whole prefix is loading (`join` before it runs). The load in flight covers blocks
    [load_start, load_end) held in `load_tiers`."""
    match: CacheMatch
    verdict: object
    blocks: RequestBlocks | None = None
    held: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    waiting: bool = False
    load_start: int = 0
    load_end: int = 0
    load_tiers: tuple[str, ...] = ()
    restore_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Joined:
    """What `join` answers: the tiers of the blocks that arrived (now the handle's, after its
    pages), the tiers planned, and the load's time."""
    arrived: tuple[str, ...]
    planned: tuple[str, ...]
    restore_s: float


@dataclass(frozen=True, slots=True)
class Growth:
    """Pages a request needs to cover its next tokens: `pages` new ones, and the page at
    `copy_at` copied first when another holder or the cache's index has it (copy-on-write)."""
    pages: int
    copy_at: int | None = None

    @property
    def total(self) -> int:
        return self.pages + (self.copy_at is not None)


class KVBlocks:
    # ---- admission -----------------------------------------------------------------------
    def plan(self, keys: Sequence[BlockKey], probed: ProbeAnswer | None, hits: HitAccount,
             choose: Callable[[CacheMatch], object], prefix: int | None = None, logits: int = 0) -> BlockPlan:
        """One admission: match `keys` (with the linked tiers' probe answers `probed`), let
        `choose` pick (called with no lock held; a Take admits), then hold its pages and start its
        fills. `prefix`, `logits`: `keys` is an exact entry's chain -- not held whole, at most its
        first `prefix` blocks are kept; held whole, its last `logits` blocks are its logits."""
        match = self.match(keys, probed)
        take = choose(match)
        if not isinstance(take, Take):
            return BlockPlan(match, take)
        blocks = match.blocks[:take.blocks]
        kv, bs = len(keys) - logits, self.layout.block_size
        shape = dict(_prefix=prefix, _whole=len(keys), _kv=kv,
                     _full=sum(len(k.token_ids) == bs for k in keys[:kv])) if prefix is not None else {}
        if take.device is not None:       # a split: the device front now, the back on the loader
            front = self.finish_load(self.start_load(CacheMatch(blocks[:take.device])))
            if len(front.pages) < take.device:      # the pool changed under us: admitted later
                self.release(front.pages)
                return BlockPlan(match, None)
            recomputed = self._recomputed(blocks[take.device:take.start], hits)
            back = self.start_load(CacheMatch(blocks[take.start:]), hits) if take.loaded else None
            handle = RequestBlocks(list(front.pages), _load=back, _registered=len(front.pages), **shape)
            span = (take.start, take.start + len(back.fills), tuple(back.tiers)) if back is not None else (0, 0, ())
            return BlockPlan(match, take, handle, held=front.tiers, recomputed=recomputed, back=span[2],
                             load_start=span[0], load_end=span[1], load_tiers=span[2], restore_s=front.restore_s)
        load = self.start_load(CacheMatch(blocks), hits)
        handle = RequestBlocks(**shape)
        if load.pending:
            first = next(i for i, f in enumerate(load.fills) if f is not None)
            handle._load = load
            return BlockPlan(match, take, handle, waiting=True, load_start=first, load_end=len(load.fills),
                             load_tiers=tuple(load.tiers[first:]))
        acquired = self._keep(handle, self.finish_load(load))
        return BlockPlan(match, take, handle, acquired.tiers, restore_s=acquired.restore_s)

    def _keep(self, handle: RequestBlocks, acquired: Acquired) -> Acquired:
        """Acquired pages become the handle's, after its own. An exact chain held whole keeps its
        logits pages apart; not whole, it is a prefix hit, capped (the pages past it given back)."""
        pages, tiers = list(acquired.pages), acquired.tiers
        registered = len(pages)
        if handle._prefix is not None and not handle._pages:
            if len(pages) == handle._whole:
                pages, handle._logits = pages[:handle._kv], pages[handle._kv:]
                tiers, registered = tiers[:handle._kv], handle._full
            elif len(pages) > handle._prefix:
                self.release(pages[handle._prefix:])
                pages, tiers = pages[:handle._prefix], tiers[:handle._prefix]
                registered = len(pages)
        handle._pages.extend(pages)
        handle._registered += registered
        return Acquired(tuple(pages), tuple(tiers), acquired.restore_s)

    def join(self, handle: RequestBlocks, tokens: int = 0, abandon: bool = False) -> Joined:
        """The handle's load ended (or, `abandon`, its request stops waiting): the blocks that
        arrived join its pages (registered: the cache holds them), the rest are given back
        (storage/load_outcome.py). `tokens`: the tokens its request has KV for, which must be
        exactly its pages' (every one registered), or the join raises (its pages given back)."""
        load, handle._load = handle._load, None
        acquired = self.finish_load(load, abandon=abandon)
        if len(handle._pages) != handle._registered or tokens != len(handle._pages) * self.layout.block_size:
            self.release(acquired.pages)
            raise RuntimeError(f"compute-or-load join out of step: {len(handle._pages)} pages, "
                               f"{handle._registered} registered, {tokens} tokens computed")
        kept = self._keep(handle, acquired)
        return Joined(kept.tiers, tuple(load.tiers), kept.restore_s)

    def load_back(self, handle: RequestBlocks, match: CacheMatch, hits: HitAccount) -> tuple[str, ...]:
        """A running request's blocks after its pages, found late (engine/probe_wait.py): pages
        held and fills started for `match`, joined later (`join`). The tiers billed (empty:
        nothing planned)."""
        load = self.start_load(match, hits)
        if not load.pages:
            return ()
        handle._load = load
        return tuple(load.tiers)

    # ---- while it runs -------------------------------------------------------------------
    def computed(self, handle: RequestBlocks, keys: Sequence[BlockKey], tokens: int) -> None:
        """The request has KV for `tokens` tokens: its full blocks past the registered ones
        (`keys`: its full blocks' keys) become findable (register)."""
        bs = self.layout.block_size
        while (handle._registered + 1) * bs <= tokens:
            self.register(handle._pages[handle._registered], keys[handle._registered])
            handle._registered += 1

    def growth(self, handle: RequestBlocks, computed: int, upto: int) -> Growth:
        """What covering tokens [computed, upto) takes: new pages, and whether the page the next
        token goes into must be copied first (shared by a fork, or cached: an exact entry's tail)."""
        at = computed // self.layout.block_size
        need = max(0, -(-upto // self.layout.block_size) - len(handle._pages))
        return Growth(need, at if at < len(handle._pages) and self._is_shared(handle._pages[at]) else None)

    def grow(self, handle: RequestBlocks, growth: Growth) -> bool:
        """The pages `growth` asks for (the copy first). False, and nothing changed, when the
        pool has not enough pages now."""
        if not self.can_allocate(growth.total):     # the engine thread alone allocates: still so below
            return False
        if growth.copy_at is not None:     # the copy runs with the lock free (SharedPages._copy_on_write)
            handle._pages[growth.copy_at] = self._copy_on_write(handle._pages[growth.copy_at])
        handle._pages.extend(self.allocate(growth.pages))
        return True

    def fork(self, handle: RequestBlocks) -> RequestBlocks:
        """A second holder of the handle's pages (a choice forked from its request's first)."""
        self._share(handle._pages)
        return RequestBlocks(list(handle._pages), _registered=handle._registered)

    def release_logits(self, handle: RequestBlocks) -> None:
        """An exact hit's first token is sampled: its stored logits' pages go back."""
        logits, handle._logits = handle._logits, []
        self.release(logits)

    def finish(self, handle: RequestBlocks) -> None:
        """The request is done with its blocks (finished, failed, preempted or cancelled): a load
        in flight is cancelled, every page given back (registered ones stay cached, evictable)."""
        if handle._load is not None:
            self.cancel_load(handle._load)
            handle._load = None
        pages, handle._pages, handle._logits = handle._pages + handle._logits, [], []
        handle._registered = 0
        self.release(pages)

    # ---- promotion -----------------------------------------------------------------------
    def start_load(self, match: CacheMatch, hits: HitAccount | None = None) -> Load:
        """Hold device pages for a matched prefix and start filling the host/disk ones on the
        loader (storage/loader.py). Returns at once: no copy, read or decode happens here.

        A device hit is acquired; a block another request is filling now shares that fill's
        page; any other block gets a new page (refcount: the fill's and the request's), left
        unregistered until filled. Stops early (a shorter prefix) when the pool is out of pages
        or the block left every tier since match(). `hits`: the request's hit account
        (storage/hit_account.py), which gives each new fill its billed tier.
        NOTE: a block's billed tier is decided once, when its fill is made (HitAccount.tier_of), and
        carried on the fill (Fill.billed_tier): every request waiting for the fill is billed from it, and
        the loader counts the promotion from it, so hits and promotions per tier always agree.
        """
        hits = HitAccount() if hits is None else hits
        with self._lock:
            pages: list[int] = []
            tiers: list[str] = []
            fills: list[Fill | None] = []
            tokens: list[int] = []
            new: list[Fill] = []
            for key, tier in match.blocks:
                page = self.pool.page_of(key)
                if page is not None:
                    self.pool.acquire(page)
                    pages.append(page)
                    tiers.append("device")
                    fills.append(None)
                    tokens.append(len(key.token_ids))
                    continue
                fill = self.loader.inflight.get(key.hash)
                # A fill whose read was given up (no load waited for it) is never waited for again.
                if fill is None or fill.key.token_ids != key.token_ids or fill.given_up:
                    if not self.pool.can_allocate(1):
                        break
                    # Allocate first, then look the block up: the allocation may evict a device
                    # page whose demotion pushes this very block out of a full host tier.
                    page = self.pool.allocate(1)[0]     # the fill's reference
                    source = self._source_of(key, tier)
                    if source is None:
                        self.pool.release(page)
                        break   # the block left every tier since match(): the prefix ends here
                    fill = Fill(key, page, source, billed_tier=hits.tier_of(key, source))
                    self.loader.inflight[key.hash] = fill
                    new.append(fill)
                self.pool.acquire(fill.page)            # the request's reference
                self.loader.wait_for(fill)
                pages.append(fill.page)
                tiers.append(fill.billed_tier)
                fills.append(fill)
                tokens.append(len(key.token_ids))
            # NOTE: pages just allocated may still be copying their evicted blocks out (CUDA):
            # the loader's stream waits for those copies before it writes the pages (a mark, not
            # a CPU wait here: the copies wait for the forward in flight).
            self.loader.start(new, after=self.transfer.issued() if new else None)
            return Load(pages, tiers, fills, tokens)

    def _source_of(self, key: BlockKey, matched: str) -> str | None:
        """Where a fill planned now reads the block: the host, else a local tier below that
        holds it, else the tier that needs a probe if match() found it there."""
        if self.host.enabled and self.host.slot_of(key) is not None:
            return "host"
        for below in self.tiers.lower:
            if below.contains(key) if below.local else below.name == matched:
                return below.name
        return None

    def finish_load(self, load: Load, abandon: bool = False) -> Acquired:
        """A ready Load (load.ready()) as the prefix its request keeps: pages up to the first
        block that failed to fill (a damaged or vanished block ends the prefix; the request
        computes the rest), the pages after it given back. `abandon`: the load is not ready and
        its request stops waiting (its deadline passed): it keeps the blocks that arrived, up to
        the first that did not; the fills still running end on their own pages, never on the
        request's (storage/load_outcome.py)."""
        with self._lock:
            acquired = finish(self.tiers, load, abandon)
            given_up = self.loader.stop_waiting(load.fills)
        for read in given_up:     # no request waits for these reads: their bytes stop crossing the link
            read.cancel()
        return acquired

    def _recomputed(self, blocks: Sequence[tuple[BlockKey, str]], hits: HitAccount | None = None) -> tuple[str, ...]:
        """Matched blocks a request recomputes by choice (compute-or-load, engine/restore_planner.py):
        the tier each is billed from -- the one match() found it in, by the request's hit account
        as start_load() would bill it (HitAccount.tier_of) -- counted as a hit and a recompute of that
        tier. Nothing is read, moved or held."""
        hits = HitAccount() if hits is None else hits
        with self._lock:
            out = []
            for key, found in blocks:
                tier = hits.tier_of(key, found)
                self.tiers.counters[tier].hits += 1
                self.tiers.counters[tier].hit_tokens += len(key.token_ids)
                self.tiers.counters[tier].recomputed += 1
                out.append(tier)
            return tuple(out)

    def cancel_load(self, load: Load) -> None:
        """The request behind a Load is gone: give its pages back now. Fills in flight finish on
        their own references (their pages become cached blocks or free pages when done); a remote
        read no other request waits for is cut off (storage/loader.py)."""
        with self._lock:
            for page in load.pages:
                self.pool.release(page)
            given_up = self.loader.stop_waiting(load.fills)
        for read in given_up:
            read.cancel()

    def load_now(self, match: CacheMatch) -> Acquired:
        """start_load() and wait for it: device pages for a matched prefix, filled (tests, tools)."""
        load = self.start_load(match)
        load.wait()
        return self.finish_load(load)

