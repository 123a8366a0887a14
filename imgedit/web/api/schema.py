"""The REST routes' request bodies in the OpenAPI schema (/docs), written from the declaration
(imgedit.protocol.PARAMETERS): the routes read their forms themselves (imgedit.web.api.rest_requests), so
FastAPI cannot see the fields."""

from __future__ import annotations

from imgedit.protocol import REST, parameters

TYPES = {"text": "string", "whole": "integer", "number": "number", "flag": "boolean", "size": "string"}
# OpenAI's fields that are not request parameters of ours: how the reply is given
REPLY_FIELDS = {
    "response_format": {"type": "string", "enum": ["b64_json", "url"], "default": "b64_json",
                        "description": "the images in the reply, or URLs of the stored results (an hour)"},
    "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"], "default": "png"},
    "output_compression": {"type": "integer", "minimum": 0, "maximum": 100, "default": 100},
    "model": {"type": "string", "description": "any: this server runs its own model (GET /v1/models)"},
}


def _properties(files: bool) -> tuple[dict, list[str]]:
    properties: dict = {}
    required: list[str] = []
    for param in parameters(REST):
        if param.kind == "file":
            if not files:
                continue
            binary = {"type": "string", "format": "binary"}
            prop = {"type": "array", "items": binary} if param.name == "images" else binary
        else:
            prop = {"type": TYPES.get(param.kind, "string")}
        low, high = param.bounds()
        if isinstance(low, (int, float)) and param.kind != "file":
            prop["minimum"] = low
        if isinstance(high, (int, float)) and param.kind != "file":
            prop["maximum"] = high
        prop["description"] = param.help
        properties[param.form_name] = prop
        if param.required and (files or param.kind != "file"):
            required.append(param.form_name)
    return {**properties, **REPLY_FIELDS}, required


def edit_body() -> dict:
    """`openapi_extra` of POST /v1/images/edits: its multipart form."""
    properties, required = _properties(files=True)
    return _body("multipart/form-data", properties, required)


def generation_body() -> dict:
    """`openapi_extra` of POST /v1/images/generations: its JSON body."""
    properties, required = _properties(files=False)
    return _body("application/json", properties, required)


def _body(content_type: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {content_type: {"schema": schema}}}}
