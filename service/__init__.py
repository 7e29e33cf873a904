"""The HTTP service: OpenAI-compatible completions and chat, Anthropic's Messages API, plus cache
status, lookup, billing and flush routes, over one Engine. `create_app(engine, settings)` builds the FastAPI app;
`serve(engine, settings, host, port)` runs it under uvicorn with graceful shutdown.
`service.router` is the prefix-aware front of several servers (`tieredkv route`).
Knows HTTP; the engine knows nothing of it. Names are resolved lazily, so the router (which
needs no engine) does not import torch.
"""
import importlib

_EXPORTS = {"create_app": "service.app", "serve": "service.server", "ServiceSettings": "service.settings"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'service' has no attribute {name!r}")
