"""Cache routes: /v1/cache/status, /v1/cache/tree, /v1/cache/lookup, /v1/cache/block_hashes,
/v1/cache/billing, /v1/cache/flush.

Knows: who may see what -- status shows the whole cache to an admin (and to everyone on a
server without keys), with the service's requests in flight and TTFT by source, and to any
other key only that key's own tenant's usage: tier-wide hit counts describe other tenants'
traffic, so they are not every tenant's to read; tree shows an admin every tenant's cached
prefixes and any other key its own tenant's; lookup answers for the caller's own
tenant (the engine salts hashes by tenant, so a tenant can never probe another's cache);
block_hashes gives a router (`tieredkv route`) the caller's tenant's block hashes of a prompt,
the keys this server's KV events name (a router cannot derive the tenant's namespace itself);
billing shows the caller's tenant, and an admin any tenant (?tenant=X) or all of them;
flush is admin-only. Blocking engine and ledger calls run in Starlette's threadpool.
NOTE (issue 28): a tier in trouble never makes status or flush a 500: the tiers' stats are a
state (storage/tiered_cache.py), and what a tier still raises is a 503 naming it (`_tier_call`).
Doesn't know: generation, or how the engine computes a lookup.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from engine.errors import EngineClosedError, QueueFullError
from engine.outputs import TIERS
from service.auth import check_tenant_name, require_admin
from service.context import ctx
from service.errors import APIError, bad_request, from_engine_error
from service.body_parsing import parse_body
from service.schemas import FlushRequest, LookupRequest

router = APIRouter(prefix="/v1/cache")
log = logging.getLogger("tieredkv.service")


async def _engine_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except Exception as e:
        raise from_engine_error(e) from None


async def _tier_call(fn: Any, what: str) -> Any:
    """An engine call that reads or writes the tiers (status, flush): an error that is not the
    engine's own (closed, busy) is a tier in trouble -- 503 with its reason, never a 500."""
    try:
        return await run_in_threadpool(fn)
    except Exception as e:
        if isinstance(e, (APIError, ValueError, EngineClosedError, QueueFullError)):
            raise from_engine_error(e) from None
        log.error("%s failed: a cache tier is in trouble", what, exc_info=e)
        raise APIError(503, f"{what} failed: a cache tier is in trouble ({type(e).__name__}: {e})",
                       code="cache_tier_unavailable") from None


@router.get("/status")
async def status(request: Request, history: bool = False) -> Any:
    c = ctx(request)
    caller = c.caller(request)
    if caller.admin:
        status = await _tier_call(c.engine.cache_status, "cache status")
        # The service's side of the same moment: requests admitted, and TTFT by where prompts came
        # from; with ?history=1 also the hit tokens of the last minutes (the dashboard's first paint).
        service = {"in_flight": c.dispatcher.in_flight, "ttft_by_source": c.metrics.recent_ttft.summary(),
                   "ttft_by_length": c.metrics.recent_ttft.by_length()}
        if history:
            service["hit_history"] = c.history.snapshot()
        return {**status, "service": service}
    ledger = getattr(c.engine, "ledger", None)
    usage = None if ledger is None else (await run_in_threadpool(ledger.tenant, caller.tenant)).to_dict()
    return {"tenant": caller.tenant, "usage": usage,
            "note": "tier-wide cache status is shown to admin keys only"}


@router.get("/tree")
async def tree(request: Request, depth: int = 8, width: int = 8) -> Any:
    """The cached prefixes with their text, as trees (device pool, host slab and disk; chains of
    single children folded): an admin sees every tenant's, any other key its own tenant's only."""
    c = ctx(request)
    caller = c.caller(request)
    for name, value in (("depth", depth), ("width", width)):
        if not 1 <= value <= 64:
            raise bad_request(f"{name}: expected an int in 1..64, got {value}", param=name)
    if not hasattr(c.engine, "prefix_tree"):
        raise APIError(404, "this server's engine cannot list its cached prefixes", code="tree_unavailable")
    tenants = None if caller.admin else [caller.tenant]
    return await _engine_call(c.engine.prefix_tree, tenants, depth=depth, width=width)


