"""The startup summary: what a server runs, once its engine is up -- what `vllm serve` and
`llama-server` print before their first request.

Knows: which facts an operator checks first (model and the name it is served as, device, dtype,
attention backend, the context length and what set it, each tier's size and place, the ledger,
the listen address) and where the engine keeps each. Only the remote store's redacted URL is
ever shown. Doesn't know: how the lines are printed (the CLI prints them; anyone may log them).
"""
from __future__ import annotations

from typing import Any

from storage.config import format_size

_CONTEXT_SOURCES = {
    "model": "the model (max_position_embeddings)",
    "device_pool": "the device pool (what it holds; more device memory gives more)",
    "max_model_len": "max_model_len",
}


def startup_summary(engine: Any, url: str, served_model_name: str | None = None) -> list[tuple[str, str]]:
    """(label, text) rows: model, device, context, each tier, billing, listen."""
    status = engine.cache_status()
    tiers = status["tiers"]
    config = engine.config
    loaded = engine.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    block = status["block_size"]
    name = engine.model_name
    rows = [("model", name if served_model_name in (None, name) else f"{name}, served as {served_model_name!r}"),
            ("device", f"{loaded.device}, {dtype}, attention {status['engine']['attention']}")]
    pool = tiers["device"]
    pool_tokens = pool["pages"] * block
    source = _CONTEXT_SOURCES.get(engine.max_context_source, engine.max_context_source)
    rows.append(("context", f"{engine.max_context:,} tokens (max model len), set by {source}; the model allows "
                            f"{loaded.max_context:,}, the device pool holds {pool_tokens:,}"))
    rows.append(("device pool", f"{format_size(pool['capacity_bytes'])}: {pool['pages']:,} pages of {block} tokens "
                                f"({format_size(status['block_bytes'])} each)"))
    host = tiers["host"]
    rows.append(("host tier", "off" if not host.get("enabled", True) else
                 f"{format_size(host['capacity_bytes'])} in {'pinned' if host.get('pinned') else 'pageable'} memory"))
    disk = tiers["disk"]
    if config.disk_path is None:
        rows.append(("disk tier", "off"))
    else:
        state = f" [unavailable: {disk['unavailable']}]" if disk.get("unavailable") else ""
        rows.append(("disk tier", f"{config.disk_path}, capacity {format_size(disk.get('capacity_bytes', 0))}, "
                                  f"holds {disk.get('blocks', 0):,} blocks ({format_size(disk.get('used_bytes', 0))})"
                                  f"{state}"))
    rows.append(("remote tier", "off" if config.remote is None else
                 f"{config.remote.redacted} ({config.remote_write})"))
    rows.append(("restores", f"compute or load: {config.restore_policy} (engine/restore_planner.py); "
                             f"blocks below the host stored {_codec(engine, config)}"
                             + (" (zstd level %d)" % config.zstd_level if config.codec == "zstd" else "")))
    events = getattr(engine.cache, "events_publisher", None)
    rows.append(("kv events", "off" if events is None else
                 f"{events.endpoint} (replay {events.replay_endpoint}; vLLM's KV events format)"))
    rows.append(("billing", _billing(engine, status.get("billing", {"state": "off"}))))
    rows.append(("listen", f"{url} (OpenAI API under {url}/v1; {url}/docs)"))
    return rows


def _billing(engine: Any, billing: dict) -> str:
    writer = getattr(engine, "billing", None)
    if billing.get("state") == "off" or writer is None:
        return "off"
    reserve = billing.get("reserve", 0)
    text = f"{writer.path}, reserve {format_size(reserve)}" if reserve else f"{writer.path}, no reserve"
    if billing.get("reserve_error"):
        text += f" ({billing['reserve_error']})"
    if billing.get("ledger") == "unavailable":
        text += (f" [unavailable: {billing.get('error')}; " + ("requests served, bills held until it opens"
                 if billing.get("on_failure") == "serve" else "requests refused") + "]")
    return text


def format_summary(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {text}" for label, text in rows)


def _codec(engine, config) -> str:
    """The configured codec; under auto, the kind chosen (its figures: the disk's status)."""
    disk = getattr(engine.cache, "disk", None)
    if config.codec != "auto":
        return config.codec
    return f"auto: {disk.codec.kind}" if disk is not None else "auto: zstd (no disk tier)"
