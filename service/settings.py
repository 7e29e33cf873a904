"""ServiceSettings: how the HTTP service admits, authenticates and shuts down; validated on construction.

Knows: the service's own knobs. Doesn't know: the engine's or the cache's (CacheConfig, the
engine's max_queue) -- those are set where the engine is built.
"""
from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

def _positive(value: object, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number of seconds{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class ServiceSettings:
    # JSON file {"sk-...": {"tenant": "acme", "role": "admin" | "user"}}; None: no auth, every
    # caller is an admin and names its tenant in `user` (the server then binds loopback only).
    api_keys_file: str | None = None
    # Keys given one by one (vLLM's --api-key): each an admin of the default tenant.
    api_keys: tuple[str, ...] = ()
    # Tenants whose keys are admins whatever their role says.
    admin_tenants: tuple[str, ...] = ()
    # Generation requests admitted at once (running or waiting in the engine); more get 429.
    # Each admitted request holds one worker thread, so this also sizes the service's pool. A
    # batch of prompts is one request here; its prompts count one by one against the engine's
    # queue (Engine(max_queue=4096): two whole batches of MAX_BATCH_PROMPTS), 429 past it.
    max_queue: int = 256
    # Generation requests one tenant may have admitted at once (running or waiting); more get 429
    # with Retry-After. None: three quarters of the engine's batch (max_seqs), at least 1 --
    # so a quarter of the batch is always open to the other tenants (`per_tenant_bound`).
    max_inflight_per_tenant: int | None = None
    # Seconds a non-streaming request may take, or a stream may wait for its next chunk; the
    # client then gets 504 and the engine's request is aborted (billed for what was sent). None: no limit.
    request_timeout_s: float | None = 600.0
    # A slow client's bounds (service/read_limits.py): the request line and headers within
    # header_timeout_s of the request's first byte; the body within body_timeout_s of the headers,
    # plus a second per 64 KiB received. Past either: 408, the connection closed.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # On SIGTERM/SIGINT: seconds to wait for in-flight requests before closing the engine.
    shutdown_timeout_s: float = 30.0
    # max_tokens when a chat request gives none (completions default to 16, as OpenAI's do).
    default_chat_max_tokens: int = 256
    host: str = "127.0.0.1"
    port: int = 8000
    # Close the engine (flushing cached blocks to disk) when the app shuts down.
    close_engine_on_shutdown: bool = True
    # Largest request body accepted; past it, 413 (counted as the body streams in).
    max_body_bytes: int = 8 << 20
    # /metrics needs an admin key (when keys are configured). Off by default, as Prometheus
    # scrapers usually reach it on a private port; turn it on when the port is public.
    protect_metrics: bool = False
    # A request field the server does not know: "reject" (a 400 naming it, OpenAI's behaviour) or
    # "ignore" (vLLM's: dropped, logged once per name, named in the X-Tieredkv-Ignored-Fields
    # header). Known fields the server cannot honour are refused either way.
    unknown_fields: str = "reject"
    # Longest prompt text (UTF-8 bytes; chat: the messages' contents together) that is tokenized;
    # longer is a 400 before the tokenizer runs. None: 32 bytes per token of the model's context.
    max_prompt_bytes: int | None = None
    # The model's name as clients see it (/v1/models lists it, responses echo it); requests may
    # name it or the engine's own model name. None: the engine's name.
    served_model_name: str | None = None
    # Write polling's successful answers in the request log at INFO (probes, the router's block
    # hashes, the dashboard's fetches: service/request_log.py); False: DEBUG only.
    log_probes: bool = False

    def __post_init__(self) -> None:
        if self.api_keys_file is not None and not isinstance(self.api_keys_file, (str, os.PathLike)):
            raise ValueError(f"api_keys_file: expected a path or None, got {self.api_keys_file!r}")
        if isinstance(self.admin_tenants, str) or not all(isinstance(t, str) and t for t in self.admin_tenants):
            raise ValueError(f"admin_tenants: expected a sequence of tenant names, got {self.admin_tenants!r}")
        object.__setattr__(self, "admin_tenants", tuple(self.admin_tenants))
        if isinstance(self.api_keys, str) or not all(isinstance(k, str) and k.strip() for k in self.api_keys):
            raise ValueError("api_keys (--api-key): expected a sequence of non-empty keys")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue: expected an int >= 1, got {self.max_queue!r}")
        if self.max_inflight_per_tenant is not None and (isinstance(self.max_inflight_per_tenant, bool) or not
                                                         isinstance(self.max_inflight_per_tenant, int) or
                                                         self.max_inflight_per_tenant < 1):
            raise ValueError(f"max_inflight_per_tenant: expected an int >= 1 or None, got {self.max_inflight_per_tenant!r}")
        _positive(self.request_timeout_s, "request_timeout_s", allow_none=True)
        _positive(self.shutdown_timeout_s, "shutdown_timeout_s")
        _positive(self.header_timeout_s, "header_timeout_s")
        _positive(self.body_timeout_s, "body_timeout_s")
        if isinstance(self.default_chat_max_tokens, bool) or not isinstance(self.default_chat_max_tokens, int) \
                or self.default_chat_max_tokens < 1:
            raise ValueError(f"default_chat_max_tokens: expected an int >= 1, got {self.default_chat_max_tokens!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected an int in [0, 65535], got {self.port!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: expected an int >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.protect_metrics, bool):
            raise ValueError(f"protect_metrics: expected True or False, got {self.protect_metrics!r}")
        if self.unknown_fields not in ("reject", "ignore"):
            raise ValueError(f"unknown_fields: expected 'reject' or 'ignore', got {self.unknown_fields!r}")
        if self.max_prompt_bytes is not None and (isinstance(self.max_prompt_bytes, bool) or
                                                  not isinstance(self.max_prompt_bytes, int) or self.max_prompt_bytes < 1):
            raise ValueError(f"max_prompt_bytes: expected an int >= 1 or None, got {self.max_prompt_bytes!r}")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()
                                                   or not self.served_model_name.isprintable()):
            raise ValueError(f"served_model_name: expected a non-empty printable name, got {self.served_model_name!r}")
        if not isinstance(self.log_probes, bool):
            raise ValueError(f"log_probes: expected True or False, got {self.log_probes!r}")
        if not isinstance(self.close_engine_on_shutdown, bool):
            raise ValueError(f"close_engine_on_shutdown: expected True or False, got {self.close_engine_on_shutdown!r}")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False      # any other name may resolve to a public address


def per_tenant_bound(setting: int | None, max_seqs: int | None, max_queue: int) -> int:
    """One tenant's bound on requests in flight: the setting, else three quarters of the engine's
    batch (max_seqs; at least 1), so one tenant's flood leaves a quarter of the batch to the
    others and their requests start within a step or two (the scheduler takes tenants in
    turns). Never more than max_queue, the bound on all of them. An engine that does not say
    its batch size: max_queue (no bound of its own)."""
    if setting is not None:
        return min(setting, max_queue)
    if max_seqs is None:
        return max_queue
    return min(max(1, max_seqs * 3 // 4), max_queue)
