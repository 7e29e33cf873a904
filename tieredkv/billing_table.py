"""`tieredkv billing`'s tables: per-tenant tokens by origin and cost; then, where any tenant
bought retention, its cache writes by retention class and its retained token-hours.

Knows: the ledger's JSON (engine/billing.py's `to_dict`/`summary`, or GET /v1/cache/billing),
read leniently (a field an older server does not send reads as 0), and how to draw it.
Doesn't know: where the JSON came from (tieredkv/cli.py's `billing` reads it).
"""
from __future__ import annotations

from typing import Any, Optional

from rich.markup import escape

from engine.outputs import RETENTION_CLASSES, TIERS      # a light module: no torch
from tieredkv.cli_common import micro, narrow_table, out


def print_bills(body: dict[str, Any], tenant: Optional[str]) -> None:
    """One tenant's bill (`tenant` given: the body is its bill) or every tenant's and the total."""
    bills = [body] if "tenant" in body else list(body.get("tenants", {}).values())
    total = body.get("total", body)
    t = narrow_table(title="Billing" + (f" — tenant {tenant}" if tenant else ""),
                     caption="Device/Host/Disk/Remote: prompt tokens hit in that tier; Miss: computed; Output: "
                     "completion tokens; cost in micro-dollars")
    # The tenant name folds onto more lines rather than vanish (rich squeezed a wrappable
    # column to nothing at 80 columns); numbers never wrap.
    t.add_column("Tenant", justify="left", min_width=8, max_width=14, overflow="fold")
    for col in ("Reqs", "Prompt", "Device", "Host", "Disk", "Remote", "Miss", "Output", "Cost µ$"):
        t.add_column(col, justify="right", no_wrap=True)

    def row(name: str, b: dict) -> list[str]:
        hits = b.get("hit_tokens_by_tier", {})
        return [name, f"{b['requests']:,}", f"{b['prompt_tokens']:,}", *(f"{hits.get(x, 0):,}" for x in TIERS),
                f"{b['miss_tokens']:,}", f"{b['completion_tokens']:,}", micro(b["cost_pico"])]
    for b in bills:
        t.add_row(*row(escape(b["tenant"]), b))
    if "total" in body and len(bills) > 1:
        t.add_section()
        t.add_row(*row("total", body["total"]))
    out.print(t)
    if _retained(total) or any(_retained(b) for b in bills):
        _print_retention(bills, body.get("total") if len(bills) > 1 else None)
    n = total["requests"]
    out.print(f"total ${total['cost_pico'] / 1e12:.6f} for {n:,} request{'s' if n != 1 else ''}")
    waiting = body.get("uncommitted", {}).get("tenants", {})
    if waiting:
        reqs = sum(b["requests"] for b in waiting.values())
        out.print(f"plus {reqs:,} bill{'s' if reqs != 1 else ''} of {', '.join(sorted(waiting))} not in the ledger "
                  f"yet, waiting in {', '.join(body['uncommitted']['where'])}: the next start commits them")


def _retained(b: dict) -> bool:
    return any((b.get("cache_write_tokens") or {}).values()) or bool(b.get("retained_token_seconds"))


def _print_retention(bills: list[dict], total: Optional[dict]) -> None:
    t = narrow_table(title="Cache writes and retention",
                     caption="Write 5m/1h/24h: prompt tokens written into the cache under that retention (of "
                     "Miss, billed at the miss price times its multiplier); Retained tok·h: token-hours of "
                     "retention bought")
    t.add_column("Tenant", justify="left", min_width=8, max_width=14, overflow="fold")
    for col in ("Write 5m", "Write 1h", "Write 24h", "Retained tok·h"):
        t.add_column(col, justify="right", no_wrap=True)

    def row(name: str, b: dict) -> list[str]:
        writes = b.get("cache_write_tokens") or {}
        return [name, *(f"{writes.get(c, 0):,}" for c in RETENTION_CLASSES),
                f"{(b.get('retained_token_seconds') or 0) / 3600:,.2f}"]
    for b in bills:
        t.add_row(*row(escape(b["tenant"]), b))
    if total is not None:
        t.add_section()
        t.add_row(*row("total", total))
    out.print(t)
