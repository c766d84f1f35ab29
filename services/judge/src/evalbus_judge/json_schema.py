"""The JSON Schema subset the `json-schema` rule judge checks, implemented here without a
dependency: `type`, `properties`, `required`, `items`, `enum`, `const`, `minimum`, `maximum`,
boolean schemas, and the annotation keywords (`title`, `description`…), which are ignored.

Any other keyword (`pattern`, `additionalProperties`, `$ref`…) would be silently skipped by a
partial validator and let wrong answers pass, so a schema using one is reported as unsupported.
"""

from __future__ import annotations

import math
from typing import Any

JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
"""The type names of JSON Schema."""
CHECKED_KEYWORDS = frozenset({"type", "properties", "required", "items", "enum", "const", "minimum", "maximum"})
"""Keywords this validator enforces."""
ANNOTATION_KEYWORDS = frozenset({"$schema", "$id", "$comment", "title", "description", "default", "examples"})
"""Keywords that never constrain a value."""


def schema_problems(schema: Any, path: str = "#") -> list[str]:
    """What makes `schema` unusable by this validator (unknown keywords, malformed values); empty when usable."""
    if isinstance(schema, bool):
        return []
    if not isinstance(schema, dict):
        return [f"{path}: a schema must be an object or a boolean"]
    problems: list[str] = []
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATION_KEYWORDS:
            continue
        if key not in CHECKED_KEYWORDS:
            problems.append(f"{where}: keyword not supported")
        elif key == "type":
            names = value if isinstance(value, list) else [value]
            if not names or any(not isinstance(n, str) or n not in JSON_TYPES for n in names):
                problems.append(f"{where}: must be a JSON type name or a list of them")
        elif key == "properties":
            if not isinstance(value, dict):
                problems.append(f"{where}: must be an object")
            else:
                for name, sub in value.items():
                    problems.extend(schema_problems(sub, f"{where}/{name}"))
        elif key == "required":
            if not isinstance(value, list) or any(not isinstance(n, str) for n in value):
                problems.append(f"{where}: must be a list of strings")
        elif key == "items":
            problems.extend(schema_problems(value, where))
        elif key == "enum":
            if not isinstance(value, list):
                problems.append(f"{where}: must be a list")
        elif key in ("minimum", "maximum") and not _is_number(value):
            problems.append(f"{where}: must be a number")
    return problems


def first_violation(instance: Any, schema: Any, path: str = "$") -> str | None:
    """The first way `instance` breaks `schema` (a usable schema, see `schema_problems`), or None."""
    if schema is True:
        return None
    if schema is False:
        return f"{path}: no value is allowed here"
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_has_type(instance, n) for n in names):
            return f"{path}: expected {' or '.join(names)}, got {_type_name(instance)}"
    if "const" in schema and not json_equal(instance, schema["const"]):
        return f"{path}: must equal {schema['const']!r}"
    if "enum" in schema and not any(json_equal(instance, option) for option in schema["enum"]):
        return f"{path}: must be one of {schema['enum']!r}"
    if _is_number(instance):
        if "minimum" in schema and instance < schema["minimum"]:
            return f"{path}: {instance} is below the minimum {schema['minimum']}"
        if "maximum" in schema and instance > schema["maximum"]:
            return f"{path}: {instance} is above the maximum {schema['maximum']}"
    if isinstance(instance, dict):
        for name in schema.get("required", []):
            if name not in instance:
                return f"{path}: missing required property {name!r}"
        for name, sub in schema.get("properties", {}).items():
            if name in instance:
                found = first_violation(instance[name], sub, f"{path}.{name}")
                if found is not None:
                    return found
    if isinstance(instance, list) and "items" in schema:
        for index, item in enumerate(instance):
            found = first_violation(item, schema["items"], f"{path}[{index}]")
            if found is not None:
                return found
    return None


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON defines it: `true` is not `1`, `1` equals `1.0`, containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _has_type(value: Any, name: str) -> bool:
    match name:
        case "null":
            return value is None
        case "boolean":
            return isinstance(value, bool)
        case "integer":
            return _is_number(value) and (isinstance(value, int) or (math.isfinite(value) and value.is_integer()))
        case "number":
            return _is_number(value)
        case "string":
            return isinstance(value, str)
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
    return False


def _type_name(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _has_type(value, name):
            return name
    return type(value).__name__
