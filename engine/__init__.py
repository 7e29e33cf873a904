"""Inference on transformers decoder models over the tiered KV cache (see engine/engine.py).

Names are resolved lazily, so importing a light submodule (engine.outputs, engine.model's
helpers) does not import the whole engine.
"""
import importlib

_EXPORTS = {
    "Engine": "engine.engine",
    "SamplingParams": "engine.sampling_params",
    "CompletionOutput": "engine.outputs", "StreamChunk": "engine.outputs", "Usage": "engine.outputs",
    "RequestMetrics": "engine.outputs", "LookupResult": "engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
