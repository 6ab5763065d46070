"""Schemas and prompts shared by the structured-output tests (tests/test_structured*.py): nested objects,
arrays, enums, numbers with bounds, required and optional fields, strings with patterns."""
from __future__ import annotations

import json
from typing import Any

import jsonschema

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"product": {"type": "string", "maxLength": 30},
                       "severity": {"enum": ["low", "medium", "high"]}},
        "required": ["product", "severity"], "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                       "count": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["score", "count"], "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 50}, "licence": {"type": "string", "maxLength": 20},
                       "stars": {"type": "integer", "minimum": 0}},
        "required": ["title"], "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "ok": {"type": "boolean"}},
        "required": ["code", "ok"], "additionalProperties": False,
    },
}

DOCUMENT = ("Ticket ABC-1234 from Jane Doe, 12 Rue Lafayette, Paris 75009: the Acme Router crashes every "
            "night; severity high, seen 3 times. Project rqllm, Apache-2.0 licence, 120 stars, score 7.5.")


def messages(schema_name: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You extract facts from documents as JSON."},
            {"role": "user", "content": f"Document: {DOCUMENT}\nGive the {schema_name.replace('_', ' ')} fields "
                                        "of this document as a JSON object."}]


def response_format(schema_name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": schema_name, "schema": SCHEMAS[schema_name],
                                                   "strict": True}}


def check_output(text: str, finish: str, schema: dict) -> bool:
    """True when the output is a complete valid object; a cut one must say "length"."""
    if finish == "length":
        return False
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)
    return True
