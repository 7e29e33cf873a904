"""The prefixes an engine has cached for its tenants, as trees with their text (`Engine.prefix_tree`).

Knows: which namespaces to show (the tenants asked for, or every tenant the ledger knows and
"default"; tenants sharing a namespace shown once, as "*"), and how storage/prefix_tree.py's
forest becomes the JSON `/v1/cache/tree` answers. Doesn't know: HTTP, or how blocks are stored.
Runs on the caller's thread (it reads the disk's block records), never the engine thread.
"""
from __future__ import annotations

from typing import Any, Sequence as Seq

from storage.prefix_tree import build_forest, node_to_dict


def prefix_tree(engine: Any, tenants: Seq[str] | None = None, depth: int = 8, width: int = 8,
                max_disk_blocks: int = 20_000) -> dict:
    """The prefixes cached for these tenants (None: those of every tenant the ledger knows,
    and "default", that have any) in the device pool, host slab and disk, as trees with
    their text: one per tenant, chains of single children folded (storage/prefix_tree.py).
    Tenants sharing a namespace (isolate_tenants=False) are shown once, as "*". Reads the
    disk's block records (at most `max_disk_blocks`): call it off the engine thread."""
    every = tenants is None
    if every:
        tenants = sorted(set(engine.ledger.tenants() if engine.ledger is not None else ()) | {"default"})
    by_ns = {}
    for t in tenants:
        by_ns.setdefault(engine.namespace(t), "*" if not engine.config.isolate_tenants else t)
    blocks, truncated = engine.cache.cached_blocks(frozenset(by_ns), max_disk_blocks)
    forest = build_forest(blocks)
    decode = None if engine.tokenizer is None else (lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    out = {}
    for ns, tenant in by_ns.items():
        nodes = forest.get(ns, [])
        if every and not nodes:
            continue           # every tenant asked for: only those with something cached
        shown, more = nodes[:width], nodes[width:]
        out[tenant] = {"namespace": ns.hex(), "blocks": sum(n.total_blocks for n in nodes),
                       "tree": [node_to_dict(n, decode, depth, width, preview_chars=160) for n in shown],
                       "more_roots": len(more)}
    return {"block_size": engine.block_size, "truncated": truncated, "tenants": out}
