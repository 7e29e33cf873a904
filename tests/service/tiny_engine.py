"""A tiny random-weight Llama with the real SmolLM2 tokenizer: text prompts work, steps take milliseconds.

Shared by the in-process test servers (conftest) and the subprocess server (server_main.py):
the same seed gives the same weights, so a restarted server hits what an earlier one stored.
"""
from __future__ import annotations

import os

import torch
from transformers import AutoTokenizer, LlamaConfig

from engine.gguf_cache import converted_dir
from engine.model import default_gguf_path, model_from_config
from tieredkv import CacheConfig, Engine

BLOCK_SIZE = 8


def default_tokenizer_dir() -> str | None:
    """The converted default model's directory, if the one-time conversion has happened: fp32, or
    bf16 where `load_model()` chose it (a CPU with native bf16 converts only that one)."""
    for dtype in (torch.float32, torch.bfloat16):
        d = converted_dir(default_gguf_path(), dtype=dtype)
        if (d / "tokenizer.json").is_file() and (d / "config.json").is_file():
            return str(d)
    return None


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=1024)


def build_engine(cache_root: str | os.PathLike, tokenizer, *, seed: int = 0, max_queue: int | None = None,
                 device_memory: str = "1MiB", host_memory: str = "512KiB", **cache_kw) -> Engine:
    """KV cache under <cache_root>/kv and the ledger under <cache_root>/billing (the engine's default).
    `cache_kw`: more CacheConfig fields (remote_url=..., for servers sharing a store). max_queue
    None: the engine's default."""
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=seed)
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory=device_memory, host_memory=host_memory,
                        disk_dir=os.path.join(os.fspath(cache_root), "kv"), disk_capacity="64MiB", **cache_kw)
    return Engine.from_loaded(loaded, cache, **({} if max_queue is None else {"max_queue": max_queue}))
