"""flex_paged: flex_attention over the page pool in place, compiled for a bounded, known set of shapes.

Knows: the row mapping (`layer_rows`: one layer's K and V of the pool [page, layer, k/v, slot,
head, dim] as two views of rows, V a block after K, page p's rows at p * stride .. + B in both:
page-major, the whole pool as one sequence of slots starting at the layer's first K slot, stride
2L * B; layer-major (storage/device_pool.py), the layer's own region, stride 2B, so a view spans
one layer's pages and stays within the kernels' 32-bit offsets at any pool size), the block mask that lists each
sequence's pages (one mask block per page) with a mask_mod mapping a physical row back to its
logical position, and the shapes it ever hands the compiled kernel:
- one query tile (Q_TILE) and fixed kernel options per kind of pass;
- the group's batch padded to a power of two >= 2 (`bucket_batch`) and its query length to
  1 (decodes), a power of two in [16, 64], or a multiple of Q_TILE (`bucket_query`);
- the block table's width a power of two >= 2.
Compiled with those sizes as symbols (marked dynamic; the model's constants stay constants), what remains are the
specializations those buckets leave: one per `shape_class` (decode, a short chunk, one tile,
several tiles). `warm_up` compiles each at engine start (a progress line each, never on a first
request); after it the set is sealed: a compile past it raises FlexRecompileError (and
torch._dynamo's fail_on_recompile_limit_hit is on), so a new specialization fails loudly
instead of running flex eagerly -- which materializes scores against the whole pool (GiBs).
Each instance compiles a fresh code object, so its recompile count is its own (tests build many
engines in one process; dynamo counts recompiles per code object).
On CUDA the compile backend is inductor (Triton kernels). On CPU flex runs eagerly by default
(its reference path: dense scores over the view, for the tiny test models); `compile="aot_eager"`
runs the same compiled path through dynamo, so the bucket set and the recompile counts are
asserted on the CPU (inductor's CPU template refuses a block mask narrower than the key length).
Doesn't know: scheduling, tiers, how groups are formed (engine/paged_batch.py).
"""
from __future__ import annotations

import logging
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

import torch

from engine.paged_batch import Group, PagedBatch

log = logging.getLogger("tieredkv.engine")

Q_TILE = 128          # the block mask's one query tile
SHORT_MAX = 64        # a chunk up to this many queries is padded to a power of two (>= 16)
SHAPE_CLASSES = ("decode", "short", "tile", "tiles")


class FlexRecompileError(RuntimeError):
    """flex_paged met a shape outside the set it compiled at start (a bug in its buckets)."""


def bucket_batch(s: int) -> int:
    """A group's batch padded: a power of two >= 2 (a batch of 1 would be a specialization)."""
    return max(2, 1 << (s - 1).bit_length())


def bucket_query(q: int) -> int:
    """A group's query length padded: 1 (decodes), a power of two in [16, SHORT_MAX], or a
    multiple of Q_TILE."""
    if q <= 1:
        return 1
    if q <= SHORT_MAX:
        return max(16, 1 << (q - 1).bit_length())
    return -(-q // Q_TILE) * Q_TILE


def bucket_width(blocks: int) -> int:
    """The block table's width: a power of two >= 2, the same for the mask_mod's table."""
    return max(2, 1 << (blocks - 1).bit_length())


def shape_class(q_padded: int) -> str:
    """Which compiled specialization a padded query length runs."""
    if q_padded == 1:
        return "decode"
    if q_padded <= SHORT_MAX:
        return "short"
    return "tile" if q_padded == Q_TILE else "tiles"


def _kernel_options(q_padded: int, block_size: int) -> dict:
    # The kernel's query tile divides Q_TILE; one value per class (a new value is a new compile).
    return {"BLOCK_M": 16 if q_padded == 1 else 64, "BLOCK_N": block_size}


def _flex_call(q, k, v, block_mask, scale, kernel_options):
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=kernel_options)


