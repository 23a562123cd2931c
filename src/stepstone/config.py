"""Settings in effect and where each value came from.

Precedence, highest first: command-line flag, ``STEPSTONE_DATABASE_URL`` / ``STEPSTONE_SCHEMA`` /
``STEPSTONE_BROKER_URL``, ``DATABASE_URL``, ``[tool.stepstone]`` in the nearest ``pyproject.toml`` (walking up
from cwd), default. An empty environment variable counts as unset; an empty flag or pyproject value, and a
key of ``[tool.stepstone]`` stepstone does not know, are refused (each would otherwise silently mean the
embedded database or the default).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stepstone.errors import ConfigError

__all__ = [
    "DEFAULT_SCHEMA",
    "PYPROJECT_KEYS",
    "SCHEMA_NAME_PATTERN",
    "Settings",
    "find_pyproject",
    "load_settings",
    "project_root",
    "quote_ident",
    "validate_schema_name",
]

DEFAULT_SCHEMA = "stepstone"
PYPROJECT_KEYS = ("broker_url", "database_url", "schema")
"""The keys ``[tool.stepstone]`` may hold."""
SCHEMA_NAME_PATTERN = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Settings:
    """Resolved configuration; ``sources`` maps each field name to where its value came from."""

    database_url: str | None = None
    schema: str = DEFAULT_SCHEMA
    sources: dict[str, str] = field(default_factory=dict)
    broker_url: str | None = None
    """Where the outbox relay publishes (`stepstone relay`, and `stepstone worker` when set)."""

    def __post_init__(self) -> None:
        validate_schema_name(self.schema)


def validate_schema_name(name: str) -> str:
    """Return ``name`` if it is a safe lower-case identifier, else raise ConfigError."""
    if not isinstance(name, str) or not SCHEMA_NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"invalid schema name {name!r}: use 1-63 characters of a-z, 0-9 and _, not starting with a digit"
        )
    return name


def quote_ident(name: str) -> str:
    """Quote a validated schema name as a PostgreSQL identifier."""
    validate_schema_name(name)
    # The pattern admits no double quote, so no escaping is needed; quoting keeps keywords safe.
    return f'"{name}"'


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` (default: cwd)."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def project_root(start: Path | None = None) -> Path:
    """Directory of the nearest pyproject.toml, else cwd."""
    pyproject = find_pyproject(start)
    return pyproject.parent if pyproject is not None else (start or Path.cwd()).resolve()


def _pyproject_table(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {path}: it is not UTF-8 text, as TOML is (byte 0x{exc.object[exc.start]:02x} "
                          f"at offset {exc.start})") from exc
    tool = data.get("tool", {})
    table = tool.get("stepstone", {}) if isinstance(tool, dict) else {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.stepstone] must be a table")
    unknown = sorted(key for key in table if key not in PYPROJECT_KEYS)
    if unknown:
        raise ConfigError(f"{path} [tool.stepstone]: unknown key {', '.join(map(repr, unknown))} "
                          f"(known keys: {', '.join(PYPROJECT_KEYS)})")
    return table


def load_settings(
    *,
    database_url: str | None = None,
    schema: str | None = None,
    broker_url: str | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Resolve settings from flags (the arguments), environment and pyproject.toml."""
    env = os.environ if environ is None else environ
    pyproject = find_pyproject(cwd)
    table = _pyproject_table(pyproject) if pyproject is not None else {}
    where = f"{pyproject} [tool.stepstone]" if pyproject is not None else ""

    def pick(flag_value: str | None, env_names: tuple[str, ...], key: str) -> tuple[str | None, str]:
        flag = f"--{key.replace('_', '-')}"
        if flag_value is not None:
            if not flag_value:  # `--database-url "$UNSET"`: never fall back to the embedded database
                raise ConfigError(f"{flag} is empty: give a value or leave the flag out")
            return flag_value, flag
        for name in env_names:
            value = env.get(name)
            if value:  # an empty variable counts as unset, as click treats STEPSTONE_APP
                return value, f"env {name}"
        configured = table.get(key)
        if configured is not None:
            if not isinstance(configured, str):
                raise ConfigError(f"{where}: {key} must be a string")
            if not configured:
                raise ConfigError(f"{where}: {key} is empty: give a value or remove the key")
            return configured, f"{where} {key}"
        return None, "default"

    url, url_source = pick(database_url, ("STEPSTONE_DATABASE_URL", "DATABASE_URL"), "database_url")
    schema_value, schema_source = pick(schema, ("STEPSTONE_SCHEMA",), "schema")
    broker, broker_source = pick(broker_url, ("STEPSTONE_BROKER_URL",), "broker_url")
    if url is None:
        url_source = "default (embedded PostgreSQL)"
    return Settings(
        database_url=url,
        schema=schema_value if schema_value is not None else DEFAULT_SCHEMA,
        sources={"database_url": url_source, "schema": schema_source,
                 **({"broker_url": broker_source} if broker is not None else {})},
        broker_url=broker,
    )
