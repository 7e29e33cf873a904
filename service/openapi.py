"""The OpenAPI document at /openapi.json, with the request bodies the routes really take.

Knows: which route parses which body model (the routes read their bodies themselves, through
service.schemas.parse_body, for OpenAI-shaped 400s, so FastAPI cannot see them), that a body is
closed to unknown fields (`additionalProperties: false`) unless the app ignores them, and
OpenAI's error body. Doesn't know: what the routes do.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.schemas import ChatRequest, CompletionRequest, FlushRequest, LookupRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/v1/cache/lookup": LookupRequest, "/v1/cache/block_hashes": LookupRequest,
          "/v1/cache/flush": FlushRequest}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def install_openapi(app: FastAPI) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["Error"] = _ERROR
        error = {"description": "OpenAI-shaped error",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
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
        for methods in doc["paths"].values():
            for op in methods.values():
                op.setdefault("responses", {}).update({"4XX": error, "5XX": error})
        app.openapi_schema = doc
        return doc

    app.openapi = build
