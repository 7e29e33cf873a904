"""The OpenAPI document at /openapi.json, with the request bodies the routes really take, and
/docs: that document drawn as one HTML page.

Knows: which route parses which body model (the routes read their bodies themselves, through
service.body_parsing.parse_body, for OpenAI-shaped 400s, so FastAPI cannot see them), that a body is
closed to unknown fields (`additionalProperties: false`) unless the app ignores them, and
the error body: OpenAI's, Anthropic's on the Messages routes. /docs is drawn here, on the server, with no script and nothing fetched
from elsewhere: FastAPI's own docs page loads Swagger UI from a CDN, so it is blank offline.
Doesn't know: what the routes do.
"""
from __future__ import annotations

import html
import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse

from service.messages_errors import is_messages_path
from service.messages_schemas import CountTokensRequest, MessagesRequest
from service.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, FlushRequest, LookupRequest,
                             TokenizeRequest)

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/v1/cache/lookup": LookupRequest, "/v1/cache/block_hashes": LookupRequest,
          "/v1/cache/flush": FlushRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# Anthropic's, on the Messages routes (service/messages_errors.py).
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


def install_openapi(app: FastAPI) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["Error"], schemas["AnthropicError"] = _ERROR, _ANTHROPIC_ERROR
        error = {"description": "OpenAI-shaped error",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        anthropic = {"description": "Anthropic-shaped error",
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
        lenient = getattr(app.state, "unknown_fields", "reject") == "ignore"
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            if lenient:      # unknown fields are dropped (and named in a response header), not refused
                for s in [schema, *schemas.values()]:
                    s.pop("additionalProperties", None)
            op = doc["paths"][path]["post"]
            op["requestBody"] = {"required": path != "/v1/cache/flush", "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for path, methods in doc["paths"].items():
            shape = anthropic if is_messages_path(path) else error
            for op in methods.values():
                op.setdefault("responses", {}).update({"4XX": shape, "5XX": shape})
        app.openapi_schema = doc
        return doc

    app.openapi = build

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))


def docs_page(doc: dict[str, Any]) -> str:
    """Every route of the document with its description and request body schema, as plain HTML."""
    e = html.escape
    schemas = doc.get("components", {}).get("schemas", {})
    toc, sections = [], []
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            anchor = f"{method}-{path}".replace("/", "-").strip("-")
            title = f"{method.upper()} {path}"
            toc.append(f'<li><a href="#{e(anchor)}"><code>{e(title)}</code></a> {e(op.get("summary", ""))}</li>')
            parts = [f'<h2 id="{e(anchor)}"><code>{e(title)}</code></h2>']
            if op.get("description"):
                parts.append(f"<p>{e(op['description'])}</p>")
            ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                   .get("schema", {}).get("$ref", ""))
            name = ref.rsplit("/", 1)[-1]
            if name in schemas:
                parts.append(f"<details><summary>request body: {e(name)}</summary>"
                             f"<pre>{e(json.dumps(schemas[name], indent=2))}</pre></details>")
            params = [p["name"] for p in op.get("parameters", [])]
            if params:
                parts.append(f"<p>parameters: {e(', '.join(params))}</p>")
            sections.append("\n".join(parts))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(doc.get("info", {}).get("title", "API"))} API</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}}
pre{{background:#f4f4f4;padding:.5em;overflow:auto}}h2{{margin-top:1.5em}}</style></head>
<body><h1>{e(doc.get("info", {}).get("title", "API"))} API</h1>
<p>The machine-readable document: <a href="/openapi.json">/openapi.json</a>. Errors are OpenAI-shaped:
<code>{{"error": {{"message", "type", "param", "code"}}}}</code> (on /v1/messages, Anthropic's:
<code>{{"type": "error", "error": {{"type", "message"}}}}</code>).</p>
<ul>{"".join(toc)}</ul>
{"".join(sections)}
</body></html>
"""
