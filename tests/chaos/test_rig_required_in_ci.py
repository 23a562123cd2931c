"""The rig's server is optional on a developer machine but required in CI."""

from __future__ import annotations

import pytest

from tests.chaos.conftest import rig_unavailable


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_in_ci_an_unavailable_rig_fails(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="must run in CI"):
        rig_unavailable("no initdb")


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_elsewhere_an_unavailable_rig_skips(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="no initdb"):
        rig_unavailable("no initdb")
