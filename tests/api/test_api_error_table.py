"""docs/api.md's error table against the one mapping (stepstone.api.problems): every error it names
answers with the status of its row, and the errors the API gives are all named."""

from __future__ import annotations

import re
from pathlib import Path

from stepstone import errors
from stepstone.api import auth
from stepstone.api.problems import status_of
from tests.api.conftest import Api

DOC = Path(__file__).parents[2] / "docs" / "api.md"
NOT_CLASSES = {"BadRequest", "MethodNotAllowed", "InternalError", "BodyTooLarge"}  # the framework's answers (and
# api.body_guard's), or a bug's
GIVEN = {"TaskRefused", "TaskNotOpen", "TaskHeld", "TaskNotPermitted", "StateChangedSinceReview", "TaskNotFound",
         "UnknownDecision", "UnknownSignal", "InstanceNotFound", "DefinitionNotFound", "PositionNotFound",
         "InvalidState", "ChildNotAwaited", "IdempotencyConflict", "BusinessKeyInUse", "OpenSignalLimit",
         "InvalidInput", "PayloadTooLarge", "PayloadTooDeep", "Forbidden", "Unauthenticated", "ReadOnly",
         "MethodNotAllowed", "NotLocal"}


def _table() -> dict[str, int]:
    text = DOC.read_text()
    section = text[text.index("| status | error |"):]
    rows = section[:section.index("\n\n")].splitlines()[2:]
    found = {}
    for row in rows:
        status, names = row.split("|")[1:3]
        for name in re.findall(r"`([A-Z][A-Za-z]+)`", names):
            found[name] = int(status)
    return found


def test_the_error_table_names_each_error_with_the_status_it_answers() -> None:
    table = _table()
    assert sorted(GIVEN - set(table)) == []
    for name, status in table.items():
        if name in NOT_CLASSES:
            continue
        cls = getattr(errors, name, None) or getattr(auth, name)
        assert (name, status_of(cls.__new__(cls))) == (name, status)


async def test_a_method_a_path_does_not_take_is_405_method_not_allowed(api: Api) -> None:
    admin = await api.token("admin")
    r = await api.http.delete("/api/v1/bulk/retry", headers=admin)
    assert (r.status_code, r.json()["error"], r.headers["content-type"]) == (
        405, "MethodNotAllowed", "application/problem+json")
