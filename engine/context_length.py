"""The longest sequence the engine runs, and what set it.

Knows: the three limits -- the model's context (max_position_embeddings), what the device pool
holds, and an asked-for max_model_len (refused when more than either) -- and which one binds.
Doesn't know: the model or the pool themselves (engine/engine.py passes their sizes).
"""
from __future__ import annotations


def context_length(model_max: int, pool_pages: int, block_size: int,
                   max_model_len: int | None = None) -> tuple[int, str]:
    """The longest sequence (prompt + output) the engine runs, and what set it: "max_model_len"
    (asked for), "model" (its max_position_embeddings) or "device_pool" (what the pool holds)."""
    pool_tokens = pool_pages * block_size
    if max_model_len is not None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len: expected an int >= 2, got {max_model_len!r}")
        if max_model_len > model_max:
            raise ValueError(f"max_model_len: {max_model_len:,} tokens is more than the model's context of "
                             f"{model_max:,} (max_position_embeddings)")
        if max_model_len > pool_tokens:
            raise ValueError(f"max_model_len: {max_model_len:,} tokens do not fit the device pool, which holds "
                             f"{pool_tokens:,} ({pool_pages:,} pages of {block_size}); give it more device memory "
                             "or ask for fewer tokens")
        return max_model_len, "max_model_len"
    return (model_max, "model") if model_max <= pool_tokens else (pool_tokens, "device_pool")
