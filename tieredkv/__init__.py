"""tieredkv: a tiered KV-cache store for LLM inference.

Users import only this package: `from tieredkv import Engine, CacheConfig, SamplingParams`.
The engine is imported lazily so that `import tieredkv` (the config, the CLI's
help) does not pay for torch and transformers.
"""
from storage.config import CacheConfig

__all__ = ["CacheConfig", "Engine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Engine", "SamplingParams"):
        import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
