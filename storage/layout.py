"""The block layout: one block of every layer, K and V, as one contiguous array.

Knows: the shape `[num_layers, 2, block_size, num_kv_heads, head_dim]`, its dtype, its size
in bytes, and the dtype names used in headers and model identities. One block is one copy
between tiers (vLLM's contiguous cross-layer layout made offload 4-5x faster than per-layer
copies). Doesn't know: where a block lives or what model made it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Stable dtype names: they go into codec headers and namespace digests, so never reorder.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}; expected one of {list(DTYPES_BY_NAME)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {list(DTYPES_BY_NAME)}") from None


@dataclass(frozen=True, slots=True)
class BlockLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"BlockLayout.{name}: expected a positive int, got {v!r}")
        dtype_name(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def blocks_in(self, nbytes: int) -> int:
        """How many whole blocks fit in `nbytes`."""
        return nbytes // self.nbytes
