"""Instance ids, `stepstone list` cursors and error summaries, as the command line reads and prints them.

Shared by the instance commands and the operations commands (find, list, history, repair ...), which
need no client: importing them from here, not from cli.instances, keeps the client, the authoring
layer and pydantic out of those command lines (about 0.04 s of CPU of each).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from stepstone import cursors
from stepstone.cli.common import CliError
from stepstone.errors import InvalidInput

__all__ = ["decode_cursor", "describe_error", "encode_cursor", "instance_id_arg", "short_json"]

_SHORT = 60


def instance_id_arg(value: str, what: str = "an instance id") -> str:
    """`value` as a canonical UUID, or one line saying it is not `what`."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise CliError(f"{value!r} is not {what} (expected a UUID)") from None


def encode_cursor(created_at: datetime, instance_id: str) -> str:
    """An opaque `--after` value for the page after the row (created_at, id)."""
    return cursors.encode(created_at.isoformat(), instance_id)


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        at, instance_id = cursors.decode(cursor, cursors.INSTANT, cursors.UUID, what="--after")
    except InvalidInput:
        raise CliError(f"--after {cursor!r} is not a cursor printed by `stepstone list`") from None
    return at, instance_id


def short_json(data: Any) -> str:
    if data is None:
        return ""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)
    return text if len(text) <= _SHORT else text[: _SHORT - 1] + "…"


def describe_error(error: Any) -> str:
    if isinstance(error, dict) and "type" in error:
        where = ", ".join(f"{k} {error[k]}" for k in ("step", "attempt") if error.get(k) is not None)
        return f"{error['type']}: {error.get('message') or ''}" + (f" ({where})" if where else "")
    return error if isinstance(error, str) else short_json(error)
