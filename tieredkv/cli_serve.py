"""`tieredkv serve` and `tieredkv route`: the commands that run a server, and their options; and
`tieredkv kv-events-keys`, the keypair a router subscribes to a server's KV events with.

Knows: the options of both, the names vLLM and llama-server users reach for (`-m`, `-c`,
`--max-num-seqs`, `--api-key`, ...; what each becomes is in tieredkv/cli_flags.py), binding the
port before the model loads, what is printed while it loads, and the loggers each writes to.
Doesn't know: how the engine or the service work inside (imported inside the commands, so
`tieredkv --help` stays fast); the other commands (tieredkv/cli.py registers these two).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from storage.config import parse_size
from tieredkv.cli_common import (CACHE_HELP, REMOTE_HELP, SECRET_HELP, CLIError, api_key_of, cache_default,
                                 cache_root, err, friendly, load_description, remote_options, remote_url_of,
                                 spinner)
from tieredkv.cli_flags import pool_size, read_chat_template


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


def kv_events_options(root: Path, endpoint: str | None, replay: str | None, allow_keys: str | None,
                      secret_file: str | None, tokens: bool, no_tokens: bool, replay_s: float) -> dict:
    """serve's --kv-events* flags as CacheConfig fields: token ids only with --kv-events-tokens
    (--kv-events-no-tokens is the default said aloud), the server's secret certificate under the
    cache root unless given (only where keys are: ipc takes none)."""
    if tokens and no_tokens:
        raise CLIError("give one of --kv-events-tokens and --kv-events-no-tokens", code=2)
    if endpoint is None:
        for flag, given in (("--kv-events-replay", replay), ("--kv-events-allow-keys", allow_keys),
                            ("--kv-events-secret-file", secret_file), ("--kv-events-tokens", tokens)):
            if given:
                raise CLIError(f"{flag}: needs --kv-events (the events' endpoint)", code=2)
        return {}
    if secret_file is not None and allow_keys is None:
        raise CLIError("--kv-events-secret-file: needs --kv-events-allow-keys (the subscribers' public keys)", code=2)
    if allow_keys is not None and secret_file is None:
        secret_file = str(root / "kv-events" / "server.key_secret")
    return dict(kv_events=endpoint, kv_events_replay=replay, kv_events_allow_keys=allow_keys,
                kv_events_secret_file=secret_file, kv_events_tokens=tokens, kv_events_replay_s=replay_s)


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


@friendly
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                              help="Model, as `vllm serve MODEL` takes it (the same as --model)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model: a .gguf file, a transformers directory, "
                                        "or a hub id in the local HF cache (default SmolLM2-135M-Instruct)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model's name in the API: /v1/models lists it "
                                                    "and responses echo it; requests may name it or the real model."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", "-c", "--ctx-size", help="Context length: prompt + output tokens of one request "
                                                "(default: the model's, cut to what the device pool holds; an "
                                                "error if the pool cannot hold this many)."),
    max_n: int = typer.Option(16, help="Most choices (`n`) one request may ask for; more is a 400. The choices "
                              "share one prefill and the prompt's pages."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; other than loopback needs --api-keys."),
    port: int = typer.Option(8000, help="Port (0: any free port; the chosen one is printed)."),
    cache_dir: Optional[str] = typer.Option(None, help=CACHE_HELP),
    device_memory: Optional[str] = typer.Option(None, help="Device page pool size (default "
                                                 f"{cache_default('device_memory')})."),
    host_memory: str = typer.Option(cache_default("host_memory"), help="Host tier size (0 disables it)."),
    disk_capacity: str = typer.Option(cache_default("disk_capacity"), help="Disk tier capacity (compressed bytes)."),
    disk_reserve: str = typer.Option(cache_default("disk_reserve"), help="Free space the disk tier always leaves on its filesystem "
                                     "(it shrinks, LRU first, rather than fill the disk)."),
    codec: str = typer.Option(cache_default("codec"), help="How the disk and remote tiers store blocks: zstd (compressed, "
                              "1.15-1.45x fewer bytes), raw (the bytes as they are, checked the same way, "
                              "several times faster to decode: better where the drive or network is faster "
                              "than decoding) or nibble (1.33x fewer bytes on bf16 KV, decoded by a table "
                              "lookup at ~5x zstd's speed). Each reads what the others wrote."),
    on_billing_failure: str = typer.Option("serve", help="When the billing ledger cannot be written or opened "
                                           "(a full or read-only disk): serve (answer once the bill is held in "
                                           "billing/reserve.bin, written when space returns; /ready says 503) or "
                                           "refuse (the request fails)."),
    api_keys: Optional[str] = typer.Option(None, help='JSON file {"sk-...": {"tenant": ..., "role": "admin"|"user"}}.'),
    block_size: int = typer.Option(cache_default("block_size"), help="Tokens per cached block."),
    prices: Optional[str] = typer.Option(None, help="Prices file (JSON or .toml), micro-dollars per 1M tokens; "
                                         "cache_write_5m/1h/24h: multiples of the miss price; retained_token_hour: "
                                         "per 1M token-hours."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16."),
    log_level: str = typer.Option("info", help="Log level: " + ", ".join(LOG_LEVELS) + " (uvicorn's and "
                                  "tieredkv's lines; each request is one INFO line of tieredkv.requests)."),
    access_log: bool = typer.Option(False, "--access-log", help="Also uvicorn's access line per request (off: "
                                    "the tieredkv.requests line has the same and tokens, hits and TTFT)."),
    max_body: str = typer.Option("8MiB", help="Largest request body accepted (413 past it)."),
    header_timeout: float = typer.Option(10.0, min=0.001, help="Seconds a request's line and headers may take "
                                         "from its first byte; past it 408 and the connection closed."),
    body_timeout: float = typer.Option(30.0, min=0.001, help="Seconds a request's body may take after its "
                                       "headers, plus one per 64 KiB received (a trickle is cut, a big body "
                                       "at 512 kbit/s or faster is not); past it 408 and the connection closed."),
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
                                                   f"(default {cache_default('remote_timeout_s')}); a failure is a miss."),
    remote_ttl: Optional[float] = typer.Option(None, help="Seconds to live of every block written to the remote "
                                               "store (default: none; its maxmemory + LRU bound it)."),
    remote_write: Optional[str] = typer.Option(None, help="write_back (default: blocks reach the store when they "
                                               "reach disk) or write_through (as soon as computed: what several "
                                               "servers sharing a store want)."),
    cache_secret_file: Optional[str] = typer.Option(None, help=SECRET_HELP),
    max_retained: Optional[str] = typer.Option(None, help="What clients may keep past LRU (Anthropic's cache_control "
                                               "ttl, OpenAI's prompt_cache_retention \"24h\"), e.g. 8GiB "
                                               "(default: half the disk capacity; it must stay below it). 0: none."),
    max_retained_per_tenant: Optional[str] = typer.Option(None, help="One tenant's share of --max-retained "
                                                          "(default: all of it); past it a request is served "
                                                          "and cached as usual, its usage says what was refused."),
    seal_disk: bool = typer.Option(False, "--seal-disk", help="Seal every disk block under the fleet secret "
                                   "(a cache dir others can write: one shared between users or containers; a "
                                   "keyed hash per block written and read). Without it a shared kv/ is refused."),
    restore_policy: str = typer.Option(cache_default("restore_policy"), help="auto (default: recompute the front of a hit held below the "
                                       "device while its back loads, split where the measured restore rates "
                                       "and prefill time predict the earliest first token), load (always load "
                                       "a hit) or recompute (never load: a fast GPU with a slow drive). Hits "
                                       "are billed from the tier that held them either way."),
    kv_events: Optional[str] = typer.Option(None, "--kv-events",
                                            help="Publish KV events (vLLM's format: ZMQ PUB, msgpack) on this "
                                            "endpoint; alone: tcp://127.0.0.1:5557. They name every tenant's "
                                            "prompt prefixes: a tcp endpoint takes --kv-events-allow-keys (CURVE); "
                                            "ipc:///DIR/events.sock needs none, DIR yours alone (made 0700). "
                                            "Port 0: a free one. GET /v1/cache/status names the bound endpoints."),
    kv_events_replay: Optional[str] = typer.Option(None, help="The events' replay endpoint (default: the same "
                                                   "host, port + 1; ipc: PATH.replay)."),
    kv_events_allow_keys: Optional[str] = typer.Option(None, "--kv-events-allow-keys", metavar="FILE|DIR",
                                                       help="The subscribers allowed (CURVE): a public certificate "
                                                       "NAME.key, or a directory of them, as `tieredkv "
                                                       "kv-events-keys` writes; read at start."),
    kv_events_secret_file: Optional[str] = typer.Option(None, "--kv-events-secret-file", metavar="FILE",
                                                        help="This server's CURVE secret certificate (default "
                                                        "CACHE_DIR/kv-events/server.key_secret, made 0600 on first "
                                                        "start; its public half beside it as server.key)."),
    kv_events_tokens: bool = typer.Option(False, "--kv-events-tokens",
                                          help="Put token ids (the tenants' prompt text) in BlockStored events, "
                                          "for routers that hash tokens themselves (llm-d, Dynamo). Default: off."),
    kv_events_no_tokens: bool = typer.Option(False, "--kv-events-no-tokens",
                                             help="Token ids left out: the default; accepted as its explicit form."),
    kv_events_replay_seconds: float = typer.Option(cache_default("kv_events_replay_s"), "--kv-events-replay-seconds",
                                                   help="The replay buffer keeps no batch older than this (nor "
                                                   "more than 10,000)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager",
                                       help="Run every step eagerly: no CUDA graphs for decode steps (as vLLM's "
                                       "flag; default on CUDA with flex_paged: one graph per batch bucket, "
                                       "captured at start)."),
    log_probes: bool = typer.Option(False, "--log-probes", help="Write polling in the request log too: /health, "
                                    "/ready, /metrics, the router's block-hash calls, the dashboard's page and fetches "
                                    "(off: DEBUG lines only)."),
    # What vLLM and llama-server users reach for (tieredkv/cli_flags.py says what each becomes).
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1, help="vLLM's: sequences in one batch."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", min=1,
                                                         help="vLLM's: tokens one engine step computes (prefill "
                                                         "chunks and decodes together; default 512 on a CPU, "
                                                         "8192 on a GPU)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization",
                                                           help="vLLM's, here: the device pool is this fraction "
                                                           "of the GPU's free memory at start (instead of "
                                                           "--device-memory). CUDA only."),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help="vLLM's: on by default; off, no request reuses another's "
                                               "blocks: the device pool shares none and the host, disk and "
                                               "remote tiers are off (every prompt token computed)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="vLLM's: a Jinja chat template, a "
                                                "file or the template itself, in place of the model's."),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help="vLLM's: seeds the engine once; each sampled "
                                       "request without a seed takes the next seed of that stream (requests "
                                       "differ; the same requests in the same order sample the same). Default: "
                                       "each draws its own."),
    disable_log_requests: bool = typer.Option(False, "--disable-log-requests", help="vLLM's: no line per request "
                                              "(a 5xx is still logged)."),
    disable_log_stats: bool = typer.Option(False, "--disable-log-stats", help="vLLM's: accepted; there is nothing "
                                           "to turn off (no periodic stats lines: the figures are at /metrics and "
                                           "/v1/cache/status)."),
    api_key: Optional[list[str]] = typer.Option(None, "--api-key", help="vLLM's: a key clients must send "
                                                "(Authorization: Bearer KEY), any non-empty string; repeat for "
                                                "several. Each is an admin of tenant 'default'; --api-keys FILE "
                                                "gives tenants and roles."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", min=1, help="llama-server's: CPU threads for "
                                          "the model's compute (torch.set_num_threads)."),
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
    from engine.default_model import DEFAULT_MODEL_NAME, names_default
    if served_model_name is None and model not in (None, DEFAULT_MODEL_NAME) and names_default(model):
        served_model_name = model       # the default model by its hub id: served under it, as vLLM serves a hub id
    if max_model_len is not None and max_model_len < 2:
        raise CLIError(f"--max-model-len: expected an int >= 2, got {max_model_len}", code=2)
    if max_n < 1:
        raise CLIError(f"--max-n: expected an int >= 1, got {max_n}", code=2)
    if served_model_name is not None and (not served_model_name.strip() or not served_model_name.isprintable()):
        raise CLIError(f"--served-model-name: expected a non-empty printable name, got {served_model_name!r}", code=2)
    if log_level not in LOG_LEVELS:
        raise CLIError(f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}", code=2)
    device_memory = pool_size(device_memory, gpu_memory_utilization, device)
    for flag, value in (("--device-memory", device_memory), ("--host-memory", host_memory),
                        ("--disk-capacity", disk_capacity), ("--disk-reserve", disk_reserve),
                        ("--max-retained", max_retained or 0), ("--max-retained-per-tenant", max_retained_per_tenant or 0)):
        parse_size(value, flag)             # a bad size names the flag the user typed
    from storage.config import CODECS, RESTORE_POLICIES
    if codec not in CODECS:
        raise CLIError(f"--codec: expected one of {', '.join(CODECS)}, got {codec!r}", code=2)
    if restore_policy not in RESTORE_POLICIES:
        raise CLIError(f"--restore-policy: expected one of {', '.join(RESTORE_POLICIES)}, got {restore_policy!r}",
                       code=2)
    if not enable_prefix_caching and remote_url_of(remote_url):
        raise CLIError("--no-enable-prefix-caching turns the remote tier off: drop --remote-url (or unset "
                       "$TIEREDKV_REMOTE_URL)", code=2)
    root = cache_root(cache_dir)
    # --no-enable-prefix-caching: no block kept for reuse, in the device pool or below it.
    tiers = dict(host_memory=host_memory, disk_dir=str(root / "kv")) if enable_prefix_caching else \
        dict(host_memory=0, disk_dir=None, prefix_caching=False)
    try:
        cache = CacheConfig(block_size=block_size, device_memory=device_memory, disk_capacity=disk_capacity,
                            disk_reserve=disk_reserve, restore_policy=restore_policy, codec=codec, **tiers,
                            max_retained=max_retained, max_retained_per_tenant=max_retained_per_tenant,
                            **kv_events_options(root, kv_events, kv_events_replay, kv_events_allow_keys,
                                                kv_events_secret_file, kv_events_tokens, kv_events_no_tokens,
                                                kv_events_replay_seconds),
                            **remote_options(remote_url, remote_timeout, remote_ttl, remote_write, cache_secret_file, root,
                                             seal_disk and enable_prefix_caching))
    except ValueError as e:     # --max-retained past the disk, and the like: named, before the model loads
        raise CLIError(str(e), code=2) from None
    if cache.kv_events is not None:
        from storage.kv_events.access import prepare
        prepare(cache)        # keys read (the server's made), ipc directories made: errors now, not after the load
    if cache.remote is not None or cache.seal_disk:     # the fleet secret read (or made) before the model loads
        from storage.fleet_secret import SecretFileError, load_fleet_secret
        try:
            load_fleet_secret(cache.cache_secret_file)
        except SecretFileError as e:
            raise CLIError(f"--cache-secret-file: {e}", code=2) from None
    from engine.billing_writer import ON_FAILURE
    if on_billing_failure not in ON_FAILURE:
        raise CLIError(f"--on-billing-failure: expected one of {', '.join(ON_FAILURE)}, got {on_billing_failure!r}",
                       code=2)
    for name, path in (("--prices", prices), ("--api-keys", api_keys)):
        if path and not os.path.isfile(path):
            raise CLIError(f"{name}: no such file {path}", code=2)
    try:
        price_table = Prices.from_file(prices) if prices else None
    except ValueError as e:       # a bad price or multiplier: named, with its file, before the model loads
        why = str(e) if str(e).startswith(prices) else f"{prices}: {e}"
        raise CLIError(f"--prices: {why}", code=2) from None
    from service.auth import ApiKeys
    from service.server import check_bind
    from service.settings import ServiceSettings
    settings = ServiceSettings(api_keys_file=api_keys, host=host, port=port, max_body_bytes=parse_size(max_body, "--max-body"),
                               protect_metrics=protect_metrics, unknown_fields="ignore" if lenient_fields else "reject",
                               served_model_name=served_model_name, max_inflight_per_tenant=max_inflight_per_tenant,
                               api_keys=tuple(api_key or ()), log_probes=log_probes,
                               header_timeout_s=header_timeout, body_timeout_s=body_timeout)
    check_bind(host, settings)
    ApiKeys.of(api_keys, settings.api_keys)      # bad keys fail now, not after the model loads
    template = read_chat_template(chat_template)
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    sock = bind_socket(host, port)
    try:
        # Where Engine.from_pretrained converts a GGUF: beside the disk tier (the cache root), else the default root.
        with spinner(load_description(model, root if cache.disk_dir is not None else None)):
            from engine import Engine
            try:
                engine = Engine.from_pretrained(model, cache, device=device, dtype=dtype,
                                                ledger_dir=str(root / "billing"), prices=price_table,
                                                billing_failure=on_billing_failure, max_model_len=max_model_len,
                                                max_seqs=max_num_seqs, max_batch_tokens=max_num_batched_tokens,
                                                enforce_eager=enforce_eager, max_n=max_n, seed=seed)
            except ValueError as e:
                if not str(e).startswith("max_model_len:"):
                    raise
                why = str(e).removeprefix("max_model_len:")
                pool = f" (--device-memory is {device_memory})" if "device pool" in why else ""
                raise CLIError(f"--max-model-len:{why}{pool}", code=2) from None
        if template is not None:
            if engine.tokenizer is None:
                raise CLIError("--chat-template: this model has no tokenizer to template for", code=2)
            engine.tokenizer.chat_template = template
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
        if not enable_prefix_caching:
            err.print("tieredkv: --no-enable-prefix-caching: no request reuses another's blocks (the device pool "
                      "shares none; host, disk and remote tiers off): every prompt token is computed", soft_wrap=True)
    except BaseException:
        sock.close()
        raise
    from service.server import serve as run_server
    from tieredkv.startup_heap import freeze_startup_heap
    frozen = freeze_startup_heap()      # no full GC pass walks the start-up heap mid-request
    log_to_stderr(log_level)
    import logging
    # Nothing a user acts on: a DEBUG line (issue 40), for whoever looks into a latency spike.
    logging.getLogger("tieredkv.service").debug("%s start-up objects frozen out of the garbage collector's full "
                                                "passes", f"{frozen:,}")
    if disable_log_requests:
        logging.getLogger("tieredkv.requests").setLevel(logging.WARNING)
    run_server(engine, settings, sock=sock, log_level=log_level, access_log=access_log)


# ---- route -------------------------------------------------------------------------------

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
    in_flight_tokens: float = typer.Option(64.0, "--in-flight-tokens", "--load-tokens",
                                           help="What one request in flight on a backend costs (its decode "
                                           "steps), in prompt tokens to prefill: weighed against the prefix it "
                                           "holds. The prefill queued there counts too (half, so a hit is "
                                           "preferred). --load-tokens: its old name."),
    health_interval: float = typer.Option(2.0, help="Seconds between health checks of each backend."),
    prediction_ttl: float = typer.Option(30.0, help="Seconds a routed prompt's blocks count as on its backend "
                                         "before its events confirm them (without events: the only knowledge)."),
    eject_cooldown: float = typer.Option(5.0, help="Seconds a server whose answers failed (garbage, a 5xx, a "
                                         "timeout) stays ejected before a probe completion may readmit it; "
                                         "doubled after each failed probe, up to 60."),
    kv_events_key: Optional[str] = typer.Option(None, "--kv-events-key", metavar="FILE",
                                                help="The router's CURVE secret certificate (NAME.key_secret from "
                                                "`tieredkv kv-events-keys`), to subscribe to servers whose events "
                                                "take keys (serve --kv-events-allow-keys NAME.key)."),
    kv_events_server_key: Optional[list[str]] = typer.Option(None, "--kv-events-server-key", metavar="FILE|DIR",
                                                              help="Subscribe only to servers whose key is among "
                                                              "these public certificates (their server.key); "
                                                              "default: each server's, as its status names it."),
    header_timeout: float = typer.Option(10.0, min=0.001, help="Seconds a request's line and headers may take "
                                         "from its first byte; past it 408 and the connection closed."),
    body_timeout: float = typer.Option(30.0, min=0.001, help="Seconds a request's body may take after its "
                                       "headers, plus one per 64 KiB received; past it 408."),
    log_probes: bool = typer.Option(False, "--log-probes", help="Write successful /health and /metrics answers "
                                    "in the request log at INFO too (default: DEBUG)."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Route OpenAI requests over several servers: each to the one holding its prompt's prefix.

    Subscribes to every backend's KV events (serve --kv-events; a tcp endpoint takes the router's
    key, --kv-events-key, which the servers allow), keeps an index of which server
    holds which block on which tier, and sends each request where its longest prefix is cached,
    weighed against the requests in flight there. Streams pass through; a dead backend gets no
    traffic; a request whose connection fails, or whose answer is garbage or a 5xx, before any
    byte reaches the client goes to another backend, and that backend is ejected until a probe passes.
    """
    import logging

    from service.router.server import serve_router
    from service.router.settings import RouterSettings
    settings = RouterSettings(backends=tuple(backend), host=host, port=port, api_key=api_key_of(api_key),
                              in_flight_tokens=in_flight_tokens, health_interval_s=health_interval,
                              prediction_ttl_s=prediction_ttl, eject_cooldown_s=eject_cooldown,
                              eject_cooldown_max_s=max(60.0, eject_cooldown), kv_events_key=kv_events_key,
                              kv_events_server_keys=tuple(kv_events_server_key or ()), header_timeout_s=header_timeout,
                              body_timeout_s=body_timeout, log_probes=log_probes)
    sock = bind_socket(host, port)
    sock.listen(2048)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(levelname)s: %(message)s")
    # httpx logs every call at INFO (a health probe every 2 s per backend): only under --log-level debug.
    logging.getLogger("httpx").setLevel(logging.DEBUG if log_level in ("debug", "trace") else logging.WARNING)
    err.print(f"tieredkv: routing on http://{shown}:{bound[1]} over {len(settings.backends)} backend"
              f"{'s' if len(settings.backends) != 1 else ''}: {', '.join(settings.backends)}", soft_wrap=True)
    serve_router(settings, sock, log_level=log_level)


# ---- kv-events-keys ----------------------------------------------------------------------

@friendly
def kv_events_keys(
    directory: str = typer.Argument(..., metavar="DIR", help="Where to write them (made 0700 when absent)."),
    name: str = typer.Option("router", help="The keypair's name: DIR/NAME.key and DIR/NAME.key_secret."),
) -> None:
    """Make a CURVE keypair for a KV-event subscriber (a router): NAME.key (public) and
    NAME.key_secret (0600). The server allows the public one (serve --kv-events-allow-keys
    DIR/NAME.key, or a directory of such files); the subscriber keeps the secret one (route
    --kv-events-key DIR/NAME.key_secret). Never overwrites a key."""
    from storage.kv_events.keys import write_keypair
    try:
        public, secret = write_keypair(directory, name)
    except FileExistsError as e:
        raise CLIError(str(e), code=2) from None
    err.print(f"tieredkv: wrote {public} (public: give it to the servers, serve --kv-events-allow-keys) and "
              f"{secret} (secret, 0600: the router's, route --kv-events-key)", soft_wrap=True)
