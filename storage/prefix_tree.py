"""The cached prefixes as a forest: stored blocks (hash, parent, namespace, tokens) -> trees.

Knows: how block metadata becomes one forest per namespace, rooted at the blocks whose parent is
the namespace's root hash, with chains of single children folded into one node (a radix tree, so
a 90-block document is one node); the order nodes are shown in; a node's one-line preview and its
JSON form. Shared by `tieredkv inspect --tree` (the disk tier, read from its files) and the live
server's /v1/cache/tree (every tier of a running cache: TieredKVCache.cached_blocks).
Doesn't know: where the blocks were read from, or what a token id means (a decode function is
handed in where text is wanted).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from storage.hashing import root_hash

PREVIEW_CHARS = 72


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One block a running cache holds, in the fastest tier that holds it. `reads`: the disk's
    count of reads of it (0 for a block only in memory: the pool and the slab keep no count)."""
    hash: bytes
    parent: bytes
    namespace: bytes
    token_ids: tuple[int, ...]
    tier: str
    reads: int = 0


@dataclass(slots=True)
class PrefixNode:
    """A run of blocks where each block is the only stored child of the one before."""
    depth: int | None            # block index of the run's first block in its prompt; None: unknown
    orphan: bool = False         # the first block's parent is not stored (evicted or deleted)
    hashes: list[bytes] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)
    tiers: list[str | None] = field(default_factory=list)   # per block; None where the source has no tiers
    children: list["PrefixNode"] = field(default_factory=list)

    @property
    def total_blocks(self) -> int:
        return len(self.hashes) + sum(c.total_blocks for c in self.children)

    @property
    def total_reads(self) -> int:
        return sum(self.reads) + sum(c.total_reads for c in self.children)


def build_forest(blocks: Iterable[Any]) -> dict[bytes, list[PrefixNode]]:
    """namespace -> its trees. A block whose parent is neither stored nor the namespace root
    (evicted or deleted) starts a tree of its own: depth None, orphan True. A block may carry a
    `tier` (CachedBlock); the disk's DiskBlockInfo does not."""
    by_hash = {b.hash: b for b in blocks}
    children: dict[bytes, list[Any]] = defaultdict(list)
    starts: dict[bytes, list[tuple[Any, int | None]]] = defaultdict(list)
    for b in by_hash.values():
        if b.parent in by_hash and b.parent != b.hash:
            children[b.parent].append(b)
        else:
            starts[b.namespace].append((b, 0 if b.parent == root_hash(b.namespace) else None))
    seen: set[bytes] = set()

    def grow(first: Any, depth: int | None, orphan: bool = False) -> PrefixNode:
        node = PrefixNode(depth, orphan)
        cur = first
        while True:
            # NOTE: `seen` guards against a cycle in a damaged store (a chain of sha256 hashes
            # cannot loop, but a rewritten parent field could): no block is visited twice.
            seen.add(cur.hash)
            node.hashes.append(cur.hash)
            node.token_ids.extend(cur.token_ids)
            node.reads.append(cur.reads)
            node.tiers.append(getattr(cur, "tier", None))
            kids = [k for k in children.get(cur.hash, ()) if k.hash not in seen]
            if len(kids) != 1:
                break
            cur = kids[0]
        nxt = None if depth is None else depth + len(node.hashes)
        node.children = ordered([grow(k, nxt) for k in kids if k.hash not in seen])
        return node

    return {ns: ordered([grow(b, d, d is None) for b, d in sorted(items, key=lambda x: x[0].hash)])
            for ns, items in sorted(starts.items())}


def ordered(nodes: list[PrefixNode]) -> list[PrefixNode]:
    """Whole prefixes before orphans, then the most-hit, then the biggest; the first hash breaks
    ties (stable output)."""
    return sorted(nodes, key=lambda n: (n.orphan, -n.total_reads, -n.total_blocks, n.hashes[0] if n.hashes else b""))


def preview(token_ids: list[int], decode: Callable[[list[int]], str] | None, limit: int = PREVIEW_CHARS) -> str:
    """A one-line preview: decoded text (newlines shown as ⏎) or the token ids, middle elided."""
    if decode is not None:
        text = decode(token_ids).replace("\r", "").replace("\n", "⏎")
    else:
        text = "ids " + " ".join(map(str, token_ids))
    if len(text) <= limit:
        return text
    head = limit * 5 // 9
    return text[:head] + " … " + text[-(limit - head - 3):]


def limited(nodes: list[PrefixNode], max_width: int) -> tuple[list[PrefixNode], list[PrefixNode]]:
    return nodes[:max_width], nodes[max_width:]


def node_to_dict(node: PrefixNode, decode: Callable[[list[int]], str] | None, max_depth: int,
                 max_width: int, preview_chars: int = PREVIEW_CHARS) -> dict[str, Any]:
    """JSON form of a node, `max_depth` levels and `max_width` branches per node. `tiers`: how
    many of the node's own blocks each tier holds (only where the blocks say)."""
    d: dict[str, Any] = {"first_block": node.depth, "orphan": node.orphan, "blocks": len(node.hashes),
                         "tokens": len(node.token_ids), "first_hash": node.hashes[0].hex(), "reads": node.reads,
                         "preview": preview(node.token_ids, decode, preview_chars), "subtree_blocks": node.total_blocks}
    if any(t is not None for t in node.tiers):
        counts: dict[str, int] = {}
        for t in node.tiers:
            counts[t or "?"] = counts.get(t or "?", 0) + 1
        d["tiers"] = counts
    shown, more = limited(node.children, max_width) if max_depth > 1 else ([], node.children)
    d["children"] = [node_to_dict(c, decode, max_depth - 1, max_width, preview_chars) for c in shown]
    d["more_children"] = len(more)
    return d