async def _prompt_call(request: Request, method: str) -> tuple[str, Any]:
    """engine.<method>(prompt, tenant=...) for a LookupRequest body (prompt, or chat messages run
    through the chat template exactly as /v1/chat/completions does), for the caller's tenant."""
    c = ctx(request)
    c.authenticate(request)
    req = await parse_body(request, LookupRequest)
    caller = c.caller(request, req.user)
    c.check_prompt_size(prompt=req.prompt, messages=req.messages)
    engine = c.engine
    fn = getattr(engine, method)
    if req.messages is not None:
        messages = [m.to_dict() for m in req.messages]
        return caller.tenant, await _engine_call(lambda: fn(engine.apply_chat_template(messages), tenant=caller.tenant))
    return caller.tenant, await _engine_call(fn, req.prompt, tenant=caller.tenant)


@router.post("/lookup")
async def lookup(request: Request) -> Any:
    """What a prompt would hit right now, per tier, for the caller's tenant. Promotes nothing, bills nothing."""
    tenant, result = await _prompt_call(request, "lookup")
    hit = sum(result.hit_tokens_by_tier.values())
    return {"tenant": tenant, "prompt_tokens": result.prompt_tokens, "hit_tokens": hit,
            "miss_tokens": result.prompt_tokens - hit,
            "hit_tokens_by_tier": {t: result.hit_tokens_by_tier.get(t, 0) for t in TIERS}}


@router.post("/block_hashes")
async def block_hashes(request: Request) -> Any:
    """The hashes (hex) of the prompt's full blocks for the caller's tenant, capped at len - 1
    tokens as a request's lookup is: what this server's KV events call these blocks. Same body,
    auth and tenant as /v1/cache/lookup. Reads no tier."""
    tenant, (ids, keys) = await _prompt_call(request, "prompt_keys")
    return {"tenant": tenant, "block_size": ctx(request).engine.block_size, "prompt_tokens": len(ids),
            "hashes": [k.hash.hex() for k in keys]}


@router.get("/billing")
async def billing(request: Request, tenant: str | None = None) -> Any:
    c = ctx(request)
    caller = c.caller(request)
    ledger = getattr(c.engine, "ledger", None)
    if ledger is None and getattr(c.engine, "billing", None) is not None:
        raise APIError(503, "the billing ledger cannot be opened now (see /ready)", code="ledger_unavailable")
    if ledger is None:
        raise APIError(404, "billing is not enabled on this server (the engine has no ledger)", code="billing_disabled")
    if tenant is not None:
        try:
            check_tenant_name(tenant, "tenant")
        except ValueError as e:
            raise bad_request(str(e), param="tenant") from None
    if tenant is not None and tenant != caller.tenant:
        require_admin(caller)
    if tenant is None and caller.admin:
        return await run_in_threadpool(ledger.summary)
    bill = await run_in_threadpool(ledger.tenant, tenant or caller.tenant)
    return bill.to_dict()


@router.post("/flush")
async def flush(request: Request) -> Any:
    """Admin: {"tier": null} pushes every cached block down to disk; {"tier": "device"|"host"|"disk"}
    drops that tier's cached blocks (pages in use are kept)."""
    c = ctx(request)
    require_admin(c.caller(request))
    req = await parse_body(request, FlushRequest, empty_ok=True)
    result: dict = {"flushed": req.tier or "all"}
    if req.tier is None:
        result.update((await _tier_call(c.engine.flush, "flush")).to_dict())
    else:
        await _tier_call(functools.partial(c.engine.drop_tier, req.tier), "flush")
    return {**result, "cache": await _tier_call(c.engine.cache_status, "cache status")}
