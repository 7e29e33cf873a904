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
import socket
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tieredkv.cli_common import (CLIError, api_key_of, cache_root, err, existing_dir, friendly, get_json, micro, out,
                                 print_json, remote_options, server_url, spinner)
from tieredkv.cli_common import FIRST_LOAD
from storage.config import format_size, parse_size

TIERS = ("device", "host", "disk", "remote")

app = typer.Typer(help="tieredkv: a tiered KV-cache store for LLM inference (device -> host -> disk).\n\n"
                  "Exit status: 0 ok, 1 failure (server unreachable, HTTP error, damage found), "
                  "2 bad input (bad size, missing cache dir).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown", context_settings={"help_option_names": ["-h", "--help"]})
URL_HELP = "Server URL (default $TIEREDKV_URL or http://127.0.0.1:8000)."
KEY_HELP = "API key, if the server has keys (default $TIEREDKV_API_KEY)."
JSON_HELP = "Print one JSON object instead of tables."
CACHE_HELP = "Cache root holding kv/ and billing/ (default $TIEREDKV_HOME or ~/.cache/tieredkv)."
REMOTE_HELP = ("A Valkey/Redis store shared by every server, below disk: valkey://host:6379, "
               "rediss://:PASSWORD@host:6380 (TLS), valkey://h1:7000,h2:7001,h3:7002 or ?cluster=1 (a cluster) "
               "(default $TIEREDKV_REMOTE_URL; none: no remote tier).")


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


def narrow_table(**kw: Any) -> Table:
    """A table that fits 80 columns: SIMPLE_HEAD's column divider is already a space, so one
    more on the left and none on the right (rich's default padding cut the last columns)."""
    return Table(box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, **kw)


# ---- serve -------------------------------------------------------------------------------

def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now, before the model loads, so a taken port fails at once (serve() gets the socket)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise CLIError(f"--host: cannot resolve {host!r} ({e})", code=2) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def log_to_stderr(level: str) -> None:
    """The service's loggers (tieredkv.*: the per-request line, startup and shutdown) on stderr,
    formatted as uvicorn's own lines are, at --log-level."""
    import logging

    from uvicorn.logging import DefaultFormatter
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
    logger = logging.getLogger("tieredkv")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level in ("debug", "trace") else getattr(logging, level.upper()))