@dataclass(frozen=True)
class _Flex:
    block_mask: Any
    q_index: torch.Tensor      # [Sb, Qb] packed rows of the padded queries (padding reads row 0)
    size: int                  # Sb
    max_q: int                 # Qb
    sized: tuple               # (tensor, its dims that vary between passes): marked dynamic


def _mark_dynamic(sized) -> None:
    """Only the sizes that vary between passes are symbols (the rest, heads, head size, layers,
    are constants that cannot tie to them by chance: dynamo's duck sizing would guard on it)."""
    for t, dims in sized:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


class _CountingBackend:
    """The compile backend, counting its compiles; sealed after warm-up (a compile then raises)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.compiles = 0
        self.sealed = False
        self.lock = threading.Lock()

    def __call__(self, gm, example_inputs):
        with self.lock:
            if self.sealed:
                raise FlexRecompileError(
                    "flex_paged: a shape outside the set compiled at start; refusing to compile or run "
                    "flex eagerly over the whole pool (engine/flex_paged.py buckets)")
            self.compiles += 1
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


_instances = 0


class FlexPaged:
    """flex_attention over the pool in place. `compile`: a torch.compile backend ("inductor",
    "aot_eager") or None (eager); the default is inductor on CUDA, eager on CPU."""
    name = "flex_paged"

    def __init__(self, device: torch.device, compile: str | None = "auto") -> None:
        global _instances
        if compile == "auto":
            compile = "inductor" if device.type == "cuda" else None
        self.compile = compile
        self.counter: _CountingBackend | None = None
        self.classes_seen: set[str] = set()
        if compile is None:
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = lambda q, k, v, bm, scale, opts: flex_attention(
                q, k, v, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=opts)
            return
        _instances += 1
        # A fresh code object: dynamo keeps compiled entries (and counts recompiles) per code object.
        code = _flex_call.__code__.replace(co_name=f"flex_paged_{_instances}")
        fn = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        self.counter = _CountingBackend(compile)
        cfg = torch._dynamo.config
        # Never run flex eagerly past the recompile limit: fail. The set is len(SHAPE_CLASSES).
        cfg.fail_on_recompile_limit_hit = True
        cfg.recompile_limit = max(cfg.recompile_limit, 2 * len(SHAPE_CLASSES))
        # dynamic=None: the sizes marked in attend are symbols, every other one a constant.
        self._flex = torch.compile(fn, backend=self.counter, fullgraph=True)

    @property
    def compiles(self) -> int:
        return self.counter.compiles if self.counter is not None else 0

    @staticmethod
    def _rows(kv: torch.Tensor) -> tuple[int, int, int]:
        P, _, _, B, H_kv, D = kv.shape
        stride = kv.stride(0) // (H_kv * D)     # rows from one page's slots to the next page's
        return P, stride, (P - 1) * stride + B  # ... and the length every layer's view has

    def prepare(self, batch: PagedBatch, g: Group) -> _Flex:
        return self._prepare(batch.kv, batch.block_size, g)

    def _prepare(self, kv: torch.Tensor, B: int, g: Group) -> _Flex:
        from torch.nn.attention.flex_attention import BlockMask
        P, stride, M = self._rows(kv)
        S, nb = g.block_table.shape
        Sb, Qb, width = bucket_batch(S), bucket_query(g.max_q), bucket_width(nb)
        dev = kv.device
        pad_s = Sb - S
        ctx = torch.nn.functional.pad(g.context_len, (0, pad_s))            # padded sequences: no keys
        q_first = torch.nn.functional.pad(g.q_first, (0, pad_s))
        q_len = torch.nn.functional.pad(g.q_len, (0, pad_s))
        q_index = torch.nn.functional.pad(g.q_index, (0, Qb - g.max_q, 0, pad_s))   # padding reads row 0
        blocks = torch.arange(nb, device=dev)
        used = blocks[None, :] < (g.context_len[:, None] + B - 1) // B          # [S, nb]
        # physical page -> its logical block, one row for the group: NOTE invariant: a page holds
        # K/V with RoPE applied at one block's positions, so every sequence that maps it maps it
        # at the same logical index (shared prefix pages included). -1: no sequence's page;
        # column P takes the padding entries of the table. The mask_mod checks the page is the
        # row's own (its table at that index holds it); padding pages fail `k_pos < ctx`.
        p2l = torch.full((P + 1,), -1, dtype=torch.int32, device=dev)
        p2l.scatter_(0, torch.where(used, g.block_table, P).reshape(-1),
                     torch.where(used, blocks[None, :], -1).to(torch.int32).reshape(-1))
        # One mask block per page: the block index of page p's rows is p * stride / B. The
        # kernels read only the first kv_num entries of a row (flex_attention.py.jinja: the loop
        # stops at kv_num; utilities.py.jinja get_offset_for_next_block masks the next load by
        # kv_num; flex_decode.py.jinja indexes modulo the width), and the eager path reads only
        # mask_mod: so the width is the group's blocks (a power of two), not the view's (M // B + 1
        # columns: 5.6 MB a row for an 8 GiB SmolLM2-135M pool).
        table = torch.nn.functional.pad(g.block_table.to(torch.int32), (0, width - nb, 0, pad_s))   # page 0
        n_q_blocks = -(-Qb // Q_TILE)
        kv_indices = (table * (stride // B))[:, None, None, :].expand(Sb, 1, n_q_blocks, width).contiguous()
        kv_num = ((ctx + B - 1) // B).to(torch.int32).view(Sb, 1, 1).expand(Sb, 1, n_q_blocks).contiguous()

        def mask_mod(b, h, q_idx, kv_idx):
            page, row = kv_idx // stride, kv_idx % stride
            logical = p2l[page]
            mine = (logical >= 0) & (table[b, logical.clamp(min=0)] == page)
            k_pos = logical * B + row
            # row < B: this layer's K (V) slots of the page, not another layer's (the block mask
            # already says so; the mask says it again for partial and unfused evaluation).
            return (row < B) & mine & (k_pos <= q_first[b] + q_idx) & (k_pos < ctx[b]) & (q_idx < q_len[b])

        block_mask = BlockMask.from_kv_blocks(
            kv_num, kv_indices, BLOCK_SIZE=(Q_TILE, B), mask_mod=mask_mod, seq_lengths=(Qb, M),
            compute_q_blocks=False)     # forward only: no transposed (backward) index, no full_kv_*
        sized = ((p2l, (0,)), (table, (0, 1)), (q_first, (0,)), (ctx, (0,)), (q_len, (0,)),
                 (kv_indices, (0, 2, 3)), (kv_num, (0, 2)))
        return _Flex(block_mask, q_index, Sb, Qb, sized)

    def attend(self, q_all, kv, layer, g, prepared: _Flex, scaling):
        k, v = layer_rows(kv, layer)                            # [M, kv_heads, D] each, views
        M, H_kv, D = k.shape
        B = kv.shape[3]
        Sb, Qb = prepared.size, prepared.max_q
        q = q_all[prepared.q_index].transpose(1, 2)             # [Sb, heads, Qb, D]
        k = k.permute(1, 0, 2).unsqueeze(0).expand(Sb, H_kv, M, D)
        v = v.permute(1, 0, 2).unsqueeze(0).expand(Sb, H_kv, M, D)
        self.classes_seen.add(shape_class(Qb))
        if self.counter is not None:
            _mark_dynamic(prepared.sized + ((q, (0, 2)), (k, (0, 2)), (v, (0, 2))))
        o = self._flex(q, k.to(q.dtype), v.to(q.dtype), prepared.block_mask, scaling,
                       _kernel_options(Qb, B))                  # [Sb, heads, Qb, D]
        S, Q = g.size, g.max_q
        H = o.shape[1]
        return o[:S, :, :Q].transpose(1, 2).reshape(S * Q, H, D)

    def warm_up(self, kv: torch.Tensor, block_size: int, num_heads: int, dtype: torch.dtype,
                max_query: int, scaling: float | None = None) -> int:
        """Compile every shape class a pass up to `max_query` new tokens can take, on the real
        pool (reads only: every query attends to page 0's first slot, nothing is written), with
        a progress line each; then seal. Returns the compiles made. A no-op when eager."""
        if self.counter is None:
            return 0
        classes = {shape_class(bucket_query(q)): q for q in (1, 2, Q_TILE, 2 * Q_TILE) if q <= max(max_query, 1)}
        # Sizes picked pairwise distinct from each other and from the pool's: no size the trace
        # sees equals another by chance, so no guard ties two of them together (duck sizing).
        P, _, M = self._rows(kv)
        taken = {0, 1, 2, 16, Q_TILE, 2 * Q_TILE, P + 1, M}
        Sb = next(x for x in (4, 8, 32, 64, 128, 256) if x not in taken)
        width = next(x for x in (64, 512, 1024, 2048, 4096) if x not in taken | {Sb})
        S, nb = Sb - 1, width - 1
        started = time.perf_counter()
        for i, (cls, q_len) in enumerate(classes.items(), 1):
            t = time.perf_counter()
            with torch.inference_mode():       # as the engine's forward runs (tensors' kind is guarded)
                g = _dummy_group(S, q_len, nb, block_size, kv.device)
                q_all = torch.zeros((S * q_len, num_heads, kv.shape[-1]), dtype=dtype, device=kv.device)
                self.attend(q_all, kv, 0, g, self._prepare(kv, block_size, g), scaling)
            log.info("attention: flex_paged compiled for %s passes (%d/%d) in %.1fs", cls, i, len(classes),
                     time.perf_counter() - t)
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        with self.counter.lock:
            self.counter.sealed = True
        log.info("attention: flex_paged ready: %d shape classes, %d compiles, %.1fs", len(classes),
                 self.counter.compiles, time.perf_counter() - started)
        return self.counter.compiles


def layer_rows(kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V of the pool view [page, layer, k/v, slot, head, dim] as row views
    [M, kv_heads, D] (FlexPaged._rows): over the whole contiguous pool (page-major), or over the
    layer's contiguous region (layer-major: the view's page stride is one page of one layer)."""
    B, H_kv, D = kv.shape[3:]
    if kv.is_contiguous():
        flat, first = kv.view(-1, H_kv, D), layer * 2 * B
    else:
        flat, first = kv[:, layer].view(-1, H_kv, D), 0     # NOTE: a layer-major pool's region is contiguous
    M = FlexPaged._rows(kv)[2]
    return flat[first:first + M], flat[first + B:first + B + M]


def attention_span(kv: torch.Tensor) -> int:
    """The elements one layer's view spans from its start (storage/device_pool.py attention_span)."""
    return kv.numel() if kv.is_contiguous() else kv[:, 0].numel()


def _dummy_group(S: int, q_len: int, nb: int, block_size: int, device: torch.device) -> Group:
    """A group of S sequences with q_len new tokens each over nb pages (read only)."""
    ctx = max(q_len, (nb - 1) * block_size + 1)
    q_index = torch.arange(S * q_len, device=device).view(S, q_len)
    rows = torch.arange(S * q_len, device=device)
    table = torch.zeros((S, nb), dtype=torch.int64, device=device)      # page 0 at every index
    full = lambda v: torch.full((S,), v, dtype=torch.int64, device=device)   # noqa: E731
    return Group(S, q_len, ctx, q_index, rows, rows, table,
                 full(ctx), full(ctx - q_len), full(q_len))
