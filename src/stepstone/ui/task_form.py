"""A task's completion form, generated from the JSON Schema of its decisions (`TaskInfo.form`), and the
posted form read back into the decision's payload.

Each decision is one form; each property of its payload's object schema is one field: a string is a
text box (a select when it has an ``enum``), an integer or number a number box, a boolean a checkbox,
anything else (lists, nested objects) a JSON text area. Optional properties (``anyOf`` with null)
are fields that may be left empty. The payload is then checked by the decision's model in the client,
so a wrong value comes back as the client's InvalidInput, shown on the form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stepstone.core import json_text
from stepstone.errors import InvalidInput

__all__ = ["Decision", "Field", "decisions_of", "payload_of"]


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str
    """text, number, integer, checkbox, select or json."""
    required: bool
    choices: tuple[str, ...] = ()
    default: str = ""
    description: str = ""


@dataclass(frozen=True)
class Decision:
    name: str
    fields: tuple[Field, ...]
    takes_payload: bool
    """False for a decision whose payload is null: its form is the button alone."""


def _choices(form: Any) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for choice in form.get("oneOf", []) if isinstance(form, dict) else []:
        props = choice.get("properties", {}) if isinstance(choice, dict) else {}
        name = props.get("decision", {}).get("const")
        if isinstance(name, str):
            payload = props.get("payload")
            found.append((name, payload if isinstance(payload, dict) else {}))
    return found


def _plain_type(schema: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    """The schema without its ``null`` alternative, and whether null was one."""
    options = schema.get("anyOf")
    if isinstance(options, list):
        rest = [o for o in options if isinstance(o, dict) and o.get("type") != "null"]
        if len(rest) == 1:
            return {**schema, **rest[0]}, len(rest) < len(options)
    return schema, False


def _field(name: str, schema: Mapping[str, Any], required: bool) -> Field:
    plain, nullable = _plain_type(schema)
    kind = {"string": "text", "integer": "integer", "number": "number", "boolean": "checkbox"}.get(
        str(plain.get("type")), "json")
    choices: tuple[str, ...] = ()
    if isinstance(plain.get("enum"), list) and all(isinstance(v, str) for v in plain["enum"]):
        kind, choices = "select", tuple(plain["enum"])
    default = plain.get("default", schema.get("default"))
    shown = "" if default is None else (json.dumps(default) if kind == "json" else str(default))
    return Field(name, str(plain.get("title") or name), kind, required and not nullable, choices, shown,
                 str(plain.get("description") or ""))


def decisions_of(form: Any) -> list[Decision]:
    """The decisions of a task's form schema, each with the fields of its payload."""
    result = []
    for name, payload in _choices(form):
        if payload.get("type") != "object":
            result.append(Decision(name, (), payload.get("type") != "null" and bool(payload)))
            continue
        required = set(payload.get("required") or [])
        props = payload.get("properties") or {}
        fields = tuple(_field(f, s, f in required) for f, s in props.items() if isinstance(s, dict))
        result.append(Decision(name, fields, True))
    return result


def _value(field: Field, raw: str | None) -> Any:
    if field.kind == "checkbox":
        return raw is not None
    text = (raw or "").strip()
    if text == "":
        return None
    if field.kind in ("integer", "number"):
        try:
            return int(text) if field.kind == "integer" else float(text)
        except ValueError:
            raise InvalidInput(f"{field.label} must be a number, got {text[:40]!r}", what=field.name) from None
    if field.kind == "json":
        try:
            return json_text.parse(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{field.label} is not JSON: {exc.msg}", what=field.name) from None
    return text


def payload_of(decision: Decision, posted: Mapping[str, str]) -> Any:
    """The payload a posted form of `decision` stands for (form fields are named ``f.<property>``).
    An empty optional field is left out, so the model's default applies."""
    if not decision.fields:
        raw = (posted.get("payload") or "").strip()
        if decision.takes_payload and raw:
            return _value(Field("payload", "Payload", "json", False), raw)
        return None
    payload: dict[str, Any] = {}
    for field in decision.fields:
        value = _value(field, posted.get(f"f.{field.name}"))
        if value is not None:
            payload[field.name] = value
    return payload
