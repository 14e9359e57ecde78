"""Structured outputs on the request side: ``response_format`` (``json_object``, ``json_schema``)
and vLLM's extensions (``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and the newer ``structured_outputs`` object) to one ``GuidedDecoding``.

``constraint`` validates the shape (400 naming the parameter) and allows at most one constraint
per request; ``response_format: text`` is free text. The engine applies the constraint
(``Capability.STRUCTURED_OUTPUTS``); the frontend refuses it for an engine without that. A
``json_schema`` is enforced whether or not it says ``strict``; ``strict: true`` also refuses a
schema OpenAI's strict mode would not accept (``_strict_schema``).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from ..llm import GuidedDecoding
from ._strict_schema import check_strict
from .errors import bad_request

__all__ = ["Constraint", "constraint"]

#: The request fields of vLLM's extensions, in the order they are checked.
_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")
#: vLLM's ``structured_outputs`` keys and our ``GuidedDecoding`` fields they set.
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}


class Constraint(NamedTuple):
    """One request's constraint and the parameter the client set it with."""

    param: str
    guided: GuidedDecoding


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"'{param}' is not valid JSON: {exc}", param=param,
                              code="invalid_value") from exc
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param,
                          code="invalid_type")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param=param,
                          code="invalid_type")
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(
        isinstance(c, str) for c in value
    ):
        raise bad_request(f"'{param}' must be a non-empty list of strings", param=param,
                          code="invalid_value")
    return value


def _response_format(kind: str, json_schema: dict[str, Any] | None) -> GuidedDecoding | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type", code="invalid_value",
        )
    if json_schema is None:
        raise bad_request("'response_format' of type 'json_schema' needs 'json_schema'",
                          param="response_format.json_schema",
                          code="missing_required_parameter")
    if not isinstance(json_schema.get("name", ""), str):
        raise bad_request("'response_format.json_schema.name' must be a string",
                          param="response_format.json_schema.name", code="invalid_type")
    param = "response_format.json_schema.schema"
    if "schema" not in json_schema:
        raise bad_request(f"'{param}' is required", param=param,
                          code="missing_required_parameter")
    schema = _schema(json_schema["schema"], param)
    strict = json_schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean",
                          param="response_format.json_schema.strict", code="invalid_type")
    if strict:
        check_strict(schema, param)
    return GuidedDecoding(json_schema=schema)


def _structured_outputs(value: Any) -> GuidedDecoding:
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object", param="structured_outputs",
                          code="invalid_type")
    set_keys = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(set_keys) != 1:
        raise bad_request(
            "'structured_outputs' needs exactly one of " + ", ".join(_STRUCTURED_KEYS),
            param="structured_outputs", code="invalid_value",
        )
    key = set_keys[0]
    return _guided(key, value[key], f"structured_outputs.{key}")


def _guided(key: str, value: Any, param: str) -> GuidedDecoding:
    """``GuidedDecoding`` for one vLLM-style key (json, regex, choice, grammar, json_object)."""
    if key == "json":
        return GuidedDecoding(json_schema=_schema(value, param))
    if key == "regex":
        return GuidedDecoding(regex=_text(value, param))
    if key == "choice":
        return GuidedDecoding(choice=_choices(value, param))
    if key == "grammar":
        return GuidedDecoding(grammar=_text(value, param))
    if value is not True:
        raise bad_request(f"'{param}' must be true", param=param, code="invalid_value")
    return GuidedDecoding(json_object=True)


def constraint(req: Any) -> Constraint | None:
    """The one constraint of a parsed chat or completion request, or None for free text.

    Raises:
        HttpError: 400 naming the parameter for a malformed constraint or more than one.
    """
    fmt = req.response_format
    found: list[Constraint] = []
    if fmt is not None:
        guided = _response_format(fmt.type, fmt.json_schema)
        if guided is not None:
            found.append(Constraint("response_format", guided))
    for name in _EXTENSIONS:
        value = getattr(req, name)
        if value is None:
            continue
        if name == "structured_outputs":
            found.append(Constraint(name, _structured_outputs(value)))
        else:
            found.append(Constraint(name, _guided(name.removeprefix("guided_"), value, name)))
    if len(found) > 1:
        names = ", ".join(f"'{c.param}'" for c in found)
        raise bad_request(f"Only one structured-output constraint per request; got {names}",
                          param=found[1].param, code="invalid_value")
    return found[0] if found else None
