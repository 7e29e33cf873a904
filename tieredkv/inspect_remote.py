"""What a remote store holds, for `tieredkv inspect --remote-url`: the command, the report, its drawing.

Knows: the command's run (list, verify, repair; its exit status), how storage/remote/inspect.py's
survey and verify results become one JSON-ready dict and rich renderables, and how to name a namespace (a model whose identity a load
recorded and a tenant the local billing ledger knows, as tieredkv/inspect_tree.py does for the
disk tier: the store holds no names).
Doesn't know: the store's protocol, keys or values (storage/remote/inspect.py reads them).
"""
from __future__ import annotations

from typing import Any, Optional

import typer
from rich.markup import escape

from tieredkv.cli_common import CLIError, cache_root, out, print_json, spinner
from tieredkv.inspect_tree import namespace_labels, namespace_table


def survey_report(survey: Any, billing_dir: str) -> dict[str, Any]:
    """The survey as a dict: totals, each node's memory, each namespace (labelled when known)."""
    sizes = set().union(*(u.block_sizes for u in survey.namespaces)) if survey.namespaces else set()
    labels = namespace_labels({u.namespace for u in survey.namespaces}, sizes, billing_dir)
    namespaces = []
    for u in survey.namespaces:
        lab = labels[u.namespace][0] if u.namespace in labels else None
        namespaces.append({"namespace": u.namespace.hex(), "label": None if lab is None else str(lab),
                           "model": lab.model if lab else None, "dtype": lab.dtype if lab else None,
                           "tenant": lab.tenant if lab else None, "blocks": u.blocks, "tokens": u.tokens,
                           "stored_bytes": u.value_bytes})
    nodes = [{"address": n.address, "keys": n.keys, "tieredkv_keys": n.tkv_keys, "used_memory": n.used_memory,
              "maxmemory": n.maxmemory, "maxmemory_policy": n.maxmemory_policy, "evicted_keys": n.evicted_keys}
             for n in survey.nodes]
    return {"url": survey.url, "cluster": survey.cluster, "blocks": survey.blocks, "stored_bytes": survey.value_bytes,
            "foreign_keys": survey.foreign_keys, "nodes": nodes, "namespaces": namespaces}


def verify_report(report: Any, repair: bool) -> dict[str, Any]:
    return {"checked": report.checked, "damaged": len(report.damaged), "repaired": report.repaired,
            "vanished": report.vanished, "errors": report.errors, "foreign": report.foreign, "repair": repair,
            "values": [{"key": d.key.decode(errors="replace"), "reason": d.reason} for d in report.damaged]}


def remote_overview(report: dict[str, Any]) -> Any:
    """The store's totals, its nodes and a table of its namespaces."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from storage.config import format_size
    n = report["blocks"]
    kind = f"cluster of {len(report['nodes'])} primaries" if report["cluster"] else "standalone"
    head = (f"Remote store {escape(report['url'])} ({kind})\n"
            f"  {n:,} block{'s' if n != 1 else ''}, {format_size(report['stored_bytes'])} in values under tkv:r2:"
            + (f"; {report['foreign_keys']:,} other keys under the prefix" if report["foreign_keys"] else ""))
    nodes = Table(title="Nodes (capacity is the store's: maxmemory and its eviction policy)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("Node", "Keys", "tieredkv", "Used", "Maxmemory", "Policy", "Evicted"):
        nodes.add_column(col, justify="left" if col in ("Node", "Policy") else "right", no_wrap=True)

    def size(v: Any) -> str:
        return "?" if v is None else ("no limit" if v == 0 else format_size(int(v)))
    for nd in report["nodes"]:
        nodes.add_row(nd["address"], f"{nd['keys']:,}", f"{nd['tieredkv_keys']:,}",
                      "?" if nd["used_memory"] is None else format_size(int(nd["used_memory"])), size(nd["maxmemory"]),
                      escape(str(nd["maxmemory_policy"] or "?")),
                      "?" if nd["evicted_keys"] is None else f"{int(nd['evicted_keys']):,}")
    return Group(head, nodes, namespace_table(report["namespaces"], reads=False))


def inspect_remote(url: str, cache_dir: Optional[str], check: bool, repair: bool, namespace: Optional[str],
                   json_out: bool, secret_file: Optional[str] = None) -> None:
    """`inspect --remote-url`: the store's listing (and with `check` its verification under the
    fleet secret -- the file given, else <cache dir>/fleet.secret -- never made here), printed."""
    from storage.remote.inspect import RemoteInspector
    from storage.remote.url import parse_remote_url
    parsed = parse_remote_url(url, "--remote-url")        # a bad URL: exit 2, the password never shown
    ns = None
    if namespace is not None:
        try:
            ns = bytes.fromhex(namespace)
        except ValueError:
            ns = b""
        if len(ns) != 32:
            raise CLIError(f"--namespace: expected 64 hex digits, got {namespace!r}", code=2)
    secret = None
    if check:
        from storage.fleet_secret import SecretFileError, load_fleet_secret
        try:
            secret = load_fleet_secret(secret_file or str(cache_root(cache_dir) / "fleet.secret"), create=False)
        except SecretFileError as e:
            raise CLIError(f"{e} (--verify checks each value's seal: give the fleet's --cache-secret-file)",
                           code=2) from None
    elif secret_file is not None:
        raise CLIError("--cache-secret-file: needs --verify or --repair (the listing reads no seal)", code=2)
    try:
        with RemoteInspector(parsed, namespace=ns) as ri:
            with spinner(f"Listing {parsed.redacted}"):
                survey = ri.survey()
            checked = None
            if check:
                with spinner(f"Verifying every value in {parsed.redacted}"):
                    checked = ri.verify(secret, repair=repair)
    except Exception as e:
        from redis.exceptions import RedisError
        if isinstance(e, (RedisError, OSError)):
            raise CLIError(f"remote store {parsed.redacted}: {type(e).__name__}: {e}") from None
        raise
    report = survey_report(survey, str(cache_root(cache_dir) / "billing"))
    if checked is not None:
        report["verify"] = verify_report(checked, repair)
    if json_out:
        print_json(report)
    else:
        out.print(remote_overview(report))
        if checked is not None:
            v = report["verify"]
            out.print(f"checked {v['checked']:,} values in {escape(parsed.redacted)}: {v['damaged']} damaged"
                      + (f", {v['repaired']} deleted" if repair else "")
                      + (f" ({v['vanished']} evicted or expired meanwhile)" if v["vanished"] else "")
                      + (f" ({v['errors']} not readable now)" if v["errors"] else "")
                      + (f"; {v['foreign']} sealed under another fleet secret (left alone: another fleet's, "
                         f"or not the secret file its servers use)" if v["foreign"] else ""), soft_wrap=True)
            for d in v["values"][:50]:
                out.print(f"  {escape(d['key'])}  {escape(d['reason'])}", soft_wrap=True)
            if len(v["values"]) > 50:
                out.print(f"  … and {len(v['values']) - 50} more")
            if v["damaged"] > v["repaired"] and not repair:
                out.print("run again with --repair to delete them")
    if checked is not None and (len(checked.damaged) > checked.repaired or checked.foreign):
        raise typer.Exit(1)             # damage left, or values this secret cannot vouch for
