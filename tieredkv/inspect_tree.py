"""What a disk tier holds, for `tieredkv inspect`: blocks per namespace and the prefix tree.

Knows: how to survey an open DiskTier (`survey`: totals and blocks per namespace, its blocks'
metadata made a forest by storage/prefix_tree.py, which the live server's tree shares); how to
name a namespace when it belongs to a model converted under the cache root (or the default one)
and a tenant the billing ledger knows: the disk tier stores no model names, but each load of a
converted GGUF records its identity beside the conversion (engine/conversion_path.py), and the
namespace is rebuilt from that for every dtype, block size and tenant. Neither torch nor
transformers is imported (inspect of 1,000 blocks in well under a second), except that --tree's
text previews load the model's tokenizer.
`overview` and `forest_tree` draw the result (rich renderables: a node is its full blocks, then a prompt's
exact entry -- tail tokens and logits blocks -- counted apart); an empty store's overview says
why it is empty (write-back) and how to flush a running server (`empty_disk_note`).
Doesn't know: LMDB or payloads -- it reads only what DiskTier.iter_blocks yields.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from engine.conversion_path import RecordedIdentity, recorded_identities
from storage.hashing import ModelIdentity, namespace_digest, tenant_salt
from storage.layout import DTYPE_ITEMSIZES
from storage.prefix_tree import PrefixNode, build_forest, limited, node_to_dict, preview


@dataclass(frozen=True, slots=True)
class NamespaceLabel:
    model: str
    dtype: str
    tenant: str | None           # None: tenants share the cache (isolate_tenants=False)

    def __str__(self) -> str:
        who = "all tenants (shared)" if self.tenant is None else f"tenant {self.tenant}"
        return f"{self.model} ({self.dtype}), {who}"


@dataclass(slots=True)
class Survey:
    report: dict[str, Any]                          # JSON-ready totals and namespaces
    forest: dict[bytes, list[PrefixNode]]
    labels: dict[bytes, NamespaceLabel]
    decoders: dict[bytes, Callable[[list[int]], str]]   # a labelled namespace's tokenizer, when wanted and loadable
    block_tokens: dict[bytes, int] = field(default_factory=dict)   # hash -> its token count (labels tell KV from exact entries)

    def decode_for(self, ns: bytes) -> Callable[[list[int]], str] | None:
        """Token ids are decoded only in namespaces whose model is known."""
        return self.decoders.get(ns)


def survey(tier: Any, billing_dir: str, decode: bool) -> Survey:
    """Read every block's metadata from an open DiskTier (read-only is enough) and sum it up
    per namespace; `decode`: also load the tokenizer for text previews."""
    blocks = list(tier.iter_blocks())
    stats = tier.stats()
    per_ns: dict[bytes, dict[str, int]] = {}
    for b in blocks:
        d = per_ns.setdefault(b.namespace, {"blocks": 0, "tokens": 0, "stored_bytes": 0, "raw_bytes": 0, "reads": 0})
        d["blocks"] += 1
        d["tokens"] += len(b.token_ids)
        d["stored_bytes"] += b.stored_size
        d["raw_bytes"] += b.raw_size
        d["reads"] += b.reads
    found = namespace_labels(set(per_ns), {len(b.token_ids) for b in blocks}, billing_dir)
    labels = {ns: label for ns, (label, _) in found.items()}
    namespaces = []
    for ns, d in sorted(per_ns.items(), key=lambda kv: (-kv[1]["blocks"], kv[0])):
        lab = labels.get(ns)
        namespaces.append({"namespace": ns.hex(), "label": None if lab is None else str(lab),
                           "model": lab.model if lab else None, "dtype": lab.dtype if lab else None,
                           "tenant": lab.tenant if lab else None, **d})
    report = {"path": tier.path, "blocks": stats.blocks, "stored_bytes": stats.used_bytes, "raw_bytes": stats.raw_bytes,
              "compression_ratio": round(stats.compression_ratio, 3), "namespaces": namespaces,
              "retained": retained_report(tier, {b.hash for b in blocks})}
    decoders: dict[bytes, Callable[[list[int]], str]] = {}
    if decode:
        by_dir = {str(d): load_decoder(str(d)) for d in {d for _, d in found.values()}}
        decoders = {ns: by_dir[str(d)] for ns, (_, d) in found.items() if by_dir[str(d)] is not None}
    return Survey(report, build_forest(blocks), labels, decoders, {b.hash: len(b.token_ids) for b in blocks})


def retained_report(tier: Any, stored: set[bytes]) -> dict[str, dict[str, Any]]:
    """Per tenant, the blocks retained past LRU now (issue 39): how many the store holds, how many
    it does not (yet, or no more), and the next deadline (ISO 8601, UTC)."""
    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    for row in tier.retained_rows():
        if row.deadline <= now:
            continue
        t = out.setdefault(row.tenant, {"blocks": 0, "not_stored": 0, "next_deadline": None, "by_class": {}})
        t["blocks" if row.block_hash in stored else "not_stored"] += 1
        t["by_class"][row.klass] = t["by_class"].get(row.klass, 0) + 1
        t["next_deadline"] = row.deadline if t["next_deadline"] is None else min(t["next_deadline"], row.deadline)
    for t in out.values():
        t["next_deadline"] = datetime.fromtimestamp(t["next_deadline"], timezone.utc).isoformat(timespec="seconds")
    return dict(sorted(out.items()))


def tree_to_dict(s: Survey, max_depth: int, max_width: int) -> dict[str, list[dict[str, Any]]]:
    return {ns.hex(): [node_to_dict(n, s.decode_for(ns), max_depth, max_width) for n in limited(nodes, max_width)[0]]
            for ns, nodes in s.forest.items()}


# ---- naming namespaces -----------------------------------------------------------------

def ledger_tenants(billing_dir: str) -> list[str]:
    """Tenants the billing ledger beside the disk tier knows (read-only); [] without one."""
    from engine.billing import Ledger
    try:
        with Ledger(billing_dir, readonly=True) as ledger:
            return ledger.tenants()
    except Exception:       # no ledger, or an unreadable one: names are a nicety here
        return []


def namespace_labels(namespaces: set[bytes], block_sizes: set[int],
                     billing_dir: str) -> dict[bytes, tuple[NamespaceLabel, Any]]:
    """`identify` with the tenants of the ledger in `billing_dir` and the identities recorded
    under its cache root (its parent) and the default root."""
    if not namespaces:
        return {}
    root = os.path.dirname(os.path.abspath(billing_dir)) if billing_dir else None
    return identify(namespaces, block_sizes, ledger_tenants(billing_dir), recorded_identities(root))


def identify(namespaces: set[bytes], block_sizes: set[int], tenants: Iterable[str],
             identities: Iterable[RecordedIdentity]) -> dict[bytes, tuple[NamespaceLabel, Any]]:
    """Which namespaces belong to a recorded model identity (any dtype, any block size seen), and
    for which tenant, with the model's directory. Tries every (identity, dtype, block size,
    tenant) the way the engine derives them (storage/hashing.py: sha256s, no model loaded)."""
    salts = [(tenant_salt("", False), None)] + [(tenant_salt(t), t) for t in sorted(set(tenants) | {"default"})]
    labels: dict[bytes, tuple[NamespaceLabel, Any]] = {}
    for rec in identities:
        for dtype in DTYPE_ITEMSIZES:
            ident = ModelIdentity(rec.name, rec.config_digest, dtype)
            for bs in block_sizes:
                for salt, tenant in salts:
                    ns = namespace_digest(ident, bs, salt)
                    if ns in namespaces and ns not in labels:
                        labels[ns] = (NamespaceLabel(rec.name, dtype, tenant), rec.model_dir)
    return labels


def load_decoder(model_dir: str | None) -> Callable[[list[int]], str] | None:
    """A model directory's tokenizer as a decode function, or None when it cannot be loaded: --tree's
    text previews. Its tokenizer.json read by the `tokenizers` library alone (~0.1 s) where the
    config asks for no clean-up of spaces (AutoTokenizer's decode is then the same call); else
    transformers' AutoTokenizer, whose import and load took ~7.7 s of a 120-block tree's 8.3 s."""
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        return None
    fast = _tokenizers_decoder(model_dir)
    if fast is not None:
        return fast
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def _tokenizers_decoder(model_dir: str) -> Callable[[list[int]], str] | None:
    """The decode of the directory's tokenizer.json through `tokenizers`, or None where that would
    differ from AutoTokenizer's (clean_up_tokenization_spaces) or cannot be read."""
    import json
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            if json.load(f).get("clean_up_tokenization_spaces", False) or not os.path.isfile(path):
                return None
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(path)
    except Exception:
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


# ---- drawing -----------------------------------------------------------------------------

def overview(report: dict[str, Any], url: str = "http://127.0.0.1:8000") -> Any:
    """The store's totals and a table of its namespaces; for an empty store, why and how to fill
    it (`url`: the server a flush would go to)."""
    from rich.console import Group
    from rich.markup import escape

    from storage.config import format_size
    n = report["blocks"]
    head = (f"Disk tier {escape(report['path'])}\n"
            f"  {n:,} block{'s' if n != 1 else ''}, {format_size(report['stored_bytes'])} stored, "
            f"{format_size(report['raw_bytes'])} raw, compression {report['compression_ratio']:.2f}x")
    if n == 0:
        return Group(head, escape(empty_disk_note(url)))
    for tenant, r in report.get("retained", {}).items():
        head += (f"\n  retained for {escape(tenant)}: {r['blocks']:,} block(s) past LRU"
                 + (f" (+{r['not_stored']:,} not on disk)" if r["not_stored"] else "")
                 + f", next deadline {r['next_deadline']}")
    return Group(head, namespace_table(report["namespaces"], reads=True))


def empty_disk_note(url: str) -> str:
    """Why a disk tier holds nothing yet (write-back: blocks reach disk late), and how to fill it."""
    return ("  Nothing on disk yet: blocks are written back, so they reach disk when the device and host\n"
            "  tiers evict them, on a flush, or when the server shuts down; until then a running server\n"
            "  holds them above disk (`tieredkv status` shows them). To write them to disk now, flush it:\n"
            f"    curl -s -X POST {url}/v1/cache/flush -H 'content-type: application/json' -d '{{}}'\n"
            "  (with -H 'authorization: Bearer <admin key>' if the server has keys), or stop the server\n"
            "  (Ctrl-C flushes), then run inspect again.")


def namespace_table(namespaces: list[dict[str, Any]], reads: bool) -> Any:
    """One row per namespace (identified by `identify`): the disk tier's (with its hit counts)
    and the remote store's (tieredkv/inspect_remote.py; a store keeps no hit counts)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from storage.config import format_size
    t = Table(title="Namespaces (one per model identity, block size and tenant)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("Namespace", "Model", "Tenant", "Blocks", "Tokens", "Stored") + (("Reads",) if reads else ()):
        t.add_column(col, justify="left" if col in ("Namespace", "Model", "Tenant") else "right",
                     no_wrap=col != "Model", min_width=21 if col == "Model" else None)
    for ns in namespaces:
        model = f"{ns['model']} ({ns['dtype']})" if ns["model"] else "unknown (not the default model)"
        tenant = "?" if not ns["model"] else ns["tenant"] or "(shared by all)"
        t.add_row(ns["namespace"][:10], escape(model), escape(tenant), f"{ns['blocks']:,}", f"{ns['tokens']:,}",
                  format_size(ns["stored_bytes"]), *((f"{ns['reads']:,}",) if reads else ()))
    return t


def forest_tree(s: Survey, max_depth: int, max_width: int) -> Any:
    """The prefix tree of every namespace; `max_depth` levels, `max_width` branches per node."""
    from rich.markup import escape
    from rich.tree import Tree
    top = Tree("Cached prefixes (chains folded; reads = gets of a block from disk)")
    for ns, nodes in s.forest.items():
        label = str(s.labels[ns]) if ns in s.labels else "unknown model"
        count = sum(n.total_blocks for n in nodes)
        lens = [s.block_tokens.get(h, 0) for h in _all_hashes(nodes)]
        block_size = max(lens, default=0)
        exact = sum(1 for n in lens if n < block_size)
        of_which = f" ({count - exact:,} of KV, {exact:,} of exact entries)" if exact and s.block_tokens else ""
        branch = top.add(f"[bold]{ns.hex()[:16]}[/] {escape(label)} — {count:,} block{'s' if count != 1 else ''}"
                         f"{of_which}")
        _add_nodes(branch, nodes, s.decode_for(ns), max_depth, max_width, escape, s.block_tokens, block_size)
    return top


def _all_hashes(nodes: list[PrefixNode]) -> Iterable[bytes]:
    for n in nodes:
        yield from n.hashes
        yield from _all_hashes(n.children)


def node_label(n: PrefixNode, block_tokens: dict[bytes, int], block_size: int) -> str:
    """What a node holds, in words that add up: its full blocks' indices and tokens, then the
    exact entry that ends a prompt's chain (storage/exact_entry.py: a tail block of the prompt's
    last 1..block_size-1 tokens, then its logits in blocks of no tokens) -- counted apart, not as
    blocks of the prompt ("blocks 2-3 (1 tok)" was a 1-token tail and a logits block)."""
    lens = [block_tokens.get(h, block_size) for h in n.hashes] if block_tokens else [block_size] * len(n.hashes)
    full = 0
    while full < len(lens) and lens[full] == block_size and block_size > 0:
        full += 1
    tail_tokens = sum(lens[full:])
    logits = sum(1 for x in lens[full:] if x == 0)
    parts = []
    if full:
        first = n.depth
        where = "?" if first is None else (f"{first}-{first + full - 1}" if full > 1 else f"{first}")
        parts.append(f"block{'s' if full > 1 else ''} {where} ({sum(lens[:full]):,} tok)")
    if full < len(lens):
        what = (f"{tail_tokens:,} tail tok + " if tail_tokens else "") + f"logits: {logits} block{'s' if logits != 1 else ''}"
        if full:
            parts.append(f"+ exact entry ({what})")
        elif n.depth is None:
            parts.append(f"exact entry ({what})")
        elif n.depth:
            parts.append(f"exact entry after block {n.depth - 1} ({what})")
        else:
            parts.append(f"exact entry of a prompt shorter than a block ({what})")
    return " ".join(parts)


def _add_nodes(parent: Any, nodes: list[PrefixNode], decode: Callable[[list[int]], str] | None, depth_left: int,
               max_width: int, escape: Callable[[str], str], block_tokens: dict[bytes, int], block_size: int) -> None:
    shown, more = limited(nodes, max_width)
    for n in shown:
        reads = f"{n.reads[0]}" if min(n.reads) == max(n.reads) else f"{max(n.reads)}…{min(n.reads)}"
        orphan = " [dim](parent not stored)[/]" if n.orphan else ""
        child = parent.add(f"[cyan]{node_label(n, block_tokens, block_size)}[/] (reads {reads}){orphan} "
                           f"{escape(preview(n.token_ids, decode))}")
        if n.children and depth_left > 1:
            _add_nodes(child, n.children, decode, depth_left - 1, max_width, escape, block_tokens, block_size)
        elif n.children:
            child.add(f"[dim]… {len(n.children)} branches, {n.total_blocks - len(n.hashes):,} blocks below[/]")
    if more:
        parent.add(f"[dim]… {len(more)} more branches, {sum(m.total_blocks for m in more):,} blocks[/]")
