"""/openapi.json with the real request bodies. The POST routes read their body themselves (under a size cap, with
OpenAI-shaped errors: serve/errors.py), so FastAPI cannot see their pydantic models; this declares them, so that
fuzzers (schemathesis) and client generators get the schemas the server validates against."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def _error_schema() -> dict[str, Any]:
    text_or_null = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": text_or_null,
                       "code": text_or_null}}}}


def declare_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` declare `bodies[path]` as the JSON request body of POST `path` (required), and the
    OpenAI error body for its 4xx/5xx answers. Call again with more paths to add them."""
    declared: dict[str, type[BaseModel]] = getattr(app.state, "request_bodies", {})
    declared.update(bodies)
    app.state.request_bodies = declared

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = _error_schema()
        error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
        for path, model in declared.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            model_schema = model.model_json_schema(ref_template=_REF)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            responses = operation.setdefault("responses", {})
            for status, what in (("400", "invalid request"), ("404", "unknown model"),
                                 ("413", "request body too large"), ("500", "the request failed in the engine")):
                responses.setdefault(status, {"description": what, **error})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
