"""tools/grafana_dashboard.json queries only metrics a running server exports.

A real server (tiny engine) with a disk tier and a real valkey-server as its remote tier (so the
remote store's metrics exist too) serves one request; then every PromQL expression of the
dashboard is read for the metric names it selects and the labels it selects or groups by, and
each must be in that server's /metrics. A renamed metric or label fails here, not on an
operator's empty panel.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import ServerThread
from tests.service.tiny_engine import build_engine
from tools.valkey_servers import ValkeyServer

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana_dashboard.json"
PROMPT = "Grafana reads what Prometheus scraped from /metrics; a panel over a metric that is not there is empty. " * 2
# PromQL words that are not metric names: functions (followed by "("), aggregation modifiers and operators.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "avg", "max", "min", "count", "irate", "delta",
             "clamp_min"}
TARGET_LABELS = {"job", "instance"}      # added by Prometheus at scrape time


def expressions(doc: dict) -> list[str]:
    """Every panel's PromQL, and each variable's `label_values(<expr>, <label>)` as `<expr> by (<label>)`
    (Grafana's query, not PromQL: what it selects and the label it reads)."""
    out = []
    for panel in doc["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"])
            assert m, f"variable {v['name']}: expected label_values(<selector>, <label>), got {v['query']!r}"
            out.append(f"{m.group(1)} by ({m.group(2)})")
    return out


def selected(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(metric names, metric -> label names in its selector, labels grouped by) of an expression."""
    labels_of: dict[str, set[str]] = {}
    for name, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        labels_of.setdefault(name, set()).update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    grouped = {g.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for g in group.split(",")}
    bare = re.sub(r'"[^"]*"', "", expr)                          # strings
    bare = re.sub(r"\{[^}]*\}", "", bare)                          # label matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)                         # ranges
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)       # grouping labels
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", bare):
        word, call = m.group(1), m.group(2)
        if call:
            assert word in FUNCTIONS, f"{expr}: unknown function {word}"
        elif word not in KEYWORDS:
            names.add(word)
    return names, labels_of, grouped - {""}


def test_the_parser_finds_names_labels_and_groupings() -> None:
    names, labels, grouped = selected('histogram_quantile(0.9, sum by (le, source) '
                                      '(rate(tieredkv_x_bucket{job=~"$job", state!="a b"}[$__rate_interval]))) / tieredkv_y')
    assert names == {"tieredkv_x_bucket", "tieredkv_y"}
    assert labels == {"tieredkv_x_bucket": {"job", "state"}} and grouped == {"le", "source"}


def test_every_metric_the_grafana_dashboard_queries_is_exported(tmp_path, tokenizer) -> None:
    doc = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in doc["panels"]}
    for want in ("Tier fill", "Hit tokens by tier (tokens/s)", "TTFT by source (p50, p90)",
                 "Restores: blocks promoted into the pool (blocks/s)", "Disk tier faults", "Bills not written"):
        assert want in titles
    store = ValkeyServer()
    try:
        store.start()
        with ServerThread(build_engine(tmp_path, tokenizer, remote_url=store.url)) as server, server.client() as c:
            r = c.post("/v1/completions", json={"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            text = c.get("/metrics").text
    finally:
        store.stop()
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    checked = set()
    for expr in expressions(doc):
        names, labels_of, grouped = selected(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert name in exported, f"{expr!r} queries {name}, which /metrics does not export"
            missing = labels_of.get(name, set()) - TARGET_LABELS - exported[name]
            assert not missing, f"{expr!r}: {name} has no label {sorted(missing)} (it has {sorted(exported[name])})"
            checked.add(name)
        in_scope = set().union(*(exported[n] for n in names)) | TARGET_LABELS | {"le"}
        assert grouped <= in_scope, f"{expr!r} groups by {sorted(grouped - in_scope)}, which none of its metrics has"
    assert len(checked) >= 20, sorted(checked)