@app.command()
@friendly
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                              help="Model, as `vllm serve MODEL` takes it (the same as --model)."),
    model: Optional[str] = typer.Option(None, help="Model: a .gguf file, a transformers directory, or a hub id in the "
                                        "local HF cache (default SmolLM2-135M-Instruct)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model's name in the API: /v1/models lists it "
                                                    "and responses echo it; requests may name it or the real model."),
    max_model_len: Optional[int] = typer.Option(None, help="Context length: prompt + output tokens of one request "
                                                "(default: the model's, cut to what the device pool holds; an "
                                                "error if the pool cannot hold this many)."),
    max_n: int = typer.Option(16, help="Most choices (`n`) one request may ask for; more is a 400. The choices "
                              "share one prefill and the prompt's pages."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; other than loopback needs --api-keys."),
    port: int = typer.Option(8000, help="Port (0: any free port; the chosen one is printed)."),
    cache_dir: Optional[str] = typer.Option(None, help=CACHE_HELP),
    device_memory: str = typer.Option("1GiB", help="Device page pool size."),
    host_memory: str = typer.Option("4GiB", help="Host tier size (0 disables it)."),
    disk_capacity: str = typer.Option("50GiB", help="Disk tier capacity (compressed bytes)."),
    disk_reserve: str = typer.Option("256MiB", help="Free space the disk tier always leaves on its filesystem "
                                     "(it shrinks, LRU first, rather than fill the disk)."),
    codec: str = typer.Option("zstd", help="How the disk and remote tiers store blocks: zstd (compressed, "
                              "1.15-1.45x fewer bytes) or raw (the bytes as they are, checked the same way, "
                              "several times faster to decode: better where the drive or network is faster "
                              "than decoding). Either reads what the other wrote."),
    on_billing_failure: str = typer.Option("serve", help="When the billing ledger cannot be written or opened "
                                           "(a full or read-only disk): serve (answer once the bill is held in "
                                           "billing/reserve.bin, written when space returns; /ready says 503) or "
                                           "refuse (the request fails)."),
    api_keys: Optional[str] = typer.Option(None, help='JSON file {"sk-...": {"tenant": ..., "role": "admin"|"user"}}.'),
    block_size: int = typer.Option(16, help="Tokens per cached block."),
    prices: Optional[str] = typer.Option(None, help="Prices file (JSON or .toml), micro-dollars per 1M tokens."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16."),
    log_level: str = typer.Option("info", help="Log level: " + ", ".join(LOG_LEVELS) + " (uvicorn's and "
                                  "tieredkv's lines; each request is one INFO line of tieredkv.requests)."),
    access_log: bool = typer.Option(False, "--access-log", help="Also uvicorn's access line per request (off: "
                                    "the tieredkv.requests line has the same and tokens, hits and TTFT)."),
    max_body: str = typer.Option("8MiB", help="Largest request body accepted (413 past it)."),
    max_inflight_per_tenant: Optional[int] = typer.Option(None, min=1, help="Requests one tenant may have running "
                                                          "or queued; more get 429 with Retry-After (default: 3/4 "
                                                          "of the batch, 48, so others always find room)."),
    protect_metrics: bool = typer.Option(False, "--protect-metrics",
                                         help="/metrics needs an admin key (with --api-keys)."),
    lenient_fields: bool = typer.Option(False, "--lenient-fields",
                                        help="Ignore request fields the server does not know (vLLM's behaviour) "
                                        "instead of refusing them with a 400; each is logged once and named in "
                                        "the X-Tieredkv-Ignored-Fields response header. Known fields it cannot "
                                        "honour (tools, guided_*, logit_bias, ...) are refused either way."),
    remote_url: Optional[str] = typer.Option(None, help=REMOTE_HELP),
    remote_timeout: Optional[float] = typer.Option(None, help="Seconds bounding every call to the remote store "
                                                   "(default 0.5); a failure is a miss."),
    remote_ttl: Optional[float] = typer.Option(None, help="Seconds to live of every block written to the remote "
                                               "store (default: none; its maxmemory + LRU bound it)."),
    remote_write: Optional[str] = typer.Option(None, help="write_back (default: blocks reach the store when they "
                                               "reach disk) or write_through (as soon as computed: what several "
                                               "servers sharing a store want)."),
    restore_policy: str = typer.Option("auto", help="auto (default: recompute the front of a hit held below the "
                                       "device while its back loads, split where the measured restore rates "
                                       "and prefill time predict the earliest first token), load (always load "
                                       "a hit) or recompute (never load: a fast GPU with a slow drive). Hits "
                                       "are billed from the tier that held them either way."),
    kv_events: Optional[str] = typer.Option(None, "--kv-events",
                                            help="Publish KV events (vLLM's format: ZMQ PUB, msgpack) on this "
                                            "endpoint; alone: tcp://127.0.0.1:5557. Loopback unless you write "
                                            "another host (tcp://*:5557: every interface); port 0: a free one. "
                                            "GET /v1/cache/status names the bound endpoints."),
    kv_events_replay: Optional[str] = typer.Option(None, help="The events' replay endpoint (default: the same "
                                                   "host, port + 1)."),
    kv_events_no_tokens: bool = typer.Option(False, "--kv-events-no-tokens",
                                             help="Leave token ids out of BlockStored events."),
) -> None:
    """Run the OpenAI-compatible HTTP service on a model with the tiered KV cache.

    Prints a summary once the model is loaded (model, device, context length, each tier),
    then logs one line per request (tieredkv.requests) and, at shutdown, the blocks flushed.
    Routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/cache/*, /tokenize,
    /detokenize, /health, /ready, /metrics, /version, /docs.
    """
    from engine.billing import Prices
    from storage.config import CacheConfig
    if model_arg is not None and model is not None and model_arg != model:
        raise CLIError(f"give the model once: MODEL is {model_arg!r} and --model is {model!r}", code=2)
    model = model or model_arg
    if max_model_len is not None and max_model_len < 2:
        raise CLIError(f"--max-model-len: expected an int >= 2, got {max_model_len}", code=2)
    if max_n < 1:
        raise CLIError(f"--max-n: expected an int >= 1, got {max_n}", code=2)
    if served_model_name is not None and (not served_model_name.strip() or not served_model_name.isprintable()):
        raise CLIError(f"--served-model-name: expected a non-empty printable name, got {served_model_name!r}", code=2)
    if log_level not in LOG_LEVELS:
        raise CLIError(f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}", code=2)
    for flag, value in (("--device-memory", device_memory), ("--host-memory", host_memory),
                        ("--disk-capacity", disk_capacity), ("--disk-reserve", disk_reserve)):
        parse_size(value, flag)             # a bad size names the flag the user typed
    from storage.config import CODECS, RESTORE_POLICIES
    if codec not in CODECS:
        raise CLIError(f"--codec: expected one of {', '.join(CODECS)}, got {codec!r}", code=2)
    if restore_policy not in RESTORE_POLICIES:
        raise CLIError(f"--restore-policy: expected one of {', '.join(RESTORE_POLICIES)}, got {restore_policy!r}",
                       code=2)
    root = cache_root(cache_dir)
    cache = CacheConfig(block_size=block_size, device_memory=device_memory, host_memory=host_memory,
                        disk_dir=str(root / "kv"), disk_capacity=disk_capacity, disk_reserve=disk_reserve,
                        restore_policy=restore_policy, codec=codec, kv_events=kv_events,
                        kv_events_replay=kv_events_replay, kv_events_tokens=not kv_events_no_tokens,
                        **remote_options(remote_url, remote_timeout, remote_ttl, remote_write))
    from engine.billing_writer import ON_FAILURE
    if on_billing_failure not in ON_FAILURE:
        raise CLIError(f"--on-billing-failure: expected one of {', '.join(ON_FAILURE)}, got {on_billing_failure!r}",
                       code=2)
    for name, path in (("--prices", prices), ("--api-keys", api_keys)):
        if path and not os.path.isfile(path):
            raise CLIError(f"{name}: no such file {path}", code=2)
    price_table = Prices.from_file(prices) if prices else None
    from service.auth import ApiKeys
    from service.server import check_bind
    from service.settings import ServiceSettings
    settings = ServiceSettings(api_keys_file=api_keys, host=host, port=port, max_body_bytes=parse_size(max_body, "--max-body"),
                               protect_metrics=protect_metrics, unknown_fields="ignore" if lenient_fields else "reject",
                               served_model_name=served_model_name, max_inflight_per_tenant=max_inflight_per_tenant)
    check_bind(host, settings)
    if api_keys:
        ApiKeys.from_file(api_keys)            # a bad keys file fails now, not after the model loads
    sock = bind_socket(host, port)
    try:
        with spinner(f"Loading {model}" if model else f"Loading SmolLM2-135M-Instruct ({FIRST_LOAD})"):
            from engine import Engine
            try:
                engine = Engine.from_pretrained(model, cache, device=device, dtype=dtype,
                                                ledger_dir=str(root / "billing"), prices=price_table,
                                                billing_failure=on_billing_failure, max_model_len=max_model_len,
                                                max_n=max_n)
            except ValueError as e:
                if not str(e).startswith("max_model_len:"):
                    raise
                why = str(e).removeprefix("max_model_len:")
                pool = f" (--device-memory is {device_memory})" if "device pool" in why else ""
                raise CLIError(f"--max-model-len:{why}{pool}", code=2) from None
        bound = sock.getsockname()
        sock.listen(2048)
        shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
        url = f"http://{shown}:{bound[1]}"
        err.print(f"tieredkv: serving {engine.model_name} on {url} (cache {root})", soft_wrap=True)
        from service.summary import format_summary, startup_summary
        err.print(escape(format_summary(startup_summary(engine, url, served_model_name))), soft_wrap=True)
        if engine.cache.remote is not None:
            # NOTE: only the redacted URL is ever printed or logged (the password stays in the config).
            problem = engine.cache.remote.ping()
            err.print(f"tieredkv: remote tier {escape(cache.remote.redacted)} ({cache.remote_write}): "
                      + ("reachable" if problem is None else
                         f"[bold yellow]not reachable now[/] ({escape(problem)}); lookups miss it until it "
                         "answers"), soft_wrap=True)
    except BaseException:
        sock.close()
        raise
    from service.server import serve as run_server
    log_to_stderr(log_level)
    run_server(engine, settings, sock=sock, log_level=log_level, access_log=access_log)


# ---- route -------------------------------------------------------------------------------

@app.command()
@friendly
def route(
    backend: list[str] = typer.Option(..., "--backend", help="A tieredkv server's URL (http://host:port); give "
                                      "--backend once per server, all serving the same model."),
    host: str = typer.Option("127.0.0.1", help="Address to bind. The router checks no key itself: the backends "
                             "do (the Authorization header passes through)."),
    port: int = typer.Option(8100, help="Port (0: any free port; the chosen one is printed)."),
    api_key: Optional[str] = typer.Option(None, help="An admin key of the backends, to read where their KV "
                                          "events are (/v1/cache/status), where they have keys "
                                          "(default $TIEREDKV_API_KEY)."),
    load_tokens: float = typer.Option(64.0, help="What one request in flight on a backend costs (its decode "
                                      "steps), in prompt tokens to prefill: weighed against the prefix it holds. "
                                      "The prefill queued there counts too (half, so a hit is preferred)."),
    health_interval: float = typer.Option(2.0, help="Seconds between health checks of each backend."),
    prediction_ttl: float = typer.Option(30.0, help="Seconds a routed prompt's blocks count as on its backend "
                                         "before its events confirm them (without events: the only knowledge)."),
    eject_cooldown: float = typer.Option(5.0, help="Seconds a server whose answers failed (garbage, a 5xx, a "
                                         "timeout) stays ejected before a probe completion may readmit it; "
                                         "doubled after each failed probe, up to 60."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Route OpenAI requests over several servers: each to the one holding its prompt's prefix.

    Subscribes to every backend's KV events (serve --kv-events), keeps an index of which server
    holds which block on which tier, and sends each request where its longest prefix is cached,
    weighed against the requests in flight there. Streams pass through; a dead backend gets no
    traffic; a request whose connection fails, or whose answer is garbage or a 5xx, before any
    byte reaches the client goes to another backend, and that backend is ejected until a probe passes.
    """
    import logging

    from service.router.server import serve_router
    from service.router.settings import RouterSettings
    settings = RouterSettings(backends=tuple(backend), host=host, port=port, api_key=api_key_of(api_key),
                              load_tokens=load_tokens, health_interval_s=health_interval,
                              prediction_ttl_s=prediction_ttl, eject_cooldown_s=eject_cooldown,
                              eject_cooldown_max_s=max(60.0, eject_cooldown))
    sock = bind_socket(host, port)
    sock.listen(2048)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(levelname)s: %(message)s")
    err.print(f"tieredkv: routing on http://{shown}:{bound[1]} over {len(settings.backends)} backend"
              f"{'s' if len(settings.backends) != 1 else ''}: {', '.join(settings.backends)}", soft_wrap=True)
    serve_router(settings, sock, log_level=log_level)


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
    for name in TIERS:
        d = tiers.get(name, {})
        if d.get("enabled") is False:
            t.add_row(name, "off", "", "", "", "", "", "")
            continue
        if name == "remote":
            # Its capacity, contents and evictions are the store's own (shared by every server):
            # `tieredkv inspect --remote-url` reads them from the store.
            t.add_row(name, "shared", "-", "-", *(f"{d.get(k, 0):,}" for k in ("hit_tokens", "promotions", "demotions")),
                      "-")
            continue
        t.add_row(name, format_size(d.get("capacity_bytes", 0)), format_size(d.get("used_bytes", 0)),
                  *(f"{d.get(k, 0):,}" for k in ("blocks", "hit_tokens", "promotions", "demotions", "evictions")))
    out.print(t)
    disk = tiers.get("disk", {})
    if disk.get("enabled", True) and "compression_ratio" in disk:
        ratio = f"{disk['compression_ratio']:.2f}x" if disk.get("used_bytes") else "n/a (empty)"
        out.print(f"disk: compression ratio {ratio}, pending writes "
                  f"{disk.get('pending_writes', 0)}, corrupt blocks found {disk.get('corrupt', 0)}")
    if disk.get("moved_aside"):
        out.print(f"[bold yellow]disk: damaged store moved aside {disk['moved_aside']}x[/] (a fresh one serves): "
                  f"{escape(str(disk.get('recovered')))}", soft_wrap=True)
    if disk.get("unavailable"):
        out.print(f"[bold red]disk: unavailable[/] ({escape(str(disk['unavailable']))}); serving without it",
                  soft_wrap=True)
    if disk.get("space_bound_bytes"):
        out.print(f"[bold yellow]disk: bounded by free space[/]: {format_size(disk.get('free_bytes') or 0)} free, "
                  f"store file held at {format_size(disk['space_bound_bytes'])}", soft_wrap=True)
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
                  f"{billing.get('held_in', 'memory')}, not yet in the ledger ({escape(str(billing.get('error')))}); "
                  "written when the ledger can be", soft_wrap=True)
    remote = tiers.get("remote", {})
    if remote.get("enabled"):
        breaker = remote.get("breaker", "?")
        shown = f"[bold red]{breaker}[/]" if breaker == "open" else breaker
        out.print(f"remote: {escape(str(remote.get('url', '?')))}{' (cluster)' if remote.get('cluster') else ''}, "
                  f"breaker {shown} (opened {remote.get('breaker_opened', 0)}x), errors {remote.get('errors', 0)}, "
                  f"corrupt blocks found {remote.get('corrupt', 0)}, writes {remote.get('writes', 0)} "
                  f"(pending {remote.get('pending_writes', 0)}, dropped {remote.get('write_drops', 0)}, "
                  f"refused {remote.get('write_errors', 0)})", soft_wrap=True)
        if remote.get("last_error"):
            out.print(f"remote: last error {escape(str(remote['last_error']))}", soft_wrap=True)
    eng = body.get("engine")
    if isinstance(eng, dict):
        out.print(f"engine: {eng.get('running', 0)} running, {eng.get('waiting', 0)} waiting, "
                  f"{eng.get('preemptions', 0)} preemptions")


# ---- inspect / verify --------------------------------------------------------------------

def open_disk_tier(root: Path, readonly: bool) -> Any:
    kv = existing_dir(root / "kv", "disk tier (kv/)")
    if not (kv / "data.mdb").is_file():
        raise CLIError(f"cache dir: {kv} holds no disk tier (no data.mdb)", code=2)
    from storage.disk.tier import DiskTier
    # Capacity is enforced only by writers; inspect/verify never add blocks.
    return DiskTier(str(kv), parse_size("50GiB"), readonly=readonly)


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
) -> None:
    """What the disk tier holds: blocks, bytes, namespaces. Read-only: safe while a server runs.

    With --remote-url, what the shared remote store holds (SCAN of its tkv:r1:* keys on every
    primary): blocks and bytes per namespace and each node's memory; --verify checks every
    value, --repair deletes the damaged ones. Exit status: 0 clean (or every damaged value
    deleted), 1 damage left or the store unreachable, 2 bad input.
    """
    if remote_url is not None:
        if tree:
            raise CLIError("--tree: draws the disk tier's prefixes; not with --remote-url", code=2)
        from tieredkv.inspect_remote import inspect_remote
        return inspect_remote(remote_url, cache_dir, verify_values or repair, repair, namespace, json_out)
    for flag, given in (("--verify", verify_values), ("--repair", repair), ("--namespace", namespace)):
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
    tier = open_disk_tier(root, readonly=not repair)
    try:
        report = tier.verify(repair=repair)
    finally:
        tier.close()
    left = len(report.damaged) - report.repaired
    store_left = bool(report.store) and not report.store_repaired
    if json_out:
        print_json({"path": str(root / "kv"), "checked": report.checked, "damaged": len(report.damaged),
                    "repaired": report.repaired, "blocks": [{"hash": d.hash.hex(), "reason": d.reason}
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
            out.print(f"  {d.hash.hex()[:16]}  {d.reason}", soft_wrap=True)
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
        from engine.billing import Ledger
        root = cache_root(cache_dir)
        path = root / "billing"
        if not (path / "data.mdb").is_file():
            raise CLIError(f"cache dir: no billing ledger at {path} (pass --cache-dir or --url)", code=2)
        with Ledger(path, readonly=True) as ledger:
            known = ledger.tenants()
            if tenant is not None and tenant not in known:
                shown = ", ".join(known[:10]) + (f", ... ({len(known)} in all)" if len(known) > 10 else "")
                raise CLIError(f"no such tenant {tenant!r} in {path} (tenants: {shown or 'none yet'})", code=1)
            body = ledger.tenant(tenant).to_dict() if tenant else ledger.summary()
    if json_out:
        return print_json(body)
    bills = [body] if "tenant" in body else list(body.get("tenants", {}).values())
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
    total = body.get("total", body)
    n = total["requests"]
    out.print(f"total ${total['cost_pico'] / 1e12:.6f} for {n:,} request{'s' if n != 1 else ''}")


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
    app(args=bare_kv_events(sys.argv[1:]))


if __name__ == "__main__":
    main()
