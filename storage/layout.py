"""The block layout: one block of every layer, K and V, as one contiguous array.

Knows: the shape `[num_layers, 2, block_size, num_kv_heads, head_dim]`, its dtype, its size
in bytes, and the dtype names used in headers and model identities. One block is one copy
between tiers (vLLM's contiguous cross-layer layout made offload 4-5x faster than per-layer
copies). Doesn't know: where a block lives or what model made it.

torch is imported only by dtype_from_name (which hands back a torch.dtype): a dtype's name and
size are known without it, so the CLI's disk inspection (`tieredkv inspect`, `verify`) runs
without importing torch (issue 31).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Stable dtype names: they go into codec headers and namespace digests, so never rename. Each
# with its size in bytes (what a header's raw size is checked against, without torch).
DTYPE_ITEMSIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "float16" or "bfloat16" for that torch.dtype; ValueError for anything else."""
    # A torch.dtype prints as "torch.<name>"; its type is torch.dtype (checked without importing torch).
    name = str(dtype).removeprefix("torch.")
    if type(dtype).__module__ != "torch" or type(dtype).__name__ != "dtype" or name not in DTYPE_ITEMSIZES:
        raise ValueError(f"unsupported KV dtype {dtype}; expected one of {list(DTYPE_ITEMSIZES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPE_ITEMSIZES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {list(DTYPE_ITEMSIZES)}")
    import torch
    dtype: Any = getattr(torch, name)
    return dtype


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
