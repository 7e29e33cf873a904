"""The HTTP service: OpenAI-compatible completions and chat, plus cache status, lookup, billing
and flush routes, over one Engine. `create_app(engine, settings)` builds the FastAPI app;
`serve(engine, settings, host, port)` runs it under uvicorn with graceful shutdown.
Knows HTTP; the engine knows nothing of it.
"""
from service.app import create_app
from service.server import serve
from service.settings import ServiceSettings

__all__ = ["ServiceSettings", "create_app", "serve"]
