"""The `tieredkv` command line: serve, route, demo, status, inspect, verify, billing.

Knows: the commands and their options; the cache layout (the KV store in <cache>/kv, the
ledger in <cache>/billing); which command reads a running server (httpx) and which reads the
files (read-only where it can); how to draw the answers (rich tables, or one JSON object with
--json). Errors and exit statuses: tieredkv/cli_common.py.
Doesn't know: how the engine, tiers or service work inside. torch, the engine and the service
are imported inside the commands that need them, so `tieredkv --help` stays fast.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from tieredkv.cli_common import (CLIError, api_key_of, cache_root, err, existing_dir, friendly, get_json, narrow_table,
                                 out, print_json, server_url, spinner)
from tieredkv.cli_common import CACHE_HELP, cache_default, disk_seal_of, open_disk_tier
from tieredkv import cli_serve
from tieredkv.cli_flags import translate
from storage.config import format_size, parse_size
from storage.tier_health import Span, StatusLine
from storage.tier_kinds import TIERS, kind_of, kinds

app = typer.Typer(help="tieredkv: a tiered KV-cache store for LLM inference (device -> host -> disk).\n\n"
                  "Exit status: 0 ok, 1 failure (server unreachable, HTTP error, damage found), "
                  "2 bad input (bad size, missing cache dir).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  # Help is click's plain text, as vLLM's argparse prints it: an option's names on a
                  # line of their own when they are long, never cut at any width or when piped (typer's
                  # rich panels squeezed a flag to `--served-model-n…` at 80 columns).
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})
URL_HELP = "Server URL (default $TIEREDKV_URL or http://127.0.0.1:8000)."
KEY_HELP = "API key, if the server has keys (default $TIEREDKV_API_KEY)."
JSON_HELP = "Print one JSON object instead of tables."


def show_version(value: bool) -> None:
    if value:
        from tieredkv import __version__
        out.print(f"tieredkv {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=show_version),
) -> None:
    # The options of `tieredkv` itself (the app's help text is Typer(help=...) above).
    return None


_STYLES = {"warn": "bold yellow", "alert": "bold red"}


def drawn(row: StatusLine) -> str:
    """A tier's status line (storage/tier_health.py) as rich markup: its values escaped, its sizes
    formatted, its styled spans bold."""
    def span(s: Span) -> str:
        text = escape(format_size(s.nbytes) if s.nbytes is not None else s.text)
        return f"[{_STYLES[s.style]}]{text}[/]" if s.style else text
    return "".join(span(s) for s in row.spans)


def held_in_memory(billing: dict) -> str:
    """" (12 in memory: 3 KiB of its 16 MiB bound)" when bills are held in memory, else ""."""
    n = billing.get("held_in_memory")
    if not n:
        return ""
    return (f" ({n} in memory: {format_size(billing.get('memory_bytes') or 0)} of its "
            f"{format_size(billing.get('memory_bound') or 0)} bound)")


# ---- serve, route: tieredkv/cli_serve.py ---------------------------------------------

app.command()(cli_serve.serve)
app.command()(cli_serve.route)
app.command("kv-events-keys")(cli_serve.kv_events_keys)


# ---- demo --------------------------------------------------------------------------------

@app.command()
@friendly
def demo(
    cache_dir: Optional[str] = typer.Option(None, help="Demo cache dir (default: demo/ in the cache root). It is "
                                            "CLEARED at start so every run tells the same story; a dir holding "
                                            "anything the demo did not make (kv/, billing/, server2/, kv's lock) is refused."),
    model: Optional[str] = typer.Option(None, help="Model (default SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(16, help="Tokens generated per request."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    remote_url: Optional[str] = typer.Option(None, help="A Valkey/Redis store (valkey://host:6379, ...): the demo "
                                             "ends with a second server reading the first's blocks from it. Only "
                                             "this flag turns it on ($TIEREDKV_REMOTE_URL does not)."),
) -> None:
    """Play a scenario on a real model: shared document, chat, host tier, restart from disk.

    Each phase prints a table: hit tokens by tier, misses, TTFT, speedup over recomputing
    the same prompt on an uncached engine, and the ledger's cost. Clears its cache dir first.
    With --remote-url, one more phase: a second server with an empty disk hits the shared store.
    """
    from tieredkv.demo import Demo, phase_view, summary
    root = Path(cache_dir).expanduser().absolute() if cache_dir else cache_root(None) / "demo"
    shown: list[Any] = []

    def show(phase: Any) -> None:
        if not json_out:
            out.print(phase_view(phase, legend=not shown))
            shown.append(phase)
    report = Demo(root, model=model, max_tokens=max_tokens, device=device, step=spinner, on_phase=show,
                  remote_url=remote_url).run()
    if json_out:
        print_json(report)
    else:
        out.print(summary(report))


# ---- status ------------------------------------------------------------------------------

@app.command()
@friendly
def status(
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    api_key: Optional[str] = typer.Option(None, help=KEY_HELP),
) -> None:
    """Per-tier cache status of a running server (GET /v1/cache/status)."""
    url = server_url(url)
    body = get_json(url, "/v1/cache/status", api_key_of(api_key))
    if json_out:
        return print_json(body)
    tiers = body.get("tiers", {})
    t = narrow_table(title=f"{body.get('model', '?')} at {url} — block size {body.get('block_size', '?')}",
                     caption="Hit tok: prompt tokens served from the tier; Promoted: blocks copied "
              "up to the device pool; Demoted: blocks written down into the tier; Evicted: blocks that left it")
    for col in ("Tier", "Capacity", "Used", "Blocks", "Hit tok", "Promoted", "Demoted", "Evicted"):
        t.add_column(col, justify="left" if col == "Tier" else "right", no_wrap=True)
    for name in [*TIERS, *(n for n in tiers if n not in TIERS)]:     # a tier the server knows and we don't: shown too
        d = tiers.get(name, {})
        if d.get("enabled") is False:
            t.add_row(name, "off", "", "", "", "", "", "")
            continue
        if name in TIERS and not kind_of(name).local:
            # Its capacity, contents and evictions are the store's own (shared by every server):
            # `tieredkv inspect --remote-url` reads them from the store.
            t.add_row(name, "shared", "-", "-", *(f"{d.get(k, 0):,}" for k in ("hit_tokens", "promotions", "demotions")),
                      "-")
            continue
        t.add_row(name, format_size(d.get("capacity_bytes", 0)), format_size(d.get("used_bytes", 0)),
                  *(f"{d.get(k, 0):,}" for k in ("blocks", "hit_tokens", "promotions", "demotions", "evictions")))
    out.print(t)
    for kind in kinds():        # each tier's own lines, as its kind says them
        for row in kind.health.lines(tiers.get(kind.name) or {}):
            out.print(drawn(row), soft_wrap=True)
    ret = body.get("retention") or {}
    if ret.get("tenants"):        # prefixes kept past LRU (cache_control ttl, prompt_cache_retention "24h")
        kept = ", ".join(f"{escape(t)} {r['blocks']:,} blocks" for t, r in ret["tenants"].items())
        out.print(f"retained in {ret.get('keeper')}: {kept} (bound {format_size(ret.get('max_bytes', 0))}; "
                  f"{ret.get('refused', 0):,} blocks refused)", soft_wrap=True)
    cost = body.get("cost_model", {})
    rates = cost.get("restore_bytes_per_s", {})
    if rates:
        def rate(t: str, r: dict) -> str:
            note = "" if r.get("source") == "measured" else f" ({r.get('source')})"
            return f"{t} {r.get('latency_s', 0) * 1e3:.2f} ms + {format_size(int(r['bytes_per_s']))}/s{note}"
        shown = ", ".join(rate(t, r) for t, r in rates.items())
        pre = cost.get("prefill", {})
        out.print(f"restore rates: {shown}; prefill of 2048 tokens "
                  + (f"~{pre['prefill_2048_s'] * 1e3:.0f} ms (fitted on {pre['steps']} steps)"
                     if pre.get("fitted") else "not fitted yet"), soft_wrap=True)
        errors = [f"{name} {e * 100:.0f}%" for name, e in [("prefill", pre.get("median_error"))]
                  + [(t, r.get("median_error")) for t, r in rates.items()] if e is not None]
        if errors:     # the last predictions against what was measured
            out.print(f"cost model off by (median of recent): {', '.join(errors)}", soft_wrap=True)
        plan = cost.get("planner", {})
        if plan:
            made = plan.get("decisions", {})
            recomputed = sum(d.get("recomputed_hit_tokens", 0) for d in tiers.values() if isinstance(d, dict))
            out.print(f"compute or load ({plan.get('policy')}): {made.get('load', 0)} hits loaded, "
                      f"{made.get('split', 0)} split, {made.get('recompute', 0)} recomputed; "
                      f"{recomputed:,} hit tokens recomputed by choice", soft_wrap=True)
    billing = body.get("billing", {})
    if billing.get("state") == "degraded":
        out.print(f"[bold red]billing: degraded[/]: {billing.get('unwritten', 0)} bills held in "
                  f"{billing.get('held_in', 'memory')}{held_in_memory(billing)}, not yet in the ledger "
                  f"({escape(str(billing.get('error')))}); written when the ledger can be"
                  + (f"; {billing['refused']} requests refused (503: nowhere to hold their bills)"
                     if billing.get("refused") else ""), soft_wrap=True)
    eng = body.get("engine")
    if isinstance(eng, dict):
        out.print(f"engine: {eng.get('running', 0)} running, {eng.get('waiting', 0)} waiting, "
                  f"{eng.get('preemptions', 0)} preemptions")


# ---- inspect / verify --------------------------------------------------------------------

@app.command()
@friendly
def inspect(
    cache_dir: Optional[str] = typer.Option(None, help=CACHE_HELP),
    tree: bool = typer.Option(False, "--tree", help="Show the cached prefixes as a tree with text previews."),
    depth: int = typer.Option(6, help="Tree levels shown (a level is a branch point; chains are folded)."),
    width: int = typer.Option(6, help="Branches shown per node (the most-hit first)."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    remote_url: Optional[str] = typer.Option(None, help="Read this remote store (valkey://, redis://, rediss://; a "
                                             "cluster: every primary) instead of the disk tier."),
    verify_values: bool = typer.Option(False, "--verify", help="With --remote-url: read and check every value "
                                       "(as a server's read does, and the hash chain); exit 1 on damage."),
    repair: bool = typer.Option(False, "--repair", help="With --remote-url: --verify, and delete damaged values."),
    namespace: Optional[str] = typer.Option(None, help="With --remote-url: only this namespace (64 hex digits)."),
    cache_secret_file: Optional[str] = typer.Option(None, help="With --verify: the fleet secret the values are "
                                                    "sealed under (default <cache dir>/fleet.secret)."),
) -> None:
    """What the disk tier holds: blocks, bytes, namespaces. Read-only: safe while a server runs.

    With --remote-url, what the shared remote store holds (SCAN of its tkv:r2:* keys on every
    primary): blocks and bytes per namespace and each node's memory; --verify checks every
    value, --repair deletes the damaged ones (never those sealed under another fleet secret). Exit status: 0 clean (or every damaged value
    deleted), 1 damage left or the store unreachable, 2 bad input.
    """
    if remote_url is not None:
        if tree:
            raise CLIError("--tree: draws the disk tier's prefixes; not with --remote-url", code=2)
        from tieredkv.inspect_remote import inspect_remote
        return inspect_remote(remote_url, cache_dir, verify_values or repair, repair, namespace, json_out,
                              cache_secret_file)
    for flag, given in (("--verify", verify_values), ("--repair", repair), ("--namespace", namespace),
                        ("--cache-secret-file", cache_secret_file)):
        if given:
            raise CLIError(f"{flag}: needs --remote-url (the disk tier's check is `tieredkv verify`)", code=2)
    from tieredkv.inspect_tree import forest_tree, overview, survey, tree_to_dict
    if depth < 1 or width < 1:
        raise CLIError("--depth and --width: expected ints >= 1", code=2)
    root = cache_root(cache_dir)
    tier = open_disk_tier(root, readonly=True)
    try:
        s = survey(tier, str(root / "billing"), decode=tree)
    finally:
        tier.close()
    if json_out:
        return print_json({**s.report, **({"tree": tree_to_dict(s, depth, width)} if tree else {})})
    out.print(overview(s.report, server_url(None)))
    if tree and s.report["blocks"]:
        out.print(forest_tree(s, depth, width))


@app.command()
@friendly
def verify(
    cache_dir: Optional[str] = typer.Option(None, help=CACHE_HELP),
    repair: bool = typer.Option(False, "--repair", help="Delete damaged blocks (a later request recomputes them)."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    cache_secret_file: Optional[str] = typer.Option(None, help="A sealed disk tier's fleet secret "
                                                    "(serve --seal-disk): each block's seal is checked first."),
) -> None:
    """Check the disk tier: its pages (every pointer, overflow header and free-page list), its
    counters and LRU index against a recount, and every block (checksum, full decode, hash chain).

    Exit status: 0 clean, or everything fixed by --repair (damaged blocks deleted, counters
    recounted, a store with damaged pages moved aside); 1 damage found and left in place; 2 no
    cache dir. Without --repair the store is opened read-only, so it is safe while a server runs.
    """
    root = cache_root(cache_dir)
    from storage.disk.preflight import DamagedEnvironment, move_aside
    try:
        open_disk_tier(root, readonly=True).close()     # checks the files before anything maps them
    except DamagedEnvironment as e:
        # The environment itself is damaged (truncated, bad meta page, damaged index): no block
        # in it can be trusted. --repair moves it aside, as a server would at its next start.
        if not repair:
            err.print(f"[bold red]damaged disk tier:[/] {escape(str(e))}\n"
                      "run `tieredkv verify --repair` to move it aside (a fresh tier starts in its place)")
            raise typer.Exit(1)
        aside = move_aside(str(root / "kv"), f"tieredkv verify --repair: {e}")
        out.print(f"damaged disk tier moved aside to {escape(aside)} ({escape(str(e))}); "
                  "a fresh tier starts at the next open")
        return
    seal = disk_seal_of(root, cache_secret_file)
    tier = open_disk_tier(root, readonly=not repair, seal=seal)
    try:
        report = tier.verify(repair=repair)
    except ValueError as e:              # sealed, and no secret (or not its) given
        raise CLIError(str(e), code=2) from None
    finally:
        tier.close()
    left = len(report.damaged) - report.repaired
    store_left = bool(report.store) and not report.store_repaired
    if json_out:
        print_json({"path": str(root / "kv"), "checked": report.checked, "damaged": len(report.damaged),
                    "repaired": report.repaired, "blocks": [{"hash": d.key.hex(), "reason": d.reason}
                                                            for d in report.damaged],
                    "store": list(report.store), "store_repaired": list(report.store_repaired)})
    else:
        for problem in report.store:
            out.print(f"store: {escape(problem)}", soft_wrap=True)
        for done in report.store_repaired:
            out.print(f"repaired: {escape(done)}", soft_wrap=True)
        if store_left:
            out.print("run again with --repair to recount the counters and rebuild the LRU index")
        out.print(f"checked {report.checked} blocks in {root / 'kv'}: {len(report.damaged)} damaged"
                  + (f", {report.repaired} deleted" if repair else ""), soft_wrap=True)
        for d in report.damaged[:50]:
            out.print(f"  {d.key.hex()[:16]}  {d.reason}", soft_wrap=True)
        if len(report.damaged) > 50:
            out.print(f"  … and {len(report.damaged) - 50} more")
        if left and not repair:
            out.print("run again with --repair to delete them")
    if left or store_left:
        raise typer.Exit(1)


# ---- billing -----------------------------------------------------------------------------

@app.command()
@friendly
def billing(
    url: Optional[str] = typer.Option(None, help="Read a running server's ledger (GET /v1/cache/billing; "
                                      "default $TIEREDKV_URL when set, else the ledger file)."),
    cache_dir: Optional[str] = typer.Option(None, help="Read the ledger file read-only: " + CACHE_HELP),
    tenant: Optional[str] = typer.Option(None, help="Only this tenant."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    api_key: Optional[str] = typer.Option(None, help=KEY_HELP),
) -> None:
    """Per-tenant bills: requests, tokens by origin, cost. From a server (--url) or the ledger file."""
    if url and cache_dir:
        raise CLIError("give --url or --cache-dir, not both", code=2)
    if not url and not cache_dir and os.environ.get("TIEREDKV_URL"):
        url = server_url(None)        # $TIEREDKV_URL names the server, as for `status`
    if url:
        body = get_json(url, "/v1/cache/billing", api_key_of(api_key), {"tenant": tenant} if tenant else None)
        if tenant is not None and not body.get("requests"):
            raise CLIError(f"no such tenant {tenant!r}: the server has billed no request to it", code=1)
    else:
        from engine.billing import Ledger, uncommitted
        root = cache_root(cache_dir)
        path = root / "billing"
        if not (path / "data.mdb").is_file():
            raise CLIError(f"cache dir: no billing ledger at {path} (pass --cache-dir or --url)", code=2)
        with Ledger(path, readonly=True) as ledger:
            known = ledger.tenants()
            # A stopped server's bills may wait in reserve.bin or spill files (issue 44): counted apart.
            waiting, where = uncommitted(ledger, tenant)
            if tenant is not None and tenant not in known and tenant not in waiting:
                shown = ", ".join(known[:10]) + (f", ... ({len(known)} in all)" if len(known) > 10 else "")
                raise CLIError(f"no such tenant {tenant!r} in {path} (tenants: {shown or 'none yet'})", code=1)
            body = ledger.tenant(tenant).to_dict() if tenant else ledger.summary()
            body["uncommitted"] = {"tenants": waiting, "where": where}
    if json_out:
        return print_json(body)
    from tieredkv.billing_table import print_bills
    print_bills(body, tenant)


def bare_kv_events(argv: list[str]) -> list[str]:
    """`serve --kv-events` with no endpoint after it means the default one (typer has no option
    whose value may be left out, so the command line is completed here)."""
    from storage.kv_events.endpoints import DEFAULT_ENDPOINT
    out = list(argv)
    for i in range(len(out) - 1, -1, -1):
        if out[i] == "--kv-events" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out.insert(i + 1, DEFAULT_ENDPOINT)
    return out


def main() -> None:
    import sys
    try:
        args = translate(bare_kv_events(sys.argv[1:]))
    except CLIError as e:          # a vLLM or llama-server flag serve cannot honour: what to use instead
        err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise SystemExit(e.code) from None
    app(args=args)


if __name__ == "__main__":
    main()
