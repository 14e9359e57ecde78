"""OpenAI's strict-mode rules for ``response_format: {type: json_schema, json_schema: {strict:
true}}``: the schema is enforced by the engine's guided decoding either way (as vLLM's server
does), and ``strict: true`` also promises what OpenAI's strict mode promises, so a schema that
mode does not accept is refused with 400 rather than served with a weaker guarantee.

The rules checked (OpenAI's "Supported schemas"): the root is an object schema (not ``anyOf``);
every object sets ``additionalProperties: false`` and lists all its properties in
``required``; ``allOf``, ``not``, ``if``/``then``/``else``, ``dependentRequired``,
``dependentSchemas`` and ``patternProperties`` are not used. Subschemas are checked through
``properties``, ``items``, ``prefixItems``, ``anyOf``, ``$defs`` and ``definitions``.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request

__all__ = ["check_strict"]

_UNSUPPORTED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                "patternProperties")
#: Deepest nesting checked (OpenAI allows 10 levels of objects; this bounds the walk).
_MAX_DEPTH = 64


def _refuse(path: str, why: str, param: str) -> Exception:
    return bad_request(
        f"'{param}' has 'strict': true, but its schema is not one strict mode accepts: "
        f"{why} at '{path}'", param=param, code="invalid_value",
    )


def _walk(schema: Any, path: str, param: str, depth: int) -> None:
    if not isinstance(schema, dict):
        return  # ``true``/``false`` schemas and malformed parts are the engine's to judge
    if depth > _MAX_DEPTH:
        raise _refuse(path, "the schema nests too deeply", param)
    for key in _UNSUPPORTED:
        if key in schema:
            raise _refuse(path, f"'{key}' is not supported", param)
    props = schema.get("properties")
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        isinstance(props, dict))
    if is_object:
        if schema.get("additionalProperties") is not False:
            raise _refuse(path, "objects must set 'additionalProperties': false", param)
        names = list(props) if isinstance(props, dict) else []
        required = schema.get("required") or []
        missing = [n for n in names if n not in required]
        if missing:
            raise _refuse(path, "every property must be in 'required' (missing: "
                          + ", ".join(repr(n) for n in missing[:5]) + ")", param)
        for name, sub in (props or {}).items():
            _walk(sub, f"{path}.properties.{name}", param, depth + 1)
    for key in ("items", "additionalItems"):
        _walk(schema.get(key), f"{path}.{key}", param, depth + 1)
    for key in ("prefixItems", "anyOf"):
        for i, sub in enumerate(schema.get(key) or ()):
            _walk(sub, f"{path}.{key}[{i}]", param, depth + 1)
    for key in ("$defs", "definitions"):
        defs = schema.get(key)
        if isinstance(defs, dict):
            for name, sub in defs.items():
                _walk(sub, f"{path}.{key}.{name}", param, depth + 1)


def check_strict(schema: dict[str, Any], param: str) -> None:
    """Refuse a ``strict: true`` ``schema`` (the value of ``param``) that OpenAI's strict mode
    would not accept.

    Raises:
        HttpError: 400 naming the rule and where in the schema it is broken.
    """
    if "anyOf" in schema and "properties" not in schema:
        raise _refuse("$", "the root must be an object, not 'anyOf'", param)
    if schema.get("type") != "object":
        raise _refuse("$", "the root must be 'type': 'object'", param)
    _walk(schema, "$", param, 0)
