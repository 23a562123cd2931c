"""Settings precedence, sources and schema-name validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepstone.config import Settings, load_settings, project_root, quote_ident, validate_schema_name
from stepstone.errors import ConfigError, StepstoneError


def _project(tmp_path: Path, table: str = "") -> Path:
    (tmp_path / "pyproject.toml").write_text(f"[project]\nname = 'x'\n{table}")
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    return sub


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings(environ={}, cwd=tmp_path)
    assert settings.database_url is None
    assert settings.schema == "stepstone"
    assert settings.sources["schema"] == "default"
    assert "embedded" in settings.sources["database_url"]


def test_pyproject_found_walking_up(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\ndatabase_url = 'postgresql://p/db'\nschema = 'wf'\n")
    settings = load_settings(environ={}, cwd=cwd)
    assert (settings.database_url, settings.schema) == ("postgresql://p/db", "wf")
    assert "pyproject.toml" in settings.sources["database_url"]
    assert project_root(cwd) == tmp_path.resolve()


def test_precedence_flag_then_env_then_pyproject(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\ndatabase_url = 'postgresql://p/db'\nschema = 'wf'\n")
    env = {"DATABASE_URL": "postgresql://d/db"}
    assert load_settings(environ=env, cwd=cwd).database_url == "postgresql://d/db"
    env["STEPSTONE_DATABASE_URL"] = "postgresql://s/db"
    env["STEPSTONE_SCHEMA"] = "from_env"
    settings = load_settings(environ=env, cwd=cwd)
    assert settings.database_url == "postgresql://s/db"
    assert settings.sources == {"database_url": "env STEPSTONE_DATABASE_URL", "schema": "env STEPSTONE_SCHEMA"}
    settings = load_settings(database_url="postgresql://f/db", schema="flag", environ=env, cwd=cwd)
    assert (settings.database_url, settings.schema) == ("postgresql://f/db", "flag")
    assert settings.sources == {"database_url": "--database-url", "schema": "--schema"}


@pytest.mark.parametrize("name", ["a$$b", "o'brien", 'x";drop', "", "1abc", "Upper", "a" * 64, "a b"])
def test_invalid_schema_names(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid schema name" if name else "--schema is empty"):
        load_settings(schema=name, environ={}, cwd=tmp_path)
    with pytest.raises(ConfigError):
        quote_ident(name)


def test_invalid_schema_in_pyproject(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\nschema = 'no-dashes'\n")
    with pytest.raises(ConfigError):
        load_settings(environ={}, cwd=cwd)


def test_broken_pyproject_is_config_error(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.stepstone\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(environ={}, cwd=tmp_path)


def test_a_pyproject_that_is_not_utf8_is_config_error(tmp_path: Path) -> None:
    """A pyproject.toml saved as UTF-16 (Windows Notepad's "Unicode") ended every command that reads the
    settings with a UnicodeDecodeError traceback."""
    (tmp_path / "pyproject.toml").write_bytes("[tool.stepstone]\nschema = 'wf'\n".encode("utf-16"))
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={}, cwd=tmp_path)
    assert str(raised.value) == (f"cannot read {tmp_path / 'pyproject.toml'}: it is not UTF-8 text, as TOML is "
                                 "(byte 0xff at offset 0)")


def test_valid_names_and_quoting() -> None:
    assert validate_schema_name("_a1") == "_a1"
    assert quote_ident("select") == '"select"'
    assert validate_schema_name("a" * 63)


def test_settings_is_frozen_and_validates() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.schema = "x"  # type: ignore[misc]
    with pytest.raises(StepstoneError):
        Settings(schema="bad;name")


def test_unknown_key_in_pyproject_is_refused_naming_it_and_the_known_keys(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\ndatabse_url = 'postgresql://p/db'\n")
    with pytest.raises(ConfigError, match=r"unknown key 'databse_url'.*broker_url, database_url, schema"):
        load_settings(environ={}, cwd=cwd)


@pytest.mark.parametrize("key", ["database_url", "schema", "broker_url"])
def test_empty_flag_is_refused(key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"--{key.replace('_', '-')} is empty"):
        load_settings(**{key: ""}, environ={}, cwd=tmp_path)  # type: ignore[arg-type]


def test_empty_value_in_pyproject_is_refused(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\ndatabase_url = ''\n")
    with pytest.raises(ConfigError, match="database_url is empty"):
        load_settings(environ={}, cwd=cwd)


def test_empty_environment_variable_counts_as_unset(tmp_path: Path) -> None:
    cwd = _project(tmp_path, "[tool.stepstone]\ndatabase_url = 'postgresql://p/db'\n")
    env = {"STEPSTONE_DATABASE_URL": "", "DATABASE_URL": "", "STEPSTONE_SCHEMA": ""}
    settings = load_settings(environ=env, cwd=cwd)
    assert (settings.database_url, settings.schema) == ("postgresql://p/db", "stepstone")
    assert "pyproject.toml" in settings.sources["database_url"]
